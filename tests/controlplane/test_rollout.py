"""Rollouts and shadow calls in the control plane: the rollout rules, their storage on every
backend (memory, SQLite, PostgreSQL), the CLI, the snapshot stream of a real server (full
snapshots and compact deltas), and shadow calls' round trip over the wire into the store,
learned as any call but kept out of the pin statistics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlplane._gen.cachettl.v1 import model_pb2
from controlplane.cli import main
from controlplane.errors import TenantNotFoundError
from controlplane.records import PinOutcome, ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store
from controlplane.storage.rollouts import Rollout, RolloutMode, parse_tools
from enginehook.core.rollout import RolloutState
from enginehook.link.snapshot import rollout_of

BACKENDS = ["memory", "sqlite", "postgres"]
SQL_BACKENDS = ["sqlite", "postgres"]


# -- the rules ---------------------------------------------------------------------------


def test_rollout_rules_pin_only_the_listed_or_all_but_the_listed_tools() -> None:
    only, skip = Rollout.of("only", ["pytest", "bash"]), Rollout.of("except", ["web_search"])
    assert (only.pins("bash"), only.pins("pytest"), only.pins("ls")) == (True, True, False)
    assert (skip.pins("bash"), skip.pins("web_search")) == (True, False)
    assert Rollout.of("all").pins("anything")
    assert not Rollout.of("shadow").pins("bash")
    assert only.tools == ("bash", "pytest")  # sorted, once each
    assert Rollout() == Rollout.of("all")


@pytest.mark.parametrize(
    ("mode", "tools", "message"),
    [
        ("only", [], "mode 'only' needs at least one tool"),
        ("except", [], "mode 'except' needs at least one tool"),
        ("all", ["bash"], "mode 'all' takes no tools"),
        ("shadow", ["bash"], "mode 'shadow' takes no tools"),
        ("some", [], "unknown mode 'some'; valid: all, only, except, shadow"),
        ("only", ["a,b"], "without commas"),
        ("only", ["x" * 129], "at most 128 characters"),
        (RolloutMode.UNSPECIFIED, [], "mode must be all, only, except or shadow"),
    ],
)
def test_a_bad_rollout_is_refused_by_name(mode, tools, message) -> None:
    with pytest.raises(ValueError, match=message):
        Rollout.of(mode, tools)


def test_tool_lists_name_where_they_came_from() -> None:
    assert parse_tools(" bash , pytest,bash", "--only") == ("bash", "pytest")
    with pytest.raises(ValueError, match=r"^\$CACHETTL_PIN_TOOLS: tool 2 is empty"):
        parse_tools("bash,", "$CACHETTL_PIN_TOOLS")
    with pytest.raises(ValueError, match=r"additional_config\.cachettl\.pin_tools: a list"):
        parse_tools(5, "additional_config.cachettl.pin_tools")  # type: ignore[arg-type]


def test_which_wins_own_shadow_then_control_plane_then_own_lists() -> None:
    own = RolloutState(Rollout.of("only", ["bash"]))
    assert own.pins("bash")
    assert not own.pins("pytest")
    assert not own.keeps_vllm_order
    own.remote = Rollout.of("shadow")
    assert not own.pins("bash")
    assert own.keeps_vllm_order
    own.remote = Rollout.of("except", ["bash"])
    assert not own.pins("bash")
    assert own.pins("pytest")
    own.remote = None  # cleared, or a server from before rollouts: the own lists again
    assert own.pins("bash")
    assert not own.pins("pytest")
    watched = RolloutState(shadow=True, remote=Rollout.of("all"))
    assert not watched.pins("bash")
    assert watched.keeps_vllm_order


# -- storage -----------------------------------------------------------------------------


@pytest.fixture
def plane(store: Store) -> ControlPlane:
    plane = ControlPlane(store, policy="fixed", policy_params={"ttl_s": 2.0}, min_samples=1)
    return plane


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_rollout_is_stored_versioned_and_cleared(store: Store) -> None:
    store.create_tenant("acme", False, "h1", 0.0)
    store.create_tenant("beta", False, "h2", 0.0)
    assert store.rollouts() == []
    first = store.set_rollout("acme", Rollout.of("only", ["pytest", "bash"]), 10.0)
    assert (first.version, first.rollout, first.updated_at) == (
        1,
        Rollout(RolloutMode.ONLY, ("bash", "pytest")),
        10.0,
    )
    store.set_rollout("beta", Rollout.of("shadow"), 11.0)
    store.set_rollout("acme", Rollout.of("except", ["web_search"]), 12.0)
    cleared = store.set_rollout("beta", None, 13.0)
    assert cleared.rollout is None
    assert cleared.version == 2
    rows = store.rollouts()
    assert [(r.tenant, r.rollout, r.version) for r in rows] == [
        ("acme", Rollout(RolloutMode.EXCEPT, ("web_search",)), 2),
        ("beta", None, 2),
    ]
    with pytest.raises(TenantNotFoundError, match="no tenant named 'nobody'"):
        store.set_rollout("nobody", Rollout(), 14.0)
    assert len(store.rollouts()) == 2


def _call(event_id: str, tool: str, outcome: PinOutcome, *, shadow: bool) -> ToolCall:
    return ToolCall(
        event_id, "p1", tool, "", 0.5, 100.0, 0, 2.0, outcome, 0.1, shadow=shadow
    )  # fmt: skip


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_shadow_calls_round_trip_the_wire_and_the_store_and_stay_out_of_pin_statistics(
    db_url: str, serve
) -> None:
    store = create_store(db_url)
    plane = ControlPlane(store, policy="fixed", policy_params={"ttl_s": 2.0}, min_samples=1)
    _, token = plane.create_tenant("acme")
    calls = [
        _call("real-hit", "bash", PinOutcome.HIT, shadow=False),
        _call("shadow-hit", "bash", PinOutcome.HIT, shadow=True),
        _call("shadow-expired", "bash", PinOutcome.EXPIRED, shadow=True),
    ]
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        assert client.record_tool_calls(calls).accepted == 3
    stored = {row.call.event_id: row.call for row in store.read_tool_calls(0, 10)}
    assert [stored[c.event_id].shadow for c in calls] == [False, True, True]
    assert stored["shadow-hit"] == calls[1]  # every field as sent
    pins = plane.state.pin_counts("acme", "bash")
    assert (pins.hits, pins.expired, pins.hit_rate) == (1, 0, 1.0)  # the real pin only
    model = plane.state.models.durations.lookup("bash", None, "acme").model
    assert model is not None
    assert model.n_samples == 3  # every call learned, shadow or not
    # the shadow EXPIRED call's delay is a sample of T, as a real one's would be
    assert plane.workload_stats("acme").queue_delay_s == pytest.approx(0.1)
    restarted = ControlPlane(store, policy="fixed", policy_params={"ttl_s": 2.0}, min_samples=1)
    assert restarted.state.pin_counts("acme", "bash").hits == 1  # replayed from the log
    store.close()


# -- the snapshot stream -----------------------------------------------------------------


def _next(stream: Iterator[model_pb2.WatchSnapshotsResponse]) -> model_pb2.WatchSnapshotsResponse:
    for reply in stream:  # the stream's own deadline bounds the wait
        return reply
    raise AssertionError("the snapshot stream ended without a reply")


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_rollout_reaches_the_stream_as_a_new_version_full_and_delta(
    plane: ControlPlane, serve, compact: bool, db_url: str
) -> None:
    _, token = plane.create_tenant("acme")
    with (
        serve(plane, watch_interval_s=0.05, tail_interval_s=0.05) as server,
        ControlPlaneClient(server.target, token) as client,
    ):
        client.record_tool_calls([_call("e1", "bash", PinOutcome.HIT, shadow=False)])
        stream = client.watch_snapshots(0, timeout_s=20, compact=compact)
        first = _next(stream)
        assert not first.HasField("rollout")
        assert rollout_of(first) is None
        assert main(["rollout", "set", "--tenant", "acme", "--only", "bash", "--db", db_url]) == 0
        second = _next(stream)
        assert second.version == first.version + 1
        assert rollout_of(second) == Rollout.of("only", ["bash"])
        if compact:  # a delta carries the rollout too, and no model (none changed)
            assert second.delta
            assert not second.models
        assert main(["rollout", "set", "--tenant", "acme", "--clear", "--db", db_url]) == 0
        third = _next(stream)
        assert third.version == second.version + 1
        assert rollout_of(third) is None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_rollout_cli_refuses_a_bad_request_and_writes_nothing(
    store: Store, db_url: str, capsys
) -> None:
    store.create_tenant("acme", False, "h", 0.0)
    assert main(["rollout", "set", "--tenant", "nobody", "--all", "--db", db_url]) == 2
    assert "--tenant: no tenant named 'nobody'; nothing written" in capsys.readouterr().err
    assert main(["rollout", "set", "--tenant", "acme", "--only", "a,,b", "--db", db_url]) == 2
    assert "--only: tool 2 is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one of the modes, exactly
        main(["rollout", "set", "--tenant", "acme", "--all", "--shadow", "--db", db_url])
    assert store.rollouts() == []
    assert main(["rollout", "set", "--tenant", "acme", "--shadow", "--db", db_url]) == 0
    assert "acme: shadow" in capsys.readouterr().out
    assert main(["rollout", "show", "--json", "--db", db_url]) == 0
    assert '"mode": "shadow"' in capsys.readouterr().out
