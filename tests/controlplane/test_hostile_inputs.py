"""Hostile events, each over a real server on a port (SQLite and
PostgreSQL where the database matters): one poisonous event, unbounded names, a turn
index PostgreSQL could not hold, and what reaches an operator's terminal."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from sqlalchemy import create_engine, text

from controlplane.__main__ import main
from controlplane._gen.cachettl.v1 import events_pb2, events_pb2_grpc
from controlplane.errors import InvalidInputError
from controlplane.learning import NameLimits
from controlplane.records import Tenant
from controlplane.rpc.client import ControlPlaneClient, ToolCall, to_event
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store
from controlplane.storage.migrate import upgrade
from controlplane.storage.sql import SqlStore

from .conftest import pg_url

BOTH = pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
#: The poison event: 4,005 characters, within every input limit.
POISON = '{"a":' + "[" * 4000


def _call(i: int | str, tool: str = "bash", args: str = "ls", **fields: object) -> ToolCall:
    return ToolCall(f"e{i}", "prog", tool, args, 0.5, **fields)  # type: ignore[arg-type]


def _metrics(port: int | None) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _restart(db_url: str, **kwargs: object) -> tuple[Store, ControlPlane]:
    store = create_store(db_url)
    return store, ControlPlane(store, min_samples=1, **kwargs)  # type: ignore[arg-type]


# -- defect 1: learning never fails after a commit --------------------------------------


@BOTH
def test_poison_event_is_learned_and_the_server_goes_on(store: Store, db_url: str, serve) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, evil = plane.create_tenant("evil")
    _, other = plane.create_tenant("other")
    with (
        serve(plane, tail_interval_s=0.05, metrics_listen="127.0.0.1:0") as server,
        ControlPlaneClient(server.target, evil) as e,
        ControlPlaneClient(server.target, other) as o,
    ):
        assert (
            e.record_tool_calls([_call("poison", "search", POISON)]).accepted == 1
        )  # was INTERNAL
        assert e.record_tool_calls([_call(1, "search", '{"q": 1}')]).accepted == 1
        assert o.record_tool_calls([_call(2), _call(3)]).accepted == 2
        assert o.decide_ttl("bash", "ls").basis
        time.sleep(0.2)  # a few tail rounds: they used to fail every time
        tools = {t.tool_name: t.sample_count for t in e.list_tools().tools}
        assert tools == {"search": 2}
        assert not plane.learning.unlearned  # the extractor copes: nothing had to be skipped
        assert 'cachettl_events_unlearned_total{reason="' not in _metrics(
            server.server.metrics_port
        )
        version = plane.version
    again_store, again = _restart(db_url)  # the server starts again on its database
    try:
        assert again.version == version
        assert [t.sample_count for t in again.list_tools("evil")] == [2]
    finally:
        again_store.close()


@BOTH
def test_rows_learning_cannot_take_are_skipped_counted_and_shown(
    store: Store, db_url: str, serve
) -> None:
    """Rows stored under a higher bound than the restarted server's: startup replay and
    the tail skip them (counted, logged, in /metrics) and serving goes on."""
    plane = ControlPlane(store, min_samples=1, name_limits=NameLimits(10, 100))
    tenant, token = plane.create_tenant("acme")
    plane.record_tool_calls(tenant, [_call(i, f"tool-{i}") for i in range(8)])
    store2, restarted = _restart(db_url, name_limits=NameLimits(5, 100))
    try:
        assert restarted.learning.unlearned == {"name_limit": 3}
        assert restarted.version == plane.version  # skipped rows still count as applied
        with (
            serve(restarted, tail_interval_s=0.05, metrics_listen="127.0.0.1:0") as server,
            ControlPlaneClient(server.target, token) as client,
        ):
            plane.record_tool_calls(tenant, [_call(8, "tool-9")])  # through the other server
            deadline = time.monotonic() + 10
            while restarted.version < plane.version and time.monotonic() < deadline:
                time.sleep(0.02)
            assert restarted.learning.unlearned == {"name_limit": 4}  # the tail skipped it
            text_ = _metrics(server.server.metrics_port)
            assert 'cachettl_events_unlearned_total{reason="name_limit"} 4.0' in text_
            assert client.record_tool_calls([_call(9, "tool-0")]).accepted == 1
            names = [t.tool_name for t in client.list_tools().tools]
            assert names == [f"tool-{i}" for i in range(5)]
    finally:
        store2.close()


def _broken_extractor(tool: str, args: str) -> str:
    raise ZeroDivisionError(f"cannot read {args[:10]!r}")


@BOTH
def test_an_event_a_plugged_in_extractor_cannot_read_is_skipped(store: Store, serve) -> None:
    plane = ControlPlane(store, min_samples=1)
    plane.state.models.durations.signatures.register("odd", _broken_extractor)
    _, token = plane.create_tenant("acme")
    with (
        serve(plane, metrics_listen="127.0.0.1:0") as server,
        ControlPlaneClient(server.target, token) as client,
    ):
        batch = [_call(1), _call(2, "odd", "x y"), _call(3, "odd"), _call(4)]
        assert client.record_tool_calls(batch).accepted == 4  # stored and answered
        assert client.record_tool_calls([_call(5)]).accepted == 1  # learning goes on
        assert plane.learning.unlearned == {"ZeroDivisionError": 2}
        assert plane.version == 5
        assert [(t.tool_name, t.sample_count) for t in client.list_tools().tools] == [("bash", 3)]
        shown = _metrics(server.server.metrics_port)
        assert 'cachettl_events_unlearned_total{reason="ZeroDivisionError"} 2.0' in shown
    assert store.count_tool_calls() == 5


# -- defect 4: bounded names per tenant, bounded memory per model -----------------------


def _refused(client: ControlPlaneClient, calls: list[ToolCall]) -> tuple[object, str]:
    with pytest.raises(grpc.RpcError) as error:
        client.record_tool_calls(calls)
    return error.value.code(), error.value.details()


@BOTH
def test_name_limits_refuse_a_batch_whole(store: Store, serve) -> None:
    plane = ControlPlane(store, min_samples=1, name_limits=NameLimits(3, 4))
    _, token = plane.create_tenant("acme")
    _, other = plane.create_tenant("other")
    with (
        serve(plane, metrics_listen="127.0.0.1:0") as server,
        ControlPlaneClient(server.target, token) as client,
        ControlPlaneClient(server.target, other) as o,
    ):
        # arguments that name a command (a signature each): {"cmd": "cmd0"} ...
        client.record_tool_calls([_call(i, f"tool-{i}", f'{{"cmd": "cmd{i}"}}') for i in range(3)])
        stored = store.count_tool_calls()
        code, details = _refused(client, [_call(10, "tool-0"), _call(11, "new-tool")])
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "events[1].tool_name" in details
        assert "3 distinct tool names" in details
        assert "limit of 3" in details
        assert "--max-tools-per-tenant" in details
        named = [_call(12, "tool-0", '{"cmd": "a"}'), _call(13, "tool-1", '{"cmd": "b"}')]
        code, details = _refused(client, named)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "events[1].tool_args" in details
        assert "--max-signatures-per-tenant" in details
        assert store.count_tool_calls() == stored  # nothing of either batch
        assert client.record_tool_calls([_call(14, "tool-2", '{"cmd": "cmd0"}')]).accepted == 1
        assert o.record_tool_calls([_call(i, f"x-{i}") for i in range(3)]).accepted == 3
        shown = _metrics(server.server.metrics_port)
        assert 'cachettl_batches_refused_total{limit="tools"} 1.0' in shown
        assert 'cachettl_batches_refused_total{limit="signatures"} 1.0' in shown


def test_a_new_name_costs_kilobytes_not_tens(store: Store, serve) -> None:
    import tracemalloc

    plane = ControlPlane(store, min_samples=1, name_limits=NameLimits(5000, 5000))
    _, token = plane.create_tenant("acme")
    names = 2000
    with serve(plane) as server, ControlPlaneClient(server.target, token, timeout_s=60) as c:
        c.record_tool_calls([_call("warm", "warm", "warm")])
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for start in range(0, names, 1000):
                calls = [_call(i, f"tool-{i}", f"cmd{i} -x") for i in range(start, start + 1000)]
                c.record_tool_calls(calls)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    per_name = grown / names
    print(f"{per_name:.0f} bytes of models per new tool name")
    assert per_name < 16_384  # about 42 KB before (two models of 2,000-sample buffers)


# -- defect 6: turn_index holds a uint32 everywhere; what the store cannot hold ---------


@BOTH
def test_turn_index_holds_the_wire_type(store: Store, serve) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        result = client.record_tool_calls(
            [_call(1, turn_index=2**32 - 1), _call(2, turn_index=2**31)]
        )
        assert result.accepted == 2  # PostgreSQL answered UNAVAILABLE: integer out of range
    assert [r.call.turn_index for r in store.read_tool_calls(0, 10)] == [2**32 - 1, 2**31]


@BOTH
def test_a_value_the_store_cannot_hold_is_invalid_input(store: Store) -> None:
    if not isinstance(store, SqlStore):
        pytest.skip("SQL stores only")
    tenant = store.create_tenant("acme", False, "h" * 64, 0.0)
    with pytest.raises(InvalidInputError, match="request: holds a value the database cannot"):
        store.append_tool_calls(tenant, [_call(1), _call(2, turn_index=2**63)])
    assert store.count_tool_calls() == 0


def test_postgres_turn_index_migrates_to_bigint(pg_schemas: Callable[[], str]) -> None:
    url = pg_url(pg_schemas())
    engine = create_engine(url)
    upgrade(engine, "0002")
    with engine.begin() as c:
        tenant_row = "INSERT INTO tenants (name, token_hash, share, created_at)"
        c.execute(text(tenant_row + " VALUES ('a', 'h', false, 0)"))
        c.execute(
            text(
                "INSERT INTO tool_events (tenant_id, event_id, program_id, tool_name, tool_args,"
                " duration_s, turn_index, shared, received_at) VALUES (1, 'e', 'p', 'bash', 'ls',"
                " 0.5, 7, false, 0)"
            )
        )
    upgrade(engine)
    column = "SELECT data_type FROM information_schema.columns WHERE table_name = 'tool_events'"
    column += " AND column_name = 'turn_index' AND table_schema = current_schema()"
    with engine.connect() as c:
        assert c.execute(text(column)).scalar() == "bigint"
    store = SqlStore(url)
    try:
        tenant = Tenant(1, "a", False, 0.0)
        store.append_tool_calls(tenant, [_call(9, turn_index=2**32 - 1)])
        assert [r.call.turn_index for r in store.read_tool_calls(0, 10)] == [7, 2**32 - 1]
    finally:
        store.close()
        engine.dispose()


# -- defect 11: the operator's terminal and the authorization header --------------------


def test_cli_escapes_control_characters_of_names(store: Store, db_url: str, serve, capsys) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    hostile = "\x1b[2J\x1b]0;owned\x07bash\u202e"
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        client.record_tool_calls([_call(1, hostile, "\x1b[31mls")])
    capsys.readouterr()
    assert main(["tools", "list", "--db", db_url, "--tenant", "acme", "--min-samples", "1"]) == 0
    assert (
        main(["tools", "show", hostile, "--args", "\x1b[31mls", "--db", db_url, "--tenant", "acme"])
        == 0
    )
    out = capsys.readouterr().out
    assert not {"\x1b", "\x07", "\u202e"} & set(out)
    assert "\\x1b[2J\\x1b]0;owned\\x07bash\\u202e" in out


def test_several_authorization_headers_are_refused(store: Store, serve) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    request = events_pb2.RecordToolCallsRequest(events=[to_event(_call(1))])
    with serve(plane) as server, grpc.insecure_channel(server.target) as channel:
        stub = events_pb2_grpc.ToolEventServiceStub(channel)  # type: ignore[no-untyped-call]
        for headers in ((token, "someone-else"), ("someone-else", token), (token, token)):
            metadata = tuple(("authorization", f"Bearer {t}") for t in headers)
            with pytest.raises(grpc.RpcError) as error:
                stub.RecordToolCalls(request, metadata=metadata, timeout=5)
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in error.value.details()
    assert store.count_tool_calls() == 0
