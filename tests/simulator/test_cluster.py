"""The cluster simulator: every router's contract, the mechanisms on small hand-made cases,
TTL-aware routing's rules, and the cluster figures computed by hand."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from controlplane.cli import main
from simulator.cluster import (
    ROUTERS,
    Cluster,
    TopologyChange,
    TurnRequest,
    get_router,
    simulate_cluster,
)
from simulator.cluster.base import EngineView
from simulator.cluster.vllm_router import ConsistentHash
from simulator.engine import EngineConfig
from simulator.sim import ProgramState
from simulator.trace import Program, Turn
from simulator.workloads import generate

SMALL = EngineConfig(kv_tokens=64_000)
PIN_2S = "continuum-preview"  # pins every turn for 2 s (tools shorter than that)


def _program(pid: str, arrival: float, prompt: int, gap: float, turns: int = 2) -> Program:
    body = [Turn(prompt, 8, "bash", "ls", gap)]
    body += [Turn(16, 8, "bash", "ls", gap) for _ in range(turns - 2)]
    body.append(Turn(16, 8))
    return Program(pid, arrival, tuple(body))


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_serves_every_program_through_a_join_and_a_leave(name: str) -> None:
    programs = generate("bfcl", 24, 0.5, 3)
    span = programs[-1].arrival_s
    changes = [TopologyChange(span / 3, "add"), TopologyChange(2 * span / 3, "remove", 0)]
    result = simulate_cluster(programs, name, "cachettl", 3, topology=changes)
    assert sorted(p.program_id for p in result.programs) == sorted(p.program_id for p in programs)
    assert sum(result.per_engine_programs.values()) == len(programs)
    assert all(p.jct_s > 0 for p in result.programs)
    figures = result.figures()
    assert 0.0 <= figures["returning_hit_share"] <= 1.0
    assert figures["orphaned_pin_token_s"] <= figures["pinned_token_s"] + 1e-6


def test_router_errors_name_the_router_and_the_field() -> None:
    with pytest.raises(ValueError, match=r"unknown router 'nope'; valid: .*ttl-aware"):
        get_router("nope")
    with pytest.raises(ValueError, match="'dynamo': unknown parameter 'ttl'"):
        get_router("dynamo(ttl=3)")
    with pytest.raises(ValueError, match="'dynamo': parameter 'ttl_s' must be float"):
        get_router("dynamo(ttl_s=soon)")
    with pytest.raises(ValueError, match="affinity must be none, hard or soft"):
        get_router("dynamo(affinity=sticky)")
    with pytest.raises(ValueError, match="action must be 'add' or 'remove'"):
        TopologyChange(1.0, "grow")


def test_consistent_hash_moves_about_one_key_in_n_and_only_to_the_new_engine() -> None:
    cluster = Cluster([], "consistent_hash", engines=4)
    ring = cluster.router
    assert isinstance(ring, ConsistentHash)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: ring.owner(k) for k in keys}
    cluster._add(0.0)
    after = {k: ring.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert 0.14 < len(moved) / len(keys) < 0.26  # 1/5 expected
    assert {after[k] for k in moved} == {4}


def test_sticky_least_loaded_keeps_sessions_when_an_engine_joins() -> None:
    cluster = Cluster([], "sticky_least_loaded", engines=2)
    router, views = cluster.router, cluster.live
    first = {f"p{i}": router.route(TurnRequest(f"p{i}", 0, 100, 0, 0.0), views) for i in range(4)}
    assert sorted(e.engine_id for e in first.values() if e is not None) == [0, 0, 1, 1]
    cluster._add(1.0)
    again = {p: router.route(TurnRequest(p, 1, 200, 100, 2.0), cluster.live) for p in first}
    assert again == first
    new = router.route(TurnRequest("p9", 0, 100, 0, 3.0), cluster.live)
    assert new is not None
    assert new.engine_id == 2  # the fewest active sessions


def _pinned_when_engine_joins(router: str) -> Cluster:
    programs = [_program(f"p{i}", 0.1 * i, 3000, 1.5) for i in range(10)]
    cluster = Cluster(programs, router, PIN_2S, 2, config=SMALL)
    cluster.topology = [TopologyChange(1.3, "add")]
    cluster.run(until=1.29)
    assert sum(len(e.pins) for e in cluster.live) == 10  # all in their tool call, pinned
    cluster.resume()
    return cluster


def test_consistent_hash_remaps_live_pins_and_orphans_them() -> None:
    cluster = _pinned_when_engine_joins("consistent_hash")
    ring = ConsistentHash()
    for i in range(2):
        ring.joined(cluster.all[i], 0.0)
    before = {f"p{i}": ring.owner(f"p{i}") for i in range(10)}
    ring.joined(cluster.all[2], 0.0)
    moved = sum(before[p] != ring.owner(p) for p in before)
    assert moved > 0
    assert cluster.result.remapped_pins == moved
    assert cluster.result.moved_returns == moved
    assert cluster.result.orphaned_token_s > 0


def test_ttl_aware_never_remaps_a_live_pin_when_an_engine_joins() -> None:
    cluster = _pinned_when_engine_joins("ttl-aware")
    assert cluster.result.remapped_pins == 0
    assert cluster.result.moved_returns == 0
    assert cluster.result.orphaned_token_s == 0.0
    assert cluster.result.returning_hit_tokens == cluster.result.returning_reusable_tokens


def test_ttl_aware_spreads_new_programs_by_bound_programs_where_free_kv_piles_them() -> None:
    # four programs 1 s apart; each first turn ends in about 0.2 s, then a 5 s tool call
    # with no pin (vllm): the KV it leaves is cached but free, so every engine looks empty
    programs = [_program(f"p{i}", float(i), 3000, 5.0) for i in range(4)]
    cluster = Cluster(programs, "ttl-aware", "vllm", 2, config=SMALL)
    router = cluster.router
    placed: list[int] = []
    by_free_kv: list[int] = []  # what the earlier rule 3 (most free KV) would have picked
    route = router.route

    def spy(request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        choice = route(request, engines)
        if request.turn == 0 and choice is not None:
            placed.append(choice.engine_id)
            free = min(engines, key=lambda e: (-e.free_blocks(), e.queued_tokens(), e.engine_id))
            by_free_kv.append(free.engine_id)
        return choice

    router.route = spy  # type: ignore[method-assign]
    result = cluster.run()
    assert by_free_kv == [0, 0, 0, 0]  # every program on engine 0, the others away
    assert placed == [0, 1, 0, 1]  # the fewest bound programs (queues empty: waits tie)
    assert result.per_engine_programs == {0: 2, 1: 2}
    assert result.moved_returns == 0


def test_ttl_aware_places_a_new_program_by_its_wait_before_bound_programs() -> None:
    programs = [_program(f"p{i}", 0.5 * i, 3000, 5.0) for i in range(3)]
    cluster = Cluster(programs, "ttl-aware", "vllm", 2, config=SMALL)
    cluster.run(until=1.5)
    assert cluster.result.per_engine_programs == {0: 2, 1: 1}  # 0, 1, then the tie to 0
    busy = cluster.all[1]
    hog = _program("hog", 1.5, 40_000, 1.0)  # traffic the router did not place
    cluster._states[hog.program_id] = ProgramState(hog)
    for event in cluster._deliver(cluster._states[hog.program_id], busy, 1.5):
        cluster.loop.schedule(event)
    cluster.resume(until=1.6)
    new = TurnRequest("new", 0, 100, 0, 1.6)
    assert busy.queued_ahead_tokens("new", 1.6) > 30_000  # the hog's prefill still to run
    choice = cluster.router.route(new, cluster.live)
    assert choice is not None
    assert choice.engine_id == 0  # no wait there, though it has more programs bound


def _first_turns_beside_a_long_decode(router: str) -> tuple[list[int], dict[str, float]]:
    """``long`` decodes 4,000 tokens on engine 0 from 0 s (about 30 s of steps, no queue);
    three short programs arrive at 0.5, 1.0 and 1.5 s and go away for 5 s after their first
    turn. Where each first turn went, and each program's first-turn wait."""
    long = Program("long", 0.0, (Turn(100, 4000),))
    short = [_program(f"s{i}", 0.5 * (i + 1), 500, 5.0) for i in range(3)]
    cluster = Cluster([long, *short], router, "vllm", 2, config=SMALL)
    placed: list[int] = []
    route = cluster.router.route

    def spy(request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        choice = route(request, engines)
        if request.turn == 0 and choice is not None:
            if request.program_id == "s2":  # both queues are empty: the queued waits tie
                live = [cluster.all[e.engine_id] for e in engines]
                assert [e.queued_ahead_tokens("s2", request.now) for e in live] == [0, 0]
                assert live[0].step_s() > 0.0 == live[1].step_s()  # 0 is mid-step
            placed.append(choice.engine_id)
        return choice

    cluster.router.route = spy  # type: ignore[method-assign]
    result = cluster.run()
    return placed, {p.program_id: p.first_turn_wait_s for p in result.programs}


def test_ttl_aware_with_step_wait_places_a_first_turn_on_an_idle_engine_not_one_mid_step() -> None:
    placed, waits = _first_turns_beside_a_long_decode("ttl-aware(step_wait=true)")
    # s2 finds engine 0 with one program bound (decoding) and engine 1 with two bound (both
    # away): half a decode step against none, it goes where its prefill starts at once
    assert placed == [0, 1, 1, 1]
    assert waits["s2"] == 0.0
    # by default the waits tie at 0 (no queued prefill) and the fewest bound programs win:
    # s2 waits for engine 0's decode step to end
    placed, waits = _first_turns_beside_a_long_decode("ttl-aware")
    assert placed == [0, 1, 1, 0]
    assert waits["s2"] > 0.0


def _pinned_return_against_hogs(busy_rival: bool) -> tuple[Cluster, int]:
    """``a`` pinned on engine 0, forty 40k-token first turns delivered there behind it;
    with ``busy_rival`` engine 1 runs ten long decodes. Runs until ``a`` returns."""
    a = _program("a", 0.0, 3000, 1.5)
    cluster = Cluster([a], "ttl-aware", PIN_2S, 2, config=SMALL)
    cluster.run(until=0.5)
    pin = cluster.all[0].pin_of("a")
    assert pin is not None
    tokens = cluster.all[0].pinned_tokens(pin)
    hogs = [(_program(f"hog{i}", 0.5, 40_000, 1.0), 0) for i in range(40)]
    if busy_rival:
        hogs += [(Program(f"dec{i}", 0.5, (Turn(100, 2000),)), 1) for i in range(10)]
    for program, engine in hogs:
        state = cluster._states[program.program_id] = ProgramState(program)
        for event in cluster._deliver(state, cluster.all[engine], 0.5):
            cluster.loop.schedule(event)
    back = pin.pinned_at + 1.5
    cluster.resume(until=back - 1e-6)
    holder = cluster.all[0]
    # the holder's queue is 39 hogs, but a pinned turn goes ahead of them: it waits only
    # for the rest of the running hog's prefill; a new program would wait behind them all
    assert holder.queued_tokens() == 39 * 40_000  # one hog admitted, prefilling
    ahead = holder.queued_ahead_tokens("a", back)
    assert 0 < ahead < 40_000
    assert holder.queued_ahead_tokens("new", back) == ahead + 39 * 40_000
    cluster.resume(until=back)
    return cluster, tokens


def test_ttl_aware_keeps_a_pinned_turn_when_the_recompute_would_delay_a_busy_engine() -> None:
    cluster, _ = _pinned_return_against_hogs(busy_rival=True)
    # the earlier rule (total queued prompt tokens, recompute of the turn alone) broke here
    assert cluster._at["a"][0] == 0  # routed back to the holder
    assert cluster.result.dropped_pins == 0
    assert cluster.result.moved_returns == 0
    cluster.resume(until=cluster.loop.now + 1.2)  # admitted; the hogs are not back yet
    assert cluster.result.returning_hit_tokens == cluster.result.returning_reusable_tokens > 0
    assert cluster.result.orphaned_token_s == 0.0


def test_ttl_aware_drops_the_pin_at_once_when_it_sends_the_turn_elsewhere() -> None:
    cluster, tokens = _pinned_return_against_hogs(busy_rival=False)
    # the running hog's rest outweighs recomputing a's 3,000 tokens on the idle engine 1
    assert cluster.all[0].pin_of("a") is None  # dropped when the return went elsewhere
    assert cluster.result.dropped_pins == 1
    assert cluster.result.moved_returns == 1
    assert cluster.result.orphaned_token_s == pytest.approx(tokens * 1.5)
    cluster.resume()


def test_figures_of_a_tiny_run_by_hand() -> None:
    a = _program("a", 0.0, 1000, 1.5)
    b = _program("b", 0.0, 500, 1.5)
    cluster = Cluster([a, b], "round_robin", PIN_2S, 2, config=SMALL)
    result = cluster.run()
    figures = result.figures()
    # decisions: a → 0 (queues [0, 0]: no sample), b → 1 (queues [1000, 0]: max/mean 2);
    # the returns find empty queues; b returns first (shorter prompt) → 0, a → 1
    assert (result.imbalance_samples, figures["load_imbalance"]) == (1, 2.0)
    assert result.per_engine_programs == {0: 1, 1: 1}
    assert (result.returns, result.moved_returns) == (2, 2)
    # no return finds its prefix: both pins sat on the engines the programs left
    assert result.returning_hit_tokens == 0
    assert result.returning_reusable_tokens == (1007 // 16 + 507 // 16) * 16  # full blocks
    assert figures["returning_hit_share"] == 0.0
    assert result.orphaned_token_s == pytest.approx(result.pinned_token_s)
    # both pins outlive their programs' returns (2 s TTL) and end with the run
    end = max(p.finish_s for p in result.programs)
    assert 1488 * (end - 0.2) < result.orphaned_token_s <= 1488 * end
    jct = sorted(p.jct_s for p in result.programs)
    assert figures["mean_jct_s"] == pytest.approx(sum(jct) / 2)
    assert figures["p99_jct_s"] == pytest.approx(jct[0] + (jct[1] - jct[0]) * 0.99)


def test_bench_cluster_writes_verdicts_and_rerenders_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cluster"
    args = ["bench", "cluster", "--workload", "bfcl", "--programs", "6", "--seeds", "0-1"]
    args += ["--rate", "0.2", "--routers", "round_robin,ttl-aware", "--retentions", "vllm,cachettl"]
    assert main([*args, "--out", str(out)]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    block = summary["loads"]["1.0"]
    assert set(block["means"]) == {
        "ttl-aware+cachettl",
        "ttl-aware+vllm",
        "round_robin+vllm",
        "round_robin+cachettl",
    }
    assert {v["rival"] for v in block["verdicts"]} == set(block["means"]) - {"ttl-aware+cachettl"}
    assert all(len(rows) == 2 for rows in block["per_seed"].values())
    assert out.with_suffix(".png").stat().st_size > 0
    out.with_suffix(".md").unlink()
    assert (
        main(["bench", "cluster", "--report", str(out.with_suffix(".json")), "--out", str(out)])
        == 0
    )
    assert "| 1.0x |" in out.with_suffix(".md").read_text()
    capsys.readouterr()
    assert main([*args, "--ours", "ttl-aware", "--out", str(out)]) == 2
    assert "expected ROUTER+RETENTION, got 'ttl-aware'" in capsys.readouterr().err


def test_program_scheduling_holds_turns_at_admission_and_survives_its_home_leaving() -> None:
    programs = generate("bfcl", 40, 1.0, 1)
    leave = [TopologyChange(20.0, "remove", 0)]
    free = simulate_cluster(programs, "program-scheduling", "vllm", 2, topology=leave)
    tight = "program-scheduling(capacity_share=0.1,stats_window=5)"
    held = simulate_cluster(programs, tight, "vllm", 2, topology=leave)
    assert len(free.programs) == len(held.programs) == 40
    # a tenth of the pool per target: turns wait in the router, first turns included
    assert held.figures()["first_turn_wait_p90_s"] > 2 * free.figures()["first_turn_wait_p90_s"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--real-hook", "[1]"], "--real-hook: must be a JSON object of hook settings"),
        (["--real-hook", "{x"], "--real-hook: not JSON"),
        (["--real-policies", ""], "--real-policies must name a policy"),
        (["--real-runs", "0"], "--real-runs be >= 1"),
    ],
)
def test_the_real_bench_refuses_bad_flags_before_starting_anything(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "cluster", "--real", *flags]) == 2
    assert message in capsys.readouterr().err
