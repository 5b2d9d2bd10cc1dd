"""Everything a TTL policy learns, in one picklable bundle.

``Models`` holds the duration hierarchy (all tenants), per-tenant workload statistics
(η, remaining turns, queueing delay T) and the cost model. The control plane snapshots it
with pickle; the simulator and the engine hook each keep one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from estimator.cost import CostModel
from estimator.hierarchy import DurationHierarchy
from estimator.profiles import DEFAULT_PROFILE, HardwareProfile, get_profile
from estimator.workload import MemoryFactor, QueueDelay, RemainingTurns

__all__ = ["Models", "WorkloadStats"]


@dataclass
class WorkloadStats:
    """One tenant's program-level statistics."""

    eta: MemoryFactor = field(default_factory=MemoryFactor)
    remaining: RemainingTurns = field(default_factory=RemainingTurns)
    queue: QueueDelay = field(default_factory=QueueDelay)


class Models:
    """Learned state behind TTL decisions.

    >>> models = Models.for_profile("llama3.1-8b-h100", min_samples=1)
    >>> models.record_tool_call("bash", "ls", 0.05, tenant="acme")
    >>> models.record_program_end(3, tenant="acme")
    >>> models.record_queue_delay(0.4, tenant="acme")
    >>> models.workload("acme").queue.get()
    0.4
    """

    def __init__(
        self,
        durations: DurationHierarchy,
        cost: CostModel,
        program_window: int = 256,
        queue_window: int = 256,
    ) -> None:
        self.durations = durations
        self.cost = cost
        self.program_window = program_window
        self.queue_window = queue_window
        self._workloads: dict[str, WorkloadStats] = {}

    @classmethod
    def for_profile(
        cls,
        profile: str | HardwareProfile = DEFAULT_PROFILE,
        min_samples: int = 100,
        window: int = 2000,
        forget_on_drift: bool = True,
        program_window: int = 256,
        queue_window: int = 256,
    ) -> Models:
        """Fresh models with the cost model of a hardware profile (object or name)."""
        if isinstance(profile, str):
            profile = get_profile(profile)
        return cls(
            DurationHierarchy(
                min_samples=min_samples, window=window, forget_on_drift=forget_on_drift
            ),
            CostModel.from_profile(profile),
            program_window=program_window,
            queue_window=queue_window,
        )

    def clone(self) -> Models:
        """Fresh, unfitted models with the same parameters."""
        return Models(
            self.durations.clone(),
            self.cost.clone(),
            program_window=self.program_window,
            queue_window=self.queue_window,
        )

    def workload(self, tenant: str = "default") -> WorkloadStats:
        """The tenant's workload statistics (created empty on first use)."""
        stats = self._workloads.get(tenant)
        if stats is None:
            stats = self._workloads[tenant] = WorkloadStats(
                MemoryFactor(self.program_window),
                RemainingTurns(self.program_window),
                QueueDelay(self.queue_window),
            )
        return stats

    def tenants(self) -> list[str]:
        """Tenants with any learned state, sorted."""
        return sorted(set(self._workloads) | set(self.durations.tenants()))

    def record_tool_call(
        self,
        tool: str,
        args: str | None,
        duration_s: float,
        tenant: str = "default",
        share: bool = False,
    ) -> None:
        """Learn one finished tool call (duration = next arrival − finish of the turn)."""
        self.durations.update(tool, args, duration_s, tenant=tenant, share=share)

    def record_program_end(self, total_turns: int, tenant: str = "default") -> None:
        """Learn one completed program's length (feeds η and remaining turns)."""
        stats = self.workload(tenant)
        stats.eta.update(total_turns)  # validates first: nothing half-updated
        stats.remaining.update(total_turns)

    def revise_program_end(self, total_turns: int, corrected: int, tenant: str = "default") -> None:
        """Correct the latest program learned as ``total_turns`` turns to ``corrected``
        (the same program's end as another engine saw it), where it stands in η's and
        the remaining turns' windows."""
        stats = self.workload(tenant)
        stats.eta.revise(total_turns, corrected)
        stats.remaining.revise(total_turns, corrected)

    def record_queue_delay(self, delay_s: float, tenant: str = "default") -> None:
        """Learn the admission delay of a returning request whose cache had been released."""
        self.workload(tenant).queue.update(delay_s)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """Learn one observed prefill timing (refines the cost model)."""
        self.cost.update(tokens, seconds)
