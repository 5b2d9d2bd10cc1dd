"""What the vLLM hook runs beside its pin controller: the TTL decider on the latest model
snapshot, the event sink to the control plane, the metrics and their endpoint, and the CPU
tier detected from the engine's config; the endpoint also takes routers' pin commands
(:mod:`enginehook.core.commands`). Engine-independent (nothing here imports vLLM).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from enginehook.core.commands import PinCommands
from enginehook.core.config import HookConfig, detect_cpu_tier
from enginehook.core.decide import TtlDecider
from enginehook.core.lifecycle import FinishedTurn
from enginehook.core.tracker import ProgramEndEvent, ToolCallEvent
from enginehook.link.sinks import EventSink, build_sink
from enginehook.vllm.metrics import HookMetrics, serve_metrics
from estimator import Decision, RequestFacts

__all__ = ["HookServices"]

logger = logging.getLogger("enginehook")


class HookServices:
    """The hook's decider, sink, metrics and CPU tier for one engine (``vllm_config``).

    It is the controller's :class:`~enginehook.core.lifecycle.Decider` (a client's ``pin_ttl_s``
    wins; every decision is counted by basis) and receives its events.
    """

    def __init__(
        self, config: HookConfig, vllm_config: Any, commands: PinCommands | None = None
    ) -> None:
        self.config = config
        self.engine_id = uuid.uuid4().hex[:12]
        self.metrics = HookMetrics()
        self.decider = TtlDecider(
            config.policy,
            config.policy_params,
            profile=config.profile,
            tenant=config.tenant,
            min_samples=config.min_samples,
        )
        self.cpu_tier = detect_cpu_tier(config.cpu_tier, vllm_config)
        self.metrics.set_cpu_tier(self.cpu_tier.on, ",".join(self.cpu_tier.connectors))
        logger.info("CacheTTL CPU tier: %s", self.cpu_tier.reason)
        self.sink: EventSink = build_sink(config, self.decider, self.engine_id)
        self.metrics.set_sink(self.sink.counters)
        self._server: Any = None
        if config.metrics_listen:
            self._server, port = serve_metrics(
                self.metrics, config.metrics_listen, commands, token=config.token
            )
            logger.info("CacheTTL metrics on port %d", port)

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        decision = self.decider.decide_facts(facts, turn.pin_ttl_s)
        self.metrics.decision(decision.basis)
        return decision

    def emit(self, event: ToolCallEvent | ProgramEndEvent) -> None:
        self.decider.learn_later(event)
        self.sink.submit(event)
        self.metrics.emitted()

    def close(self) -> None:
        self.decider.close()
        self.sink.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
