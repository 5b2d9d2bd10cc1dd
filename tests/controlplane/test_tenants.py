"""Tenant isolation and opt-in sharing (SQLite and PostgreSQL), and two servers on one
PostgreSQL converging by tailing the log."""

from __future__ import annotations

import time

import pytest

from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.service import ControlPlane
from controlplane.sharing import SharingRules
from controlplane.storage import Store, create_store
from tests.support import running

DURATIONS = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


def _calls(prefix: str, tool: str = "bash") -> list[ToolCall]:
    return [ToolCall(f"{prefix}{i}", "prog", tool, "", d) for i, d in enumerate(DURATIONS)]


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_a_tenant_sees_and_affects_only_its_own_statistics(store: Store) -> None:
    plane = ControlPlane(store, min_samples=3)
    _, acme = plane.create_tenant("acme")
    _, zeta = plane.create_tenant("zeta")
    with (
        running(plane) as server,
        ControlPlaneClient(server.target, acme) as a,
        ControlPlaneClient(server.target, zeta) as z,
    ):
        a.record_tool_calls(_calls("e"))
        a.record_program_end("prog", 8)
        # the same event and program ids are a different tenant's own, not duplicates
        assert z.record_tool_calls(_calls("e", tool="grep")).accepted == len(DURATIONS)
        assert z.record_program_end("prog", 3) is True
        assert [t.tool_name for t in a.list_tools().tools] == ["bash"]
        assert [t.tool_name for t in z.list_tools().tools] == ["grep"]
        assert a.workload_stats().tool_calls == z.workload_stats().tool_calls == 7
        assert z.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0).basis == "all-tools"
        assert a.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0).basis == "tool"
        snapshot = next(z.watch_snapshots(timeout_s=10))
        assert {m.tool_name for m in snapshot.models} == {"", "grep"}
        with pytest.raises(Exception, match="no samples of tool 'bash'"):
            z.tool_distribution("bash")


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_sharing_is_opt_in_and_never_exposes_raw_events(store: Store) -> None:
    """One sharing tenant's calls are never shown to another (the shared model needs
    three other contributors, none over half); once published it is quantised."""
    plane = ControlPlane(
        store, policy="cachettl", min_samples=3, sharing=SharingRules(refresh_every=8)
    )
    _, acme = plane.create_tenant("acme", share=True)
    _, beta = plane.create_tenant("beta", share=True)
    _, solo = plane.create_tenant("solo")
    others = [plane.create_tenant(f"t{i}", share=True)[1] for i in range(3)]
    with (
        running(plane) as server,
        ControlPlaneClient(server.target, acme) as a,
        ControlPlaneClient(server.target, beta) as b,
        ControlPlaneClient(server.target, solo) as s,
    ):
        a.record_tool_calls(_calls("e"))
        decision = b.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0)
        assert (decision.basis, decision.model_version) == ("cold-start", 0)
        assert b.list_tools().tools == []
        s.record_tool_calls(_calls("s", tool="bash"))  # a non-sharing tenant feeds no prior
        raw = set(DURATIONS)
        for i, token in enumerate(others):
            with ControlPlaneClient(server.target, token) as t:
                t.record_tool_calls(_calls(f"t{i}", tool="bash"))
        decision = b.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0)
        assert (decision.basis, decision.model_version) == ("shared", 1)
        (shared,) = next(b.watch_snapshots(timeout_s=10)).models
        assert (shared.level, shared.tool_name) == ("shared", "bash")
        assert shared.summarized
        assert shared.sample_count == len(shared.sorted_durations_seconds)
        assert not raw & set(shared.sorted_durations_seconds)  # rounded to a 5 % grid
        assert s.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0).basis == "tool"
        assert [m.level for m in next(s.watch_snapshots(timeout_s=10)).models] == [
            "all-tools",
            "tool",
        ]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_servers_on_one_postgres_converge(db_url: str) -> None:
    """Bound: a row committed through one server is in the other's models within one
    tail interval (here 0.05 s; 0.5 s by default) plus one read of the log."""
    first, second = create_store(db_url), create_store(db_url)
    plane_a, plane_b = ControlPlane(first, min_samples=3), ControlPlane(second, min_samples=3)
    _, token = plane_a.create_tenant("acme")
    with (
        running(plane_a, tail_interval_s=0.05) as server_a,
        running(plane_b, tail_interval_s=0.05) as server_b,
        ControlPlaneClient(server_a.target, token) as a,
        ControlPlaneClient(server_b.target, token) as b,
    ):
        before = b.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0)
        assert before.basis == "cold-start"
        ack = a.record_tool_calls(_calls("e"))
        b.record_tool_calls(_calls("f", tool="grep"))  # both servers write
        deadline = time.monotonic() + 20
        while plane_a.version != plane_b.version and time.monotonic() < deadline:
            time.sleep(0.02)
        assert plane_a.version == plane_b.version == ack.model_version + len(DURATIONS)
        for tool in ("bash", "grep"):
            da = a.decide_ttl(tool, reload_cost_s=2.0, queue_delay_s=0.0)
            db = b.decide_ttl(tool, reload_cost_s=2.0, queue_delay_s=0.0)
            assert da == db
            assert da.basis == "tool"
        assert a.list_tools() == b.list_tools()
    first.close()
    second.close()
