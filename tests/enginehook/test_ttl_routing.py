"""The TTL-aware routing rule (enginehook.routing.rule), without Ray, one test or more per
numbered rule: stickiness while the pin lives, the escape only when the wait saved exceeds
the recompute times (1 + the rival's requests), waits in the replica's own queue order, the
decaying credit after expiry, new programs by wait then bound programs then running requests
then free KV, no remap of live pins when a replica joins; the routes a router made since a
replica's stats; and the stats a real pin controller publishes from its queue."""

from __future__ import annotations

import pytest

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.routing import (
    STATS_KEY,
    Last,
    Memory,
    PinView,
    Queued,
    ReplicaView,
    replica_stats,
    route,
    view_of,
)
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost

RATE = 1_000.0  # prefill tokens per second


def _r(
    rid: str,
    *,
    free: int = 1_000,
    queued: int = 0,
    ahead: int | None = None,
    running: int = 0,
    waiting: int = 0,
    bound: int = 0,
    at: float | None = None,
    **pins: PinView,
) -> ReplicaView:
    return ReplicaView(rid, free, queued, RATE, pins, running, waiting, bound, ahead, at)


def test_a_live_pin_keeps_its_program_on_the_holder_even_when_others_have_more_room() -> None:
    a = _r("a", free=100, queued=500, p=PinView(expires_at=50.0, tokens=2_000))
    b = _r("b", free=9_000)
    decision = route("p", [b, a], now=10.0, last=Last("b", 0.0, 10))
    assert decision.ranked[0] == "a"
    assert decision.rule == "pin"
    assert decision.drop_from is None


def test_the_holder_is_escaped_when_its_wait_exceeds_the_recompute() -> None:
    # holder waits 3 s more than b; recomputing 2,000 pinned tokens on an idle b costs 2 s
    a = _r("a", queued=3_000, p=PinView(50.0, 2_000))
    b = _r("b", queued=0)
    decision = route("p", [a, b], now=10.0)
    assert decision.ranked == ("b", "a")
    assert decision.rule == "escape"
    assert decision.drop_from == "a"
    # with 2 s of queue the wait no longer exceeds the 2 s recompute: it stays
    a2 = _r("a", queued=2_000, p=PinView(50.0, 2_000))
    assert route("p", [a2, b], now=10.0).ranked[0] == "a"


def test_the_recompute_counts_once_per_request_on_the_rival() -> None:
    # 3 s saved against 1,000 pinned tokens (1 s) recomputed on b, which delays b's requests
    a = _r("a", ahead=3_000, p=PinView(50.0, 1_000, ahead_tokens=3_000))
    for running, waiting, rule in (
        (0, 0, "escape"),
        (1, 0, "escape"),
        (1, 1, "pin"),
        (0, 5, "pin"),
    ):
        b = _r("b", ahead=0, running=running, waiting=waiting)
        # 1 s x (1 + n_b) against 3 s: 1 s, 2 s escape; 3 s (not more) and 6 s stay
        assert route("p", [a, b], now=10.0).rule == rule, (running, waiting)
    # b is the rival where the turn waits least, not the idlest: c waits 1 s more
    b = _r("b", ahead=0, running=2)
    c = _r("c", ahead=1_000)
    assert route("p", [a, b, c], now=10.0).ranked == ("a", "b", "c")


def test_waits_follow_the_replicas_queue_order() -> None:
    # 50,000 queued prompt tokens on the holder, but its queue order puts p's return ahead of
    # all but 500 of them: it stays where the wait as all queued tokens would escape (50 s
    # against recomputing 2,000 tokens on the idle b, 2 s)
    a = _r("a", queued=50_000, ahead=50_000, p=PinView(50.0, 2_000, ahead_tokens=500))
    b = _r("b", ahead=0)
    assert route("p", [a, b], now=10.0).rule == "pin"
    stale = _r("a", queued=50_000, p=PinView(50.0, 2_000))  # no queue view: all queued
    assert route("p", [stale, b], now=10.0).rule == "escape"
    # a new program's turn on a waits behind the 50,000 tokens its order puts first
    assert route("new", [a, b], now=10.0).ranked == ("b", "a")
    # the pin's own wait counts only while it lives: expired, p is charged a's 50 s
    assert a.wait_s("p", now=10.0) == 0.5
    assert a.wait_s("p", now=60.0) == 50.0
    # b's wait for p is what b's order puts ahead of a program it never saw, not its queue
    b_busy = _r("b", queued=40_000, ahead=1_000)
    assert b_busy.wait_s("p", now=10.0) == 1.0


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


def test_a_new_program_goes_to_the_shortest_wait_before_the_fewest_bound_programs() -> None:
    a = _r("a", free=9_000, ahead=2_000, bound=0)  # the most room, an idle set, but 2 s
    b = _r("b", free=100, ahead=0, bound=5)
    assert route("new", [a, b], now=0.0).ranked == ("b", "a")
    assert route(None, [a, b], now=0.0).ranked[0] == "b"


def test_new_programs_tie_to_bound_programs_then_running_then_free_kv_then_id() -> None:
    # every queue idle (waits tie at 0 s)
    a = _r("a", free=9_000, ahead=0, bound=3)  # the most room, three programs away
    b = _r("b", free=500, ahead=0, bound=1, running=4)
    c = _r("c", free=100, ahead=0, bound=1, running=1)
    d = _r("d", free=800, ahead=0, bound=1, running=1)
    e = _r("e", free=800, ahead=0, bound=1, running=1)
    assert route("new", [a, b, c, d, e], now=0.0).ranked == ("d", "e", "c", "b", "a")


def test_new_programs_spread_by_bound_programs_where_free_kv_piles_them() -> None:
    # programs away in an unpinned tool call leave their KV free: a always has the most,
    # and the earlier rule (most free KV) sent every new program there. Stats taken at 0 s;
    # the router counts its own routes since.
    a = _r("a", free=9_000, ahead=0, at=0.0)
    b = _r("b", free=1_000, ahead=0, at=0.0)
    memory = Memory()
    placed = []
    for i in range(4):
        first = route(f"p{i}", memory.current([a, b]), now=1.0 + i).ranked[0]
        memory.routed(f"p{i}", first, now=1.0 + i)
        placed.append(first)
    assert placed == ["a", "b", "a", "b"]
    assert [v.bound for v in memory.current([a, b])] == [2, 2]


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
    pinned = _r("a", at=4.0, p=PinView(30.0, 640))
    memory.observe(pinned, now=5.0)  # known alive until its expiry: no decay before
    assert memory.get("p") == Last("a", 30.0, 640)
    memory.observe(_r("a", at=12.0), now=13.0, before=pinned)  # gone from a's next stats
    assert memory.get("p") == Last("a", 12.0, 640)
    memory.observe(_r("a", p=PinView(30.0, 640)), now=40.0)  # expired: not refreshed
    assert memory.get("p") == Last("a", 12.0, 640)
    memory.routed("q", "b", now=6.0)
    memory.routed("r", "b", now=7.0)
    assert memory.get("p") is None
    assert len(memory) == 2
    assert memory.get(None) is None


def test_the_memory_adds_the_routes_made_since_a_replicas_stats() -> None:
    memory = Memory()
    a = _r("a", queued=100, ahead=50, bound=1, at=10.0, p=PinView(60.0, 500, ahead_tokens=0))
    memory.observe(a, now=10.0)  # p last ran on a (its pin)
    memory.routed("p", "a", now=11.0, tokens=700)  # p's return: no new program bound
    memory.routed("n", "a", now=12.0, tokens=300)  # a new program
    memory.routed("m", "b", now=12.5, tokens=900)  # elsewhere
    (now_a,) = memory.current([a])
    assert (now_a.waiting, now_a.bound, now_a.queued_tokens) == (2, 2, 1_100)
    assert now_a.ahead_tokens == 1_050  # work ahead of a turn that holds no pin there
    assert now_a.pins == a.pins  # a pinned return keeps its place ahead of them
    # stats without a time, or newer than every route, are left as they are
    assert memory.current([_r("a", at=None)]) == [_r("a", at=None)]
    assert memory.current([_r("a", at=20.0)]) == [_r("a", at=20.0)]
    assert memory.current([_r("a", at=10.0)])[0].ahead_tokens is None  # no queue view
    # each replica counts the routes since its own stats
    memory.routed("k", "b", now=13.0, tokens=50)
    now_a, now_b = memory.current([_r("a", at=11.5), _r("b", at=12.0)])
    assert (now_a.waiting, now_a.queued_tokens) == (1, 300)  # n at 12.0; p at 11.0 was seen
    assert (now_b.waiting, now_b.queued_tokens) == (2, 950)  # m at 12.5 and k at 13.0


def test_the_memory_keeps_at_least_the_newest_routes_of_each_replica() -> None:
    memory = Memory(max_routes=3)
    for t in range(1, 11):
        memory.routed(f"p{t}", "a", now=float(t), tokens=10)
    (recent,) = memory.current([_r("a", at=7.5)])
    assert (recent.waiting, recent.bound, recent.queued_tokens) == (3, 3, 30)
    (stale,) = memory.current([_r("a", at=0.0)])
    assert 3 <= stale.waiting <= 6  # the oldest are forgotten, never the 3 newest
    assert stale.queued_tokens == 10 * stale.waiting


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


def _controller(rules: SchedulingRules | None = None) -> PinController[str]:
    controller = PinController(
        rules or SchedulingRules(), MinimalHost(), pool_blocks=100, decider=_Fixed(), engine_id="e"
    )
    controller.arrived("p", 0.0, 0.0)
    controller.admitted("p", 0.0)
    controller.finished(FinishedTurn("p", "bash", "ls", 160), 1.0, lambda: (10, "blocks"))
    return controller


def test_a_pin_controller_publishes_stats_the_router_reads_back() -> None:
    controller = _controller()
    stats = replica_stats(
        controller,
        free_tokens=640,
        queued_tokens=32,
        prefill_tokens_per_s=500.0,
        tokens_per_block=16,
        now=2.0,
        running=3,
    )
    view = view_of("r1", stats, default_prefill_tokens_per_s=RATE)
    expected = ReplicaView("r1", 640, 32, 500.0, {"p": PinView(31.0, 160)}, 3, 0, 1, None, 2.0)
    assert view == expected  # no queue view: no ahead tokens, the wait is all 32 queued
    assert view.wait_s("new", now=2.0) == 32 / 500.0
    assert stats[STATS_KEY]["pinned_tokens"] == 160
    assert route("p", [view, _r("r2", free=10_000)], now=2.0).ranked[0] == "r1"


def _queue_view(rules: SchedulingRules) -> ReplicaView:
    """A replica's view under ``rules``. Queued: a preempted request, q's pinned return, an
    older program's first turn and a new program's first turn; 200 tokens of running
    prefill left; p holds a pin and has not returned yet."""
    controller = _controller(rules)
    controller.arrived("q", 0.5, 0.5)
    controller.admitted("q", 0.5)
    controller.finished(FinishedTurn("q", "bash", "ls", 160), 1.0, lambda: (10, "blocks"))
    queue = []
    for program, arrival, preempted, tokens in (
        ("r", 0.1, True, 500),
        ("q", 1.8, False, 800),  # its pin holds 160 of them
        ("old", 0.2, False, 1_000),
        ("n1", 1.5, False, 3_000),
    ):
        controller.arrived(program, arrival, arrival)
        key = controller.order_key(0, preempted, program, arrival, f"req-{program}")
        queue.append(Queued(program, key, tokens))
    stats = replica_stats(
        controller,
        free_tokens=0,
        prefill_tokens_per_s=500.0,
        tokens_per_block=16,
        now=2.0,
        running=1,
        prefilling_tokens=200,
        waiting=queue,
    )
    view = view_of("r1", stats, RATE)
    assert (view.queued_tokens, view.waiting, view.running) == (500 + 640 + 1_000 + 3_000, 4, 1)
    assert view.bound == 5  # p, q, r, old, n1
    return view


def test_a_replica_publishes_the_waits_of_the_papers_queue_order() -> None:
    # the paper's `program` order: preempted, then programs with a live pin, then by first
    # arrival (new programs' first turns wait behind pinned returns)
    view = _queue_view(SchedulingRules(first_turn_over_pins=False))
    # p's return: behind the running prefill and the preempted request only (q arrived later)
    assert view.pins["p"].ahead_tokens == 200 + 500
    assert view.pins["q"].ahead_tokens == 200 + 500 + 640  # its own queued turn first
    assert view.ahead_tokens == 200 + 500 + 640 + 1_000 + 3_000  # a new program: behind all
    # p stays unless 1.4 s saved exceeds its 160 tokens (0.16 s) x (1 + requests on r2)
    for requests, rule in ((7, "escape"), (8, "pin")):
        rival = _r("r2", ahead=0, running=requests)
        assert route("p", [view, rival], now=2.0).rule == rule, requests
    assert route("fresh", [view, _r("r2", ahead=0, running=8)], now=2.0).ranked[0] == "r2"


def test_a_replica_publishes_the_waits_of_the_default_queue_order() -> None:
    # the default: preempted, then new programs' first turns (old and n1, by arrival), then
    # programs with a live pin, then the rest by first arrival
    view = _queue_view(SchedulingRules())
    assert view.pins["p"].ahead_tokens == 200 + 500 + 1_000 + 3_000
    assert view.pins["q"].ahead_tokens == 200 + 500 + 1_000 + 3_000 + 640
    # a new program: behind the preempted request and the earlier first turns, ahead of q
    assert view.ahead_tokens == 200 + 500 + 1_000 + 3_000


def test_bad_stats_and_views_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"pins\['p'\]"):
        view_of("r1", {STATS_KEY: {"pins": {"p": "soon"}}}, RATE)
    with pytest.raises(ValueError, match="queued_tokens"):
        view_of("r1", {STATS_KEY: {"queued_tokens": "many"}}, RATE)
    with pytest.raises(ValueError, match="bound"):
        view_of("r1", {STATS_KEY: {"bound": "several"}}, RATE)
    with pytest.raises(ValueError, match=r"pins\['p'\]"):
        view_of("r1", {STATS_KEY: {"pins": {"p": [1.0, 16, 0, 9]}}}, RATE)
    with pytest.raises(ValueError, match="at must be"):
        view_of("r1", {STATS_KEY: {"at": "now"}}, RATE)
    with pytest.raises(ValueError, match="prefill_tokens_per_s of r1"):
        route("p", [ReplicaView("r1", prefill_tokens_per_s=0.0)], now=0.0)
    with pytest.raises(ValueError, match="replicas"):
        route("p", [], now=0.0)
    assert view_of("r9", None, RATE) == ReplicaView("r9", prefill_tokens_per_s=RATE)
