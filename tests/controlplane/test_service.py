"""The gRPC service end to end: a real aio server on port 0 and the Python client."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.records import PinOutcome
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.rpc.server import SERVICE_NAMES
from controlplane.service import ControlPlane
from estimator import exponential_ttl, optimal_ttl


def _calls(prefix: str, tool: str, durations: list[float], args: str = "") -> list[ToolCall]:
    return [
        ToolCall(f"{prefix}-{i}", f"{prefix}-prog", tool, args, d) for i, d in enumerate(durations)
    ]


def test_continuum_ttl_equals_optimal_ttl_over_the_window(store, serve):
    plane = ControlPlane(store, policy="continuum", min_samples=5)
    _, token = plane.create_tenant("acme")
    durations = [0.1 * (i % 17) + 0.05 for i in range(40)] + [30.0, 45.0]
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        ack = client.record_tool_calls(_calls("e", "grep", durations))
        assert (ack.accepted, ack.duplicates) == (len(durations), 0)
        d = client.decide_ttl("grep", context_tokens=1000, reload_cost_s=1.5, queue_delay_s=0.2)
        assert d.basis == "tool"
        assert d.ttl_s == pytest.approx(optimal_ttl(durations, 1.5), abs=1e-9)
        assert d.model_version == ack.model_version == len(durations)
        cold = client.decide_ttl("never-seen-tool", reload_cost_s=4.0, queue_delay_s=0.0)
        # no tool model: the tenant's all-tools pool decides (the paper's back-off) ...
        assert cold.basis == "all-tools"
        assert cold.ttl_s == pytest.approx(optimal_ttl(durations, 4.0), abs=1e-9)


def test_cold_start_rule_before_any_sample(store, serve):
    plane = ControlPlane(store, policy="continuum", min_samples=5)
    _, token = plane.create_tenant("acme")
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        d = client.decide_ttl("bash", reload_cost_s=5.0, queue_delay_s=0.0)
        assert d.basis == "cold-start"
        assert d.ttl_s == pytest.approx(exponential_ttl(5.0), abs=1e-9)


def test_duplicates_are_counted_and_ignored(store, serve):
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        first = client.record_tool_calls(_calls("a", "ls", [0.1, 0.2, 0.3]))
        again = client.record_tool_calls(_calls("a", "ls", [0.1, 0.2, 0.3, 0.4]))
        assert (first.accepted, again.accepted, again.duplicates) == (3, 1, 3)
        assert store.count_tool_calls("acme") == 4
        assert client.record_program_end("a-prog", 5) is True
        assert client.record_program_end("a-prog", 5) is False
        stats = client.workload_stats()
        assert (stats.tool_calls, stats.programs_completed) == (4, 1)


@pytest.mark.parametrize("db_url", ["memory", "sqlite", "postgres"], indirect=True)
def test_a_program_id_run_again_is_learned_again(store, serve):
    """A session id reused after its program ended: each run's end feeds η and the
    remaining turns; resending an end (the hook's retry) changes nothing."""
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    first, second = 1_700_000_000.25, 1_700_000_600.5
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        assert client.record_program_end("swe-17", 4, first) is True
        assert client.record_program_end("swe-17", 10, second) is True
        assert client.record_program_end("swe-17", 10, second) is False
        assert client.record_program_end("swe-17", 4, first) is False
        stats = client.workload_stats()
        assert (stats.programs_completed, stats.programs_in_window) == (2, 2)
    remaining = plane.state.models.workload("acme").remaining
    assert remaining.expected_remaining(5) == 5.0  # only the 10-turn run went past 5
    assert [r.end.total_turns for r in store.read_program_ends(0, 10)] == [4, 10]
    replayed = ControlPlane(store, min_samples=1)  # a restart learns both from the log
    assert replayed.workload_stats("acme").programs_completed == 2


def test_pin_outcomes_feed_hit_rates_and_queue_delay(store, serve):
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    outcomes = [PinOutcome.HIT, PinOutcome.HIT, PinOutcome.EXPIRED, PinOutcome.NOT_PINNED]
    calls = [
        ToolCall(f"p{i}", "prog", "bash", "", 1.0, pin_outcome=o, admission_delay_s=0.5 * i)
        for i, o in enumerate(outcomes)
    ]
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        client.record_tool_calls(calls)
        (tool,) = client.list_tools().tools
        assert (tool.pins.hits, tool.pins.expired, tool.pins.not_pinned) == (2, 1, 1)
        assert tool.pins.hit_rate == pytest.approx(2 / 3)
        stats = client.workload_stats()
        # T averages the delays of turns whose cache had been released: 1.0 and 1.5 s
        assert stats.queue_delay.ToTimedelta().total_seconds() == pytest.approx(1.25)
        assert stats.queue_samples == 2


def test_health_and_reflection_are_served(store, serve):
    plane = ControlPlane(store)
    with serve(plane) as server, grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", *SERVICE_NAMES):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert set(SERVICE_NAMES) <= names


def test_snapshot_stream_resumes_from_a_version(store, serve):
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with (
        serve(plane, watch_interval_s=0.02) as server,
        ControlPlaneClient(server.target, token) as client,
    ):
        client.record_tool_calls(_calls("s", "ls", [0.1, 0.2]))
        first = next(client.watch_snapshots(timeout_s=10))
        assert first.version == 2
        assert [m.level for m in first.models] == ["all-tools", "tool"]
        assert list(first.models[1].sorted_durations_seconds) == [0.1, 0.2]
        client.record_tool_calls(_calls("t", "ls", [0.3]))
        resumed = next(client.watch_snapshots(after_version=first.version, timeout_s=10))
        assert resumed.version == 3
        assert list(resumed.models[1].sorted_durations_seconds) == [0.1, 0.2, 0.3]


def test_restart_reuses_a_matching_snapshot_only(store):
    plane = ControlPlane(store, min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    plane.record_tool_calls(tenant, _calls("r", "ls", [0.1, 0.2, 0.3]))
    assert plane.write_snapshot()
    assert not plane.write_snapshot()  # unchanged models: nothing to write
    plane.record_tool_calls(tenant, _calls("s", "ls", [0.4]))
    again = ControlPlane(store, min_samples=1)  # snapshot (3 calls) + the log's tail (1)
    assert again.state.version == 4
    assert again.list_tools("acme") == plane.list_tools("acme")
    other = ControlPlane(store, min_samples=2, profile="llama3.1-70b-h100-tp4")
    assert other.state.config[:3] == ("cachettl", "llama3.1-70b-h100-tp4", 2)
    assert other.state.version == 4  # rebuilt from the whole log


def test_database_failures_become_storage_errors():
    from controlplane.errors import StorageError
    from controlplane.storage import create_store

    with pytest.raises(StorageError, match="database error"):
        create_store("postgresql://postgres@127.0.0.1:1/test")


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_concurrent_writers_in_one_process_are_learned_as_sent(store):
    """Batches from many threads (as the gRPC server's handlers run) are committed (in
    groups, tests/controlplane/test_group_commit.py) and learned one writer at a time:
    never out of log order, so the log is never re-read, and the models equal a replay of
    the log."""
    import threading

    plane = ControlPlane(store, min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    rereads = []
    catch_up = plane.catch_up

    def counted() -> int:
        rereads.append(1)
        return catch_up()

    plane.catch_up = counted  # type: ignore[method-assign]

    start = threading.Barrier(8)

    def writer(w: int) -> None:
        start.wait()  # all at once
        for b in range(40):
            durations = [0.5 + i / 100 for i in range(100)]
            calls = _calls(f"w{w}b{b}", "bash", durations, "pytest -x")
            plane.record_tool_calls(tenant, calls)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rereads == []
    assert plane.state.tool_seq == 8 * 40 * 100
    replay = ControlPlane(store, min_samples=1)  # no snapshot: the whole log
    assert replay.list_tools("acme") == plane.list_tools("acme")
    assert replay.state.version == plane.state.version
