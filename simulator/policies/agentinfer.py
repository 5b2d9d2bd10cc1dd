"""AgentInfer 0.2.0's Progress-TTL (PyPI ``agentinfer``, its vLLM ``--scheduler-cls`` bridge).

Read in the 0.2.0 wheel: ``agentinfer/agentcache/core/scheduler.py`` (the bridge retains a
program's request in its RequestPool before vLLM's own waiting queue, and passes admitted
ones on), ``agentinfer/scheduling/progress_ttl/strategy.py`` (``handle_admission``,
``schedule_resume``, ``repair_capacity``, ``handle_scheduled_check``,
``on_request_finished``), ``progress_ttl/rolling_stats.py`` (the TTL and the windows) and
``progress_ttl/config.py`` (every constant below, its default).

- **It never pins.** A finished turn's KV goes vLLM's usual way (freed into the LRU prefix
  cache); the program stays ACTIVE, ACTING for a TTL, and its context is *reserved* in the
  capacity count, so that other programs are held out and the cache survives.
- **TTL** (``rolling_stats.estimate_ttl``): one log-normal fitted over all same-program
  request intervals (no tool key), a window of 100; 0 until the window is full. The TTL
  maximises ``C·F(d) − E[T; T<d] − d·(1−F(d))`` over a 32-point log grid on
  [0.05, 32] s plus {0.05, 32, C}, capped at C, and is 0 when its utility is negative;
  ``C`` is the cold-prefill impact ``(2 − 0.15) · (0.042935 + 0.080027 x + 0.00220962 x²)``
  s for ``x`` thousand prompt tokens.
- **Admission** (``handle_admission``): a program's turn while it is ACTIVE goes in; a new
  program goes in only if nothing waits and ``remaining ≥ context + 100 + reserve``, where
  ``remaining = pool − (vLLM's used + ACTING programs' contexts + vLLM's waiting
  prompts)`` and the **growth reserve** is ``avg growth per round × (target rounds of the
  candidate + the rounds active programs still lack)``, the target being
  ``min(14, ceil(2 · mean rounds since a TTL pause))`` once 100 requests are seen (0
  before). **Batch-gain admission** lets it in without the reserve when the decode
  throughput gained (0.012112 + 0.0006939 b + 2.2516e-7 ctx s per step) times the mean
  decode time covers its cold prefill plus the continuity lost by the others.
- **Resume** (``schedule_resume``): paused programs with a waiting request, forced ones
  first, then most recently finished first (``resume_order`` mru); each is resumed if it
  fits with its reserve, by batch gain, or after pausing ACTING programs past their
  protected rounds (those with 14 rounds served first); a request waiting past its
  **force-resume deadline** (``3 · rounds ahead / request throughput``, clamped to
  [30, 300] s; 300 s until 100 requests are seen) is resumed regardless.
- **Expiry and repair**: an ACTING program past its TTL is paused (its reservation ends);
  when fewer tokens remain than the reasoning programs' mean completion, the longest
  tenured programs (tenure × context / mean prompt) are paused or marked to pause.

Left out, with the reason: privileges (a privileged program is resumed regardless of
capacity and never reclaimed; AgentInfer takes a session's id as its task id, so one
program at a time holds the privilege on a pool under 524,288 tokens; ``_can_promote``,
``_privileged_program_limit``) and the parent/child handoff (these traces carry no
parent): here that one program may be held where AgentInfer lets it through; the 30-min
paused retention release (no program here pauses that long); the ``auto`` mode (the
default is ``on``); and the subset-sum fit of reclaim victims (here: smallest first
within each layer until the deficit is covered).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from enginehook.core.rules import SchedulingRules
from simulator.policies.base import Param, SchedulingPolicy, register_scheduling_policy
from simulator.policies.cachettl import Cachettl

__all__ = [
    "AgentInfer",
    "CachettlAgentInfer",
    "ProgressTtlAdmission",
    "cold_prefill_impact_s",
    "install_progress_ttl",
    "progress_ttl",
]

# progress_ttl/config.py defaults.
WINDOW = 100
TTL_MIN_S, TTL_MAX_S = 0.05, 32.0
ALPHA = 0.15
PREFILL = (0.042935, 0.080027, 0.00220962)
DECODE = (0.012112, 0.0006939, 2.2516e-7)
DECODE_BUFFER = 100
MAX_SEGMENT_ROUNDS = 14
FORCE_SCALE, FORCE_MIN_S, FORCE_MAX_S = 3.0, 30.0, 300.0
GRID = 32
#: rolling_stats defaults before the request window has its first half.
DEFAULT_GROWTH, DEFAULT_COMPLETION, DEFAULT_DECODE_S = 1024.0, 256.0, 1.0


def cold_prefill_impact_s(prompt_tokens: int) -> float:
    """``_cache_miss_impact_seconds``: cold prefill plus its decode interference.

    >>> round(cold_prefill_impact_s(10_000), 3)
    1.969
    """
    if prompt_tokens <= 0:
        return 0.0
    x = prompt_tokens / 1000.0
    cold = PREFILL[0] + PREFILL[1] * x + PREFILL[2] * x * x
    return cold + (1.0 - ALPHA) * cold


def _utility(impact: float, ttl: float, mu: float, sigma: float) -> float:
    z = (math.log(max(ttl, 1e-6)) - mu) / sigma
    below = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    partial = (
        math.exp(mu + sigma * sigma / 2.0) * 0.5 * (1.0 + math.erf((z - sigma) / math.sqrt(2.0)))
    )
    return impact * below - partial - ttl * (1.0 - below)


def progress_ttl(intervals: list[float], impact: float) -> float:
    """``estimate_ttl`` on a full window of intervals (0 before it is full).

    >>> progress_ttl([1.0] * 50 + [2.0] * 50, 5.0) > 2.0
    True
    >>> progress_ttl([1.0] * 99, 5.0)
    0.0
    """
    if len(intervals) < WINDOW:
        return 0.0
    logs = [math.log(v) for v in intervals if v > 0]
    if len(logs) < 2:
        return min(TTL_MAX_S, max(TTL_MIN_S, impact))
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in logs) / len(logs))
    if sigma <= 1e-9:
        return min(impact, min(TTL_MAX_S, max(TTL_MIN_S, impact)))
    lo, hi = math.log(TTL_MIN_S), math.log(TTL_MAX_S)
    grid = {math.exp(lo + (hi - lo) * i / (GRID - 1)) for i in range(GRID)}
    grid |= {TTL_MIN_S, TTL_MAX_S, min(TTL_MAX_S, max(TTL_MIN_S, impact))}
    best = max(sorted(grid), key=lambda d: _utility(impact, d, mu, sigma))
    candidate = min(best, impact)
    return 0.0 if _utility(impact, candidate, mu, sigma) < 0 else candidate


@dataclass(slots=True)
class _Program:
    tokens: int
    reasoning: bool = True
    active: bool = False
    held: bool = False
    marked: bool = False
    served: int = 0
    rounds_since_pause: int = 0
    segment_started: float = 0.0
    context: int = 0
    last_finished: float | None = None
    ttl_deadline: float | None = None
    previous_ttl: float | None = None
    pending_gap: float | None = None
    force_deadline: float | None = None


class ProgressTtlAdmission:
    """AgentInfer's RequestPool in front of the engine, with the controller's admission
    interface (:class:`enginehook.core.admission.ProgramAdmission`'s methods).
    ``native()``: the engine's (used tokens, waiting prompt tokens not held here)."""

    def __init__(self, capacity_tokens: int, native: Callable[[], tuple[int, int]]) -> None:
        self.capacity_tokens = capacity_tokens
        self._native = native
        self._programs: dict[str, _Program] = {}
        self._intervals: deque[float] = deque(maxlen=WINDOW)
        self._requests: deque[tuple[int, int, float, int]] = deque(maxlen=WINDOW)
        self._spans: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._last_growth: dict[str, int] = {}
        self._dirty = True
        self.pauses = 0
        self.resumes = 0
        self.forced = 0

    # -- rolling statistics (rolling_stats.py) -----------------------------------------
    def _average(self, index: int, default: float) -> float:
        if len(self._requests) < WINDOW // 2:  # min_update_window_fraction 0.5
            return default
        return sum(float(r[index]) for r in self._requests) / len(self._requests)

    def _target_rounds(self) -> float:
        if len(self._requests) < WINDOW:
            return 0.0
        since = sum(r[3] for r in self._requests) / len(self._requests)
        return float(min(MAX_SEGMENT_ROUNDS, max(1, math.ceil(2 * since))))

    def _throughput(self) -> float:
        if not self._spans:
            return 0.0
        spans = sorted(self._spans)
        covered, start, end = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > end:
                covered, start, end = covered + end - start, s, e
            else:
                end = max(end, e)
        covered += end - start
        return len(spans) / covered if covered > 0 else 0.0

    def observe(self, program_id: str, output_tokens: int, latency_s: float, now: float) -> None:
        """A finished request (``on_request_finished``): its context growth, completion
        tokens, latency and span enter the request window."""
        program = self._programs.get(program_id)
        rounds = program.rounds_since_pause if program is not None else 0
        growth = self._last_growth.pop(program_id, 0)
        self._requests.append((growth, output_tokens, latency_s, rounds))
        self._spans.append((now - latency_s, now))

    # -- capacity (strategy.py) --------------------------------------------------------
    def _remaining(self) -> float:
        used, waiting = self._native()
        acting = sum(
            p.tokens + DECODE_BUFFER
            for p in self._programs.values()
            if p.active and not p.reasoning
        )
        return self.capacity_tokens - (used + acting + waiting)

    def _reserve(self, candidate: _Program) -> int:
        target = self._target_rounds()
        rounds = target + sum(
            max(0.0, target - p.served)
            for p in self._programs.values()
            if p.active and p is not candidate
        )
        return math.ceil(self._average(0, DEFAULT_GROWTH) * rounds)

    def _batch_gain(self, candidate: _Program, remaining: float) -> bool:
        running = [
            p for p in self._programs.values() if p.active and p.reasoning and p is not candidate
        ]
        if not running:
            return False
        context = sum(p.tokens for p in running)

        def rate(b: int, ctx: int) -> float:
            return b / (DECODE[0] + DECODE[1] * b + DECODE[2] * ctx)

        b = len(running)
        gain = max(0.0, rate(b + 1, context + candidate.tokens) / rate(b, context) - 1.0)
        gain_s = self._average(2, DEFAULT_DECODE_S) * gain
        return gain_s >= cold_prefill_impact_s(candidate.tokens) + self._continuity_loss(
            candidate, remaining
        )

    def _continuity_loss(self, candidate: _Program, remaining: float) -> float:
        growth, target = self._average(0, DEFAULT_GROWTH), self._target_rounds()
        if growth <= 0 or target <= 0:
            return 0.0
        protected = [
            (p, max(0.0, target - p.served))
            for p in self._programs.values()
            if p.active and p is not candidate and target - p.served > 0
        ]
        total = sum(r for _, r in protected)
        if total <= 0:
            return 0.0
        before = min(total, max(0.0, remaining) / growth)
        left = remaining - (candidate.tokens + DECODE_BUFFER) - growth * target
        after = min(total, max(0.0, left) / growth)
        lost = max(0.0, before - after)
        if lost <= 0:
            return 0.0
        cost = sum(cold_prefill_impact_s(p.tokens) for p, _ in protected) / len(protected)
        if cost <= 0:
            return 0.0
        return math.inf if after <= 0 else lost / after * cost

    def _fits(self, program: _Program, remaining: float) -> bool:
        required = program.tokens + DECODE_BUFFER
        if remaining >= required + self._reserve(program):
            return True
        return remaining >= required and self._batch_gain(program, remaining)

    # -- the controller's admission interface ----------------------------------------
    def arrived(self, program_id: str, tokens: int, now: float) -> bool:
        self._dirty = True
        program = self._programs.get(program_id)
        if program is None:
            program = self._programs[program_id] = _Program(tokens, segment_started=now)
            if not any(p.held for p in self._programs.values()) and self._fits(
                program, self._remaining()
            ):
                program.active = True
                return True
            self._queue(program, now)
            return False
        program.tokens, program.reasoning, program.ttl_deadline = tokens, True, None
        if program.last_finished is not None:
            program.pending_gap = now - program.last_finished
        if program.active:
            return True  # already_active
        alone = not any(p.held for p in self._programs.values())
        required = tokens + DECODE_BUFFER
        if alone and self._remaining() >= required + self._reserve(program):
            self._resume(program, now)
            return True
        self._queue(program, now)
        return False

    def acting(self, program_id: str, tokens: int, now: float) -> None:
        self._dirty = True
        program = self._programs.get(program_id)
        if program is None:
            return
        self._last_growth[program_id] = max(0, tokens - program.context)
        impact = cold_prefill_impact_s(program.tokens)
        if program.previous_ttl is not None and program.pending_gap:
            self._intervals.append(program.pending_gap)
        ttl = progress_ttl(list(self._intervals), impact)
        program.tokens, program.context, program.reasoning = tokens, tokens, False
        program.served += 1
        program.rounds_since_pause += 1
        program.previous_ttl, program.pending_gap = ttl, None
        program.last_finished, program.ttl_deadline = now, now + ttl
        if program.marked:
            program.marked = False
            self._pause(program, now)

    def ended(self, program_id: str) -> None:
        self._dirty = True
        self._programs.pop(program_id, None)
        self._last_growth.pop(program_id, None)

    def held(self, program_id: str | None) -> bool:
        program = self._programs.get(program_id) if program_id is not None else None
        return program is not None and program.held

    def paused_count(self) -> int:
        return sum(1 for p in self._programs.values() if p.held)

    def next_tick(self) -> float:
        times = [
            t
            for p in self._programs.values()
            for t in (p.ttl_deadline if p.active and not p.reasoning else None, p.force_deadline)
            if t is not None
        ]
        return min(times, default=math.inf)

    def due(self, now: float) -> bool:
        return self._dirty or now >= self.next_tick()

    def tick(self, now: float) -> list[str]:
        """One Progress-TTL cycle: expire TTLs, resume, repair capacity."""
        self._dirty = False
        for program in self._programs.values():
            deadline = program.ttl_deadline
            if (
                program.active
                and not program.reasoning
                and deadline is not None
                and deadline <= now
            ):
                program.rounds_since_pause = 0
                self._pause(program, now)
        resumed = self._schedule_resume(now)
        self._repair(now)
        return resumed

    # -- transitions ---------------------------------------------------------------------
    def _queue(self, program: _Program, now: float) -> None:
        program.active, program.held = False, True
        program.force_deadline = now + self._force_timeout(program)

    def _force_timeout(self, candidate: _Program) -> float:
        rate = self._throughput()
        if len(self._requests) < WINDOW or rate <= 0:
            return FORCE_MAX_S
        target = self._target_rounds()
        active = sum(
            max(1.0 if p.reasoning else 0.0, target - p.served)
            for p in self._programs.values()
            if p.active
        )
        pool = sum(max(1.0, target - p.served) for p in self._programs.values() if p.held)
        return min(FORCE_MAX_S, max(FORCE_MIN_S, FORCE_SCALE * (active + pool) / rate))

    def _pause(self, program: _Program, now: float) -> None:
        if program.active:
            self.pauses += 1
        program.active, program.served, program.ttl_deadline = False, 0, None

    def _resume(self, program: _Program, now: float) -> None:
        program.active, program.held, program.force_deadline = True, False, None
        program.served, program.segment_started = 0, now
        self.resumes += 1

    def _schedule_resume(self, now: float) -> list[str]:
        def key(item: tuple[str, _Program]) -> tuple[int, float, str]:
            pid, p = item
            forced = p.force_deadline is not None and now >= p.force_deadline
            tier = -2 if forced else (0 if p.last_finished is not None else 1)
            return tier, -(p.last_finished or 0.0), pid

        resumed: list[str] = []
        for pid, program in sorted(((k, p) for k, p in self._programs.items() if p.held), key=key):
            forced = program.force_deadline is not None and now >= program.force_deadline
            if forced:
                self.forced += 1
            elif not self._fits(program, self._remaining()) and not self._reclaim(program, now):
                continue
            self._resume(program, now)
            resumed.append(pid)
        return resumed

    def _reclaim(self, program: _Program, now: float) -> bool:
        """Pause ACTING programs past their protected rounds until the candidate fits."""
        protected = int(self._target_rounds())
        deficit = program.tokens + DECODE_BUFFER + self._reserve(program) - self._remaining()
        victims = [
            p
            for p in self._programs.values()
            if p.active and not p.reasoning and p.served >= protected
        ]
        layered = sorted(victims, key=lambda p: (p.served < MAX_SEGMENT_ROUNDS, p.tokens))
        chosen, relief = [], 0
        for victim in layered:
            if relief >= deficit:
                break
            chosen.append(victim)
            relief += victim.tokens + DECODE_BUFFER
        if relief < deficit:
            return False
        for victim in chosen:
            self._pause(victim, now)
        return self._remaining() >= program.tokens + DECODE_BUFFER + self._reserve(program)

    def _repair(self, now: float) -> None:
        active = [p for p in self._programs.values() if p.active]
        completion = math.ceil(self._average(1, DEFAULT_COMPLETION))
        headroom = sum(1 for p in active if p.reasoning) * completion
        relief = sum(p.tokens + completion for p in active if p.reasoning and p.marked)
        deficit = headroom - self._remaining() - relief
        if deficit <= 0:
            return
        prompt = max(1.0, sum(p.tokens for p in active) / len(active))
        order = sorted(
            (p for p in active if not p.marked),
            key=lambda p: (-(now - p.segment_started) * p.tokens / prompt, -p.tokens),
        )
        for victim in order:
            if deficit <= 0:
                return
            if victim.reasoning:
                victim.marked = True
                deficit -= victim.tokens + DECODE_BUFFER + completion
            else:
                self._pause(victim, now)
                deficit -= victim.tokens + DECODE_BUFFER

    def __repr__(self) -> str:
        return (
            f"ProgressTtlAdmission(capacity={self.capacity_tokens}, "
            f"programs={len(self._programs)}, "
            f"held={self.paused_count()})"
        )


@register_scheduling_policy
class AgentInfer(SchedulingPolicy):
    """AgentInfer 0.2.0's Progress-TTL in front of vLLM (module docstring): FCFS engine,
    end-of-turn release into the LRU prefix cache, no pins; programs held before the
    engine's queue by :class:`ProgressTtlAdmission`."""

    name = "agentinfer"
    help = "AgentInfer 0.2.0 Progress-TTL: hold other programs out at admission; no pins"
    RULES = SchedulingRules(ordering="fcfs", admission="thunderagent")
    PARAMS: ClassVar[dict[str, Param]] = {}

    def attach(self, host: Any) -> None:
        self.admission = install_progress_ttl(host, count_pins=True)


def install_progress_ttl(host: Any, *, count_pins: bool) -> ProgressTtlAdmission:
    """Put a :class:`ProgressTtlAdmission` in front of ``host``'s engine (the run's
    :class:`simulator.sim.Simulation`) as its controller's admission; it learns from every
    finished request. ``count_pins``: whether blocks only pins hold count in the used KV
    the admission reads (with the CacheTTL hook, vLLM's ``get_kv_cache_usage`` counts
    them as free unless the rule ``pins_in_kv_usage`` is on)."""
    engine, size = host.engine, host.config.block_size
    pins = host.controller.pins
    admission: ProgressTtlAdmission | None = None

    def native() -> tuple[int, int]:
        waiting = sum(
            r.prompt_tokens
            for r in engine.waiting
            if admission is None or not admission.held(r.program_id)
        )
        used = engine.pool.used - (0 if count_pins else pins.pinned_blocks)
        return used * size, waiting

    admission = ProgressTtlAdmission(engine.pool.num_blocks * size, native)
    host.controller.admission = admission
    finish = host.on_finish

    def on_finish(request: Any, now: float) -> None:
        finish(request, now)  # the controller's turn end (the admission's ``acting``)
        admitted = request.first_admitted_at
        latency = now - (admitted if admitted is not None else request.arrival)
        admission.observe(request.program_id, request.output_tokens, latency, now)

    host.on_finish = on_finish
    return admission


@register_scheduling_policy
class CachettlAgentInfer(Cachettl):
    """AgentInfer's Progress-TTL admission (as ``agentinfer``) in front of an engine
    running ``cachettl``: its rules, its pins and its queue order behind the admission.
    The admission reads the used KV as the hook publishes it (pins count as free unless
    ``pins_in_kv_usage``), and a request it holds does not keep a pin past its expiry."""

    name = "cachettl-agentinfer"
    help = "AgentInfer's Progress-TTL admission in front of cachettl (pins, program order)"

    def attach(self, host: Any) -> None:
        admission = install_progress_ttl(host, count_pins=self.rules.pins_in_kv_usage)
        self.admission = admission
        engine = host.engine

        def waiting_programs() -> set[str]:
            return {p for p in engine.waiting_programs() if not admission.held(p)}

        # A request the admission holds is not waiting for the engine: it does not keep
        # its program's pin past expiry, nor shield the pin from pressure. Otherwise a
        # held program's pin lives until the admission resumes it, holding KV the
        # admission (which reads pins as free) has given to others.
        host.waiting_programs = waiting_programs
