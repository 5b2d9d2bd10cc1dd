"""vLLM scheduler classes with CacheTTL pinning (imports vLLM; load with ``--scheduler-cls``).

- ``enginehook.scheduler.CacheTTLScheduler``: over ``Scheduler`` (CPU, or
  ``--no-async-scheduling``).
- ``enginehook.scheduler.CacheTTLAsyncScheduler``: over ``AsyncScheduler`` (GPU, where
  async scheduling is on by default).

Configure with ``--additional-config '{"cachettl": {...}}'`` (:class:`HookConfig`). The
mixin is an adapter: it hosts the engine-independent
:class:`enginehook.core.lifecycle.PinController` (the object the simulator hosts too) and routes
vLLM's narrow hooks to it:

- ``add_request``: program id from ``session_id``, hints from ``vllm_xargs`` and the
  KV-hint envelope, arrival; a ``release`` hint closes the session (its pin goes now);
- ``schedule``: expire pins first, order the waiting queue by the controller's key, then
  hand each admitted request's pin over to its prefix hit;
- ``_free_blocks``: a finished turn that ends in a tool call may be pinned;
- ``_free_request``: the decision goes back in the turn's ``kv_transfer_params``
  (:mod:`enginehook.hints.replies`), which vLLM writes into the non-streaming reply
  (these two: :class:`~enginehook.vllm.finishing.FinishedTurnHooks`);
- ``kv_cache_manager.allocate_slots`` (wrapped): release pins under memory pressure;
- ``reset_prefix_cache`` / ``shutdown``: release every pin first;
- ``make_stats`` / ``get_kv_cache_usage``: the KV usage routers read counts blocks that
  only pins hold as free, unless ``pins_in_kv_usage`` (:mod:`enginehook.vllm.usage`).

Shadow mode (``mode: shadow``, or the tenant's rollout ``shadow`` from the control plane)
and tools outside the rollout (:mod:`enginehook.core.rollout`): the controller decides
and reports, and pins nothing. In shadow mode the waiting queue is vLLM's own (the hook's
order is taken off, and put back when the rollout leaves shadow), so the engine schedules
as stock vLLM does, step for step.

No exception from the hook's own code reaches vLLM's scheduler: each hook runs its part
under one ``try``; an exception there is logged with the request id (with its traceback
the first time for each hook), counted in ``cachettl_hook_faults_total{hook=...}`` and
costs at most that request's hints or pin (the request then runs as one without hints;
a finished request whose blocks were not yet taken is freed by vLLM's own path), never
the engine. vLLM's own calls are outside the guard: their errors stay vLLM's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from enginehook.config import HookConfig
from enginehook.core.lifecycle import PinController
from enginehook.core.pins import Pin, ReleaseReason
from enginehook.core.tracker import CacheSeen
from enginehook.hints.flat import Hints
from enginehook.hints.ids import session_id_problem
from enginehook.hints.turns import turn_hint
from enginehook.link.coherence import CoherenceLink
from enginehook.vllm.finishing import FinishedTurnHooks
from enginehook.vllm.guards import check_engine, passthrough_reason
from enginehook.vllm.idle import IdleExpiry, engine_input_queue
from enginehook.vllm.pin_commands import PinCommands
from enginehook.vllm.requests import (
    ADDED_ATTR,
    ADMITTED_ATTR,
    HINTS_ATTR,
    PREEMPTIONS_ATTR,
    ProgramRequestQueue,
    ToolCallText,
    read_hints,
)
from enginehook.vllm.services import HookServices
from enginehook.vllm.usage import PinnedUsage, published_usage

__all__ = ["CacheTTLAsyncScheduler", "CacheTTLMixin", "CacheTTLScheduler"]

_HOUSEKEEPING_S = 10.0
_MIN_PREFILL_TOKENS = 64

logger = logging.getLogger("enginehook")


class CacheTTLMixin(FinishedTurnHooks):
    """The hook; mixed in before ``Scheduler`` or ``AsyncScheduler``. It is the
    controller's :class:`~enginehook.core.lifecycle.EngineHost`."""

    # Attributes of vLLM's Scheduler that the mixin uses (for the type checker).
    vllm_config: Any
    kv_cache_config: Any
    kv_cache_manager: Any
    cache_config: Any
    block_size: int
    hash_block_size: int
    waiting: Any
    kv_holding_waiting: Any
    running: list[Request]
    requests: dict[str, Request]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cachettl = config = HookConfig.from_additional(self.vllm_config.additional_config)
        check_engine(self)
        passthrough = passthrough_reason(self) if config.enabled else None
        #: Whether the hook pins and orders (off: disabled, or passing through).
        self.active = config.enabled and passthrough is None
        self.clock: Callable[[], float] = time.time
        self._pool = self.kv_cache_manager.block_pool
        self._usage = PinnedUsage(self._pool.num_gpu_blocks, time.monotonic)
        #: Routers' drop / extend commands (the hook's endpoint), settled in schedule().
        self.commands = PinCommands(self.active)
        self.services = HookServices(config, self.vllm_config, self.commands)
        self.metrics = self.services.metrics
        self.emit = self.services.emit
        if passthrough is not None:
            logger.warning("CacheTTL passes through (vLLM's own scheduling): %s", passthrough[1])
            self.metrics.set_passthrough(passthrough[0])
        #: Which tools may be pinned (own setting; the link adds the control plane's).
        self.rollout = self.services.decider.rollout = config.rollout()
        self.metrics.track_rollout(self.rollout.in_force)
        if config.shadow or config.pin_tools or config.skip_tools:
            logger.info("CacheTTL pins by %r", self.rollout)  # own shadow mode: always shadow
        self.controller: PinController[list[Any]] = PinController(
            config.rules,
            self,
            pool_blocks=self._pool.num_gpu_blocks,
            decider=self.services,
            engine_id=self.services.engine_id,
            cpu_tier=self.services.cpu_tier.on,
            block_size=self.block_size,
            rollout=self.rollout,
        )
        self.pins = self.controller.pins
        inbox = engine_input_queue() if self.active else None
        self.idle = IdleExpiry(inbox, lambda: len(self.pins), lambda: self.metrics.schedule_calls)
        self.commands.on_submit = self.idle.wake  # an idle engine settles a command at once
        self.coherence: CoherenceLink | None = None
        if self.active and config.control_plane and config.coherence:
            engine_id = self.services.engine_id
            self.coherence = CoherenceLink.from_config(config, engine_id, on_moved=self.idle.wake)
            self.metrics.add_counters(self.coherence.counters)
        self._text = ToolCallText(self.vllm_config.model_config)
        self._priority = self.vllm_config.scheduler_config.policy == "priority"
        self._next_housekeeping = 0.0
        self._step: tuple[float, int] | None = None
        #: Whether the hook orders the waiting queue (outside shadow mode).
        self._ordering = self.active and config.rules.ordering != "fcfs"
        self._order_queues()
        self._allocate = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_with_pressure
        self._faulted: set[str] = set()

    def _fault(self, hook: str, request_id: str | None, exc: Exception) -> None:
        """A defect of the hook's own code in ``hook``: logged (the traceback once per
        hook), counted, and never raised into vLLM."""
        self.metrics.fault(hook)
        first = hook not in self._faulted
        self._faulted.add(hook)
        logger.error(
            "CacheTTL: %s failed for request %s (%s: %.200s); the request goes on without "
            "CacheTTL's part",
            hook,
            request_id,
            type(exc).__name__,
            exc,
            exc_info=first,
        )

    def _order_queues(self) -> None:
        """The hook's order on the waiting queues, or vLLM's own while shadow mode is in
        force; a change moves the waiting requests over in their current order."""
        ours = self._ordering and not self.rollout.keeps_vllm_order
        names = ["waiting"] + (["async_kv_waiting"] if hasattr(self, "async_kv_waiting") else [])
        for name in names:  # vLLM 0.34's async_kv_waiting is ordered the same way
            queue = getattr(self, name)
            if isinstance(queue, ProgramRequestQueue) == ours:
                continue
            policy = self.policy  # type: ignore[attr-defined]
            fresh = ProgramRequestQueue(self._key) if ours else create_request_queue(policy)
            for request in list(queue):
                fresh.add_request(request)
            setattr(self, name, fresh)

    def _key(self, r: Request) -> tuple[object, ...]:
        priority = r.priority if self._priority else 0
        preempted = r.status == RequestStatus.PREEMPTED
        return self.controller.order_key(
            priority, preempted, r.session_id, r.arrival_time, r.request_id
        )

    # -- the controller's host interface -------------------------------------------------
    def free_tokens(self) -> int:
        return int(self._pool.get_num_free_blocks()) * self.block_size

    def waiting_requests(self) -> Iterator[tuple[str | None, int]]:
        return ((r.session_id, r.num_tokens) for r in self.waiting)

    def waiting_programs(self) -> set[str]:
        programs = {r.session_id for r in self.waiting if r.session_id}
        for queue in self._other_waiting():
            programs.update(r.session_id for r in queue if r.session_id)
        return programs

    def _other_waiting(self) -> list[Any]:
        """vLLM's waiting queues besides ``waiting``: requests holding blocks, and (from
        0.34, with ``--max-num-inflight-kv-loads``) requests that may load KV
        asynchronously, ``async_kv_waiting``. A program's turn there is waiting too."""
        queues = [self.kv_holding_waiting]
        async_kv = getattr(self, "async_kv_waiting", None)
        if async_kv is not None:
            queues.append(async_kv)
        return queues

    def pinned_tokens(self, pin: Pin[list[Any]]) -> int:
        return int(getattr(pin.handle, "tokens", pin.blocks * self.block_size))

    def pin_released(self, pin: Pin[list[Any]], reason: ReleaseReason) -> None:
        if pin.handle:
            self._pool.free_blocks(reversed(pin.handle))
        self.metrics.released(reason.value)
        self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)

    # -- vLLM's hooks ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        try:
            self._arrived(request)
        except Exception as exc:
            setattr(request, HINTS_ATTR, Hints())
            self._fault("add_request", request.request_id, exc)
        super().add_request(request)  # type: ignore[misc]

    def _arrived(self, request: Request) -> None:
        if request.session_id and (problem := session_id_problem(request.session_id)):
            self.metrics.refused_session(problem)  # runs without a session: no pin, no order
            request.session_id = None
        hints = read_hints(request)
        setattr(request, HINTS_ATTR, hints)
        setattr(request, ADDED_ATTR, self.clock())
        if request.session_id and self.active:
            now, tenant = self.clock(), self.cachettl.tenant
            self.controller.arrived(
                request.session_id,
                request.arrival_time,
                now,
                tenant,
                prompt_tokens=request.num_prompt_tokens,
                parent=hints.parent_session_id,
                turns=turn_hint(params.extra_args if (params := request.sampling_params) else None),
            )
            if hints.release:  # the session closes: its pin goes now, not at admission
                self.controller.close(request.session_id)
            if self.coherence is not None:
                self.coherence.arrived(request.session_id, request.arrival_time)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if not self.active:
            return super().schedule(*args, **kwargs)  # type: ignore[misc,no-any-return]
        started, now = time.perf_counter(), self.clock()
        queue = self.waiting if isinstance(self.waiting, ProgramRequestQueue) else None
        sorted_before = queue.sort_seconds if queue is not None else 0.0
        try:
            if self._ordering:
                self._order_queues()
                queue = self.waiting if isinstance(self.waiting, ProgramRequestQueue) else None
                sorted_before = queue.sort_seconds if queue is not None else 0.0
            self.controller.expire(now)
            self._moved_away()
            if self.commands:
                self.commands.apply(self.controller, now)
            if queue is not None:
                queue.mark_dirty()
                async_kv = getattr(self, "async_kv_waiting", None)
                if isinstance(async_kv, ProgramRequestQueue):
                    async_kv.mark_dirty()
        except Exception as exc:
            self._fault("schedule", None, exc)
        before = time.perf_counter()
        output: SchedulerOutput = super().schedule(*args, **kwargs)  # type: ignore[misc]
        after = time.perf_counter()
        for new in output.scheduled_new_reqs:
            try:
                self._admitted(new, now)
            except Exception as exc:
                self._fault("schedule", new.req_id, exc)
        try:
            if now >= self._next_housekeeping:
                self._next_housekeeping = now + _HOUSEKEEPING_S
                self.controller.forget_idle(now, self.cachettl.idle_program_s)
                self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)
        except Exception as exc:
            self._fault("schedule", None, exc)
        done = time.perf_counter()
        sorting = queue.sort_seconds - sorted_before if queue is not None else 0.0
        own = (before - started) + (done - after) + sorting
        self.metrics.scheduled(own, after - before - sorting)
        new_requests = bool(output.scheduled_new_reqs)
        self._step = (done, output.total_num_scheduled_tokens) if new_requests else None
        return output

    def _admitted(self, new: Any, now: float) -> None:
        """A request vLLM admitted this step: its program's pin goes over to its prefix hit.
        From vLLM 0.34 a request resumed after preemption is listed with the new ones
        (``scheduled_resumed_reqs`` is gone): it is no new turn, so it is skipped."""
        request = self.requests.get(new.req_id)
        if request is None or not request.session_id:
            return
        preemptions = getattr(request, "num_preemptions", 0)
        if getattr(request, ADMITTED_ATTR, None) is not None and preemptions > getattr(
            request, PREEMPTIONS_ATTR, 0
        ):
            setattr(request, PREEMPTIONS_ATTR, preemptions)
            return
        setattr(request, ADMITTED_ATTR, now)
        setattr(request, PREEMPTIONS_ATTR, preemptions)
        seen = CacheSeen(
            new.num_computed_tokens,
            request.num_prompt_tokens,
            request.block_hashes,
            self.hash_block_size,
        )
        pin, turn = self.controller.admitted(request.session_id, now, seen)
        if pin is not None:
            self.metrics.hit(new.num_computed_tokens)
        if turn is not None:
            self.metrics.returned(turn.cache)
            if turn.event is not None and turn.event.shadow:
                self.metrics.shadow_returned(turn.event.pin_outcome)

    def _next_waiting_queue(self, take_async_kv: bool) -> Any:
        """vLLM 0.34: which of ``waiting`` and ``async_kv_waiting`` goes next. vLLM compares
        the heads' arrival; with the hook's order both queues are in the controller's
        order, so the heads are compared by its key (a returning turn of an early program
        keeps its place whichever queue it is in)."""
        chosen = super()._next_waiting_queue(take_async_kv)  # type: ignore[misc]
        other = getattr(self, "async_kv_waiting", None)
        if not (isinstance(self.waiting, ProgramRequestQueue) and take_async_kv):
            return chosen
        if self._priority or not other or not self.waiting:
            return chosen
        first = self._key(other.peek_request()) < self._key(self.waiting.peek_request())
        return other if first else self.waiting

    def update_from_output(
        self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any
    ) -> Any:
        step, self._step = getattr(self, "_step", None), None
        sync = not isinstance(self, AsyncScheduler)
        if step is not None and sync and step[1] >= _MIN_PREFILL_TOKENS:
            # The step ran new requests' prefill: one observed timing for the cost model.
            try:
                self.services.decider.learn_prefill(step[1], time.perf_counter() - step[0])
            except Exception as exc:
                self._fault("update_from_output", None, exc)
        return super().update_from_output(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def _allocate_with_pressure(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        got = [self._allocate(request, *args, **kwargs)]
        if got[-1] is not None or not len(self.pins):
            return got[-1]

        def fits() -> bool:
            got.append(self._allocate(request, *args, **kwargs))
            return got[-1] is not None

        now = self.clock()
        try:
            self.controller.relieve(
                self.pins.pinned_blocks,
                request.session_id,
                for_running=request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED),
                nothing_running=not any(r is not request for r in self.running),
                now=now,
                fits=fits,
                waited_s=now - getattr(request, ADDED_ATTR, now),
            )
        except Exception as exc:
            self._fault("allocate_slots", request.request_id, exc)
        return got[-1]

    def _published_usage(self, usage: float) -> float:
        """vLLM's KV ``usage`` as this engine publishes it (:mod:`enginehook.vllm.usage`);
        the share only pins hold goes to the hook's gauge."""
        try:
            pins_only = self._usage.blocks(
                lambda: [p.handle or () for p in self.pins], len(self.pins)
            )
            self.metrics.set_kv_pinned(self._usage.share(pins_only))
            count_pins = self.cachettl.rules.pins_in_kv_usage or not self.active
            return published_usage(
                usage, pins_only=pins_only, total=self._usage.total, count_pins=count_pins
            )
        except Exception as exc:
            self._fault("make_stats", None, exc)
            return usage

    def get_kv_cache_usage(self) -> float:
        # What vLLM's data-parallel load balancing reads.
        return self._published_usage(super().get_kv_cache_usage())  # type: ignore[misc]

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # What vLLM publishes as vllm:kv_cache_usage_perc (and logs as KV cache usage).
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None:
            stats.kv_cache_usage = self._published_usage(stats.kv_cache_usage)
        return stats

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        try:
            self.controller.release_all(ReleaseReason.SHUTDOWN)
        except Exception as exc:
            self._fault("reset_prefix_cache", None, exc)
        return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def has_requests(self) -> bool:
        # An idle engine woken to expire pins (enginehook.vllm.idle), or told a program
        # moved away (read here too, so no wake-up of the watcher's can be missed).
        if self.idle.take() or (self.coherence is not None and self.coherence.pending):
            try:
                now = self.clock()
                self.controller.expire(now)
                self._moved_away()
                if self.commands:
                    self.commands.apply(self.controller, now)
            except Exception as exc:
                self._fault("has_requests", None, exc)
        return super().has_requests()  # type: ignore[misc,no-any-return]

    def _moved_away(self) -> None:
        """Drop the pins of programs whose turns arrived at another engine
        (:mod:`enginehook.link.coherence`); one truthiness test when none did."""
        if self.coherence is None:
            return
        moved = self.coherence.moved()
        if not moved:
            return
        here: dict[str, float] = {}  # each program's latest arrival among the requests held
        for r in self.requests.values():
            if r.session_id and r.arrival_time > here.get(r.session_id, -math.inf):
                here[r.session_id] = r.arrival_time
        for program, arrived_at in self.coherence.departures(moved, here):
            self.controller.moved_away(program, arrived_at)

    def shutdown(self) -> None:
        self.idle.stop()
        if self.coherence is not None:
            self.coherence.close()
        try:
            self.controller.release_all(ReleaseReason.SHUTDOWN)
            self.services.close()
        except Exception as exc:
            self._fault("shutdown", None, exc)
        super().shutdown()  # type: ignore[misc]


class CacheTTLScheduler(CacheTTLMixin, Scheduler):
    """CacheTTL over vLLM's synchronous ``Scheduler`` (CPU; ``--no-async-scheduling``)."""


class CacheTTLAsyncScheduler(CacheTTLMixin, AsyncScheduler):
    """CacheTTL over vLLM's ``AsyncScheduler`` (GPU with async scheduling)."""
