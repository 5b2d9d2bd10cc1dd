"""One storage contract, run against every backend, and through the gRPC client.

``TestStoreContract`` runs on the in-memory store, a SQLite file and a fresh schema of the
real PostgreSQL. ``TestIngestContract`` runs the ingest rules both on the store directly
and through a real server and ``ControlPlaneClient``, reading back from the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from controlplane.errors import TenantExistsError, TenantNotFoundError
from controlplane.records import (
    AppendResult,
    PinOutcome,
    ProgramEnd,
    SnapshotRecord,
    Tenant,
    ToolCall,
)
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import SNAPSHOTS_KEPT, Store, hash_token
from controlplane.storage.base import Horizon
from tests.support import running

BACKENDS = ["memory", "sqlite", "postgres"]


def call(event_id: str, duration: float = 1.0, tool: str = "bash") -> ToolCall:
    return ToolCall(event_id, "prog", tool, "pytest -x", duration)


def make_tenant(store: Store, name: str = "acme", share: bool = False) -> Tenant:
    return store.create_tenant(name, share, hash_token(f"token-{name}"), 1.0)


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
class TestStoreContract:
    def test_tenants(self, store: Store) -> None:
        acme = make_tenant(store, "acme", share=True)
        make_tenant(store, "zeta")
        with pytest.raises(TenantExistsError):
            make_tenant(store, "acme")
        assert [t.name for t in store.list_tenants()] == ["acme", "zeta"]
        found = store.tenant_by_token_hash(hash_token("token-acme"))
        assert found is not None
        assert (found.id, found.share, found.revoked_at) == (acme.id, True, None)
        assert store.tenant_by_token_hash(hash_token("nope")) is None
        store.revoke_tenant("acme", 5.0)
        revoked = store.tenant_by_token_hash(hash_token("token-acme"))
        assert revoked is not None
        assert revoked.revoked_at == 5.0
        with pytest.raises(TenantNotFoundError):
            store.revoke_tenant("ghost", 5.0)

    def test_rotating_a_token_replaces_it_and_reactivates_the_tenant(self, store: Store) -> None:
        acme = make_tenant(store, "acme", share=True)
        make_tenant(store, "zeta")
        store.revoke_tenant("acme", 5.0)
        rotated = store.rotate_token("acme", hash_token("token-acme-2"))
        assert (rotated.id, rotated.name, rotated.share, rotated.revoked_at) == (
            acme.id,
            "acme",
            True,
            None,
        )
        assert store.tenant_by_token_hash(hash_token("token-acme")) is None
        assert store.tenant_by_token_hash(hash_token("token-acme-2")) == rotated
        zeta = store.tenant_by_token_hash(hash_token("token-zeta"))
        assert zeta is not None
        assert zeta.name == "zeta"  # another tenant's token is untouched
        with pytest.raises(TenantNotFoundError):
            store.rotate_token("ghost", hash_token("x"))

    def test_log_positions_increase_and_read_back_in_order(self, store: Store) -> None:
        acme, zeta = make_tenant(store, "acme"), make_tenant(store, "zeta")
        full = ToolCall(
            "x", "p", "bash", "ls", 0.25, 1.5, 3, 2.0, PinOutcome.EXPIRED, admission_delay_s=0.7
        )
        first = store.append_tool_calls(acme, [full, call("y")])
        second = store.append_tool_calls(zeta, [call("x")])  # ids are per tenant
        assert first.accepted == 2
        assert second.accepted == 1
        assert list(first.seqs) + list(second.seqs) == sorted({*first.seqs, *second.seqs})
        rows = store.read_tool_calls(0, 100)
        assert [(r.tenant, r.call.event_id) for r in rows] == [
            ("acme", "x"),
            ("acme", "y"),
            ("zeta", "x"),
        ]
        assert rows[0].call == full
        assert [r.call.event_id for r in store.read_tool_calls(rows[0].seq, 1)] == ["y"]
        assert [r.tenant for r in store.read_tool_calls(0, 100, tenant="zeta")] == ["zeta"]
        assert store.count_tool_calls() == 3
        assert store.count_tool_calls("acme") == 2

    def test_program_ends_are_idempotent(self, store: Store) -> None:
        acme = make_tenant(store)
        seq = store.append_program_end(acme, ProgramEnd("p1", 7, 3.0))
        assert seq is not None
        # the same end resent (same program and finish time) is a repeat, whatever it says
        assert store.append_program_end(acme, ProgramEnd("p1", 7, 3.0)) is None
        assert store.append_program_end(acme, ProgramEnd("p1", 9, 3.0)) is None
        (row,) = store.read_program_ends(0, 10)
        assert (row.seq, row.tenant, row.end) == (seq, "acme", ProgramEnd("p1", 7, 3.0))

    def test_a_program_id_run_again_ends_again(self, store: Store) -> None:
        acme, zeta = make_tenant(store, "acme"), make_tenant(store, "zeta")
        ends = [
            (acme, ProgramEnd("p1", 7, 3.0)),
            (acme, ProgramEnd("p1", 4, 80.5)),  # the same id run again, ended later
            (acme, ProgramEnd("p1", 2)),  # one end without a time
            (zeta, ProgramEnd("p1", 7, 3.0)),  # ends are per tenant
        ]
        seqs = [store.append_program_end(t, e) for t, e in ends]
        assert None not in seqs
        for tenant, end in ends:  # every one resent: all repeats
            assert store.append_program_end(tenant, end) is None
        assert store.append_program_end(acme, ProgramEnd("p1", 5)) is None  # still untimed
        rows = store.read_program_ends(0, 10)
        assert [(r.seq, r.tenant, r.end) for r in rows] == [
            (seq, tenant.name, end) for seq, (tenant, end) in zip(seqs, ends, strict=True)
        ]
        assert [r.end.total_turns for r in store.read_program_ends(0, 10, "acme")] == [7, 4, 2]

    def test_snapshots_keep_the_newest(self, store: Store) -> None:
        assert store.latest_snapshot("cachettl") is None
        for i in range(SNAPSHOTS_KEPT + 2):
            store.save_snapshot(SnapshotRecord("cachettl", i, i, float(i), bytes([i])))
        store.save_snapshot(SnapshotRecord("continuum", 1, 1, 1.0, b"c"))
        latest = store.latest_snapshot("cachettl")
        assert latest is not None
        assert (latest.tool_seq, latest.payload) == (SNAPSHOTS_KEPT + 1, bytes([3]))

    def test_compaction_deletes_only_what_a_snapshot_covers_beyond_the_horizon(
        self, store: Store
    ) -> None:
        acme, beta = make_tenant(store), make_tenant(store, "beta")
        a = store.append_tool_calls(acme, [call(f"a{i}") for i in range(6)]).seqs
        b = store.append_tool_calls(beta, [call(f"b{i}") for i in range(3)]).seqs
        ends = [store.append_program_end(acme, ProgramEnd(f"p{i}", 2, float(i))) for i in range(4)]
        late = store.append_tool_calls(acme, [call("a-late")]).seqs  # above the snapshot
        covered = SnapshotRecord("cachettl", b[-1], ends[-1] or 0, 1.0, b"state")
        assert store.save_snapshot(covered)
        assert store.log_compaction() is None
        horizon = Horizon(max_rows=2)  # each tenant's newest 2 rows per log are kept
        dry = store.compact_log(covered, horizon, now=2.0, dry_run=True)
        assert (dry.tool_rows_deleted, dry.end_rows_deleted) == (6, 2)
        assert store.log_rows() == (10, 4)
        assert store.log_compaction() is None
        done = store.compact_log(covered, horizon, now=2.0)
        assert (done.tool_rows_deleted, done.end_rows_deleted) == (6, 2)
        assert (done.tool_rows_kept, done.end_rows_kept) == (4, 2)
        kept = [r.seq for r in store.read_tool_calls(0, 100)]
        assert kept == [a[5], b[1], b[2], *late]  # each tenant's newest 2, and a-late
        assert [r.seq for r in store.read_program_ends(0, 100)] == ends[2:]
        mark = store.log_compaction()
        assert mark is not None
        assert (mark.tool_seq, mark.end_seq) == (b[-1], ends[-1])
        assert (mark.tool_rows_deleted, mark.end_rows_deleted) == (6, 2)
        # a snapshot below the compaction could not be restored: it is not stored
        assert not store.save_snapshot(SnapshotRecord("cachettl", a[0], 1, 3.0, b"old"))
        assert store.latest_snapshot("cachettl") == covered
        # everything beyond an age of 0 s: every covered row goes, the newest row stays,
        # and positions keep increasing
        store.compact_log(covered, Horizon(max_age_s=0.0), now=time.time() + 1)
        assert [r.seq for r in store.read_tool_calls(0, 100)] == list(late)
        assert store.append_tool_calls(acme, [call("a-next")]).seqs == (late[0] + 1,)
        again = store.append_tool_calls(acme, [call("a0")])  # a pruned id is new again
        assert again.seqs == (late[0] + 2,)

    def test_concurrent_writers_get_distinct_ordered_positions(self, store: Store) -> None:
        acme = make_tenant(store)
        results: list[AppendResult] = []

        def write(worker: int) -> None:
            for batch in range(5):
                ids = [f"{worker}-{batch}-{i}" for i in range(10)]
                results.append(store.append_tool_calls(acme, [call(e) for e in ids]))

        threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seqs = [s for r in results for s in r.seqs]
        assert len(seqs) == len(set(seqs)) == 200
        assert [r.seq for r in store.read_tool_calls(0, 1000)] == sorted(seqs)


class ClientWriter:
    """The ingest half of ``Store`` through a real server and ``ControlPlaneClient``."""

    def __init__(self, client: ControlPlaneClient) -> None:
        self.client = client

    def append_tool_calls(self, tenant: Tenant, calls: Sequence[ToolCall]) -> AppendResult:
        reply = self.client.record_tool_calls(calls)
        return AppendResult(tuple(range(reply.accepted)), reply.duplicates)

    def append_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        new = self.client.record_program_end(end.program_id, end.total_turns, end.finished_at)
        return 1 if new else None


@pytest.fixture(params=["direct", "grpc"])
def writer(request: pytest.FixtureRequest, store: Store) -> Iterator[tuple[object, Tenant]]:
    plane = ControlPlane(store)
    tenant, token = plane.create_tenant("acme")
    if request.param == "direct":
        yield store, tenant
        return
    with running(plane) as server, ControlPlaneClient(server.target, token) as client:
        yield ClientWriter(client), tenant


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
class TestIngestContract:
    def test_repeats_are_counted_and_ignored(self, store: Store, writer) -> None:
        w, tenant = writer
        assert w.append_tool_calls(tenant, [call("a"), call("b"), call("a")]).duplicates == 1
        result = w.append_tool_calls(tenant, [call("b", 9.0), call("c")])
        assert (result.accepted, result.duplicates) == (1, 1)
        rows = store.read_tool_calls(0, 10)
        assert [(r.call.event_id, r.call.duration_s) for r in rows] == [
            ("a", 1.0),
            ("b", 1.0),
            ("c", 1.0),
        ]

    def test_program_end_once(self, store: Store, writer) -> None:
        w, tenant = writer
        assert w.append_program_end(tenant, ProgramEnd("p", 4)) is not None
        assert w.append_program_end(tenant, ProgramEnd("p", 4)) is None
        assert [r.end.total_turns for r in store.read_program_ends(0, 10)] == [4]

    def test_program_end_once_per_run(self, store: Store, writer) -> None:
        w, tenant = writer
        assert w.append_program_end(tenant, ProgramEnd("p", 4, 1_700_000_000.5)) is not None
        assert w.append_program_end(tenant, ProgramEnd("p", 6, 1_700_000_300.25)) is not None
        assert w.append_program_end(tenant, ProgramEnd("p", 6, 1_700_000_300.25)) is None
        assert w.append_program_end(tenant, ProgramEnd("p", 4, 1_700_000_000.5)) is None
        assert [r.end.total_turns for r in store.read_program_ends(0, 10)] == [4, 6]
