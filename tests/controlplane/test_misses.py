"""Why returning turns missed their cache, in the control plane: events with miss reasons
stored (SQLite, PostgreSQL, memory) and reported over a real gRPC server
(``GetToolDistribution.misses``, ``ListMisses`` with its filters), bad fields named,
events without the fields still accepted, the CLI (`cachettl misses`, `tools show`), and
revision 0004 upgrading a database that holds events."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from controlplane.__main__ import main
from controlplane._gen.cachettl.v1 import events_pb2, events_pb2_grpc
from controlplane.records import (
    MissQuery,
    MissReason,
    NotPinnedCause,
    PinOutcome,
    ToolCall,
    TurnCache,
)
from controlplane.rpc.client import ControlPlaneClient, to_event
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store
from controlplane.storage.migrate import upgrade
from controlplane.storage.schema import HEAD_REVISION
from controlplane.storage.sql import SqlStore
from enginehook.core.pins import ReleaseReason
from enginehook.core.tracker import CacheSeen, ToolCallTracker
from enginehook.link.transport import to_tool_call
from tests.support import ServerThread, running

from .conftest import pg_url

SQL_BACKENDS = ["sqlite", "postgres"]
R = MissReason


def _call(i: int, cache: TurnCache, tool: str = "bash", program: str = "p1") -> ToolCall:
    outcome = {
        R.HIT: PinOutcome.HIT,
        R.EXPIRED: PinOutcome.EXPIRED,
        R.NOT_PINNED: PinOutcome.NOT_PINNED,
    }.get(cache.reason, PinOutcome.UNSPECIFIED)
    return ToolCall(
        f"e{i}",
        program,
        tool,
        "ls",
        1.0 + i,
        finished_at=1_800_000_000.0 + i,
        turn_index=i,
        chosen_ttl_s=2.0,
        pin_outcome=outcome,
        admission_delay_s=0.01,
        cache=cache,
    )


#: Ten returning turns: three hits, three expired (1, 2, 10 s late), one refused by the
#: budget, one diverged at token 64, one served by the prefix cache, one of an engine that
#: reports no reason; then one evicted turn of another tool and program.
CALLS = [
    _call(0, TurnCache(R.HIT, hit_tokens=160, reusable_tokens=160)),
    _call(1, TurnCache(R.EXPIRED, expired_by_s=1.0, hit_tokens=0, reusable_tokens=160)),
    _call(2, TurnCache(R.HIT, hit_tokens=160, reusable_tokens=160)),
    _call(3, TurnCache(R.EXPIRED, expired_by_s=10.0, hit_tokens=0, reusable_tokens=160)),
    _call(4, TurnCache(R.NOT_PINNED, NotPinnedCause.BUDGET, hit_tokens=0, reusable_tokens=96)),
    _call(5, TurnCache(R.DIVERGED, diverged_at=64, hit_tokens=64, reusable_tokens=64)),
    _call(6, TurnCache(R.EXPIRED, expired_by_s=2.0, hit_tokens=0, reusable_tokens=160)),
    _call(7, TurnCache(R.PREFIX_CACHE, hit_tokens=160, reusable_tokens=160)),
    _call(8, TurnCache(R.HIT, hit_tokens=160, reusable_tokens=160)),
    _call(9, TurnCache()),
    _call(10, TurnCache(R.EVICTED, hit_tokens=32, reusable_tokens=160), "grep", "p2"),
]


@pytest.fixture
def served(store: Store) -> Iterator[tuple[ServerThread, ControlPlaneClient, Store]]:
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with running(plane) as server, ControlPlaneClient(server.target, token) as client:
        client.record_tool_calls(CALLS)
        yield server, client, store


@pytest.mark.parametrize("db_url", ["memory", *SQL_BACKENDS], indirect=True)
def test_reasons_are_stored_as_sent(served) -> None:
    _, _, store = served
    assert [r.call for r in store.read_tool_calls(0, 100)] == CALLS


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_tool_distribution_counts_reasons_and_expired_by_quantiles(served) -> None:
    _, client, _ = served
    misses = client.tool_distribution("bash").misses
    assert (misses.returning, misses.missed) == (9, 5)  # the unreported turn is not counted
    assert [(r.reason, r.count) for r in misses.reasons] == [
        (R.HIT, 3),
        (R.PREFIX_CACHE, 1),
        (R.NOT_PINNED, 1),
        (R.EXPIRED, 3),
        (R.DIVERGED, 1),
    ]
    quantiles = [(q.q, q.value.ToTimedelta().total_seconds()) for q in misses.expired_by]
    assert quantiles == [(0.5, 2.0), (0.9, 10.0), (0.99, 10.0)]
    assert client.tool_distribution("grep").misses.reasons[0].reason == R.EVICTED


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_list_misses_newest_first_with_filters_and_summary(served) -> None:
    _, client, _ = served
    listed = client.list_misses()
    assert [t.event_id for t in listed.turns] == ["e10", "e6", "e5", "e4", "e3", "e1"]
    assert (listed.summary.returning, listed.summary.missed) == (10, 6)
    diverged = next(t for t in listed.turns if t.event_id == "e5")
    assert (diverged.reason, diverged.diverged_at_token) == (R.DIVERGED, 64)
    assert (diverged.hit_tokens, diverged.reusable_tokens) == (64, 64)
    assert not diverged.HasField("expired_by")
    budget = next(t for t in listed.turns if t.event_id == "e4")
    assert budget.not_pinned_cause == NotPinnedCause.BUDGET
    assert not budget.HasField("diverged_at_token")
    late = client.list_misses(reason=R.EXPIRED, limit=2)
    assert [t.event_id for t in late.turns] == ["e6", "e3"]
    assert late.turns[1].expired_by.ToTimedelta().total_seconds() == 10.0
    assert late.turns[1].chosen_ttl.ToTimedelta().total_seconds() == 2.0
    other = client.list_misses(tool_name="grep", program_id="p2")
    assert [(t.event_id, t.reason, t.tool_name) for t in other.turns] == [
        ("e10", R.EVICTED, "grep")
    ]
    assert [(r.reason, r.count) for r in other.summary.reasons] == [(R.EVICTED, 1)]
    assert client.list_misses(program_id="nobody").summary.returning == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"reason": R.HIT}, "reason: must be a miss reason, got HIT"),
        ({"reason": 42}, "reason: unknown value 42"),
        ({"limit": 1001}, "limit: must be at most 1000, got 1001"),
        ({"tool_name": "t" * 129}, "tool_name: must be at most 128 characters"),
    ],
)
def test_bad_list_misses_requests_name_the_field(served, kwargs, needle) -> None:
    _, client, _ = served
    with pytest.raises(grpc.RpcError) as error:
        client.list_misses(**kwargs)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details()


def _event(**fields: object) -> events_pb2.ToolCallEvent:
    event = to_event(ToolCall("bad", "prog", "bash", "ls", 0.5))
    for name, value in fields.items():
        if name == "expired_by_s":
            event.expired_by.seconds = int(value)  # type: ignore[call-overload]
        else:
            setattr(event, name, value)
    return event


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"miss_reason": 99}, "events[1].miss_reason: unknown value 99"),
        ({"not_pinned_cause": 9}, "events[1].not_pinned_cause: unknown value 9"),
        (
            {"miss_reason": 1, "not_pinned_cause": 4},
            "events[1].not_pinned_cause: only with miss_reason NOT_PINNED or PREFIX_CACHE, got HIT",
        ),
        (
            {"miss_reason": 1, "expired_by_s": 3},
            "events[1].expired_by: only with miss_reason EXPIRED or PREFIX_CACHE, got HIT",
        ),
        ({"miss_reason": 4, "expired_by_s": -3}, "events[1].expired_by: must be >= 0"),
        ({"hit_tokens": 2_000_000_000}, "events[1].hit_tokens: must be at most 1000000000"),
    ],
)
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_bad_cache_fields_reject_the_batch_and_old_events_still_pass(
    served, fields, needle
) -> None:
    server, client, store = served
    before = store.count_tool_calls()
    old = to_event(ToolCall("old", "prog", "bash", "ls", 0.5))  # no cache fields at all
    assert not old.HasField("hit_tokens")
    with grpc.insecure_channel(server.target) as channel:
        stub = events_pb2_grpc.ToolEventServiceStub(channel)  # type: ignore[no-untyped-call]
        metadata = client._kw()["metadata"]
        request = events_pb2.RecordToolCallsRequest(events=[old, _event(**fields)])
        with pytest.raises(grpc.RpcError) as error:
            stub.RecordToolCalls(request, metadata=metadata, timeout=5)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert needle in error.value.details()
        assert store.count_tool_calls() == before
        accepted = stub.RecordToolCalls(
            events_pb2.RecordToolCallsRequest(events=[old]), metadata=metadata, timeout=5
        )
    assert accepted.accepted == 1
    assert store.read_tool_calls(before, 10)[0].call.cache == TurnCache()


def _seeded_db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'misses.sqlite3'}"
    store = create_store(url)
    plane = ControlPlane(store, min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    odd = _call(11, TurnCache(R.DIVERGED, diverged_at=0, hit_tokens=0, reusable_tokens=0))
    odd = replace(odd, program_id="x\x1b[2J")
    plane.record_tool_calls(tenant, [*CALLS, odd])
    store.close()
    return url


def test_cli_misses_lists_explains_and_escapes(tmp_path: Path, capsys) -> None:
    url = _seeded_db(tmp_path)
    assert main(["misses", "--tenant", "acme", "--db", url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["FINISHED", "(UTC)", "PROGRAM"]
    assert "x\\x1b[2J" in lines[1]  # newest first, control characters escaped
    assert "\x1b" not in out
    assert "diverged at token 0" in lines[1]
    assert "expired by 10.000s (ttl 2.000s), hit 0/160 tokens" in out
    assert "cause budget, hit 0/96 tokens" in out
    assert "returning turns 11, missed 7 (63.6%)" in out
    assert "expired by  p50=2.000s  p90=10.000s  p99=10.000s" in out
    assert main(["misses", "--tenant", "acme", "--reason", "expired", "--json", "--db", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [t["event_id"] for t in shown["turns"]] == ["e6", "e3", "e1"]
    assert shown["turns"][1]["expired_by_s"] == 10.0
    assert shown["summary"]["reasons"]["hit"] == 3
    assert main(["misses", "--tenant", "acme", "--reason", "hit", "--db", url]) == 2
    assert "'hit' is no miss reason; valid: not_pinned, expired" in capsys.readouterr().err
    assert main(["misses", "--tenant", "acme", "--reason", "late", "--db", url]) == 2
    assert "--reason: unknown reason 'late'" in capsys.readouterr().err
    assert main(["misses", "--limit", "0", "--db", url]) == 2
    assert "--limit must be in 1..1000, got 0" in capsys.readouterr().err


def test_cli_tools_show_prints_the_tools_miss_reasons(tmp_path: Path, capsys) -> None:
    url = _seeded_db(tmp_path)
    args = ["tools", "show", "bash", "--tenant", "acme", "--min-samples", "1", "--db", url]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "returning turns by miss reason" in out
    assert "returning turns 10, missed 6 (60.0%)" in out
    assert re.search(r"\n +expired +3 +30\.0%\n", out)
    assert main([*args, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["misses"]["reasons"] == {
        "hit": 3,
        "prefix_cache": 1,
        "not_pinned": 1,
        "expired": 3,
        "diverged": 2,
    }
    assert shown["misses"]["expired_by_s"] == {"p50": 2.0, "p90": 10.0, "p99": 10.0}


_OLD_ROW = (
    "INSERT INTO tool_events (tenant_id, event_id, program_id, tool_name, tool_args,"
    " duration_s, turn_index, shared, received_at, pin_outcome)"
    " VALUES (1, 'old-1', 'p', 'bash', 'ls', 1.5, 0, false, 0, 2)"
)
_TENANT = (
    "INSERT INTO tenants (id, name, token_hash, share, created_at)"
    " VALUES (1, 'acme', 'h', false, 0)"
)


@pytest.mark.parametrize("backend", SQL_BACKENDS)
def test_revision_0004_upgrades_a_database_holding_events(backend, tmp_path, pg_schemas) -> None:
    url = f"sqlite:///{tmp_path / 'r3.sqlite3'}" if backend == "sqlite" else pg_url(pg_schemas())
    engine = create_engine(url)
    assert upgrade(engine, "0003") == (None, "0003")
    with engine.begin() as c:
        c.execute(text(_TENANT))
        c.execute(text(_OLD_ROW))
    assert upgrade(engine) == ("0003", HEAD_REVISION)
    engine.dispose()
    store = SqlStore(url)
    try:
        (row,) = store.read_tool_calls(0, 10)
        assert (row.call.event_id, row.call.pin_outcome) == ("old-1", PinOutcome.EXPIRED)
        assert row.call.cache == TurnCache()  # reason 0: not reported
        tenant = store.list_tenants()[0]
        store.append_tool_calls(tenant, CALLS[:2])
        assert store.miss_counts("acme") == {R.HIT: 1, R.EXPIRED: 1}
        assert [r.call.event_id for r in store.list_misses("acme", MissQuery())] == ["e1"]
    finally:
        store.close()


def test_stored_first_revision_file_upgrades_to_unreported_reasons(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    shutil.copy(Path(__file__).parent / "data" / "schema-0001.sqlite3", path)
    url = f"sqlite:///{path}"
    assert upgrade(create_engine(url))[1] == HEAD_REVISION
    store = SqlStore(url)
    try:
        rows = store.read_tool_calls(0, 10)
        assert len(rows) == 5
        assert {r.call.cache for r in rows} == {TurnCache()}
        assert store.miss_counts("acme") == {}
        assert store.list_misses("acme", MissQuery()) == []
    finally:
        store.close()


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_the_engines_own_reports_of_turns_the_prefix_cache_served_are_accepted(served) -> None:
    """A turn served by the prefix cache after all keeps its pin's story: how late after
    its pin's expiry it came back, or why no pin was taken. The tracker reports both, and
    the server stores them as sent."""
    _, client, store = served
    tracker = ToolCallTracker("e1", "acme")
    tracker.turn_finished("late", 0.0, tool="bash", tool_args="ls", ttl_s=1.0, pinned=True)
    tracker.pin_released("late", ReleaseReason.TTL)
    tracker.turn_finished(
        "cold", 0.0, tool="bash", tool_args="ls", not_pinned=NotPinnedCause.TTL_ZERO
    )
    served_anyway = CacheSeen(hit_tokens=160, reusable_tokens=160)
    for program in ("late", "cold"):
        tracker.arrived(program, 3.0)
    late = tracker.returned("late", 3.5, pin_held=False, seen=served_anyway)
    cold = tracker.returned("cold", 3.5, pin_held=False, seen=served_anyway)
    assert late is not None
    assert late.event is not None
    assert cold is not None
    assert cold.event is not None
    assert late.cache.reason is cold.cache.reason is R.PREFIX_CACHE
    assert late.cache.expired_by_s == pytest.approx(2.0)
    assert cold.cache.not_pinned_cause is NotPinnedCause.TTL_ZERO
    calls = [to_tool_call(late.event), to_tool_call(cold.event)]
    assert client.record_tool_calls(calls).accepted == 2
    stored = [r.call for r in store.read_tool_calls(0, 100)][-2:]
    assert stored == calls
