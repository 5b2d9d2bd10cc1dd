"""The TTL-aware rule as a Ray Serve ``RequestRouter`` (ray 2.60; the API is alpha).

Configure it on a deployment whose replicas publish CacheTTL's routing stats
(:func:`enginehook.routing.stats.replica_stats` returned from the deployment's
``record_routing_stats``)::

    from ray.serve.config import RequestRouterConfig
    RequestRouterConfig(
        request_router_class="enginehook.routing.ray:TtlAwareRequestRouter",
        request_router_kwargs={
            "credit_decay_s": 60.0,
            "prefill_tokens_per_s": 1000.0,
            "pin_token_file": "/etc/cachettl/pin-token",  # the hooks' pin_command_token_file
        },
        request_routing_stats_period_s=1.0,
    )

Each replica's ``record_routing_stats`` returns ``replica_stats(controller, ...,
now=time.time(), running=..., waiting=[Queued(program, key, prompt_tokens), ...])`` from
its own queue (``waiting=None`` where it cannot see it: the wait is then all its queued
prompt tokens). The program is the request's ``metadata.session_id``
(``handle.options(session_id=...)``, or the HTTP header ``x-session-id``,
``RAY_SERVE_SESSION_ID_HEADER_KEY``). The prompt's tokens, when the first argument is a
mapping with ``prompt_tokens``, refine the credit and count as work the routed replica
has queued until its next stats. A replica that also passes ``pin_endpoint=`` (its engine
hook's endpoint, ``http://HOST:PORT``) is told to drop a pin the router escaped: the post
goes from a background thread, never from ``choose_replicas`` (Ray runs it on the router's
event loop), and ``self.drops`` counts the outcomes (:mod:`enginehook.routing.drops`).
"""

from __future__ import annotations

import time
from typing import Any

# Without the ``ray`` extra mypy finds no ray: the ignores keep it quiet then, unused otherwise.
from ray.serve.request_router import (  # type: ignore[import-not-found,unused-ignore]
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from enginehook.routing.router import TtlRouter
from enginehook.routing.rule import Route

__all__ = ["TtlAwareRequestRouter"]


def _prompt_tokens(request: PendingRequest | None) -> int | None:
    if request is None or not request.args or not isinstance(request.args[0], dict):
        return None
    value = request.args[0].get("prompt_tokens")
    return int(value) if isinstance(value, int | float) else None


def _program(request: PendingRequest | None) -> str | None:
    session = request.metadata.session_id if request is not None else ""
    return session or None


class TtlAwareRequestRouter(RequestRouter):  # type: ignore[misc,unused-ignore]
    """The rules of :mod:`enginehook.routing.rule`: back to the pin's holder while the pin
    lives, unless the wait saved elsewhere exceeds the recompute times (1 + the requests on
    the other replica); a new program to the shortest queue-order wait, then the fewest
    bound programs, the fewest running requests, the most KV neither used nor pinned. Pins,
    waits and counts are read from the replicas' routing stats; the state a router keeps
    (where each program last ran, the routes since each replica's stats, the drops of
    escaped pins) is a :class:`~enginehook.routing.router.TtlRouter`, ``self.router``."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.router = TtlRouter.from_kwargs(kwargs)

    def _core(self) -> TtlRouter:
        if not hasattr(self, "router"):  # initialize_state is only called with kwargs set
            self.initialize_state()
        return self.router

    @property
    def decisions(self) -> list[tuple[str | None, Route]]:
        """The latest decisions, newest last."""
        return self._core().decisions

    @property
    def drops(self) -> dict[str, int]:
        """How the drops of escaped pins went, by outcome."""
        return self._core().drops

    def decide(self, candidates: list[RunningReplica], request: PendingRequest | None) -> Route:
        """The rule over ``candidates`` for ``request`` (also records the live pins seen,
        and queues the drop of a pin it escapes)."""
        stats = ((r.replica_id.unique_id, r.routing_stats) for r in candidates)
        return self._core().decide(
            stats, _program(request), time.time(), prompt_tokens=_prompt_tokens(request)
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        decision = self.decide(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first, *rest = (by_id[rid] for rid in decision.ranked)
        return [[first], rest] if rest else [[first]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._core().routed(
            _program(pending_request),
            replica_id.unique_id,
            time.time(),
            tokens=_prompt_tokens(pending_request) or 0,
        )
