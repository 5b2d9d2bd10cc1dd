"""The TTL-aware routing rule (enginehook.routing.rule), without Ray: stickiness while the pin
lives, the wait-versus-recompute escape, the decaying credit after expiry, new programs to the
most free unpinned KV, no remap of live pins when a replica joins, and the stats a real pin
controller publishes."""

from __future__ import annotations

import pytest

from enginehook.core.lifecycle import FinishedTurn, PinController
from enginehook.core.rules import SchedulingRules
from enginehook.routing import (
    STATS_KEY,
    Last,
    Memory,
    PinView,
    ReplicaView,
    replica_stats,
    route,
    view_of,
)
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost

RATE = 1_000.0  # prefill tokens per second


def _r(rid: str, *, free: int = 1_000, queued: int = 0, **pins: PinView) -> ReplicaView:
    return ReplicaView(rid, free, queued, RATE, pins)


def test_a_live_pin_keeps_its_program_on_the_holder_even_when_others_have_more_room() -> None:
    a = _r("a", free=100, queued=500, p=PinView(expires_at=50.0, tokens=2_000))
    b = _r("b", free=9_000)
    decision = route("p", [b, a], now=10.0, last=Last("b", 0.0, 10))
    assert decision.ranked[0] == "a"
    assert decision.rule == "pin"
    assert decision.drop_from is None


def test_the_holder_is_escaped_when_its_wait_exceeds_the_recompute() -> None:
    # holder waits 3 s more than b; recomputing 2,000 pinned tokens on b costs 2 s
    a = _r("a", queued=3_000, p=PinView(50.0, 2_000))
    b = _r("b", queued=0)
    decision = route("p", [a, b], now=10.0)
    assert decision.ranked == ("b", "a")
    assert decision.rule == "escape"
    assert decision.drop_from == "a"
    # with 2 s of queue the wait no longer exceeds the 2 s recompute: it stays
    a2 = _r("a", queued=2_000, p=PinView(50.0, 2_000))
    assert route("p", [a2, b], now=10.0).ranked[0] == "a"


def test_an_expired_pin_no_longer_binds() -> None:
    a = _r("a", free=10, p=PinView(expires_at=9.0, tokens=2_000))
    b = _r("b", free=900)
    assert route("p", [a, b], now=10.0).ranked[0] == "b"  # never seen: a new program


def test_after_expiry_the_credit_decays_until_the_load_wins() -> None:
    last = Last("a", since=100.0, tokens=4_000)
    a = _r("a", queued=1_000)  # 1 s of queue
    b = _r("b", queued=0)
    # just after the pin ended: 4,000 tokens of credit (4 s of prefill) beat 1 s of queue
    early = route("p", [a, b], now=100.0, last=last, prompt_tokens=4_500, credit_decay_s=60.0)
    assert early.ranked[0] == "a"
    assert early.rule == "credit"
    # credit 4,000 * exp(-age/60) must fall under 1,000 tokens: age > 60 ln 4 = 83.2 s
    assert route("p", [a, b], now=183.0, last=last, prompt_tokens=4_500).ranked[0] == "a"
    late = route("p", [a, b], now=184.0, last=last, prompt_tokens=4_500)
    assert late.ranked[0] == "b"
    assert late.drop_from is None


def test_a_new_program_goes_to_the_most_kv_neither_used_nor_pinned() -> None:
    a = _r("a", free=300, queued=0)
    b = _r("b", free=800, queued=5_000)
    c = _r("c", free=800, queued=100)
    assert route("new", [a, b, c], now=0.0).ranked == ("c", "b", "a")
    assert route(None, [a, b, c], now=0.0).ranked[0] == "c"


def test_a_joining_replica_takes_no_program_with_a_live_pin() -> None:
    a = _r("a", free=100, p=PinView(60.0, 500))
    b = _r("b", free=100, q=PinView(60.0, 500))
    before = {p: route(p, [a, b], now=5.0).ranked[0] for p in ("p", "q")}
    joined = _r("c", free=10_000)  # empty, the most room by far
    after = {p: route(p, [a, b, joined], now=5.0).ranked[0] for p in ("p", "q")}
    assert before == after == {"p": "a", "q": "b"}
    assert route("fresh", [a, b, joined], now=5.0).ranked[0] == "c"


def test_the_memory_follows_pins_and_routes_and_is_bounded() -> None:
    memory = Memory(max_programs=2)
    memory.routed("p", "b", now=1.0, tokens=100)
    memory.observe([_r("a", p=PinView(30.0, 640))], now=5.0)
    assert memory.get("p") == Last("a", 5.0, 640)
    memory.observe([_r("a", p=PinView(30.0, 640))], now=40.0)  # expired: not refreshed
    assert memory.get("p") == Last("a", 5.0, 640)
    memory.routed("q", "b", now=6.0)
    memory.routed("r", "b", now=7.0)
    assert memory.get("p") is None
    assert len(memory) == 2
    assert memory.get(None) is None


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


def test_a_pin_controller_publishes_stats_the_router_reads_back() -> None:
    controller = PinController(
        SchedulingRules(), MinimalHost(), pool_blocks=100, decider=_Fixed(), engine_id="e"
    )
    controller.arrived("p", 0.0, 0.0)
    controller.admitted("p", 0.0)
    controller.finished(FinishedTurn("p", "bash", "ls", 160), 1.0, lambda: (10, "blocks"))
    stats = replica_stats(
        controller,
        free_tokens=640,
        queued_tokens=32,
        prefill_tokens_per_s=500.0,
        tokens_per_block=16,
    )
    view = view_of("r1", stats, default_prefill_tokens_per_s=RATE)
    assert view == ReplicaView("r1", 640, 32, 500.0, {"p": PinView(31.0, 160)})
    assert stats[STATS_KEY]["pinned_tokens"] == 160
    assert route("p", [view, _r("r2", free=10_000)], now=2.0).ranked[0] == "r1"


def test_bad_stats_and_views_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"pins\['p'\]"):
        view_of("r1", {STATS_KEY: {"pins": {"p": "soon"}}}, RATE)
    with pytest.raises(ValueError, match="queued_tokens"):
        view_of("r1", {STATS_KEY: {"queued_tokens": "many"}}, RATE)
    with pytest.raises(ValueError, match="prefill_tokens_per_s of r1"):
        route("p", [ReplicaView("r1", prefill_tokens_per_s=0.0)], now=0.0)
    with pytest.raises(ValueError, match="replicas"):
        route("p", [], now=0.0)
    assert view_of("r9", None, RATE) == ReplicaView("r9", prefill_tokens_per_s=RATE)
