"""Pin expiry on an idle engine.

vLLM's engine loop (``EngineCoreProc.run_busy_loop``) blocks on its input queue while no
request is in flight, so ``schedule()``, where the hook expires pins, does not run, and
overdue pins (and the ``pins_held`` gauge) would linger until traffic comes. An
:class:`IdleExpiry` thread wakes every ``interval_s``; when pins are held and the engine
has not scheduled since its last wake, it asks for expiry and puts vLLM's own no-op
``WAKEUP`` message on the engine core's input queue. The engine thread then asks the
scheduler ``has_requests()`` (``EngineCore.has_work``), where the hook takes the request
(:meth:`IdleExpiry.take`) and expires its pins: on the engine thread, as in ``schedule()``.
A wake-up asked while the engine thread takes the previous one is not lost: requests are
counted, and ``take`` compares the count with the one it last took. The hot path pays one
attribute read per ``has_requests()``; an idle engine with pins wakes twice a second.

The engine core's input queue is found on the stack while vLLM builds the scheduler (the
``EngineCoreProc`` being constructed already has it). An engine run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where the caller steps the engine) has none: there
pins expire at the next step, as before.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["IdleExpiry", "engine_input_queue"]

logger = logging.getLogger("enginehook")


def engine_input_queue() -> queue.Queue[Any] | None:
    """The input queue of the vLLM engine core whose constructor is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        found = getattr(owner, "input_queue", None)
        if isinstance(found, queue.Queue) and type(owner).__name__.endswith("EngineCoreProc"):
            return found
        if isinstance(found, queue.Queue) and hasattr(owner, "run_busy_loop"):
            return found
        frame = frame.f_back  # type: ignore[assignment]
    return None


class IdleExpiry:
    """Wakes an idle engine loop to expire pins (see the module docstring).

    ``pins_held``: how many pins are held (read from this thread: a ``len``);
    ``schedule_calls``: a count that ``schedule()`` raises.
    """

    def __init__(
        self,
        inbox: queue.Queue[Any] | None,
        pins_held: Callable[[], int],
        schedule_calls: Callable[[], int],
        interval_s: float = 0.5,
    ) -> None:
        #: Wake-ups asked (any thread) and the count the engine thread last took.
        self._asked = 0
        self._taken = 0
        #: Wake-ups sent.
        self.wakeups = 0
        self._inbox = inbox
        self._pins_held = pins_held
        self._calls = schedule_calls
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if inbox is not None:
            self._thread = threading.Thread(target=self._run, name="cachettl-idle", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Wake the engine loop now, from any thread (a program moved away: its pin goes on
        the engine thread at once, idle or not)."""
        if self._inbox is None:
            return
        from vllm.v1.engine import EngineCoreRequestType

        self._asked += 1
        self.wakeups += 1
        self._inbox.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def take(self) -> bool:
        """Whether a wake-up asked for expiry since the last call; on the engine thread.

        The count is read once: a wake-up asked after that read is seen by the next call
        (its ``WAKEUP`` message brings one), never cleared unseen.
        """
        asked = self._asked
        if asked == self._taken:
            return False
        self._taken = asked
        return True

    def _run(self) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        last = -1
        while not self._stop.wait(self._interval_s):
            calls = self._calls()
            if calls == last and self._pins_held() > 0 and self._inbox is not None:
                self._asked += 1
                self.wakeups += 1
                self._inbox.put_nowait((EngineCoreRequestType.WAKEUP, None))
            last = calls

    def stop(self) -> None:
        """End the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
