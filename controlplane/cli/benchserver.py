"""A ``cachettl serve`` process for the memory benches (:mod:`.memorybench`,
:mod:`.soakbench`): its address, /metrics and resident memory, and clients that open
``WatchSnapshots`` streams and never read them."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GAUGES", "Server", "never_read", "rss_mb", "scrape", "serve"]

#: The ``/metrics`` figures the bench prints.
GAUGES = (
    "cachettl_snapshot_streams",
    "cachettl_snapshot_payload_bytes",
    "cachettl_send_bytes_held",
    "cachettl_send_bytes_abandoned",
    "cachettl_send_waiting",
    "cachettl_heap_trims_total",
    "cachettl_slow_streams_dropped_total",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Server:
    proc: subprocess.Popen[str]
    target: str
    metrics_port: int
    console_port: int | None

    def rss(self) -> float:
        return rss_mb(self.proc.pid)


@contextmanager
def serve(db: str, flags: list[str], console: bool = False) -> Iterator[Server]:
    """``cachettl serve`` on ``db`` with ``flags`` and /metrics (and the console)."""
    metrics = free_port()
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db, "--listen", "127.0.0.1:0"]
    cmd += ["--metrics", f"127.0.0.1:{metrics}", *flags]
    console_port = free_port() if console else None
    if console_port is not None:
        cmd += ["--console", f"127.0.0.1:{console_port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "on port" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        port = int(line.split("on port")[1].split()[0])
        yield Server(proc, f"127.0.0.1:{port}", metrics, console_port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def scrape(metrics_port: int, names: tuple[str, ...] = GAUGES) -> dict[str, float]:
    """The values of ``names`` (unlabelled, or summed over their labels) in /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    found = {}
    for name in names:
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        found[name] = sum(float(v) for v in values) if values else float("nan")
    return found


def never_read(target: str, token: str, streams: int, pipe: Any) -> None:
    """Open ``streams`` WatchSnapshots calls whose client never reads, 100 per connection,
    with HTTP/2 windows that never grow; leave when told."""
    import grpc

    from controlplane._gen.cachettl.v1 import model_pb2, model_pb2_grpc

    options = [("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(target, options) for _ in range((streams + 99) // 100)]
    auth = (("authorization", f"Bearer {token}"),)
    calls = []
    for k in range(streams):
        stub: Any = model_pb2_grpc.ModelServiceStub(channels[k // 100])  # type: ignore[no-untyped-call]
        calls.append(stub.WatchSnapshots(model_pb2.WatchSnapshotsRequest(), metadata=auth))
    pipe.send("open")
    pipe.recv()
    for call in calls:
        call.cancel()
    for channel in channels:
        channel.close()
    pipe.send("closed")
