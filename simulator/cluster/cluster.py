"""N simulated engines on one event loop behind a router, with engines joining and
leaving mid-run, and the cluster's figures.

Each engine is :class:`simulator.cluster.engines.ClusterEngine` (the single-engine
simulation, unchanged, with its own retention policy and :class:`PinController`). A
program's first turn arrives at its arrival time; every turn, first or returning, is routed
when it arrives (returning turns after their tool call). Same-time order is the loop's:
step ends, then arrivals and topology changes (in scheduling order), then step starts.

Figures (:class:`ClusterResult`):

* JCT mean / P90 / P99 and new programs' first-turn wait (P90), the router's hold included;
* returning turns' hit share: hit tokens over reusable context tokens of returning turns;
* orphaned pin token-seconds: the whole life of each pin on an engine its program's next
  turn was routed away from (while the pin lived), or that left the cluster;
* load imbalance: max over mean of engines' queued tokens (prompts arrived, not admitted),
  sampled at every routing decision where the mean is positive, averaged;
* pinned programs remapped by a topology change: live pins whose router binding named
  their holder before the change and another engine (or none) after it; pins on a removed
  engine count too.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from enginehook.core.pins import Pin, ReleaseReason
from estimator import HardwareProfile
from simulator.cluster.base import Router, TurnRequest, get_router
from simulator.cluster.engines import ClusterEngine
from simulator.engine import EngineConfig
from simulator.loop import ARRIVAL, Event, EventLoop
from simulator.metrics import percentile
from simulator.sim import ProgramResult, ProgramState
from simulator.trace import Program

__all__ = ["Cluster", "ClusterResult", "TopologyChange", "simulate_cluster"]


@dataclass(frozen=True, slots=True)
class TopologyChange:
    """At ``at_s`` an engine joins (``add``) or leaves (``remove``: ``engine``, default the
    newest live one; it drains what it holds and takes nothing new, its pins go)."""

    at_s: float
    action: str
    engine: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ("add", "remove"):
            raise ValueError(f"action must be 'add' or 'remove', got {self.action!r}")
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"at_s must be a finite time >= 0, got {self.at_s!r}")


@dataclass(slots=True)
class ClusterResult:
    """One (router, retention) run over a trace."""

    router: str
    retention: str
    programs: list[ProgramResult]
    returning_hit_tokens: int = 0
    returning_reusable_tokens: int = 0
    orphaned_token_s: float = 0.0
    pinned_token_s: float = 0.0
    imbalance_sum: float = 0.0
    imbalance_samples: int = 0
    remapped_pins: int = 0
    moved_returns: int = 0
    returns: int = 0
    dropped_pins: int = 0
    per_engine_programs: dict[int, int] = field(default_factory=dict)

    def figures(self, isolated: dict[str, float] | None = None) -> dict[str, float]:
        jct = [p.jct_s for p in self.programs]
        waits = [p.first_turn_wait_s for p in self.programs if not math.isnan(p.first_turn_wait_s)]
        out = {
            "mean_jct_s": math.fsum(jct) / len(jct) if jct else math.nan,
            "p90_jct_s": percentile(jct, 90),
            "p99_jct_s": percentile(jct, 99),
            "first_turn_wait_p90_s": percentile(waits, 90),
            "returning_hit_share": _ratio(
                self.returning_hit_tokens, self.returning_reusable_tokens
            ),
            "orphaned_pin_token_s": self.orphaned_token_s,
            "pinned_token_s": self.pinned_token_s,
            "load_imbalance": _ratio(self.imbalance_sum, self.imbalance_samples),
            "remapped_pins": float(self.remapped_pins),
            "moved_return_share": _ratio(self.moved_returns, self.returns),
            "dropped_pins": float(self.dropped_pins),
            "programs": float(len(self.programs)),
        }
        if isolated:
            slow = [p.jct_s / isolated[p.program_id] for p in self.programs]
            out["mean_slowdown"] = math.fsum(slow) / len(slow)
        return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


class _Call(Event):
    """A routing decision, a router's timer or a topology change: the only events through
    which one engine (or the router) affects another."""

    __slots__ = ("action", "cluster")

    def __init__(
        self, time: float, action: Callable[[float], Iterable[Event]], cluster: Cluster
    ) -> None:
        super().__init__(time, ARRIVAL)
        self.action, self.cluster = action, cluster

    def handle(self, loop: EventLoop) -> Iterable[Event]:
        heapq.heappop(self.cluster.calls)
        return self.action(loop.now)


class Cluster:
    """Engines, a router and one event loop; :meth:`run` replays ``programs``."""

    def __init__(
        self,
        programs: Sequence[Program],
        router: str | Router,
        retention: str = "vllm",
        engines: int = 4,
        hardware: str | HardwareProfile = "llama3.1-8b-h100",
        config: EngineConfig | None = None,
        topology: Sequence[TopologyChange] = (),
        seed: int = 0,
    ) -> None:
        if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
            raise ValueError(f"engines must be an integer >= 1, got {engines!r}")
        self.programs = programs
        self.router = get_router(router, seed) if isinstance(router, str) else router
        self.retention, self.hardware, self.config = retention, hardware, config
        self.topology = sorted(topology, key=lambda c: c.at_s)
        self.loop = EventLoop()
        self.calls: list[float] = []  # times of the pending _Call events (a heap)
        self.all: dict[int, ClusterEngine] = {}
        self.live: list[ClusterEngine] = []
        self.router.attach(self)
        for _ in range(engines):
            self._add(0.0)
        self.result = ClusterResult(self.router.label, retention, [])
        self._states: dict[str, ProgramState] = {}
        self._at: dict[str, tuple[int, float]] = {}  # program → (engine, routed at)
        self._orphans: set[tuple[int, str, int]] = set()

    # -- topology ------------------------------------------------------------------------
    def _add(self, now: float) -> ClusterEngine:
        engine = ClusterEngine(
            self, len(self.all), self.retention, self.hardware, self.config, self.loop
        )
        self.all[engine.engine_id] = engine
        self.live.append(engine)
        self.router.joined(engine, now)
        return engine

    def _change(self, change: TopologyChange, now: float) -> Iterable[Event]:
        pinned = [(e, p.program_id) for e in self.live for p in e.pins]
        before = {pid: self.router.binding(pid, now) for _, pid in pinned}
        if change.action == "add":
            self._add(now)
        else:
            self._remove(change, now)
        live = {e.engine_id for e in self.live}
        for holder, pid in pinned:
            gone = holder.engine_id not in live
            if gone or (before[pid] == holder.engine_id != self.router.binding(pid, now)):
                self.result.remapped_pins += 1
        return []

    def _remove(self, change: TopologyChange, now: float) -> None:
        if len(self.live) < 2:
            raise ValueError(f"cannot remove an engine at {change.at_s} s: only one is left")
        ids = [e.engine_id for e in self.live]
        target = change.engine if change.engine is not None else ids[-1]
        if target not in ids:
            raise ValueError(f"engine {target} is not live at {change.at_s} s (live: {ids})")
        engine = self.all[target]
        self.live.remove(engine)
        self.router.left(engine, now)
        for pin in list(engine.pins):
            self._orphans.add((target, pin.program_id, pin.generation))
        engine.controller.release_all(ReleaseReason.SHUTDOWN)

    def _call(self, at: float, action: Callable[[float], Iterable[Event]]) -> None:
        heapq.heappush(self.calls, at)
        self.loop.schedule(_Call(at, action, self))

    def next_call(self) -> float:
        """When the next routing decision (or timer, or topology change) happens."""
        return self.calls[0] if self.calls else math.inf

    # -- the router's host interface ----------------------------------------------------
    def engine(self, engine_id: int) -> ClusterEngine | None:
        engine = self.all.get(engine_id)
        return engine if engine is not None and engine in self.live else None

    def call_at(self, at: float, action: Callable[[float], None]) -> None:
        def run(now: float) -> list[Event]:
            action(now)
            return []

        self._call(max(at, self.loop.now), run)

    def submit(self, program_id: str, engine_id: int, now: float) -> None:
        """A held turn goes to ``engine_id`` now."""
        state = self._states[program_id]
        self._call(now, lambda t: self._deliver(state, self.all[engine_id], t))

    def drop_pin(self, engine_id: int, program_id: str) -> None:
        """The router sent the program elsewhere: its holder releases the pin at once."""
        engine = self.all[engine_id]
        self._orphan(engine_id, program_id)  # its life until now was for nothing
        if engine.controller.close(program_id) is not None:
            self.result.dropped_pins += 1

    # -- the engines' host interface ----------------------------------------------------
    def schedule_return(self, state: ProgramState, at: float) -> None:
        self._call(at, lambda now: self._dispatch(state, now))

    def turn_finished(
        self, engine: ClusterEngine, program_id: str, context: int, now: float
    ) -> None:
        self.router.turn_finished(engine, program_id, context, now)

    def returning_hit(self, hit: int, reusable: int) -> None:
        self.result.returning_hit_tokens += hit
        self.result.returning_reusable_tokens += reusable

    def pin_ended(self, engine: ClusterEngine, pin: Pin[int], reason: ReleaseReason) -> None:
        now = self.loop.now
        tokens = engine.pinned_tokens(pin)
        self.result.pinned_token_s += tokens * (now - pin.pinned_at)
        key = (engine.engine_id, pin.program_id, pin.generation)
        if key in self._orphans:
            self._orphans.discard(key)
            self.result.orphaned_token_s += tokens * (now - pin.pinned_at)
        self.router.pin_ended(engine, pin.program_id, now)

    def program_done(self, result: ProgramResult) -> None:
        self.result.programs.append(result)
        self.router.program_ended(result.program_id, self.loop.now)

    # -- routing -------------------------------------------------------------------------
    def _dispatch(self, state: ProgramState, now: float) -> Iterable[Event]:
        program = state.program
        turn = program.turns[state.next_turn]
        request = TurnRequest(
            program.program_id,
            state.next_turn,
            state.context + turn.input_tokens,
            state.context,
            now,
        )
        self._sample()
        choice = self.router.route(request, self.live)
        if choice is None:  # held by the router: it submits the turn later
            return []
        engine = self.all[choice.engine_id]
        if engine not in self.live:
            raise RuntimeError(f"router {self.router.label!r} chose a removed engine {engine.name}")
        return self._deliver(state, engine, now)

    def _deliver(self, state: ProgramState, engine: ClusterEngine, now: float) -> Iterable[Event]:
        pid = state.program.program_id
        previous = self._at.get(pid)
        if state.next_turn > 0 and previous is not None:
            self.result.returns += 1
            if previous[0] != engine.engine_id:
                self.result.moved_returns += 1
                self._orphan(previous[0], pid)
        self._at[pid] = (engine.engine_id, now)
        counts = self.result.per_engine_programs
        if state.next_turn == 0:
            counts[engine.engine_id] = counts.get(engine.engine_id, 0) + 1
        return engine.arrive(state, now)

    def _orphan(self, engine_id: int, program_id: str) -> None:
        pin = self.all[engine_id].pins.get(program_id)
        if pin is not None:
            self._orphans.add((engine_id, program_id, pin.generation))

    def _sample(self) -> None:
        queued = [e.queued_tokens() for e in self.live]
        mean = math.fsum(queued) / len(queued)
        if mean > 0:
            self.result.imbalance_sum += max(queued) / mean
            self.result.imbalance_samples += 1

    # -- running -------------------------------------------------------------------------
    def run(self, until: float = math.inf) -> ClusterResult:
        """Replay the programs (until ``until``: then :meth:`resume` goes on)."""
        ids = {p.program_id for p in self.programs}
        if len(ids) != len(self.programs):
            raise ValueError("program ids must be unique within a run")
        pool = min(e.kv_tokens() for e in self.live)
        for program in self.programs:
            if program.total_tokens + self.live[0].block_size() > pool:
                raise ValueError(
                    f"program {program.program_id!r} needs {program.total_tokens} tokens of "
                    f"KV; an engine's pool holds {pool} (the run could never finish)"
                )
            state = self._states[program.program_id] = ProgramState(program)
            self._call(program.arrival_s, functools.partial(self._dispatch, state))
        for change in self.topology:
            self._call(change.at_s, functools.partial(self._change, change))
        return self.resume(until)

    def resume(self, until: float = math.inf) -> ClusterResult:
        """Go on until ``until`` (or the end: then the pins still held are released)."""
        self.loop.run(until)
        if until == math.inf:
            for engine in self.all.values():
                engine.controller.release_all(ReleaseReason.SHUTDOWN)
        return self.result


def simulate_cluster(
    programs: Sequence[Program],
    router: str,
    retention: str = "vllm",
    engines: int = 4,
    hardware: str | HardwareProfile = "llama3.1-8b-h100",
    config: EngineConfig | None = None,
    topology: Sequence[TopologyChange] = (),
    seed: int = 0,
) -> ClusterResult:
    """Replay ``programs`` on ``engines`` engines behind ``router`` (a name or
    ``name(key=value,...)``), each engine under the retention policy ``retention``."""
    cluster = Cluster(programs, router, retention, engines, hardware, config, topology, seed)
    return cluster.run()
