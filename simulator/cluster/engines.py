"""One engine of the cluster: the single-engine :class:`simulator.sim.Simulation` (its
engine, its :class:`PinController` and retention policy) on the cluster's shared event
loop, whose returning turns go back through the router, and which reports what the
cluster's metrics need (queued tokens, returning turns' hits, pins that end)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from enginehook.core.pins import Pin, ReleaseReason
from estimator import HardwareProfile
from simulator.engine import EngineConfig, Request
from simulator.loop import Event, EventLoop
from simulator.policies import get_scheduling_policy
from simulator.sim import ProgramResult, ProgramState, Simulation

__all__ = ["ClusterEngine"]


class Cluster(Protocol):
    """What an engine tells the cluster around it."""

    def program_done(self, result: ProgramResult) -> None: ...
    def next_call(self) -> float: ...
    def schedule_return(self, state: ProgramState, at: float) -> None: ...
    def returning_hit(self, hit: int, reusable: int) -> None: ...
    def turn_finished(
        self, engine: ClusterEngine, program_id: str, context: int, now: float
    ) -> None: ...
    def pin_ended(self, engine: ClusterEngine, pin: Pin[int], reason: ReleaseReason) -> None: ...


class ClusterEngine(Simulation):
    """A simulated engine behind the router (an :class:`EngineView`)."""

    def __init__(
        self,
        cluster: Cluster,
        engine_id: int,
        retention: str,
        hardware: str | HardwareProfile,
        config: EngineConfig | None,
        loop: EventLoop,
    ) -> None:
        policy = get_scheduling_policy(retention)
        super().__init__((), policy, hardware, config, cluster.program_done, loop=loop)
        self.cluster = cluster
        self.engine_id = engine_id
        self._queued = 0
        chunk = self.config.max_num_batched_tokens
        self._chunk_s = self.timer.step([(chunk, 0)], 0, chunk, 0)

    # -- the router's view -------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"engine-{self.engine_id}"

    def inflight(self) -> int:
        return len(self.engine.running) + len(self.engine.waiting)

    def waiting_count(self) -> int:
        return len(self.engine.waiting)

    def queued_tokens(self) -> int:
        """Prompt tokens of turns that arrived here and are not admitted yet."""
        return self._queued

    def free_blocks(self) -> int:
        """Blocks neither used by requests nor pinned (cached-but-free blocks count)."""
        return self.engine.pool.free

    def active_blocks(self) -> int:
        return self.engine.pool.used - self.pins.pinned_blocks

    def block_size(self) -> int:
        return self.config.block_size

    def kv_tokens(self) -> int:
        return self.engine.pool.num_blocks * self.config.block_size

    def pin_of(self, program_id: str) -> Pin[int] | None:
        return self.pins.get(program_id)

    def cached_tokens(self, program_id: str) -> int:
        """The program's prefix held here, pinned or in the prefix cache (what exact KV
        events would tell a router)."""
        blocks = self.pinned_blocks_of(program_id) or self.engine.pool.cached_prefix(program_id)
        return blocks * self.config.block_size

    def queued_ahead_tokens(self, program_id: str, now: float) -> int:
        """Prompt tokens still to compute ahead of a turn of ``program_id`` arriving now:
        the rest of the running prefills, and the waiting turns that this engine's own
        queue order puts first, each less the prefix of its program held here."""
        engine = self.engine
        work = sum(r.prompt_tokens - r.computed for r in engine.running if r.prefilling)
        if not engine.waiting:
            return work
        mine = self.controller.order_key(0, False, program_id, now, "\U0010ffff")
        for r in engine.waiting:
            if self._key(r) < mine:
                held = min(self.cached_tokens(r.program_id), r.prompt_tokens - 1)
                work += r.prompt_tokens - max(0, held)
        return work

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` here (whole chunks at the chunk's step time)."""
        return tokens / self.config.max_num_batched_tokens * self._chunk_s

    def step_s(self) -> float:
        """Seconds of one step of the running batch as a router can estimate it: the step
        time of one token for each running request over the KV they hold (running
        requests and KV in use are the engine's published gauges), 0 when nothing runs.
        It ignores the running prefills' chunks: :meth:`queued_ahead_tokens` counts them."""
        running = len(self.engine.running)
        if not running:
            return 0.0
        return self.timer.step((), running, self.active_blocks() * self.config.block_size)

    # -- hooks into the single-engine simulation ----------------------------------------
    def horizon(self) -> float:
        """Other engines' steps change nothing here: only the cluster's calls do."""
        return self.cluster.next_call()

    def schedule_return(self, state: ProgramState, at: float) -> None:
        self.cluster.schedule_return(state, at)

    def arrive(self, state: ProgramState, now: float) -> Iterable[Event]:
        prompt = state.context + state.program.turns[state.next_turn].input_tokens
        self._queued += prompt
        return super().arrive(state, now)

    def on_admit(self, request: Request, now: float) -> None:
        first = request.first_admitted_at is None
        super().on_admit(request, now)
        if not first:
            return
        self._queued -= request.prompt_tokens
        state: ProgramState = request.extra["state"]
        if request.turn == 0:
            state.first_wait = now - state.program.arrival_s  # the router's hold included
        else:
            reusable = self._seen(request, request.hit_tokens).reusable_tokens
            self.cluster.returning_hit(request.hit_tokens, reusable or 0)

    def on_finish(self, request: Request, now: float) -> None:
        self.cluster.turn_finished(self, request.program_id, request.computed + 1, now)
        super().on_finish(request, now)

    def pin_released(self, pin: Pin[int], reason: ReleaseReason) -> None:
        super().pin_released(pin, reason)
        self.cluster.pin_ended(self, pin, reason)
