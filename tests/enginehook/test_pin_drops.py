"""The TTL-aware router tells a pin's holder to drop the pin rule 1 escaped, without Ray:
real hook endpoints (``serve_metrics`` with real ``PinCommands``, settled on a scheduler
thread woken by each command, as the hook's idle engine is) in front of a real
``PinController`` holding the pin, and the router core the Ray adapter runs
(``TtlRouter``) fed the stats the controller publishes.

Asserted: the escape settles ``applied`` and the controller no longer holds the pin (and
its next stats route the program by rule 2); the same stale pin is told once; the token
comes from the router's token file; a hook that forbids, does not pin, refuses the
connection, or never answers is counted by kind while routing answers at once; a full queue
is counted, not waited on; a drop that found its holder unreachable is told again at the
pin's next escape; bad endpoints, token files and settings are named. The router reads each
replica's published stats once (a mapping equal to the last is not read again; the same
mapping is, with a new ``at``)."""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.routing import replica_stats, view_of
from enginehook.routing.drops import PINS_PATH, PinDrops, check_endpoint
from enginehook.routing.router import TtlRouter
from enginehook.routing.rule import Last
from enginehook.vllm import endpoint, metrics
from enginehook.vllm.pin_commands import PinCommands
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost

BLOCK = 16
NOW = 2.0  # the replicas' clock when the router decides (the pin expires at 31.0)
SETTLE_S = 5.0  # how long a test waits for a command to settle or a drop to be answered


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


def _holder(program: str = "s1") -> tuple[PinController[str], MinimalHost]:
    """A controller whose ``program`` holds a 10-block pin until 31.0."""
    host = MinimalHost(block_size=BLOCK)
    controller = PinController(
        SchedulingRules(), host, pool_blocks=100, decider=_Fixed(), engine_id="a"
    )
    controller.arrived(program, 0.0, 0.0)
    controller.admitted(program, 0.0)
    controller.finished(FinishedTurn(program, "bash", "pytest", 160), 1.0, lambda: (10, "b"))
    assert controller.pinned(program)
    return controller, host


class _Hook:
    """A hook's endpoint over a controller, its commands applied on a scheduler thread
    woken by each one (the idle engine's wake-up)."""

    def __init__(
        self, controller: PinController[str], token: str = "", supported: bool = True
    ) -> None:
        self.controller = controller
        self._wake = threading.Event()
        self._stop = False
        self.commands = PinCommands(supported=supported, on_submit=self._wake.set)
        self.lock = threading.Lock()  # the scheduler's: the test reads the controller under it
        self.server, port = endpoint.serve_metrics(
            metrics.HookMetrics(), "127.0.0.1:0", self.commands, token=token, clock=lambda: NOW
        )
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._schedule, daemon=True)
        self._thread.start()

    def _schedule(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            with self.lock:
                self.commands.apply(self.controller, now=NOW)

    def pinned(self, program: str) -> bool:
        with self.lock:
            return self.controller.pinned(program)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(SETTLE_S)
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def _hook(
    controller: PinController[str], token: str = "", supported: bool = True
) -> Iterator[_Hook]:
    hook = _Hook(controller, token, supported)
    try:
        yield hook
    finally:
        hook.close()


def _stats(
    controller: PinController[str], *, busy_tokens: int = 0, endpoint: str | None = None
) -> dict[str, Any]:
    """The replica's stats with ``busy_tokens`` of running prefill ahead of every turn."""
    return replica_stats(
        controller,
        free_tokens=1_000,
        prefill_tokens_per_s=1_000.0,
        tokens_per_block=BLOCK,
        now=NOW,
        running=1 if busy_tokens else 0,
        prefilling_tokens=busy_tokens,
        waiting=[],
        pin_endpoint=endpoint,
    )


def _idle() -> dict[str, Any]:
    """A replica with nothing queued or pinned."""
    host = MinimalHost(block_size=BLOCK)
    idle = PinController(SchedulingRules(), host, pool_blocks=100, decider=_Fixed(), engine_id="b")
    return _stats(idle)


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not done():
        assert time.monotonic() < deadline, f"not within {SETTLE_S} s: {what}"
        time.sleep(0.01)


def _escape(router: TtlRouter, holder_stats: dict[str, Any], program: str = "s1") -> None:
    """Route ``program`` while its holder has 5 s of prefill ahead of it against 0.16 s of
    recompute on the idle ``b``: rule 1 escapes to ``b``."""
    decision = router.decide([("a", holder_stats), ("b", _idle())], program, now=NOW)
    assert (decision.ranked, decision.rule, decision.drop_from) == (("b", "a"), "escape", "a")


def test_an_escaped_pin_is_dropped_on_its_holder() -> None:
    controller, host = _holder()
    router = TtlRouter.from_kwargs({})
    with _hook(controller) as hook:
        stale = _stats(controller, busy_tokens=5_000, endpoint=hook.url)
        _escape(router, stale)
        _until(lambda: not hook.pinned("s1"), "the holder drops the pin")
        [first] = hook.commands.ids()
        assert hook.commands.get(first) == {
            "id": first,
            "action": "drop",
            "session": "s1",
            "state": "applied",
            "settled_at": NOW,
            "blocks": 10,
        }
        assert host.freed == [("s1", "dropped")]
        _until(lambda: router.drops == {"sent": 1, "accepted": 1}, "the drop is counted")
        # the same pin in the same stale stats is told once
        _escape(router, stale)
        assert router.drops == {"sent": 1, "accepted": 1, "repeated": 1}
        # the holder's next stats publish no pin: the program is routed by its credit
        fresh = router.decide(
            [("a", _stats(controller, busy_tokens=5_000)), ("b", _idle())], "s1", NOW
        )
        assert (fresh.rule, fresh.drop_from) == ("credit", None)
    assert len(hook.commands.ids()) == 1  # nothing more was posted


@pytest.mark.parametrize(("with_token", "outcome"), [(False, "forbidden"), (True, "accepted")])
def test_the_token_comes_from_the_routers_token_file(
    tmp_path: Path, with_token: bool, outcome: str
) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    controller, _ = _holder()
    router = TtlRouter.from_kwargs(
        {"pin_token_file": str(tmp_path / "token")} if with_token else {}
    )
    with _hook(controller, token="s3cret") as hook:
        _escape(router, _stats(controller, busy_tokens=5_000, endpoint=hook.url))
        _until(lambda: router.drops.get(outcome) == 1, outcome)
        if with_token:
            _until(lambda: not hook.pinned("s1"), "the drop applies")
        else:
            assert hook.commands.ids() == []  # refused before it was queued
            assert hook.pinned("s1")


def test_a_hook_that_does_not_pin_or_is_gone_is_counted_and_routing_answers() -> None:
    controller, _ = _holder()
    router = TtlRouter.from_kwargs({})
    with _hook(controller, supported=False) as hook:
        _escape(router, _stats(controller, busy_tokens=5_000, endpoint=hook.url))
        _until(lambda: router.drops.get("unsupported") == 1, "501 counted")
        assert hook.pinned("s1")
    gone = hook.url  # its server is closed: the connection is refused
    _escape(router, _stats(controller, busy_tokens=5_000, endpoint=gone))  # the same pin
    controller.extend("s1", 60.0, now=NOW)  # a new expiry: another pin to tell
    _escape(router, _stats(controller, busy_tokens=5_000, endpoint=gone))
    _until(lambda: router.drops.get("unreachable") == 1, "refused counted")
    assert router.drops == {"sent": 2, "unsupported": 1, "repeated": 1, "unreachable": 1}


def test_a_pin_whose_holder_was_unreachable_is_told_again_at_its_next_escape() -> None:
    controller, _ = _holder()
    router = TtlRouter.from_kwargs({})
    with _hook(controller) as down:
        gone = down.url
    _escape(router, _stats(controller, busy_tokens=5_000, endpoint=gone))
    _until(lambda: router.drops.get("unreachable") == 1, "the refused drop is counted")
    with _hook(controller) as back:  # the holder's hook is back (on another port)
        _escape(router, _stats(controller, busy_tokens=5_000, endpoint=back.url))  # same pin
        _until(lambda: not back.pinned("s1"), "the holder drops the pin")
        _until(lambda: router.drops.get("accepted") == 1, "the second drop is answered")
        assert router.drops == {"sent": 2, "unreachable": 1, "accepted": 1}


@contextmanager
def _silent() -> Iterator[str]:
    """An endpoint that takes connections and never answers; closing it resets them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_a_hook_that_never_answers_holds_no_routing_decision() -> None:
    controller, _ = _holder()
    router = TtlRouter(pin_drops=PinDrops(timeout_s=60.0))
    with _silent() as url:
        _escape(router, _stats(controller, busy_tokens=5_000, endpoint=url))
        _until(lambda: router.drops == {"sent": 1}, "the worker posts")
        # the post waits for an answer; routing does not
        other = router.decide([("a", _idle()), ("b", _idle())], "new", now=NOW)
        assert other.rule == "new"
        assert router.drops == {"sent": 1}
    _until(lambda: router.drops.get("unreachable") == 1, "the reset is counted")


def test_a_full_queue_is_counted_not_waited_on() -> None:
    drops = PinDrops(timeout_s=60.0, max_queued=1)
    with _silent() as url:
        assert drops.escaped("p1", "a", endpoint=url, expires_at=9.0) == "queued"
        _until(lambda: drops.counts() == {"sent": 1}, "the worker takes the first")
        assert drops.escaped("p2", "a", endpoint=url, expires_at=9.0) == "queued"
        assert drops.escaped("p3", "a", endpoint=url, expires_at=9.0) == "overflow"
        assert drops.escaped("p3", "a", endpoint=url, expires_at=9.0) == "overflow"  # not told
        assert drops.counts() == {"sent": 1, "overflow": 2}
    drops.close()
    assert drops.counts() == {"sent": 2, "overflow": 2, "unreachable": 2}


def test_a_holder_without_an_endpoint_is_counted() -> None:
    controller, _ = _holder()
    router = TtlRouter.from_kwargs({})
    _escape(router, _stats(controller, busy_tokens=5_000))
    assert router.drops == {"no_endpoint": 1}
    assert controller.pinned("s1")


def test_the_endpoint_travels_in_the_stats_and_bad_ones_are_named() -> None:
    controller, _ = _holder()
    stats = _stats(controller, endpoint="http://10.0.0.7:9400/")
    assert view_of("r1", stats, 1_000.0).pin_endpoint == "http://10.0.0.7:9400"
    assert view_of("r1", _stats(controller), 1_000.0).pin_endpoint is None
    assert PINS_PATH == endpoint.PINS_PATH
    for bad, message in (
        ("ftp://10.0.0.7:9400", "must be http://HOST:PORT"),
        ("http://:9400", "must be http://HOST:PORT"),
        ("http://h:port", "is not a URL"),
        ("http://h:1/?x=1", "takes no user, query or fragment"),
        (9400, "must be an http\\(s\\) URL string"),
    ):
        with pytest.raises(ValueError, match=message):
            check_endpoint(bad, "pin_endpoint")
    with pytest.raises(ValueError, match=r"^pin_endpoint must be"):
        _stats(controller, endpoint="10.0.0.7:9400")
    stats["cachettl"]["pin_endpoint"] = ["http://h:1"]
    with pytest.raises(ValueError, match="routing stats of r1: pin_endpoint must be"):
        view_of("r1", stats, 1_000.0)


def test_bad_router_settings_are_named(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    for kwargs, message in (
        ({"credit_decay": 1.0}, r"unknown \['credit_decay'\]"),
        ({"credit_decay_s": 0}, "credit_decay_s must be > 0, got 0"),
        ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s must be > 0, got True"),
        ({"pin_token_file": str(tmp_path / "missing")}, "pin_token_file: cannot read"),
        ({"pin_token_file": str(tmp_path / "empty")}, "pin_token_file: .* holds no token"),
        ({"pin_token_file": 7}, "pin_token_file must be a path string"),
    ):
        with pytest.raises(ValueError, match=message):
            TtlRouter.from_kwargs(kwargs)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        PinDrops(timeout_s=0.0)


def test_the_router_reads_each_published_stats_once() -> None:
    controller, _ = _holder()
    router = TtlRouter.from_kwargs({})
    stats = _stats(controller)  # s1's 160-token pin on a until 31.0, taken at 2.0
    replicas = [("a", stats), ("b", _idle())]
    router.decide(replicas, "x", now=NOW)
    assert router.memory.get("s1") == Last("a", 31.0, 160)  # alive until its expiry
    router.routed("s1", "b", now=NOW)
    router.decide(replicas, "x", now=NOW + 1)  # the same stats: not read again
    assert router.memory.get("s1") == Last("b", NOW, 160)
    copied = [("a", copy.deepcopy(stats)), ("b", _idle())]  # equal stats, handed over anew
    router.decide(copied, "x", now=NOW + 1)
    assert router.memory.get("s1") == Last("b", NOW, 160)
    stats["cachettl"]["at"] = NOW + 1  # updated in place, with its time: read again
    router.decide(replicas, "x", now=NOW + 1)
    assert router.memory.get("s1") == Last("a", 31.0, 160)
    controller.close("s1")
    router.decide([("a", _stats(controller)), ("b", _idle())], "x", now=NOW + 2)
    assert router.memory.get("s1") == Last("a", NOW, 160)  # gone from stats taken at 2.0
