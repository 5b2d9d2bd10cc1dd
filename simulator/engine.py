"""One serving engine with vLLM V1's scheduling: continuous batching, chunked prefill,
``max_num_seqs``, priority-ordered admission, preemption by recompute of the most recently
admitted request, and the prefix cache of :mod:`simulator.kv`.

The engine knows nothing of tools or programs' futures; a :class:`Host` (the simulation)
is told when requests finish and decides about pins, and a scheduling policy supplies the
waiting order and the pressure rule (``simulator.policies``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from enginehook.core.priority import SortedWaitQueue
from simulator.kv import BlockPool, CpuTier
from simulator.steptime import StepTimer

__all__ = ["Engine", "EngineConfig", "Host", "Request"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine parameters (vLLM names)."""

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_tokens: int | None = None  # None: the hardware profile's pool
    cpu_tier_tokens: int = 0  # 0: no CPU tier
    #: vLLM's ``scheduler_reserve_full_isl`` (default on since it exists): a waiting request
    #: is admitted only if its whole prompt fits in the free blocks, not just its first chunk.
    reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ValueError(
                f"kv_tokens must hold at least one block ({self.block_size}), got {self.kv_tokens}"
            )
        if self.cpu_tier_tokens < 0:
            raise ValueError(f"cpu_tier_tokens must be >= 0, got {self.cpu_tier_tokens}")


@dataclass(eq=False, slots=True)
class Request:
    """One LLM call of a program."""

    request_id: str
    program_id: str
    turn: int
    arrival: float
    program_arrival: float
    prompt_tokens: int
    output_tokens: int
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    preempted: bool = False
    admitted_at: float | None = None
    first_admitted_at: float | None = None
    admit_seq: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_tokens

    @property
    def context(self) -> int:
        return self.computed


class Host(Protocol):
    """What the engine asks and tells the simulation around it."""

    def pinned_blocks_of(self, program_id: str) -> int: ...
    def may_admit(self, request: Request) -> bool: ...
    def take_pin(self, request: Request, now: float) -> int: ...
    def release_pins(self, needed: int, request: Request, now: float, running: bool) -> bool: ...
    def on_admit(self, request: Request, now: float) -> None: ...
    def on_finish(self, request: Request, now: float) -> None: ...


class Engine:
    """The scheduler state and one step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        timer: StepTimer,
        key: Callable[[Request], Any],
        host: Host,
        preemption_victim: Callable[[list[Request]], Request] | None = None,
    ) -> None:
        self.config = config
        self.timer = timer
        kv_tokens = config.kv_tokens or timer.profile.kv_pool_tokens
        self.pool = BlockPool(kv_tokens // config.block_size)
        self.cpu = CpuTier(config.cpu_tier_tokens) if config.cpu_tier_tokens else None
        self.waiting: SortedWaitQueue[Request] = SortedWaitQueue(key)
        self.running: list[Request] = []
        self.host = host
        self._victim = preemption_victim or (lambda running: running[-1])
        self._seq = 0
        self._waiting: dict[str, int] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    # -- helpers -----------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _full_blocks(self, tokens: int) -> int:
        return tokens // self.config.block_size

    def add(self, request: Request) -> None:
        """A request arrives (or returns after preemption)."""
        self.waiting.add(request)
        self._waiting[request.program_id] = self._waiting.get(request.program_id, 0) + 1

    def waiting_programs(self) -> dict[str, int]:
        """Programs with a waiting request (a live view: program id → count)."""
        return self._waiting

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def _store_cpu(self, request: Request) -> None:
        """Write-through to the CPU tier (LMCache stores every computed prefix, whether or
        not the GPU copy is then pinned)."""
        if self.cpu is not None:
            tokens = self._full_blocks(request.computed) * self.config.block_size
            self.cpu.store(request.program_id, tokens)

    def _release_request(self, request: Request) -> None:
        """Free a request's blocks into the prefix cache."""
        self.pool.release(request.program_id, request.blocks, self._full_blocks(request.computed))
        request.blocks = 0

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._store_cpu(victim)
        self._release_request(victim)
        # Recompute: the tokens generated so far become part of the prompt.
        victim.prompt_tokens += victim.generated
        victim.output_tokens -= victim.generated
        victim.generated = 0
        victim.computed = 0
        victim.preempted = True
        victim.preemptions += 1
        self.preemptions += 1
        self.add(victim)

    # -- one step ----------------------------------------------------------------------
    def schedule(self, now: float) -> tuple[list[tuple[Request, int]], int, bool]:
        """Choose this step's work: ``(request, new tokens)`` pairs, tokens reloaded from
        the CPU tier, and whether admission stopped for lack of memory or slots."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.prompt_tokens - request.computed, budget) if request.prefilling else 1
            need = self._blocks_for(request.computed + n) - request.blocks
            while need > self.pool.free:
                if self.host.release_pins(need - self.pool.free, request, now, True):
                    continue
                victim = self._victim(self.running)
                position = self.running.index(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                if position < i:  # already scheduled this step: take its tokens back
                    i -= 1
                    budget += self._unschedule(scheduled, victim)
            if request.preempted:
                break
            if need:  # a decode step mostly writes into its last block
                self.pool.allocate(need)
                request.blocks += need
            scheduled.append((request, n))
            budget -= n
            i += 1
        reload = 0
        blocked = bool(self.waiting)
        if not preempted:
            reload, blocked = self._admit(now, budget, scheduled)
        return scheduled, reload, blocked

    @staticmethod
    def _unschedule(scheduled: list[tuple[Request, int]], victim: Request) -> int:
        for k, (request, n) in enumerate(scheduled):
            if request is victim:
                del scheduled[k]
                return n
        return 0

    def _admit(
        self, now: float, budget: int, scheduled: list[tuple[Request, int]]
    ) -> tuple[int, bool]:
        reload_total = 0
        size = self.config.block_size
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                return reload_total, True
            request = self.waiting.peek()
            if not self.host.may_admit(request):  # held by a program-level admission
                return reload_total, True
            max_hit = self._full_blocks(request.prompt_tokens - 1)
            pinned = min(self.host.pinned_blocks_of(request.program_id), max_hit)
            cached = 0 if pinned else min(self.pool.cached_prefix(request.program_id), max_hit)
            gpu_hit = max(pinned, cached)
            cpu_hit = 0
            if self.cpu is not None:
                cpu_hit = min(self._full_blocks(self.cpu.tokens(request.program_id)), max_hit)
            hit = max(gpu_hit, cpu_hit)
            n = min(request.prompt_tokens - hit * size, budget)
            need = self._blocks_for(hit * size + n) - gpu_hit + cached
            gate = need
            if self.config.reserve_full_isl:
                gate = self._blocks_for(request.prompt_tokens) - gpu_hit + cached
            if gate > self.pool.free:
                short = gate - self.pool.free
                if not self.host.release_pins(short, request, now, False):
                    return reload_total, True
                continue  # pins changed: look again
            self.waiting.pop()
            left = self._waiting[request.program_id] - 1
            if left:
                self._waiting[request.program_id] = left
            else:
                del self._waiting[request.program_id]
            taken = self.host.take_pin(request, now) if pinned else 0
            if not pinned:
                taken = self.pool.take_prefix(request.program_id, cached)
            self.pool.allocate(need - cached)
            request.blocks = taken + need - cached
            request.computed = hit * size
            request.hit_tokens = hit * size
            reload_total += (hit - gpu_hit) * size
            self.prompt_tokens += request.prompt_tokens
            self.hit_tokens += hit * size
            request.preempted = False
            request.admitted_at = now
            self._seq += 1
            request.admit_seq = self._seq
            self.running.append(request)
            self.host.on_admit(request, now)
            scheduled.append((request, n))
            budget -= n
        return reload_total, False

    def step_time(self, scheduled: list[tuple[Request, int]], reload: int) -> float:
        prefills = []
        decodes = 0
        context = 0
        for request, n in scheduled:
            context += request.computed + n
            if request.prefilling:
                prefills.append((n, request.computed))
            else:
                decodes += 1
        return self.timer.step(prefills, decodes, context, reload)

    def complete(self, scheduled: list[tuple[Request, int]], now: float) -> None:
        """Apply a finished step: tokens computed, outputs generated, requests done."""
        for request, n in scheduled:
            request.computed += n
            if request.computed >= request.prompt_tokens:
                request.generated += 1
            if request.generated >= request.output_tokens:
                self.running.remove(request)
                self._store_cpu(request)
                self.host.on_finish(request, now)

    def finish_release(self, request: Request) -> None:
        """The host decided not to pin: free into the prefix cache."""
        self._release_request(request)
