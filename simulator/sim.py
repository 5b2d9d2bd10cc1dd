"""A simulation run: programs → LLM turn → tool gap → next turn, on one engine.

:class:`Simulation` owns the event loop and the engine, and hosts the shipped
:class:`enginehook.core.lifecycle.PinController` (the object the vLLM hook runs) with the
policy's rules and TTLs: the controller pins finished turns, expires pins, releases them
under pressure, orders the waiting queue and follows tool calls (duration = next arrival −
finish, pin outcome, admission delay), whose events the policy learns from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.pins import Pin, ReleaseReason
from enginehook.core.tracker import CacheSeen, ProgramEndReport, ToolCallReport
from estimator import DEFAULT_PROFILE, HardwareProfile, get_profile
from simulator.engine import Engine, EngineConfig, Request
from simulator.loop import ARRIVAL, STEP_END, STEP_START, Event, EventLoop
from simulator.policies import SchedulingPolicy, get_scheduling_policy
from simulator.steptime import StepTimer
from simulator.trace import Program

__all__ = ["PinHandle", "ProgramResult", "ProgramState", "RunResult", "Simulation", "simulate"]

#: What the simulator stores with a pin: the program's full blocks it caches.
PinHandle = int


@dataclass(slots=True)
class ProgramResult:
    """What happened to one program."""

    program_id: str
    arrival_s: float
    finish_s: float
    turns: int
    tokens: int
    first_turn_wait_s: float

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(slots=True)
class RunResult:
    """One policy's run over a trace."""

    policy: str
    programs: list[ProgramResult]
    prompt_tokens: int
    hit_tokens: int
    preemptions: int
    pinned_block_seconds: float
    num_blocks: int
    makespan_s: float
    steps: int
    pins: dict[str, int] = field(default_factory=dict)
    #: ``(time s, pinned share, used share, running, waiting)`` sampled once per
    #: ``Simulation.sample_every_s`` of simulated time (at step starts).
    timeline: list[tuple[float, float, float, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _State:
    program: Program
    next_turn: int = 0
    context: int = 0
    first_wait: float = math.nan


#: A program's progress (next turn, context so far), shared by the engines it visits.
ProgramState = _State


class _Arrival(Event):
    __slots__ = ("sim", "state")

    def __init__(self, time: float, sim: Simulation, state: _State) -> None:
        super().__init__(time, ARRIVAL)
        self.sim, self.state = sim, state

    def handle(self, loop: EventLoop) -> Iterable[Event]:
        return self.sim.arrive(self.state, loop.now)


class _StepStart(Event):
    __slots__ = ("sim",)

    def __init__(self, time: float, sim: Simulation) -> None:
        super().__init__(time, STEP_START)
        self.sim = sim

    def handle(self, loop: EventLoop) -> Iterable[Event]:
        return self.sim.start_step(loop.now, self.sim.horizon())


class _StepEnd(Event):
    __slots__ = ("scheduled", "sim", "steps")

    def __init__(
        self, time: float, sim: Simulation, scheduled: list[tuple[Request, int]], steps: int
    ) -> None:
        super().__init__(time, STEP_END)
        self.sim, self.scheduled, self.steps = sim, scheduled, steps

    def handle(self, loop: EventLoop) -> Iterable[Event]:
        return self.sim.end_step(self.scheduled, self.steps, loop.now)


class Simulation:
    """One policy on one engine over a list of programs."""

    def __init__(
        self,
        programs: Sequence[Program],
        policy: SchedulingPolicy,
        hardware: str | HardwareProfile = DEFAULT_PROFILE,
        config: EngineConfig | None = None,
        on_program_end: Callable[[ProgramResult], None] | None = None,
        timer: StepTimer | None = None,
        loop: EventLoop | None = None,
    ) -> None:
        """``hardware``: a profile name or a :class:`HardwareProfile` (e.g. one fitted to
        a measured engine); ``timer`` replaces the roofline step-time model; ``loop``
        shares one event loop between several engines (a cluster)."""
        self.programs = programs
        self.policy = policy
        self.config = config or EngineConfig()
        profile = get_profile(hardware) if isinstance(hardware, str) else hardware
        self.timer = timer or StepTimer(profile)
        self.loop = loop if loop is not None else EventLoop()
        victim = self._lowest_ranked if policy.preempt_by_order else None
        self.engine = Engine(self.config, self.timer, self._key, self, victim)
        policy.bind(profile, self.engine.cpu is not None)
        policy.see_trace(programs)
        policy.other_context = self._running_context
        self.controller: PinController[PinHandle] = PinController(
            policy.rules,
            self,
            pool_blocks=self.engine.pool.num_blocks,
            decider=policy if policy.uses_pins else None,
            engine_id="sim",
            cpu_tier=self.engine.cpu is not None,
            block_size=self.config.block_size,
        )
        self.pins = self.controller.pins
        policy.attach(self)
        self.on_program_end = on_program_end
        self.results: list[ProgramResult] = []
        self.pin_outcomes: dict[str, int] = {}
        self._states: dict[str, _State] = {}
        self.sample_every_s = 1.0
        self._next_sample = 0.0
        self.timeline: list[tuple[float, float, float, int, int]] = []
        self._stepping = False
        self._pinned_integral = 0.0
        self._steps = 0

    # -- the controller's host interface -------------------------------------------------
    def _key(self, r: Request) -> tuple[object, ...]:
        return self.controller.order_key(0, r.preempted, r.program_id, r.arrival, r.request_id)

    def _lowest_ranked(self, running: list[Request]) -> Request:
        return max(running, key=self._key)

    def _running_context(self) -> int:
        return sum(r.computed for r in self.engine.running)

    def free_tokens(self) -> int:
        return self.engine.pool.free * self.config.block_size

    def waiting_requests(self) -> Iterator[tuple[str | None, int]]:
        return ((r.program_id, r.prompt_tokens) for r in self.engine.waiting)

    def waiting_programs(self) -> Collection[str]:
        return self.engine.waiting_programs()

    def pinned_tokens(self, pin: Pin[PinHandle]) -> int:
        return (pin.handle or 0) * self.config.block_size

    def pin_released(self, pin: Pin[PinHandle], reason: ReleaseReason) -> None:
        self.pin_outcomes[reason.value] = self.pin_outcomes.get(reason.value, 0) + 1
        if reason is not ReleaseReason.HIT and pin.handle is not None:
            self.engine.pool.release(pin.program_id, pin.blocks, pin.handle)

    def emit(self, event: ToolCallReport | ProgramEndReport) -> None:
        self.policy.learn(event)

    # -- the engine's host interface -----------------------------------------------------
    def may_admit(self, request: Request) -> bool:
        return self.controller.may_admit(request.program_id)

    def pinned_blocks_of(self, program_id: str) -> int:
        pin = self.pins.get(program_id)
        return pin.handle if pin is not None and pin.handle is not None else 0

    def take_pin(self, request: Request, now: float) -> int:
        request.extra["tracked"] = True
        size = self.config.block_size
        given = min(self.pinned_blocks_of(request.program_id), (request.prompt_tokens - 1) // size)
        seen = self._seen(request, given * size)
        pin = self.controller.admitted(request.program_id, now, seen).pin
        if pin is None or pin.handle is None:
            return 0
        self.engine.pool.release(request.program_id, pin.blocks - given, 0)
        return given

    def _seen(self, request: Request, hit_tokens: int) -> CacheSeen:
        """What admission saw of the request's cache: its hit, and the reusable prefix
        (the previous turn's cached full blocks; prompts here always extend the previous
        context, so nothing diverges)."""
        state: _State = request.extra["state"]
        size = self.config.block_size
        reusable = min(max(0, state.context - 1) // size, (request.prompt_tokens - 1) // size)
        return CacheSeen(hit_tokens, request.prompt_tokens, reusable_tokens=reusable * size)

    def release_pins(self, needed: int, request: Request, now: float, running: bool) -> bool:
        released = self.controller.relieve(
            needed,
            request.program_id,
            for_running=running or request.preempted,
            nothing_running=not self.engine.running,
            now=now,
            waited_s=now - request.arrival,
        )
        if released:
            self.engine.waiting.mark_dirty()
        return released > 0

    def on_admit(self, request: Request, now: float) -> None:
        if request.first_admitted_at is not None:
            return
        request.first_admitted_at = now
        state: _State = request.extra["state"]
        if request.turn == 0:
            state.first_wait = now - request.arrival
        if not request.extra.get("tracked"):
            seen = self._seen(request, request.hit_tokens)
            pin = self.controller.admitted(request.program_id, now, seen).pin
            if pin is not None and pin.handle is not None:  # a pin of a sub-block prefix
                self.engine.pool.release(pin.program_id, pin.blocks, pin.handle)

    def on_finish(self, request: Request, now: float) -> None:
        state: _State = request.extra["state"]
        program = state.program
        state.context = request.computed + 1
        turn = program.turns[request.turn]
        cpu = self.engine.cpu is not None
        full = request.computed // self.config.block_size
        finish = self.controller.finished(
            FinishedTurn(
                program.program_id,
                turn.tool,
                turn.tool_args,
                context_tokens=request.computed,
                tenant=program.tenant,
                last_turn=turn.tool is None,
                offloaded_tokens=full * self.config.block_size if cpu else None,
                service_s=now - (request.admitted_at or now),
                output_tokens=turn.output_tokens,
                true_duration_s=turn.tool_duration_s,
            ),
            now,
            lambda: (request.blocks, full),
        )
        if finish.pinned:
            request.blocks = 0
            self.engine.waiting.mark_dirty()
        else:
            self.engine.finish_release(request)
        if turn.tool is None:
            self._record(state, now)
            return
        self.schedule_return(state, now + turn.tool_duration_s)

    def horizon(self) -> float:
        """Until when nothing from outside can change this engine's batch (the next
        queued event; a cluster: the next routing decision): decode steps fold up to it."""
        return self.loop.next_time()

    def schedule_return(self, state: _State, at: float) -> None:
        """The program's next turn arrives at ``at`` (here, on this engine; a cluster
        routes it instead)."""
        self.loop.schedule(_Arrival(at, self, state))

    def _record(self, state: _State, now: float) -> None:
        program = state.program
        result = ProgramResult(
            program.program_id,
            program.arrival_s,
            now,
            len(program.turns),
            program.total_tokens,
            state.first_wait,
        )
        self.results.append(result)
        if self.on_program_end is not None:
            self.on_program_end(result)

    # -- events ------------------------------------------------------------------------
    def arrive(self, state: _State, now: float) -> Iterable[Event]:
        program = state.program
        k = state.next_turn
        state.next_turn += 1
        turn = program.turns[k]
        prompt = state.context + turn.input_tokens
        self.controller.arrived(program.program_id, now, now, program.tenant, prompt)
        request = Request(
            f"{program.program_id}#{k}",
            program.program_id,
            k,
            now,
            program.arrival_s,
            state.context + turn.input_tokens,
            turn.output_tokens,
        )
        request.extra["state"] = state
        self.engine.add(request)
        return self._kick(now)

    def _kick(self, now: float) -> list[Event]:
        if self._stepping:
            return []
        self._stepping = True
        return [_StepStart(now, self)]

    def _sample(self, now: float) -> None:
        pool = self.engine.pool
        self.timeline.append(
            (
                now,
                self.pins.pinned_blocks / pool.num_blocks,
                pool.used / pool.num_blocks,
                len(self.engine.running),
                len(self.engine.waiting),
            )
        )
        self._next_sample = now + self.sample_every_s

    def start_step(self, now: float, horizon: float) -> Iterable[Event]:
        if now >= self._next_sample:
            self._sample(now)
        changed = self.controller.admission_tick(now)
        if self.controller.expire(now) or changed:
            self.engine.waiting.mark_dirty()
        scheduled, reload, blocked = self.engine.schedule(now)
        if not scheduled:
            self._stepping = False
            wake = None
            if self.engine.waiting:
                times = (self.pins.next_expiry(), self.controller.next_admission_check())
                wake = min((t for t in times if t is not None), default=None)
            if wake is not None:
                self._stepping = True
                return [_StepStart(max(wake, now) + 1e-9, self)]
            return []
        dt = self.engine.step_time(scheduled, reload)
        steps = 1
        if not reload and (blocked or not self.engine.waiting):
            limit = horizon
            if len(self.pins):  # an expiry changes memory (and maybe admission)
                limit = min(limit, self.pins.next_expiry() or math.inf)
            check = self.controller.next_admission_check()
            if check is not None:  # a resume changes admission
                limit = min(limit, check)
            steps, dt = self._fast_forward(scheduled, now, dt, limit)
        self._pinned_integral += self.pins.pinned_blocks * dt
        self._steps += steps
        return [_StepEnd(now + dt, self, scheduled, steps)]

    def _fast_forward(
        self, scheduled: list[tuple[Request, int]], now: float, dt: float, limit: float
    ) -> tuple[int, float]:
        """Fold consecutive decode-only steps of an unchanged batch into one event."""
        running = self.engine.running
        if now + dt >= limit or len(scheduled) != len(running):
            return 1, dt  # the limit falls within this step, or it admits requests
        if any(r.prefilling for r in running):
            return 1, dt
        steps = min(r.output_tokens - r.generated for r in running)
        if steps <= 1:
            return 1, dt
        context = sum(r.computed for r in running) + 2 * len(running)
        extra = self.timer.decode_run(len(running), context, steps - 1, now + dt, limit)
        count, total = extra
        block = self.config.block_size
        while count:
            need = sum(-(-(r.computed + 1 + count) // block) - r.blocks for r in running)
            if need <= self.engine.pool.free:
                break
            count //= 2
        if count == 0:
            return 1, dt
        if count != extra[0]:
            total = self.timer.decode_run(len(running), context, count, now + dt, math.inf)[1]
        for r in running:
            need = -(-(r.computed + 1 + count) // block) - r.blocks
            if need:
                self.engine.pool.allocate(need)
                r.blocks += need
        return count + 1, dt + total

    def end_step(
        self, scheduled: list[tuple[Request, int]], steps: int, now: float
    ) -> Iterable[Event]:
        if steps > 1:
            for request, _ in scheduled:
                request.computed += steps - 1
                request.generated += steps - 1
        self.engine.complete(scheduled, now)
        self._stepping = False
        if self.engine.idle():
            return []
        if self.loop.next_time() > now:
            # Nothing else is queued at ``now``: the step start that ``_kick`` would queue
            # is the loop's next event, so it runs here at once (the same order, one event
            # less; in a cluster most steps end on a routing decision elsewhere).
            self._stepping = True
            return self.start_step(now, self.horizon())
        return self._kick(now)

    # -- running -----------------------------------------------------------------------
    def run(self) -> RunResult:
        pool_tokens = self.engine.pool.num_blocks * self.config.block_size
        if len({p.program_id for p in self.programs}) != len(self.programs):
            raise ValueError("program ids must be unique within a run")
        for program in self.programs:
            if program.total_tokens + self.config.block_size > pool_tokens:
                raise ValueError(
                    f"program {program.program_id!r} needs {program.total_tokens} tokens of "
                    f"KV; the pool holds {pool_tokens} (the run could never finish)"
                )
        for program in self.programs:
            state = self._states[program.program_id] = _State(program)
            self.loop.schedule(_Arrival(program.arrival_s, self, state))
        self.loop.run()
        first = min((p.arrival_s for p in self.programs), default=0.0)
        end = max((r.finish_s for r in self.results), default=first)
        return RunResult(
            self.policy.label,
            self.results,
            self.engine.prompt_tokens,
            self.engine.hit_tokens,
            self.engine.preemptions,
            self._pinned_integral,
            self.engine.pool.num_blocks,
            end - first,
            self._steps,
            dict(self.pin_outcomes),
            self.timeline,
        )


def simulate(
    programs: Sequence[Program],
    policy: str,
    hardware: str | HardwareProfile = DEFAULT_PROFILE,
    config: EngineConfig | None = None,
    on_program_end: Callable[[ProgramResult], None] | None = None,
) -> RunResult:
    """Run ``programs`` under the policy ``policy`` (a name or ``name(key=value,...)``)."""
    sim = Simulation(programs, get_scheduling_policy(policy), hardware, config, on_program_end)
    return sim.run()
