"""A server process killed with SIGKILL in the middle of a 10,000-event ingest: after a
restart every acknowledged event is stored, and the models (restored from the last
snapshot plus the log's tail) are identical to a replay of the stored events."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np

from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.service import ControlPlane
from controlplane.state import ModelState
from controlplane.storage import create_store
from tests.support import same_models

TOOLS = ("bash", "grep", "python", "edit", "search")
BATCHES, PER_BATCH, WRITERS = 100, 100, 4


def _batches() -> list[list[ToolCall]]:
    rng = np.random.default_rng(7)
    batches = []
    for b in range(BATCHES):
        calls = []
        for i in range(PER_BATCH):
            tool = TOOLS[i % len(TOOLS)]
            scale = 5.0 if (tool == "bash" and b >= BATCHES // 2) else 0.5  # a regime change
            args = f"run --case {i % 3}"
            duration = float(rng.lognormal(np.log(scale), 0.5))
            calls.append(ToolCall(f"b{b}-{i}", f"prog-{b}", tool, args, duration))
        batches.append(calls)
    return batches


@contextmanager
def _server(url: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", url, "--listen"]
    cmd += ["127.0.0.1:0", "--min-samples", "10", "--snapshot-interval", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "on port" in line, line
        yield proc, f"127.0.0.1:{int(line.split('on port')[1].split()[0])}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _ingest(target: str, token: str, batches: list[list[ToolCall]], acked: set[str]) -> None:
    lock = threading.Lock()
    queue = list(enumerate(batches))

    def writer() -> None:
        with ControlPlaneClient(target, token, timeout_s=30) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    _, batch = queue.pop(0)
                try:
                    client.record_tool_calls(batch)
                except grpc.RpcError:
                    return  # the server is gone
                with lock:
                    acked.update(c.event_id for c in batch)

    threads = [threading.Thread(target=writer) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_sigkill_mid_ingest_loses_no_acknowledged_event(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.sqlite3'}"
    setup = create_store(url)
    _, token = ControlPlane(setup).create_tenant("acme")
    setup.close()
    batches = _batches()
    acked: set[str] = set()
    with _server(url) as (proc, target):
        ingest = threading.Thread(target=_ingest, args=(target, token, batches, acked))
        ingest.start()
        while len(acked) < 30 * PER_BATCH and ingest.is_alive():
            ingest.join(timeout=0.01)
        os.kill(proc.pid, signal.SIGKILL)
        ingest.join()
    assert 30 * PER_BATCH <= len(acked) < BATCHES * PER_BATCH  # killed mid-ingest

    with _server(url) as (_, target), ControlPlaneClient(target, token) as client:
        stored = create_store(url)
        rows = stored.read_tool_calls(0, 100_000)
        assert acked <= {r.call.event_id for r in rows}
        assert client.workload_stats().tool_calls == len(rows)
        # The killed server may have died before its first snapshot landed; this one
        # writes its own within --snapshot-interval of starting (write-behind).
        deadline = time.monotonic() + 30.0
        while stored.latest_snapshot("cachettl") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored.latest_snapshot("cachettl") is not None
        restored = ControlPlane(stored, min_samples=10)  # what a restart does
        replay = ModelState.fresh(restored.policy, min_samples=10)
        replay.apply_tool_calls(rows)
        same_models(restored.state, replay)
        served = client.tool_distribution("bash", cdf_points=1000)
        view = restored.tool_distribution("acme", "bash", points=1000)
        assert view is not None
        assert [p.probability for p in served.cdf] == [p for _, p in view.cdf]
        assert served.drift_epoch == view.drift_epoch
        stored.close()
