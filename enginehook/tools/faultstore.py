"""Two fault trials of what the control plane and the hook keep on disk, each printing its
figures (docs/operations.md quotes them, ``results/fault_*.md`` keeps them):

- ``cachettl bench fault-postgres-restart``: a private PostgreSQL (``initdb`` and ``pg_ctl``
  in a temporary folder, on a port of its own; never the machine's server) under a running
  ``cachettl serve``, restarted with ``pg_ctl restart -m fast`` and then ``-m immediate``
  (a crash) while a client records one tool call and asks one decision every 0.1 s: what
  each call got, for how long, and whether every acknowledged event is stored.
- ``cachettl bench fault-spill-full``: the hook's link (its real ``ControlPlaneLink`` and
  ``EventBuffer``) with the control plane down and its spill folder on a 1 MiB tmpfs, fed
  more events than fit; then the control plane started: what was delivered, dropped and
  counted, whether ``submit`` ever blocked, what was logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from controlplane.records import ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.storage import create_store
from enginehook.core.tracker import PinOutcome, ToolCallReport
from enginehook.link.remote import ControlPlaneLink
from enginehook.link.spill import DEFAULT_SPILL_MAX_BYTES, EventBuffer
from enginehook.link.transport import GrpcTransport
from enginehook.tools.servers import free_port, stop_process, wait_for

__all__ = ["PrivatePostgres", "register", "run_postgres_restart", "run_spill_full"]

PG_BIN = Path(os.environ.get("CACHETTL_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _run(args: list[str]) -> str:
    """Run ``args``; its output, or ``RuntimeError`` with its error output."""
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def _as_postgres(args: list[str]) -> list[str]:
    """``args`` run as the ``postgres`` user when this is root (``initdb`` refuses root)."""
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


@dataclass
class PrivatePostgres:
    """A PostgreSQL server of its own in ``folder`` on ``port`` (trust authentication)."""

    folder: Path
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/cachettl"

    def _ctl(self, *args: str) -> None:
        data = str(self.folder / "data")
        opts = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        command = [
            str(PG_BIN / "pg_ctl"),
            "-D",
            data,
            "-o",
            opts,
            "-l",
            str(self.folder / "pg.log"),
        ]
        _run(_as_postgres([*command, "-w", *args]))

    def start(self) -> None:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(f"{PG_BIN}/initdb not found: set $CACHETTL_PG_BIN")
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # the server runs as postgres: it must reach its folder
            self.folder.parent.chmod(0o711)
            shutil.chown(self.folder, "postgres", "postgres")
        initdb = [str(PG_BIN / "initdb"), "-D", str(self.folder / "data"), "-A", "trust"]
        _run(_as_postgres([*initdb, "-U", "postgres"]))
        self._ctl("start")
        createdb = [str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port)]
        _run([*createdb, "-U", "postgres", "cachettl"])

    def restart(self, mode: str) -> float:
        """``pg_ctl restart -m MODE``; the seconds it took."""
        started = time.monotonic()
        self._ctl("-m", mode, "restart")
        return time.monotonic() - started

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")


def _cli() -> str:
    return str(Path(sys.executable).parent / "cachettl")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Calls:
    """Every call of the client loop: (seconds since start, method, gRPC code name)."""

    prefix: str
    log: list[tuple[float, str, str]] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def _client_loop(target: str, token: str, calls: Calls, t0: float) -> None:
    """One RecordToolCalls and one DecideTtl every 0.1 s until told to stop."""
    n = 0
    with ControlPlaneClient(target, token, timeout_s=5.0) as client:
        while not calls.stop.is_set():
            event = f"{calls.prefix}-{n}"
            n += 1
            for method in ("RecordToolCalls", "DecideTtl"):
                try:
                    if method == "RecordToolCalls":
                        client.record_tool_calls([ToolCall(event, "p", "bash", "pytest", 1.0)])
                        calls.acknowledged.append(event)
                    else:
                        client.decide_ttl("bash", "pytest")
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                calls.log.append((time.monotonic() - t0, method, code))
            time.sleep(0.1)


def _summary(calls: Calls, window: tuple[float, float]) -> list[str]:
    """Per method: the codes answered, and the failures' span against the restart's."""
    lines = []
    for method in ("RecordToolCalls", "DecideTtl"):
        mine = [(t, c) for t, m, c in calls.log if m == method]
        codes = Counter(c for _, c in mine)
        failed = [t for t, c in mine if c != "OK"]
        span = (
            f"failures from {failed[0] - window[0]:+.1f} s to {failed[-1] - window[0]:+.1f} s "
            f"of the restart's start (it took {window[1] - window[0]:.1f} s)"
            if failed
            else "no failure"
        )
        lines.append(f"  {method}: {dict(codes)}; {span}")
    return lines


def run_postgres_restart(work: Path, modes: list[str]) -> str:
    """Restart a private PostgreSQL under ``cachettl serve`` once per mode; the report."""
    pg = PrivatePostgres(work / "pg")
    pg.start()
    serve = None
    lines = []
    try:
        _run([_cli(), "db", "upgrade", "--db", pg.url])
        token = _run([_cli(), "tenants", "create", "agents", "--db", pg.url]).strip()
        port, log = free_port(), work / "serve.log"
        args = [_cli(), "serve", "--db", pg.url, "--listen", f"127.0.0.1:{port}"]
        with log.open("wb") as out:
            serve = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: _listening(port), 60, "cachettl serve")
        acknowledged = 0
        for mode in modes:
            found, acked = _restart_round(pg, port, token, mode)
            acknowledged += acked
            lines += [f"## pg_ctl restart -m {mode}", *found]
        store = create_store(pg.url)
        try:
            stored = store.count_tool_calls()
        finally:
            store.close()
        lines.append(f"tool calls acknowledged in all rounds {acknowledged}, stored {stored}")
        stop_process(serve, 30)
        lines.append(f"cachettl serve exited {serve.returncode} on SIGTERM afterwards")
        logged = [ln for ln in log.read_text().splitlines() if "database" in ln.lower()]
        lines += ["its log's lines naming the database:", *(f"  {ln[:200]}" for ln in logged)]
    finally:
        stop_process(serve, 30)
        pg.stop()
    return "\n".join(lines)


def _restart_round(pg: PrivatePostgres, port: int, token: str, mode: str) -> tuple[list[str], int]:
    """One restart under the client loop: its summary lines, and the calls acknowledged."""
    calls, t0 = Calls(prefix=mode), time.monotonic()
    loop = threading.Thread(target=_client_loop, args=(f"127.0.0.1:{port}", token, calls, t0))
    loop.start()
    time.sleep(5.0)
    start = time.monotonic() - t0
    took = pg.restart(mode)
    time.sleep(15.0)
    calls.stop.set()
    loop.join(30)
    lines = _summary(calls, (start, start + took))
    return [*lines, f"  calls made {len(calls.log)}"], len(calls.acknowledged)


class _Records(logging.Handler):
    """The log records of the hook's loggers while a trial runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _report(i: int, tenant: str = "default") -> ToolCallReport:
    return ToolCallReport(
        event_id=f"eng:p{i // 20}:{i}",
        program_id=f"p{i // 20}",
        tenant=tenant,
        tool="bash",
        tool_args=f"pytest tests/test_{i % 50}.py -x",
        duration_s=1.0,
        finished_at=1_000_000.0 + i,
        turn_index=i % 20,
        chosen_ttl_s=2.0,
        pin_outcome=PinOutcome.HIT,
        admission_delay_s=0.01,
        basis="cold-start",
    )


def _mount_tmpfs(folder: Path, size: str) -> None:
    if os.geteuid() != 0:
        raise PermissionError(
            "fault-spill-full mounts a tmpfs: run it as root, or pass "
            "--spill-dir on a small filesystem of your own"
        )
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)


@dataclass
class SpillRun:
    """What a spill-full trial saw."""

    events: int
    max_bytes: int
    slowest_submit_s: float = 0.0
    disk: tuple[int, int] = (0, 0)
    full: dict[str, float] = field(default_factory=dict)
    flushed: bool = False
    after: dict[str, float] = field(default_factory=dict)
    thread_errors: list[str] = field(default_factory=list)
    close_error: str = ""
    restarted: tuple[bool, dict[str, float]] = (False, {})
    records: list[logging.LogRecord] = field(default_factory=list)


def _counters(link: ControlPlaneLink) -> dict[str, float]:
    return {
        name.removeprefix("cachettl_control_plane_"): float(v) for name, _, v in link.counters()
    }


def run_spill_full(
    work: Path,
    events: int,
    spill_dir: Path | None = None,
    tmpfs_size: str = "1m",
    max_bytes: int = DEFAULT_SPILL_MAX_BYTES,
) -> str:
    """Feed ``events`` to a link whose control plane is down and whose spill folder (its
    bound ``max_bytes``, the hook's ``spill_max_bytes``) is on a tmpfs of ``tmpfs_size``
    (or ``spill_dir``), then start the control plane; the report."""
    mounted = spill_dir is None
    spill = spill_dir or work / "spill"
    if mounted:
        _mount_tmpfs(spill, tmpfs_size)
    db = f"sqlite:///{work / 'cp.sqlite3'}"
    token = _run([_cli(), "tenants", "create", "engine", "--db", db]).strip()
    port, records, serve, run = free_port(), _Records(), None, SpillRun(events, max_bytes)
    logging.getLogger("enginehook").addHandler(records)
    hook = threading.excepthook
    threading.excepthook = lambda a: run.thread_errors.append(
        f"{a.thread.name if a.thread else '?'}: {a.exc_type.__name__}: {a.exc_value}"
    )
    link = ControlPlaneLink(
        GrpcTransport(f"127.0.0.1:{port}", token, timeout_s=2.0),
        EventBuffer(spill, token=token, max_bytes=max_bytes),
    )
    try:
        for i in range(events):
            started = time.monotonic()
            link.submit(_report(i))
            run.slowest_submit_s = max(run.slowest_submit_s, time.monotonic() - started)
        time.sleep(3.0)  # the sender writes what it can, and finds the control plane away
        run.full, usage = _counters(link), shutil.disk_usage(spill)
        run.disk = (usage.total, usage.used)
        with (work / "serve.log").open("wb") as out:
            args = [_cli(), "serve", "--db", db, "--listen", f"127.0.0.1:{port}"]
            serve = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        run.flushed = link.flush(30.0)
        run.after = {**_counters(link), "corrupt": float(link.buffer.corrupt)}
    finally:
        try:
            link.close()
        except OSError as error:
            run.close_error = f"{type(error).__name__}: {error}"
    try:  # an engine restarted on the same spill folder (the disk still full)
        again = ControlPlaneLink(
            GrpcTransport(f"127.0.0.1:{port}", token, timeout_s=2.0),
            EventBuffer(spill, token=token, max_bytes=max_bytes),
        )
        flushed = again.flush(30.0)
        run.restarted = (flushed, {**_counters(again), "corrupt": float(again.buffer.corrupt)})
        again.close()
    finally:
        threading.excepthook = hook
        logging.getLogger("enginehook").removeHandler(records)
        stop_process(serve, 30)
        if mounted:
            subprocess.run(["umount", "-l", str(spill)], check=False)
    run.records = records.records
    return _spill_report(run, db)


def _spill_report(run: SpillRun, db: str) -> str:
    store = create_store(db)
    try:
        stored = store.count_tool_calls()
    finally:
        store.close()
    dropped, rejected = run.after["spill_dropped_total"], run.after["events_rejected_total"]
    flushed, counters = run.restarted
    delivered = counters.get("events_delivered_total", 0.0)
    levels = Counter(r.levelname for r in run.records)
    messages = [f"{r.levelname}: {r.getMessage()[:200]}" for r in run.records[:5]]
    return "\n".join(
        [
            f"spill bound {run.max_bytes} bytes; events submitted {run.events}; "
            f"slowest submit {run.slowest_submit_s * 1000:.2f} ms",
            f"spill folder: {run.disk[1]} of {run.disk[0]} bytes used, control plane down",
            f"link counters then: {run.full}",
            f"uncaught in the link's threads: {run.thread_errors or 'nothing'}",
            f"control plane started: everything delivered within 30 s: {run.flushed}",
            f"link counters after: {run.after}",
            f"link.close(): {run.close_error or 'returned'}",
            f"a new link on the same spill folder (an engine restarted): delivered "
            f"{delivered:.0f}, all within 30 s: {flushed}, corrupt lines skipped "
            f"{counters.get('corrupt', 0.0):.0f}",
            f"stored {stored}; dropped and counted {dropped:.0f}; rejected {rejected:.0f}; "
            f"neither {run.events - stored - dropped - rejected:.0f}",
            f"log records by level {dict(levels)}; the first five: {messages}",
        ]
    )


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl bench fault-postgres-restart`` and ``fault-spill-full``."""
    p = bench.add_parser(
        "fault-postgres-restart",
        help="a private PostgreSQL restarted (fast, then immediate) under cachettl serve: "
        "what calls get, and whether acknowledged events are kept",
    )
    p.add_argument("--modes", default="fast,immediate", help="pg_ctl restart modes, in order")
    p.set_defaults(handler=_bench_postgres)
    p = bench.add_parser(
        "fault-spill-full",
        help="the hook's link with the control plane down and its spill on a full disk "
        "(a 1 MiB tmpfs: needs root, or --spill-dir)",
    )
    p.add_argument("--events", type=int, default=20_000, help="events fed while it is down")
    p.add_argument("--spill-dir", default="", help="a folder on a small filesystem instead")
    p.add_argument("--tmpfs-size", default="1m", help="the tmpfs's size (mount's size=)")
    p.add_argument(
        "--spill-max-bytes",
        type=int,
        default=DEFAULT_SPILL_MAX_BYTES,
        help="the spill's bound (the hook's spill_max_bytes)",
    )
    p.set_defaults(handler=_bench_spill)


def _bench_postgres(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("smart", "fast", "immediate")]
    if bad or not modes:
        raise ValueError(f"--modes: pg_ctl's smart, fast or immediate, got {args.modes!r}")
    with tempfile.TemporaryDirectory(prefix="cachettl-pg-") as work:
        print(run_postgres_restart(Path(work), modes))
    return 0


def _bench_spill(args: argparse.Namespace) -> int:
    if args.events < 1:
        raise ValueError(f"--events: at least 1, got {args.events}")
    with tempfile.TemporaryDirectory(prefix="cachettl-spill-") as work:
        spill = Path(args.spill_dir) if args.spill_dir else None
        print(run_spill_full(Path(work), args.events, spill, args.tmpfs_size, args.spill_max_bytes))
    return 0
