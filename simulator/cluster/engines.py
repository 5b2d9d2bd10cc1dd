"""One engine of the cluster: the single-engine :class:`simulator.sim.Simulation` (its
engine, its :class:`PinController` and retention policy) on the cluster's shared event
loop, whose returning turns go back through the router, and which reports what the
cluster's metrics need (queued tokens, returning turns' hits, pins that end) and the
routing stats a CacheTTL replica publishes
(:func:`enginehook.routing.stats.replica_stats` of its controller)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from enginehook.core.pins import Pin, ReleaseReason
from enginehook.routing.stats import Queued, replica_stats, view_of
from estimator import HardwareProfile
from simulator.cluster.base import EngineMetrics
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
        #: Prompt tokens prefilled per second (whole chunks at the chunk's step time).
        self.prefill_tokens_per_s = chunk / self._chunk_s

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

    def metrics(self) -> EngineMetrics:
        """What this engine's ``/metrics`` publishes now: KV usage (blocks used over the
        pool; pinned blocks count as used only under the rule ``pins_in_kv_usage``, else as
        free, as vLLM counts cached blocks no request holds), running and waiting requests.
        A stock ``vllm`` engine has no pins, so its usage is vLLM's own.

        An idle engine first expires its overdue pins, as the hook's idle wake-up does
        (``enginehook/vllm/idle.py``: twice a second while pins are held); the simulated
        engine otherwise expires pins only when it next steps."""
        if not self._stepping and self.controller.expire(self.loop.now):
            self.engine.waiting.mark_dirty()
        pool = self.engine.pool
        used = pool.used if self.controller.rules.pins_in_kv_usage else self.active_blocks()
        return EngineMetrics(
            used / pool.num_blocks, len(self.engine.running), len(self.engine.waiting)
        )

    def pin_of(self, program_id: str) -> Pin[int] | None:
        return self.pins.get(program_id)

    def cached_tokens(self, program_id: str) -> int:
        """The program's prefix held here, pinned or in the prefix cache (what exact KV
        events would tell a router)."""
        blocks = self.pinned_blocks_of(program_id) or self.engine.pool.cached_prefix(program_id)
        return blocks * self.config.block_size

    @property
    def replica_id(self) -> str:
        """The engine's id in its routing stats (zero-padded, so ids order as numbers)."""
        return f"engine-{self.engine_id:04d}"

    def routing_stats(self, now: float) -> dict[str, Any]:
        """The routing stats a CacheTTL replica publishes, taken ``now``
        (:func:`~enginehook.routing.stats.replica_stats` of this engine's controller): its
        pins, KV neither used nor pinned, running requests and what their prefills have
        left, its waiting turns in its own queue order (each less the prefix of its program
        held here), its prefill rate and the step it is running."""
        engine = self.engine
        size = self.config.block_size
        return replica_stats(
            self.controller,
            free_tokens=self.free_blocks() * size,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tokens_per_block=size,
            now=now,
            running=len(engine.running),
            prefilling_tokens=sum(
                r.prompt_tokens - r.computed for r in engine.running if r.prefilling
            ),
            waiting=[
                Queued(
                    r.program_id, self._key(r), r.prompt_tokens, self.cached_tokens(r.program_id)
                )
                for r in engine.waiting
            ],
            step_s=self.step_s(),
        )

    def queued_ahead_tokens(self, program_id: str, now: float) -> int:
        """Prompt tokens still to compute ahead of a turn of ``program_id`` arriving now, as
        a router reads them from :meth:`routing_stats`: behind a live pin here, what this
        engine's queue order puts before its program; otherwise, what it puts before a
        program it has never seen."""
        view = view_of(self.replica_id, self.routing_stats(now), self.prefill_tokens_per_s)
        return view.ahead(program_id, now)

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` here (whole chunks at the chunk's step time)."""
        return tokens / self.config.max_num_batched_tokens * self._chunk_s

    def step_s(self) -> float:
        """Seconds of one step of the running batch as a router can estimate it: the step
        time of one token for each running request over the KV they hold (running
        requests and KV in use are the engine's published gauges), 0 when nothing runs.
        It ignores the running prefills' chunks: the work ahead of a turn counts them."""
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
