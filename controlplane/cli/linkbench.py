"""`cachettl bench controlplane --links N`: the control plane under N engine links.

Starts the server as real ``python -m controlplane serve`` processes — one on SQLite or
PostgreSQL, or two or four replicas on one PostgreSQL schema (each tails the shared log) — creates
a tenant, and runs N engine links as real gRPC clients
(:class:`controlplane.rpc.client.ControlPlaneClient`, one channel per link). Each link, as
an engine hook does (``enginehook.link``), every ``--arrivals-every`` seconds reports the
turns that arrived (``PinCoherenceService.ReportArrivals``, one per tool call; 2 % of them
are programs of the next link, so some are moves) and every ``--flush`` seconds sends the
tool calls those turns ended (``RecordToolCalls``, ``--link-rate`` events/s), the hook's
two cadences (``CoherenceLink.interval_s``, ``ControlPlaneLink.send_interval_s``); a link
behind its schedule (a call not yet answered) does everything due at once, in one larger
call of each kind. Each link follows a ``WatchSnapshots`` stream: compact (one full snapshot, then
deltas, which it checks build on the version it holds, asking for a full snapshot when
not, as the engine hook does), or with ``--raw-snapshots`` whole snapshots of raw windows,
as an engine hook that does not ask for compact ones. With replicas, link i talks to
replica i mod R. The links run as threads (a sender and a stream reader
per link) spread over ``--client-procs`` spawned processes, so that neither one
interpreter's lock nor the client side starves the servers on a 2-core machine.

Figures, per setup: events/s accepted (and offered); the acknowledgement latency;
**convergence lag**: from a batch's acknowledgement to the first snapshot, on each link's
stream, whose version includes it (a tenant's version counts its events learned, so
version ≥ the acknowledged one means the batch is in the snapshot's models, on any
replica), as the worst link per batch, per (replica written → replica streaming); server
CPU seconds per 1,000 events (utime + stime of the server processes and their reaped
children, ``/proc/PID/stat``, over the load and the convergence after it); peak RSS
(``VmHWM``); snapshot messages and bytes streamed. Clocks: ``time.monotonic``, one clock
for every process of the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controlplane.cli.linkreport import markdown, ratios, summarize, table

__all__ = ["add_link_flags", "run_links"]

TOOLS = (
    ("bash", ("ls", "pytest -x", "git status")),
    ("python", ("run.py", "-c expr")),
    ("grep", ("-rn TODO", "-l import")),
    ("edit", ("",)),
    ("web_search", ("",)),
    ("read_file", ("README.md", "setup.py")),
)
SEED_EVENTS = 120
MOVE_SHARE = 0.02
PROGRAMS_PER_LINK = 16
MAX_BATCH = 500  # the hook's batch_events (enginehook.link.remote)
READY_DEADLINE_S = 120.0
CONVERGE_DEADLINE_S = 60.0
SETUP_CHOICES = ("sqlite:1", "postgres:1", "postgres:2", "postgres:4")
#: Admission limits of the benchmark's servers: one tenant, every link from one address.
SERVER_LIMITS = (
    *("--max-concurrent-rpcs", "1024", "--max-rpcs-per-tenant", "1024"),
    *("--max-rpcs-per-peer", "1024"),
)


def add_link_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the link benchmark on ``bench controlplane``."""
    p.add_argument(
        "--links", type=int, default=0, metavar="N", help="run the engine-link benchmark"
    )
    p.add_argument("--link-rate", type=float, default=20.0, help="events/s per link")
    p.add_argument(
        "--flush",
        type=float,
        default=1.0,
        help="seconds between a link's batches of tool calls (the hook's send interval)",
    )
    p.add_argument(
        "--arrivals-every",
        type=float,
        default=0.25,
        help="seconds between a link's reports of turn arrivals (the hook's coherence interval)",
    )
    p.add_argument(
        "--setups",
        default="postgres:1,postgres:2",
        help=f"comma-separated BACKEND:SERVERS of {', '.join(SETUP_CHOICES)}",
    )
    p.add_argument("--client-procs", type=int, default=4, help="processes running the links")
    p.add_argument(
        "--raw-snapshots",
        action="store_true",
        help="links ask for whole snapshots of raw windows (engines before compact ones)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("results/controlplane_links"), help="PATH(.md|.json)"
    )


@dataclass
class LoadConfig:
    links: int
    seconds: float
    link_rate: float
    flush_s: float
    client_procs: int
    compact: bool = True
    arrivals_s: float = 0.25

    @property
    def batch(self) -> int:
        return max(1, round(self.link_rate * self.flush_s))


def _check(args: argparse.Namespace, seconds: float) -> tuple[LoadConfig, list[str]]:
    if not 1 <= args.links <= 1024:
        raise ValueError(f"--links must be in 1..1024, got {args.links}")
    if not 0.5 <= seconds <= 600:
        raise ValueError(f"--seconds must be in 0.5..600, got {seconds}")
    if not 0 < args.link_rate <= 10_000:
        raise ValueError(f"--link-rate must be in (0, 10000] events/s, got {args.link_rate}")
    if not 0.01 <= args.flush <= 10:
        raise ValueError(f"--flush must be in 0.01..10 seconds, got {args.flush}")
    if not 0.01 <= args.arrivals_every <= 10:
        raise ValueError(f"--arrivals-every must be in 0.01..10 seconds, got {args.arrivals_every}")
    if not 1 <= args.client_procs <= 64:
        raise ValueError(f"--client-procs must be in 1..64, got {args.client_procs}")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    for s in setups:
        if s not in SETUP_CHOICES:
            raise ValueError(f"--setups: {s!r} is not one of {', '.join(SETUP_CHOICES)}")
    if not setups:
        raise ValueError("--setups: name at least one setup")
    if any(s.startswith("postgres") for s in setups) and not args.postgres:
        raise ValueError("--setups names postgres but --postgres is ''")
    if args.link_rate * args.flush > MAX_BATCH:
        raise ValueError(f"--link-rate x --flush must be at most {MAX_BATCH} events a batch")
    procs = min(args.client_procs, args.links)
    cfg = LoadConfig(
        args.links,
        seconds,
        args.link_rate,
        args.flush,
        procs,
        not args.raw_snapshots,
        args.arrivals_every,
    )
    return cfg, setups


# -- servers ----------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    pid: int
    target: str
    log: Path


@contextmanager
def _servers(db_url: str, count: int, logdir: Path) -> Iterator[list[Server]]:
    """``count`` ``serve`` processes on ``db_url`` (replicas A, B, ...)."""
    with ExitStack() as stack:
        servers = []
        for i in range(count):
            name = "ABCD"[i] if count > 1 else "single"
            servers.append(stack.enter_context(_server(db_url, name, logdir)))
        yield servers


@contextmanager
def _server(db_url: str, name: str, logdir: Path) -> Iterator[Server]:
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db_url, "--listen"]
    cmd += ["127.0.0.1:0", "--min-samples", "10", *SERVER_LIMITS]
    log = logdir / f"serve-{name}-{time.monotonic_ns()}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "on port" not in line:
            raise RuntimeError(f"server {name} did not start: {log.read_text()[-2000:]}")
        port = int(line.split("on port")[1].split()[0])
        yield Server(name, proc.pid, f"127.0.0.1:{port}", log)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and of its children it has reaped (``/proc/PID/stat``)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of ``pid``, MiB (``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _prepare_tenant(db_url: str) -> str:
    """A tenant ``links`` with SEED_EVENTS calls already learned; its token."""
    from controlplane.records import ToolCall
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db_url)
    try:
        tenant, token = ControlPlane(store).create_tenant("links")
        rng = random.Random(0)
        calls = []
        for i in range(SEED_EVENTS):
            tool, signatures = TOOLS[i % len(TOOLS)]
            args = signatures[i % len(signatures)]
            calls.append(ToolCall(f"seed-{i}", "seed", tool, args, rng.lognormvariate(0, 1)))
        store.append_tool_calls(tenant, calls)
    finally:
        store.close()
    return token


# -- the links (in the client processes) ------------------------------------------------


@dataclass
class LinkRecord:
    """What one link saw: acknowledgements ``(t, version, accepted, latency_s)`` and
    snapshots ``(t, version, bytes)``, ``time.monotonic`` seconds."""

    index: int
    replica: str
    acks: list[tuple[float, int, int, float]] = field(default_factory=list)
    snaps: list[tuple[float, int, int]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    arrivals: int = 0
    foreign: int = 0
    moved: int = 0
    stream_error: str | None = None
    full_snapshots: int = 0
    missed_deltas: int = 0


class _Link:
    def __init__(self, index: int, target: str, replica: str, token: str) -> None:
        from controlplane.rpc.client import ControlPlaneClient

        self.record = LinkRecord(index, replica)
        self.client = ControlPlaneClient(target, token, timeout_s=30)
        self.latest = 0
        self.closing = False
        self.rng = random.Random(index)

    def watch(self, compact: bool) -> None:
        """Follow the stream; a delta on a base this link does not hold (lineage, version)
        opens a new stream that starts with a full snapshot."""
        import grpc

        lineage = 0
        try:
            while not self.closing:
                stream = self.client.watch_snapshots(self.latest, compact=compact, lineage=lineage)
                for snap in stream:
                    self.record.snaps.append((time.monotonic(), snap.version, snap.ByteSize()))
                    if snap.delta and (snap.base_version, snap.lineage) != (self.latest, lineage):
                        self.record.missed_deltas += 1
                        lineage = 0
                        break
                    self.record.full_snapshots += not snap.delta
                    self.latest, lineage = snap.version, snap.lineage
                if not compact:
                    return
        except grpc.RpcError as error:
            if not self.closing:
                self.record.stream_error = str(error.code())

    def send(self, start_at: float, cfg: LoadConfig) -> None:
        """Event k's turn arrives at ``start_at + k / link_rate``; arrivals are reported
        every ``arrivals_s`` and the tool calls sent every ``flush_s`` (the hook's two
        cadences, each a thread of its own there; here one thread, so that a link behind
        its schedule does what is due at once, as the hook's threads would)."""
        flushes = math.ceil(cfg.seconds / cfg.flush_s - 1e-9)
        total = flushes * cfg.batch
        tick = min(cfg.arrivals_s, cfg.flush_s)
        made, sent_through, j = 0, 0.0, 0
        calls: list[Any] = []
        arrivals: list[tuple[str, float]] = []
        foreign = 0
        while made < total or calls:
            j += 1
            delay = start_at + j * tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elapsed = time.monotonic() - start_at
            due = min(total, int(elapsed * cfg.link_rate + 1e-9))
            for k in range(made, due):
                call, program, moved = self._event(k, cfg)
                calls.append(call)
                arrivals.append((program, time.time()))
                foreign += moved
            made = due
            if arrivals:
                self._report(arrivals, foreign)
                arrivals, foreign = [], 0
            flush_at = sent_through + cfg.flush_s
            if calls and (elapsed + 1e-6 >= flush_at or made == total):
                sent_through = math.floor(elapsed / cfg.flush_s + 1e-6) * cfg.flush_s
                for at in range(0, len(calls), MAX_BATCH):
                    self._record(calls[at : at + MAX_BATCH])
                calls = []
            j = max(j, int((time.monotonic() - start_at) / tick))  # ticks missed: skipped

    def _event(self, k: int, cfg: LoadConfig) -> tuple[Any, str, bool]:
        """Link event k: its tool call, the program whose turn arrived, whether that is a
        program of the next link (a move)."""
        from controlplane.records import ToolCall

        i = self.record.index
        tool, signatures = TOOLS[self.rng.randrange(len(TOOLS))]
        program = f"l{i}-p{k % PROGRAMS_PER_LINK}"
        duration = self.rng.lognormvariate(0.0, 1.0)
        call = ToolCall(f"l{i}-{k}", program, tool, self.rng.choice(signatures), duration)
        if self.rng.random() < MOVE_SHARE:  # a turn of the next link's program
            program = f"l{(i + 1) % cfg.links}-p{self.rng.randrange(PROGRAMS_PER_LINK)}"
            return call, program, True
        return call, program, False

    def _record(self, calls: list[Any]) -> None:
        import grpc

        try:
            sent = time.monotonic()
            result = self.client.record_tool_calls(calls)
            acked = time.monotonic()
            self.record.acks.append((acked, result.model_version, result.accepted, acked - sent))
        except grpc.RpcError as error:
            self._error(error)

    def _report(self, arrivals: list[tuple[str, float]], foreign: int) -> None:
        import grpc

        try:
            self.record.moved += self.client.report_arrivals(
                f"engine-{self.record.index}", arrivals
            )
            self.record.arrivals += len(arrivals)
            self.record.foreign += foreign
        except grpc.RpcError as error:
            self._error(error)

    def _error(self, error: Any) -> None:
        code = str(error.code())
        self.record.errors[code] = self.record.errors.get(code, 0) + 1


def _poll(until: Any, deadline_s: float, what: str) -> None:
    """Wait for ``until()`` with a deadline (polls every 10 ms)."""
    deadline = time.monotonic() + deadline_s
    while not until():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(0.01)


def _client_process(
    specs: list[tuple[int, str, str]], token: str, cfg: LoadConfig, ctl: dict[str, Any]
) -> None:
    """Runs the links ``(index, target, replica)``; reports through ``ctl["out"]``."""
    out = ctl["out"]
    try:
        links = [_Link(i, target, replica, token) for i, target, replica in specs]
        watchers = [
            threading.Thread(target=link.watch, args=(cfg.compact,), daemon=True) for link in links
        ]
        for t in watchers:
            t.start()
        _poll(lambda: all(x.latest >= SEED_EVENTS for x in links), READY_DEADLINE_S, "streams")
        out.put(("ready", None))
        ctl["start"].wait()
        start_at = ctl["start_at"].value
        senders = [threading.Thread(target=x.send, args=(start_at, cfg)) for x in links]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        out.put(("sent", sum(a[2] for x in links for a in x.record.acks)))
        ctl["converge"].wait()
        target = ctl["target"].value
        _poll(lambda: all(x.latest >= target for x in links), CONVERGE_DEADLINE_S, "convergence")
        for link in links:
            link.closing = True
            link.client.close()
        for t in watchers:
            t.join(timeout=10)
        out.put(("result", [asdict(x.record) for x in links]))
    except Exception as error:  # reported to the parent, which raises it
        out.put(("error", f"{type(error).__name__}: {error}"))


# -- one setup --------------------------------------------------------------------------


@dataclass
class Controls:
    ctx: Any
    out: Any
    start: Any
    start_at: Any
    converge: Any
    target: Any

    @classmethod
    def new(cls) -> Controls:
        ctx = multiprocessing.get_context("spawn")
        return cls(
            ctx, ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0), ctx.Event(), ctx.Value("q", 0)
        )

    def shared(self) -> dict[str, Any]:
        names = ("out", "start", "start_at", "converge", "target")
        return {name: getattr(self, name) for name in names}


def _collect(ctl: Controls, procs: list[Any], kind: str, timeout_s: float) -> list[Any]:
    """One message of ``kind`` from every client process."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            tag, value = ctl.out.get(timeout=1.0)
        except Exception:  # queue.Empty
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError(f"client processes: {len(got)} of {len(procs)} {kind}") from None
            continue
        if tag == "error":
            raise RuntimeError(f"a client process failed: {value}")
        if tag != kind:
            raise RuntimeError(f"client process said {tag!r}, expected {kind!r}")
        got.append(value)
    return got


def _drive(
    servers: list[Server], token: str, cfg: LoadConfig
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs the links against ``servers``; their records and the servers' usage."""
    specs = [
        (i, servers[i % len(servers)].target, servers[i % len(servers)].name)
        for i in range(cfg.links)
    ]
    ctl = Controls.new()
    parts = [specs[k :: cfg.client_procs] for k in range(cfg.client_procs)]
    procs = [
        ctl.ctx.Process(target=_client_process, args=(part, token, cfg, ctl.shared()), daemon=True)
        for part in parts
    ]
    for p in procs:
        p.start()
    try:
        _collect(ctl, procs, "ready", READY_DEADLINE_S + 60)
        cpu0 = {s.name: cpu_seconds(s.pid) for s in servers}
        rss0 = {s.name: rss_mib(s.pid, "VmRSS") for s in servers}
        client0 = sum(cpu_seconds(p.pid) for p in procs)
        ctl.start_at.value = time.monotonic() + 0.2
        ctl.start.set()
        accepted = sum(_collect(ctl, procs, "sent", cfg.seconds + 300))
        ctl.target.value = SEED_EVENTS + accepted
        ctl.converge.set()
        client1 = sum(cpu_seconds(p.pid) for p in procs)
        results = _collect(ctl, procs, "result", CONVERGE_DEADLINE_S + 60)
        usage = {
            "cpu_s": {s.name: cpu_seconds(s.pid) - cpu0[s.name] for s in servers},
            "peak_rss_mib": {s.name: rss_mib(s.pid) for s in servers},
            "rss_before_load_mib": rss0,
            "client_cpu_s": client1 - client0,
            "start_at": ctl.start_at.value,
        }
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return [r for part in results for r in part], usage


def _run_setup(setup: str, cfg: LoadConfig, pg_base: str, tmp: Path) -> dict[str, Any]:
    from controlplane.cli.pgschema import drop_schema, pg_schema_url

    backend, count = setup.split(":")
    handle = None
    if backend == "sqlite":
        url = f"sqlite:///{tmp / f'links-{time.monotonic_ns()}.sqlite3'}"
    else:
        url, handle = pg_schema_url(pg_base)
    try:
        token = _prepare_tenant(url)
        with _servers(url, int(count), tmp) as servers:
            records, usage = _drive(servers, token, cfg)
    finally:
        if handle is not None:
            drop_schema(handle)
    load = {
        "offered_per_s": cfg.links * cfg.batch / cfg.flush_s,
        "seconds": cfg.seconds,
        "seed_version": SEED_EVENTS,
    }
    return summarize(setup, load, records, usage)


def _command(cfg: LoadConfig, setups: list[str]) -> str:
    return (
        f"cachettl bench controlplane --links {cfg.links} --seconds {cfg.seconds:g} "
        f"--link-rate {cfg.link_rate:g} --flush {cfg.flush_s:g} "
        f"--arrivals-every {cfg.arrivals_s:g} --setups {','.join(setups)} "
        f"--client-procs {cfg.client_procs}" + ("" if cfg.compact else " --raw-snapshots")
    )


def run_links(args: argparse.Namespace, seconds: float) -> int:
    """The link benchmark: every setup in turn, a table, the Markdown and JSON files."""
    cfg, setups = _check(args, seconds)
    load_before = os.getloadavg()[0]
    report: dict[str, Any] = {
        "command": _command(cfg, setups),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "config": {**asdict(cfg), "batch": cfg.batch},
        "setups": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for setup in setups:
            print(f"{setup}: {cfg.links} links for {cfg.seconds:g} s ...", flush=True)
            report["setups"].append(_run_setup(setup, cfg, args.postgres, Path(tmp)))
    report["load_after"] = os.getloadavg()[0]
    print("\n".join(table(report) + ratios(report)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0
