"""One TTL-aware rule for both hosts: the simulator's ``ttl-aware`` router decides what Ray
Serve's router decides from the same published stats, decision by decision."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from enginehook.routing.router import DECISIONS_KEPT, TtlRouter
from enginehook.routing.rule import ReplicaView, Route, route
from enginehook.routing.stats import view_of
from simulator.cluster import Cluster, TopologyChange
from simulator.cluster.base import EngineView, TurnRequest
from simulator.cluster.ttlaware import TtlAware
from simulator.workloads import generate


def test_the_simulator_routes_every_turn_as_the_ray_serve_router_would() -> None:
    # 40 bfcl programs on 4 engines at about 1.2x the cluster tables' base load, one engine
    # added at half the arrivals: every rule fires, escapes included
    programs = generate("bfcl", 40, rate=0.48, seed=6)
    half = sorted(p.arrival_s for p in programs)[len(programs) // 2]
    cluster = Cluster(programs, "ttl-aware", "cachettl", 4, topology=[TopologyChange(half, "add")])
    hosted = cluster.router
    assert isinstance(hosted, TtlAware)
    simulated = hosted.route
    # what TtlAwareRequestRouter.initialize_state builds from request_router_kwargs
    ray_path = TtlRouter.from_kwargs({})
    pairs: list[tuple[Route, str]] = []

    def both(request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        stats = [(e.replica_id, e.routing_stats(request.now)) for e in engines]
        expected = ray_path.decide(
            stats, request.program_id, request.now, prompt_tokens=request.prompt_tokens
        )
        ray_path.routed(
            request.program_id, expected.ranked[0], request.now, tokens=request.prompt_tokens
        )
        choice = simulated(request, engines)
        assert choice is not None
        assert (request.program_id, request.now, choice.replica_id) == (
            request.program_id,
            request.now,
            expected.ranked[0],
        )
        pairs.append((expected, choice.replica_id))
        return choice

    hosted.route = both  # type: ignore[method-assign,assignment]
    result = cluster.run()
    assert len(result.programs) == len(programs)
    assert len(pairs) == sum(len(p.turns) for p in programs)
    # the simulator's router kept its latest decisions: the same rankings, rules and drops
    kept = [decision for _, decision in hosted.router.decisions]
    assert len(kept) == min(len(pairs), DECISIONS_KEPT)
    assert kept == [expected for expected, _ in pairs][-len(kept) :]
    assert {e.rule for e, _ in pairs} == {"new", "pin", "credit", "escape"}
    escapes = sum(e.rule == "escape" for e, _ in pairs)
    assert result.dropped_pins == escapes > 0  # each escape dropped its pin at once


def test_the_wait_adds_half_the_published_step_only_with_step_wait() -> None:
    busy = view_of("a", {"cachettl": {"step_s": 0.04, "ahead_tokens": 0, "at": 0.0}}, 1000.0)
    idle = ReplicaView("b", bound=5, ahead_tokens=0)
    assert busy.step_s == 0.04
    assert busy.wait_s(None, 0.0) == 0.0
    assert busy.wait_s(None, 0.0, step_wait=True) == pytest.approx(0.02)
    assert route(None, [busy, idle], 0.0).ranked == ("a", "b")  # fewer bound programs
    assert route(None, [busy, idle], 0.0, step_wait=True).ranked == ("b", "a")
    with pytest.raises(ValueError, match=r"routing stats of a: step_s must be >= 0, got -1\.0"):
        view_of("a", {"cachettl": {"step_s": -1}}, 1000.0)
    with pytest.raises(ValueError, match="step_wait must be a bool"):
        TtlRouter.from_kwargs({"step_wait": "yes"})
