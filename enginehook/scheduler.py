"""vLLM scheduler classes with CacheTTL pinning (imports vLLM; load with ``--scheduler-cls``).

- ``enginehook.scheduler.CacheTTLScheduler``: over ``Scheduler`` (CPU, or
  ``--no-async-scheduling``).
- ``enginehook.scheduler.CacheTTLAsyncScheduler``: over ``AsyncScheduler`` (GPU, where
  async scheduling is on by default).

Configure with ``--additional-config '{"cachettl": {...}}'`` (:class:`HookConfig`). The
classes only route vLLM's narrow hooks to the engine-independent modules:

- ``add_request``: program id from ``session_id``, hints from ``vllm_xargs``, arrival;
- ``schedule``: expire pins first, order the waiting queue by program, then hand each
  admitted request's pin over to its prefix hit;
- ``_free_blocks``: pin a finished turn that ends in a tool call;
- ``kv_cache_manager.allocate_slots`` (wrapped): release pins under memory pressure;
- ``reset_prefix_cache`` / ``shutdown``: release every pin first.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from enginehook.compat import check_kv_layout, check_vllm
from enginehook.config import HookConfig, detect_cpu_tier
from enginehook.decide import TtlDecider
from enginehook.detect import detect_tool_call
from enginehook.hints import Hints
from enginehook.link import EventSink, build_sink
from enginehook.metrics import HookMetrics, serve_metrics
from enginehook.pins import Pin, PinResult, PinTable, ReleaseReason
from enginehook.pressure import PressureRule, may_release
from enginehook.priority import (
    ProgramArrivals,
    SortedWaitQueue,
    effective_program_arrival,
    priority_key,
)
from enginehook.tracker import ProgramEndEvent, ToolCallEvent, ToolCallTracker
from estimator import Decision

__all__ = ["CacheTTLAsyncScheduler", "CacheTTLMixin", "CacheTTLScheduler", "ProgramRequestQueue"]

logger = logging.getLogger("enginehook")

_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_HINTS_ATTR = "_cachettl_hints"
_MAX_DECODE_TOKENS = 2048
_HOUSEKEEPING_S = 10.0
_MIN_PREFILL_TOKENS = 64


class ProgramRequestQueue(RequestQueue):
    """vLLM's ``RequestQueue`` over :class:`SortedWaitQueue` (program-level order)."""

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._queue: SortedWaitQueue[Request] = SortedWaitQueue(key)
        self._dirty = False
        #: Seconds spent sorting (part of the hook's own cost).
        self.sort_seconds = 0.0

    def mark_dirty(self) -> None:
        self._queue.mark_dirty()
        self._dirty = True

    def add_request(self, request: Request) -> None:
        self._queue.add(request)
        self._dirty = True

    def pop_request(self) -> Request:
        return self._queue.pop()

    def peek_request(self) -> Request:
        if not self._dirty:
            return self._queue.peek()
        started = time.perf_counter()
        try:
            return self._queue.peek()
        finally:
            self._dirty = False
            self.sort_seconds += time.perf_counter() - started

    def prepend_request(self, request: Request) -> None:
        self._queue.prepend(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._queue.extend_front(requests)

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self._queue.remove_many(requests)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Any:
        return iter(self._queue)


class CacheTTLMixin:
    """The hook; mixed in before ``Scheduler`` or ``AsyncScheduler``."""

    # Attributes of vLLM's Scheduler that the mixin uses (for the type checker).
    vllm_config: Any
    kv_cache_config: Any
    kv_cache_manager: Any
    cache_config: Any
    block_size: int
    waiting: Any
    kv_holding_waiting: Any
    running: list[Request]
    requests: dict[str, Request]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cachettl = HookConfig.from_additional(self.vllm_config.additional_config)
        check_vllm()
        check_kv_layout(self.kv_cache_config)
        if self.vllm_config.scheduler_config.async_scheduling and not isinstance(
            self, AsyncScheduler
        ):
            raise RuntimeError(
                "async scheduling is on: use enginehook.scheduler.CacheTTLAsyncScheduler "
                "(or pass --no-async-scheduling)"
            )
        if self.cachettl.enabled and not self.cache_config.enable_prefix_caching:
            raise RuntimeError("CacheTTL needs prefix caching: pass --enable-prefix-caching")
        self.clock: Callable[[], float] = time.time
        self._pool = self.kv_cache_manager.block_pool
        budget = int(self.cachettl.budget_fraction * self._pool.num_gpu_blocks)
        self.pins: PinTable[list[Any]] = PinTable(budget, self.cachettl.ttl_cap_s, self._on_release)
        self.tracker = ToolCallTracker(uuid.uuid4().hex[:12], tenant=self.cachettl.tenant)
        self.decider = TtlDecider(
            self.cachettl.policy,
            self.cachettl.policy_params,
            profile=self.cachettl.profile,
            tenant=self.cachettl.tenant,
            min_samples=self.cachettl.min_samples,
        )
        self.arrivals = ProgramArrivals()
        self.metrics = HookMetrics()
        self.cpu_tier = detect_cpu_tier(self.cachettl.cpu_tier, self.vllm_config)
        self.metrics.set_cpu_tier(self.cpu_tier.on, ",".join(self.cpu_tier.connectors))
        logger.info(
            "CacheTTL CPU tier %s: %s", "on" if self.cpu_tier.on else "off", self.cpu_tier.reason
        )
        self._rules_for: tuple[object, tuple[PressureRule, float]] = (
            None,
            self.cachettl.rules(False),
        )
        self._tokenizer = self._load_tokenizer()
        self._next_housekeeping = 0.0
        self._step_started: float | None = None
        self._step_tokens = 0
        self.sink: EventSink = build_sink(self.cachettl, self.decider, self.tracker.engine_id)
        self._metrics_server: Any = None
        if self.cachettl.metrics_listen:
            self._metrics_server, port = serve_metrics(self.metrics, self.cachettl.metrics_listen)
            logger.info("CacheTTL metrics on port %d", port)
        if self.cachettl.enabled and self.cachettl.order:
            self.waiting = ProgramRequestQueue(self._priority)
        self._allocate = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_with_pressure
        logger.info("CacheTTL hook on: %s, pin budget %d blocks", self.cachettl, budget)

    # -- requests in -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        try:
            params = request.sampling_params
            hints = Hints.from_extra_args(params.extra_args if params is not None else None)
        except ValueError as exc:
            logger.warning("request %s: ignoring hints: %s", request.request_id, exc)
            hints = Hints()
        setattr(request, _HINTS_ATTR, hints)
        program = request.session_id
        if program and self.cachettl.enabled:
            self.arrivals.observe(program, request.arrival_time)
            self.tracker.arrived(program, self.clock())
        super().add_request(request)  # type: ignore[misc]

    @property
    def cachettl_rules(self) -> tuple[PressureRule, float]:
        """``(pressure rule, order window s)`` in force: the tier settings while a CPU tier
        is on (:meth:`HookConfig.rules`)."""
        tier = self.cpu_tier
        if self._rules_for[0] is not tier:  # worked out again only when the tier changes
            self._rules_for = (tier, self.cachettl.rules(tier.on))
        return self._rules_for[1]

    def _priority(self, request: Request) -> tuple[int, int, float, float, str]:
        program = request.session_id
        return priority_key(
            request.status == RequestStatus.PREEMPTED,
            program is not None and program in self.pins,
            effective_program_arrival(
                self.arrivals.first(program, request.arrival_time),
                request.arrival_time,
                self.cachettl_rules[1],
            ),
            request.arrival_time,
            request.request_id,
        )

    def _waiting_programs(self) -> set[str]:
        programs = {r.session_id for r in self.waiting if r.session_id}
        programs.update(r.session_id for r in self.kv_holding_waiting if r.session_id)
        return programs

    # -- scheduling --------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if not self.cachettl.enabled:
            return super().schedule(*args, **kwargs)  # type: ignore[misc,no-any-return]
        started = time.perf_counter()
        now = self.clock()
        if self.pins.due(now):
            self.pins.expire(now, self._waiting_programs())
        queue = self.waiting if isinstance(self.waiting, ProgramRequestQueue) else None
        if queue is not None:
            queue.mark_dirty()
        sorted_before = queue.sort_seconds if queue is not None else 0.0
        before = time.perf_counter()
        output: SchedulerOutput = super().schedule(*args, **kwargs)  # type: ignore[misc]
        after = time.perf_counter()
        for new in output.scheduled_new_reqs:
            request = self.requests.get(new.req_id)
            if request is not None and request.session_id:
                self._admitted(request, new.num_computed_tokens, now)
        if now >= self._next_housekeeping:
            self._housekeeping(now)
        done = time.perf_counter()
        own = (before - started) + (done - after)
        sorting = queue.sort_seconds - sorted_before if queue is not None else 0.0
        self.metrics.scheduled(own + sorting, after - before - sorting)
        self._step_started = done if output.scheduled_new_reqs else None
        self._step_tokens = output.total_num_scheduled_tokens
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any
    ) -> Any:
        started = getattr(self, "_step_started", None)
        if started is not None and not isinstance(self, AsyncScheduler):
            # The step ran new requests' prefill: one observed timing for the cost model.
            self._step_started = None
            if self._step_tokens >= _MIN_PREFILL_TOKENS:
                self.decider.learn_prefill(self._step_tokens, time.perf_counter() - started)
        return super().update_from_output(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def _admitted(self, request: Request, cached_tokens: int, now: float) -> None:
        program = request.session_id
        assert program is not None
        held = self.pins.admitted(program) is not None
        if held:
            self.metrics.hit(cached_tokens)
        event = self.tracker.admitted(program, now, pin_held=held)
        if event is not None:
            self._emit(event)

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + _HOUSEKEEPING_S
        for program in self.tracker.forget_idle(now, self.cachettl.idle_program_s):
            self.arrivals.forget(program)
        self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)

    # -- pinning at finish -------------------------------------------------------------
    def _free_blocks(self, request: Request) -> None:
        if not (self.cachettl.enabled and self._pin_finished(request)):
            super()._free_blocks(request)  # type: ignore[misc]

    def _pin_finished(self, request: Request) -> bool:
        """Track the finished turn; pin its blocks if it ends in a tool call. True when
        the blocks were taken care of here (pinned, or freed after a refused pin)."""
        program = request.session_id
        if not program or request.status not in _PINNABLE:
            return False
        hints: Hints = getattr(request, _HINTS_ATTR, None) or Hints()
        now = self.clock()
        if hints.last_turn:
            self._end_program(program, now)
            return False
        call = detect_tool_call(self._decode(request), hint=hints.tool)
        if call is None:
            self.tracker.finished(program, now, tool=None)
            return False
        args = hints.tool_args or call.arguments
        if not hints.pin or not self._request_blocks_can_be_freed(request):  # type: ignore[attr-defined]
            self.tracker.finished(program, now, tool=call.name, tool_args=args)
            return False
        waiting_tokens, free_tokens = self._load_signals(request.num_tokens)
        decision = self.decider.decide(
            tool=call.name,
            tool_args=args,
            context_tokens=request.num_tokens,
            turns_served=self.tracker.turns_served(program) + 1,
            program_id=program,
            override_ttl_s=hints.pin_ttl_s,
            waiting_tokens=waiting_tokens,
            free_tokens=free_tokens,
            offload=self.cpu_tier.on,
            offloaded_tokens=self.cpu_tier.offloaded_tokens(
                request.num_prompt_tokens, request.num_tokens, self.block_size
            ),
        )
        self.metrics.decision(decision.basis)
        if decision.ttl_s <= 0:
            self.tracker.finished(
                program, now, tool=call.name, tool_args=args, basis=decision.basis
            )
            return False
        result = self._take_pin(request, program, decision, now)
        self.tracker.finished(
            program,
            now,
            tool=call.name,
            tool_args=args,
            ttl_s=result.ttl_s,
            pinned=result.pinned,
            basis=decision.basis,
        )
        return True

    def _load_signals(self, context_tokens: int) -> tuple[int, int]:
        """KV tokens the waiting requests still need (prompts less their programs' pinned
        blocks) and free KV tokens now: the load the policy prices a pin against.

        The policy clamps (waiting − free) / context to at most 1, so the walk over the
        waiting queue stops once the sum passes free + context: a long queue under
        saturation costs a few requests, not all of them, and the decision is the same.
        """
        size = self.block_size
        free = self._pool.get_num_free_blocks() * size
        enough = free + context_tokens
        waiting = 0
        for r in self.waiting:
            pin = self.pins.get(r.session_id) if r.session_id else None
            held = pin.blocks * size if pin is not None else 0
            waiting += max(0, r.num_tokens - held)
            if waiting > enough:
                break
        return waiting, free

    def _take_pin(
        self, request: Request, program: str, decision: Decision, now: float
    ) -> PinResult[list[Any]]:
        """Hold the request's full, hashed blocks for the program (free the rest, and
        everything if the pin is refused); the request leaves the scheduler."""
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        keep = [b for b in blocks if b.block_hash is not None and not b.is_null]
        rest = [b for b in blocks if b.block_hash is None or b.is_null]
        if rest:
            self._pool.free_blocks(reversed(rest))
        over_budget = self.pins.pinned_blocks + len(keep) > self.pins.budget_blocks
        result = self.pins.pin(
            program,
            len(keep),
            now,
            decision.ttl_s,
            return_probability=decision.return_probability,
            benefit_s=decision.benefit_s,
            basis=decision.basis,
            handle=keep,
            waiting_programs=self._waiting_programs() if over_budget else (),
        )
        if result.pinned:
            self.metrics.pinned()
        elif keep:
            self._pool.free_blocks(reversed(keep))
        del self.requests[request.request_id]
        self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)
        return result

    def _end_program(self, program: str, now: float) -> None:
        self.pins.program_end(program)
        self.tracker.finished(program, now, tool=None)
        event = self.tracker.program_end(program, now)
        self.arrivals.forget(program)
        if event is not None:
            self._emit(event)

    def _on_release(self, pin: Pin[list[Any]], reason: ReleaseReason) -> None:
        if pin.handle:
            self._pool.free_blocks(reversed(pin.handle))
        self.tracker.pin_released(pin.program_id, reason)
        self.metrics.released(reason.value)
        self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)

    def _emit(self, event: ToolCallEvent | ProgramEndEvent) -> None:
        self.decider.learn_later(event)
        self.sink.submit(event)
        self.metrics.emitted()

    # -- memory pressure ---------------------------------------------------------------
    def _allocate_with_pressure(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        result = self._allocate(request, *args, **kwargs)
        if result is not None or not len(self.pins):
            return result
        for_running = request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
        idle = not any(r is not request for r in self.running)
        if not may_release(self.cachettl_rules[0], for_running=for_running, nothing_running=idle):
            return None
        now = self.clock()
        waiting = self._waiting_programs()
        victims = self.pins.pressure_victims(
            self.pins.pinned_blocks, now, waiting, last_resort=idle
        )
        for victim in victims:
            if victim.program_id == request.session_id:
                continue
            self.pins.release(victim.program_id, ReleaseReason.PRESSURE)
            result = self._allocate(request, *args, **kwargs)
            if result is not None:
                return result
        return None

    # -- lifecycle ---------------------------------------------------------------------
    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.pins.release_all(ReleaseReason.SHUTDOWN)
        return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def shutdown(self) -> None:
        self.pins.release_all(ReleaseReason.SHUTDOWN)
        self.decider.close()
        self.sink.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        super().shutdown()  # type: ignore[misc]

    # -- helpers -----------------------------------------------------------------------
    def _load_tokenizer(self) -> Any:
        model_config = self.vllm_config.model_config
        if model_config.skip_tokenizer_init:
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(
                model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
            )
        except Exception as exc:  # the hint still works without a tokenizer
            logger.warning("CacheTTL: no tokenizer for tool-call detection (%s)", exc)
            return None

    def _decode(self, request: Request) -> str | None:
        if self._tokenizer is None:
            return None
        tokens = list(request.output_token_ids)[-_MAX_DECODE_TOKENS:]
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))


class CacheTTLScheduler(CacheTTLMixin, Scheduler):
    """CacheTTL over vLLM's synchronous ``Scheduler`` (CPU; ``--no-async-scheduling``)."""


class CacheTTLAsyncScheduler(CacheTTLMixin, AsyncScheduler):
    """CacheTTL over vLLM's ``AsyncScheduler`` (GPU with async scheduling)."""
