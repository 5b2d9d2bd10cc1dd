"""The load `cachettl bench controlplane` puts on a server, shared by its phases
(:mod:`controlplane.cli.bench`) and ``--decide-rate`` (:mod:`controlplane.cli.decidebench`):
a server process on a fresh database, tenants seeded, paced DecideTtl calls, and ingest
from a process of its own."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "ingest_load",
    "ingest_process",
    "latency_with_ingest",
    "paced_latency",
    "prepare",
    "server",
    "server_process",
]


@contextmanager
def server(db_url: str) -> Iterator[str]:
    """A ``cachettl serve`` on ``db_url``; its address."""
    with server_process(db_url) as (target, _):
        yield target


@contextmanager
def server_process(db_url: str) -> Iterator[tuple[str, int]]:
    """A ``cachettl serve`` on ``db_url``; its address and process id."""
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db_url]
    cmd += ["--listen", "127.0.0.1:0", "--min-samples", "10", "--max-concurrent-rpcs", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "on port" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        yield f"127.0.0.1:{int(line.split('on port')[1].split()[0])}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def prepare(db_url: str, seed: int) -> tuple[str, str]:
    """A tenant with ``seed`` bash calls, and another for background ingest; their tokens."""
    from controlplane.records import ToolCall
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db_url)
    plane = ControlPlane(store)
    tenant, token = plane.create_tenant("bench")
    _, loader = plane.create_tenant("loader")
    rng = np.random.default_rng(0)
    durations = rng.lognormal(0.0, 1.0, seed)
    calls = [ToolCall(f"seed-{i}", "p", "bash", "ls", float(d)) for i, d in enumerate(durations)]
    for start in range(0, len(calls), 1000):
        store.append_tool_calls(tenant, calls[start : start + 1000])
    store.close()
    return token, loader


def ingest_load(
    target: str, token: str, events_per_s: float, stop: Any, ready: Any = None, prefix: str = "l"
) -> float:
    """Batches of 100 events at ``events_per_s`` until ``stop``; returns events/s stored
    (after the first batch, which is when ``ready`` is set). Event ids start with
    ``prefix``: another load into the same tenant needs another prefix (else repeats)."""
    from controlplane.records import ToolCall
    from controlplane.rpc.client import ControlPlaneClient

    stored, b = 0, 0
    interval = 100 / events_per_s
    with ControlPlaneClient(target, token, timeout_s=30) as client:
        start = time.perf_counter()
        while not stop.is_set():
            calls = [
                ToolCall(f"{prefix}{b}-{i}", f"p{b}", "bash", "pytest -x", 0.5 + i / 100)
                for i in range(100)
            ]
            accepted = client.record_tool_calls(calls).accepted
            if b == 0:
                start = time.perf_counter()
                if ready is not None:
                    ready.set()
            else:
                stored += accepted
            b += 1
            stop.wait(max(0.0, start + b * interval - time.perf_counter()))
    return stored / max(time.perf_counter() - start, 1e-9)


def ingest_process(
    target: str, token: str, events_per_s: float, stop: Any, ready: Any, out: Any, prefix: str = "l"
) -> None:
    out.put(ingest_load(target, token, events_per_s, stop, ready, prefix))


def latency_with_ingest(
    target: str, token: str, loader: str, seconds: float, loader_target: str | None = None
) -> tuple[np.ndarray, float]:
    """DecideTtl latencies at 500/s while another tenant ingests 1,000 events/s, from a
    process of its own (in this one its threads would delay the timed client), into the
    same server or into ``loader_target`` (the control: the same load on the machine,
    none on the server timed)."""
    ctx = multiprocessing.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    loader_process = ctx.Process(
        target=ingest_process,
        args=(loader_target or target, loader, 1000.0, stop, ready, out),
        daemon=True,
    )
    loader_process.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(timeout=0.1):
            if not loader_process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the ingest process did not start")
        lat = paced_latency(target, token, 500.0, seconds)
    finally:
        stop.set()
        rate = float(out.get(timeout=60)) if ready.is_set() else 0.0
        loader_process.join(timeout=60)
    return lat, rate


def paced_latency(target: str, token: str, rate: float, seconds: float) -> np.ndarray:
    from controlplane.rpc.client import ControlPlaneClient

    with ControlPlaneClient(target, token) as client:
        for _ in range(200):  # warm-up
            client.decide_ttl("bash", "ls", 4000)
        n = int(rate * seconds)
        latencies = np.empty(n)
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t = time.perf_counter()
            client.decide_ttl("bash", "ls", 4000)
            latencies[i] = time.perf_counter() - t
    return latencies
