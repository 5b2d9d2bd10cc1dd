"""Retention of the event log: compaction keeps "the live models equal a restore".

On SQLite and PostgreSQL: a soak of a few seconds with a tiny horizon (a primary server
compacting, a replica tailing slower than the log is compacted, a restore and a new replica
at the end, all real gRPC servers) keeps the log's rows bounded, loses no acknowledged event
inside the horizon, counts every event once and ends with equal models; a compaction
interrupted after its record or between two batches loses nothing and counts nothing twice;
a server that cannot restore from the snapshot a compaction relies on refuses to start, in
one line; ``db compact`` and its dry run; the counters in ``/metrics``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import delete, select

from controlplane.__main__ import main
from controlplane.cli.retentionbench import Soak, soak
from controlplane.errors import LogCompactedError
from controlplane.records import ProgramEnd, ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import create_store, retention
from controlplane.storage.base import Horizon
from controlplane.storage.transactions import transaction
from tests.support import running, same_models

BACKENDS = ["sqlite", "postgres"]


def _fill(
    plane: ControlPlane, tenant_name: str = "acme", batches: int = 12, first: int = 0
) -> None:
    tenant = next(t for t in plane.store.list_tenants() if t.name == tenant_name)
    for b in range(first, first + batches):
        calls = [
            ToolCall(f"{tenant_name}-{b}-{i}", f"p{b}", ("bash", "grep")[i % 2], "x", 1.0 + i)
            for i in range(10)
        ]
        plane.record_tool_calls(tenant, calls)
        plane.record_program_end(tenant, ProgramEnd(f"p{b}", 10, 1000.0 + b))


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_soak_with_a_tiny_horizon_keeps_rows_bounded_and_models_equal(db_url: str) -> None:
    spec = Soak(
        db_url,
        seconds=4.0,
        retention_s=0.3,
        compact_s=0.2,
        snapshot_s=0.1,
        replica_tail_s=1.0,  # longer than horizon + interval: compacted past, it reloads
        rate=300.0,
        every_s=0.5,
    )
    result = soak(spec, say=lambda _: None)
    assert result.failed_batches == 0
    assert result.compactions >= 3
    assert result.reloads >= 1
    assert result.lost == 0  # every event sent after the cutoff is in the log
    assert result.counted == (result.acked_calls, result.acked_ends)  # each one once
    assert result.differences == {"replica": [], "restore": [], "new replica": []}
    assert result.ok
    late_rows = [calls for _, calls, _, _ in result.samples[len(result.samples) // 2 :]]
    assert max(late_rows) < result.acked_calls / 4  # bounded: not the whole log


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_compaction_cut_short_loses_nothing_and_counts_nothing_twice(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = create_store(db_url)
    plane = ControlPlane(store, min_samples=2)
    plane.create_tenant("acme")
    _fill(plane)
    plane.write_snapshot()
    snapshot = store.latest_snapshot("cachettl")
    assert snapshot is not None
    real_delete = retention._delete

    def one_batch_then_crash(engine, table, where):
        chosen = select(table.c.seq).where(where).order_by(table.c.seq).limit(7)
        with transaction(engine, write=True) as c:
            c.execute(delete(table).where(table.c.seq.in_(chosen)))
        raise RuntimeError("killed between two batches")

    monkeypatch.setattr(retention, "_delete", one_batch_then_crash)
    with pytest.raises(RuntimeError, match="killed"):
        store.compact_log(snapshot, Horizon(max_age_s=0.0), time.time() + 1)
    mark = store.log_compaction()
    assert mark is not None
    assert mark.finished_at is None  # recorded before the first row went
    assert store.log_rows()[0] == 120 - 7
    for other in (create_store(db_url), create_store(db_url)):
        same_models(plane.state, ControlPlane(other, min_samples=2).state)  # a restart
        other.close()
    monkeypatch.setattr(retention, "_delete", real_delete)
    done = plane.compact_log(Horizon(max_age_s=0.0))  # the next compaction finishes
    assert (done.tool_rows_kept, done.end_rows_kept) == (1, 1)
    _fill(plane, batches=2, first=12)  # two batches more, of new ids
    again = create_store(db_url)
    restored = ControlPlane(again, min_samples=2)
    same_models(plane.state, restored.state)
    assert restored.state.tool_calls["acme"] == 140
    again.close()
    store.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_server_that_cannot_use_the_snapshot_refuses_to_start(db_url: str, capsys) -> None:
    store = create_store(db_url)
    plane = ControlPlane(store, min_samples=2)
    plane.create_tenant("acme")
    _fill(plane)
    plane.compact_log(Horizon(max_age_s=0.0))
    with pytest.raises(LogCompactedError, match="compacted through positions"):
        ControlPlane(store, min_samples=3)  # another back-off threshold: another model
    argv = ["serve", "--db", db_url, "--listen", "127.0.0.1:0", "--min-samples", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--min-samples" in err
    same_models(plane.state, ControlPlane(store, min_samples=2).state)
    store.close()


def test_db_compact_says_what_it_would_delete_then_deletes_it(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'log.sqlite3'}"
    assert main(["db", "compact", "--db", url, "--older-than", "1s"]) == 2
    assert "no cachettl snapshot is stored" in capsys.readouterr().err
    store = create_store(url)
    plane = ControlPlane(store, min_samples=2)
    plane.create_tenant("acme")
    _fill(plane)
    plane.write_snapshot()
    argv = ["db", "compact", "--db", url, "--rows-per-tenant", "20"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 100 tool calls and 0 program ends" in out
    assert store.log_rows() == (120, 12)
    assert store.log_compaction() is None
    assert main(argv) == 0
    assert "deleted 100 tool calls" in capsys.readouterr().out
    assert store.log_rows() == (20, 12)
    assert main(["misses", "--db", url, "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert "compacted: each tenant's turns before its newest 20 are not counted here" in out
    same_models(plane.state, ControlPlane(store, min_samples=2).state)
    store.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_compactions_are_counted_in_metrics(db_url: str) -> None:
    store = create_store(db_url)
    plane = ControlPlane(store, min_samples=2)
    plane.create_tenant("acme")
    _fill(plane)
    options = {"retention": Horizon(max_age_s=0.0), "compact_interval_s": 0.05}
    with running(plane, metrics_listen="127.0.0.1:0", **options) as server:
        deadline = time.monotonic() + 10
        while plane.retention.compactions == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        port = server.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    assert 'cachettl_log_rows_deleted_total{log="tool_calls"} 119.0' in text
    assert 'cachettl_log_compaction_position{log="tool_calls"} 120.0' in text
    assert 'cachettl_log_rows_kept{log="tool_calls"} 1.0' in text
    assert "cachettl_log_compaction_timestamp_seconds" in text
    store.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_console_says_what_the_miss_lists_no_longer_see(db_url: str) -> None:
    from controlplane.console.bench import Client
    from controlplane.console.host import Console, ConsoleOptions
    from controlplane.rpc.server import ServerOptions
    from tests.support import ServerThread

    store = create_store(db_url)
    plane = ControlPlane(store, min_samples=2)
    _, token = plane.create_tenant("acme")
    _fill(plane)
    thread = ServerThread(plane, ServerOptions(listen="127.0.0.1:0"))
    console = Console(thread.server, ConsoleOptions("127.0.0.1:0", "admin-token"))
    thread.run(console.start())
    try:
        client = Client(console.port)
        assert client.login(token) == 303
        before = client.get("/tool?name=bash")[1].decode()
        plane.compact_log(Horizon(max_age_s=0.0))
        _fill(plane, batches=1, first=12)  # pages are kept per model version: a new one
        after = Client(console.port)
        assert after.login(token) == 303
        page = after.get("/tool?name=bash&context=1000")[1].decode()
    finally:
        thread.run(console.stop())
        thread.stop()
        store.close()
    assert 'id="compacted"' not in before
    assert 'id="compacted"' in page
    assert "were learned from every turn" in page


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_revision_0008_refuses_to_go_down_once_the_log_was_compacted(db_url: str) -> None:
    from controlplane.storage.migrate import current_revision, downgrade, upgrade
    from controlplane.storage.schema import HEAD_REVISION

    store = create_store(db_url)
    engine = store.engine  # type: ignore[attr-defined]
    assert downgrade(engine, "0007") == (HEAD_REVISION, "0007")  # never compacted: it goes
    assert upgrade(engine) == ("0007", HEAD_REVISION)
    plane = ControlPlane(store, min_samples=2)
    plane.create_tenant("acme")
    _fill(plane)
    plane.compact_log(Horizon(max_rows=50))
    assert store.log_rows() == (50, 12)
    with pytest.raises(RuntimeError, match="cannot downgrade to 0007: the event log was"):
        downgrade(engine, "0007")
    assert current_revision(engine) == HEAD_REVISION
    assert store.log_compaction() is not None
    same_models(plane.state, ControlPlane(store, min_samples=2).state)
    store.close()


def test_serve_compacts_with_its_flags(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'served.sqlite3'}"
    setup = create_store(url)
    _, token = ControlPlane(setup).create_tenant("acme")
    setup.close()
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", url, "--listen", "127.0.0.1:0"]
    cmd += ["--snapshot-interval", "0.1", "--log-retention", "0s", "--compact-interval", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        target = f"127.0.0.1:{int(line.split('on port')[1].split()[0])}"
        with ControlPlaneClient(target, token) as client:
            for b in range(5):
                calls = [ToolCall(f"e{b}-{i}", f"p{b}", "bash", "x", 1.0 + i) for i in range(10)]
                client.record_tool_calls(calls)
            store = create_store(url)
            deadline = time.monotonic() + 20
            while store.log_rows()[0] > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store.log_rows()[0] == 1  # the newest row stays
            mark = store.log_compaction()
            assert mark is not None
            assert mark.tool_seq == 50
            assert client.workload_stats().tool_calls == 50
            restored = ControlPlane(store)
            assert restored.state.tool_calls == {"acme": 50}
            store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
