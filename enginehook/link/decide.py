"""TTL decisions on the engine's local model snapshot.

:class:`TtlDecider` wraps an estimator policy and the latest :class:`estimator.Models`
snapshot (swapped atomically by the control-plane link's thread), applies the client's
``pin_ttl_s`` override and learns locally from the engine's own events, so that decisions
keep improving when no control plane is configured or it is down.

>>> decider = TtlDecider("fixed", {"ttl_s": 3.0}, profile="llama3.1-8b-h100")
>>> decider.decide(tool="bash", tool_args="ls", context_tokens=100, turns_served=1).ttl_s
3.0
>>> decider.decide(tool="bash", tool_args=None, context_tokens=100, turns_served=1,
...                pin_ttl_s=0.5).basis
'client'
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

from enginehook.core.rollout import RolloutState
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from estimator import DEFAULT_PROFILE, Decision, Models, RequestFacts, get_policy

__all__ = ["TtlDecider", "client_decision"]


def client_decision(ttl_s: float) -> Decision:
    """The decision when the client set the TTL itself (``pin_ttl_s``)."""
    return Decision(ttl_s, 1.0, 0.0, "client", 0.0)


class TtlDecider:
    """A named estimator policy plus the model snapshot it decides on."""

    def __init__(
        self,
        policy: str,
        params: Mapping[str, Any] | None = None,
        *,
        profile: str = DEFAULT_PROFILE,
        tenant: str = "default",
        min_samples: int = 100,
    ) -> None:
        self.policy = get_policy(policy, **dict(params or {}))
        self.tenant = tenant
        self._models = self.policy.new_models(profile, min_samples=min_samples)
        self._lock = threading.Lock()
        self.snapshot_version = ""
        #: Which tools may be pinned: the engine's own setting and the control plane's
        #: rollout, which the link sets from each snapshot (:mod:`enginehook.core.rollout`).
        self.rollout = RolloutState()
        self._pending: queue.SimpleQueue[ToolCallReport | ProgramEndReport | None] = (
            queue.SimpleQueue()
        )
        self._learner: threading.Thread | None = None

    @property
    def models(self) -> Models:
        """The snapshot decisions use now."""
        return self._models

    def replace_models(self, models: Models, version: str = "") -> None:
        """Install a new snapshot (from the control plane); safe from any thread."""
        with self._lock:
            self._models = models
            self.snapshot_version = version

    def decide(
        self,
        *,
        tool: str,
        tool_args: str | None,
        context_tokens: int,
        turns_served: int,
        program_id: str | None = None,
        pin_ttl_s: float | None = None,
        reload_cost_s: float | None = None,
        waiting_tokens: int | None = None,
        free_tokens: int | None = None,
        offload: bool = False,
        offloaded_tokens: int | None = None,
    ) -> Decision:
        """The TTL for a finished turn that called ``tool``.

        ``offload``: a CPU tier holds a copy of the turn's KV, so a miss costs a reload,
        not a full prefill; ``offloaded_tokens``: how much of the context it holds
        (default: all of it). The cost model prices both
        (:meth:`estimator.CostModel.prefill_reload_s`).
        """
        facts = RequestFacts(
            tool=tool,
            tool_args=tool_args,
            context_tokens=context_tokens,
            tenant=self.tenant,
            program_id=program_id,
            turns_served=turns_served,
            reload_cost_s=reload_cost_s,
            offload=offload,
            offloaded_tokens=offloaded_tokens,
            waiting_tokens=waiting_tokens,
            free_tokens=free_tokens,
        )
        return self.decide_facts(facts, pin_ttl_s)

    def decide_facts(self, facts: RequestFacts, pin_ttl_s: float | None = None) -> Decision:
        """The TTL for ``facts``: the client's ``pin_ttl_s`` when it set one, else the
        policy's on the snapshot in use now (the engine's one decide entry; the limits
        that apply on top are :mod:`enginehook.core.ttl`'s)."""
        if pin_ttl_s is not None:
            return client_decision(pin_ttl_s)
        with self._lock:
            return self.policy.decide(facts, self._models)

    def learn(self, event: ToolCallReport | ProgramEndReport) -> None:
        """Update the local snapshot with one of the engine's own events."""
        with self._lock:
            models = self._models
            if isinstance(event, ProgramEndReport):
                models.record_program_end(event.total_turns, tenant=event.tenant)
                return
            models.record_tool_call(event.tool, event.tool_args, event.duration_s, event.tenant)
            if event.queue_delay_sample:
                models.record_queue_delay(event.admission_delay_s, tenant=event.tenant)

    def learn_later(self, event: ToolCallReport | ProgramEndReport) -> None:
        """Queue ``event`` for :meth:`learn` on a background thread (returns at once)."""
        if self._learner is None:
            self._learner = threading.Thread(
                target=self._learn_loop, name="cachettl-learn", daemon=True
            )
            self._learner.start()
        self._pending.put(event)

    def _learn_loop(self) -> None:
        while (event := self._pending.get()) is not None:
            try:
                self.learn(event)
            except ValueError:  # an out-of-range sample: skip it, keep learning
                continue

    def wait_learned(self, timeout_s: float = 10.0) -> bool:
        """Block until every queued event was learned (stops the thread; the next
        :meth:`learn_later` starts a new one)."""
        learner, self._learner = self._learner, None
        if learner is None:
            return True
        self._pending.put(None)
        learner.join(timeout_s)
        return not learner.is_alive()

    def close(self) -> None:
        """Learn what is queued and stop the background thread."""
        self.wait_learned()

    def learn_prefill(self, tokens: int, seconds: float) -> None:
        """One observed prefill timing for the cost model."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._models.record_prefill(tokens, seconds)
