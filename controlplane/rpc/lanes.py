"""Fair lanes: the server time of the doors' work, shared across tenants.

The control plane is one Python process. Every call's validation, storage and learning
runs under one interpreter lock, so whoever keeps the most threads busy takes the most of
the process, and the event loop that answers ``DecideTtl`` waits behind them: four threads
of one tenant's ingest made another tenant's decisions several times slower. So the doors'
off-loop work (ingest, program ends, arrivals, inspection) runs here, on a fixed, small
number of threads (``workers``), and never on more:

- each tenant's calls wait in the tenant's own queue, oldest first, and a tenant runs on
  at most ``workers - 1`` threads at once (when there are two or more): one thread is
  always left for the others, whatever one tenant sends;
- a free thread serves the tenant that has used the least server time lately: the CPU
  seconds its calls took on these threads, decayed with a half-life of ``half_life_s``
  (least attained service). A tenant that floods queues behind itself; a tenant that
  sends little is served next, whoever else waits;
- a call that waited ``max_wait_s`` without being served is refused RESOURCE_EXHAUSTED
  with a retry hint (:data:`RETRY_AFTER_KEY`, milliseconds) instead of being run late;
  a call whose client gave up meanwhile is dropped unrun.

The interpreter lock still passes between the loop and these threads, so the server also
shortens the interval at which a thread that holds it must let a waiting one in
(:func:`sys.setswitchinterval`, :data:`SWITCH_INTERVAL_S`): the loop waits for it at most
that long each time it wakes.

>>> import asyncio
>>> async def main() -> list[str]:
...     lanes = Lanes(workers=1)
...     try:
...         return [await lanes.run("acme", str.upper, "ok"), lanes.queued("acme").__str__()]
...     finally:
...         lanes.close()
>>> asyncio.run(main())
['OK', '0']
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from controlplane.errors import RETRY_AFTER_KEY, OverloadedError

__all__ = ["RETRY_AFTER_KEY", "SWITCH_INTERVAL_S", "Lanes", "Usage"]

R = TypeVar("R")

#: The interpreter's switch interval in a serving process (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 0.001


@dataclass
class Usage:
    """One tenant's server time on the lanes: CPU seconds decayed with a half-life."""

    half_life_s: float
    seconds: float = 0.0
    at: float = 0.0
    total_s: float = 0.0

    def now(self, t: float) -> float:
        """The decayed usage at monotonic time ``t``."""
        return self.seconds * math.exp2(-(t - self.at) / self.half_life_s)

    def charge(self, cpu_s: float, t: float) -> None:
        self.seconds, self.at = self.now(t) + cpu_s, t
        self.total_s += cpu_s


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    queued_at: float


@dataclass
class _Tenant:
    usage: Usage
    queue: deque[_Job] = field(default_factory=deque)
    running: int = 0


class Lanes:
    """Runs the doors' blocking work on ``workers`` threads, fairly across tenants (the
    module doc). Create and use it on one event loop; :meth:`close` ends its threads."""

    def __init__(self, workers: int = 3, half_life_s: float = 1.0, max_wait_s: float = 2.0) -> None:
        if workers < 1:
            raise ValueError(f"lanes: workers must be at least 1, not {workers}")
        self.workers = workers
        self.half_life_s = half_life_s
        self.max_wait_s = max_wait_s
        self.per_tenant = max(1, workers - 1)
        self._pool = ThreadPoolExecutor(workers, "cachettl-lane")
        self._tenants: dict[str, _Tenant] = {}
        self._running = 0
        #: Calls refused for waiting too long, per tenant (``/metrics``).
        self.refused: dict[str, int] = {}

    async def run(self, tenant: str, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on a lane thread, in ``tenant``'s turn; its result or exception.
        Raises ``OverloadedError`` (with ``retry_after_s``) if no thread was free for the
        tenant within ``max_wait_s``."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), time.monotonic())
        self._tenant(tenant).queue.append(job)
        self._pump(loop)
        result: R = await job.future
        return result

    def queued(self, tenant: str) -> int:
        """Calls of ``tenant`` waiting for a thread."""
        found = self._tenants.get(tenant)
        return len(found.queue) if found else 0

    def usage(self) -> dict[str, float]:
        """Each tenant's server time on the lanes since the start, in CPU seconds."""
        return {name: t.usage.total_s for name, t in self._tenants.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- scheduling ---------------------------------------------------------------------

    def _tenant(self, name: str) -> _Tenant:
        found = self._tenants.get(name)
        if found is None:
            found = self._tenants[name] = _Tenant(Usage(self.half_life_s))
        return found

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start queued calls while threads are free, least-served tenant first."""
        while self._running < self.workers:
            job, name = self._next(time.monotonic())
            if job is None:
                return
            self._running += 1
            tenant = self._tenants[name]
            tenant.running += 1
            work = loop.run_in_executor(self._pool, _timed, job.fn, job.args)
            work.add_done_callback(functools.partial(self._finished, loop, job, name))

    def _next(self, now: float) -> tuple[_Job | None, str]:
        """The next call to run: the oldest of the tenant with the least decayed usage
        (among those with calls queued); calls past ``max_wait_s`` are refused and calls
        nobody awaits any more are dropped on the way."""
        while True:
            waiting = [
                (t.usage.now(now), n)
                for n, t in self._tenants.items()
                if t.queue and t.running < self.per_tenant
            ]
            if not waiting:
                self._forget_idle(now)
                return None, ""
            name = min(waiting)[1]
            job = self._tenants[name].queue.popleft()
            if job.future.done():  # the caller was cancelled (its client left)
                continue
            waited = now - job.queued_at
            if waited > self.max_wait_s:
                self.refused[name] = self.refused.get(name, 0) + 1
                job.future.set_exception(self._refusal(name, waited))
                continue
            return job, name

    def _refusal(self, name: str, waited: float) -> OverloadedError:
        error = OverloadedError(
            f"tenant {name!r}'s calls waited {waited:.1f} s for the server: it is busy "
            f"serving this tenant's earlier calls; send fewer or smaller batches, and retry "
            f"after the hinted delay"
        )
        # A hint, not a promise: the tenant's queue drains at its share of the server.
        error.retry_after_s = min(self.max_wait_s, max(0.1, waited / 2))  # type: ignore[attr-defined]
        return error

    def _finished(
        self, loop: asyncio.AbstractEventLoop, job: _Job, name: str, work: asyncio.Future[Any]
    ) -> None:
        self._running -= 1
        tenant = self._tenants[name]
        tenant.running -= 1
        if work.cancelled():
            if not job.future.done():
                job.future.cancel()
        elif work.exception() is not None:  # not the call's own: the pool failed
            if not job.future.done():
                job.future.set_exception(work.exception())  # type: ignore[arg-type]
        else:
            result, error, cpu_s = work.result()
            tenant.usage.charge(cpu_s, time.monotonic())
            if not job.future.done():
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
        self._pump(loop)

    def _forget_idle(self, now: float) -> None:
        """Drop tenants whose usage has decayed to nothing (bounded memory)."""
        if len(self._tenants) < 1024:
            return
        for name in [
            n
            for n, t in self._tenants.items()
            if not t.queue and not t.running and t.usage.now(now) < 1e-6
        ]:
            del self._tenants[name]


def _timed(
    fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Any, BaseException | None, float]:
    """``fn(*args)``'s result or exception, and the CPU seconds this thread spent on it (a
    refused batch costs its sender what validating it cost)."""
    start = time.thread_time()
    try:
        return fn(*args), None, time.thread_time() - start
    except Exception as error:
        return None, error, time.thread_time() - start
