"""Building (``make_server``) and running (``serve``) the grpc.aio control-plane server.

Besides the RPCs the server runs two background loops: it tails the event log every
``tail_interval_s`` (so several servers on one PostgreSQL converge: a row committed
through one server is in every other server's models within ``tail_interval_s`` plus one
read), together with the tenants' token changes (so a revocation or rotation reaches this
replica's token cache within as long, and an outage that starts afterwards cannot undo it:
:mod:`controlplane.rpc.auth`), and writes a model snapshot every ``snapshot_interval_s``
when the models changed (write-behind; a restart loads it and replays only the log's tail).
With a retention horizon (``retention``) a third loop compacts the log every
``compact_interval_s``: it stores a snapshot, then deletes the rows it covers beyond the
horizon (``ControlPlane.compact_log``; counted in ``/metrics``).

A loop whose round fails (the database is down) logs it once, when the first round fails,
and once when a round succeeds again, with the failed rounds and how long it lasted
(:mod:`controlplane.storage.outages`; counted in ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import re
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane._gen.cachettl.v1 import cluster_pb2, events_pb2, inspect_pb2, model_pb2, ttl_pb2
from controlplane.records import LIMITS, Limits
from controlplane.rpc.auth import AuthOptions
from controlplane.rpc.gate import Budgets
from controlplane.rpc.lanes import SWITCH_INTERVAL_S
from controlplane.rpc.metrics import Metrics
from controlplane.rpc.servicer import Servicer, generic_handlers
from controlplane.service import ControlPlane
from controlplane.snapshots import MAX_SNAPSHOT_BYTES
from controlplane.storage.base import Horizon, SnapshotSupersededError
from controlplane.storage.outages import LoopHealth

__all__ = [
    "SERVICE_NAMES",
    "ControlPlaneServer",
    "ServerOptions",
    "TlsFiles",
    "serve",
    "until_signalled",
]

log = logging.getLogger(__name__)

_PACKAGE = events_pb2.DESCRIPTOR.package
SERVICE_NAMES = tuple(
    f"{_PACKAGE}.{name}"
    for name in (
        "ToolEventService",
        "TtlService",
        "InspectService",
        "ModelService",
        "PinCoherenceService",
    )
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS; with ``client_ca`` clients must present a certificate (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """The server's credentials; ``ValueError`` naming the flag and the file of one
        that is missing, unreadable, holds no PEM block of its kind or one that does not
        parse, or a key that is not the certificate's (checked here with ``cryptography``:
        gRPC would only fail to bind, with a traceback and no file named)."""
        key, cert = _pem("--tls-key", self.key, "PRIVATE KEY"), _pem("--tls-cert", self.cert)
        _check_pair(key, self.key, cert, self.cert)
        pair = [(key, cert)]
        if self.client_ca is None:
            return grpc.ssl_server_credentials(pair)
        ca = _pem("--tls-client-ca", self.client_ca)
        _certificates("--tls-client-ca", self.client_ca, ca)
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)


def _certificates(flag: str, path: Path, data: bytes) -> list[Any]:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise ValueError(f"{flag}: {str(path)!r} holds no valid certificate ({error})") from None


def _check_pair(key_pem: bytes, key_path: Path, cert_pem: bytes, cert_path: Path) -> None:
    """The key parses, the certificate parses, and the key is the certificate's."""
    from cryptography.hazmat.primitives import serialization

    leaf = _certificates("--tls-cert", cert_path, cert_pem)[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        reason = "it is encrypted" if isinstance(error, TypeError) else str(error)
        raise ValueError(
            f"--tls-key: {str(key_path)!r} holds no usable private key ({reason})"
        ) from None
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, raw) != leaf.public_key().public_bytes(der, raw):
        raise ValueError(
            f"--tls-key: {str(key_path)!r} is not the key of the certificate in "
            f"{str(cert_path)!r} (--tls-cert)"
        )


def _pem(flag: str, path: Path, kind: str = "CERTIFICATE") -> bytes:
    """The bytes of a PEM file holding a ``kind`` block (``-----BEGIN … KIND-----``)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {error.strerror}") from None
    if not re.search(rb"-----BEGIN [A-Z ]*" + kind.encode() + rb"-----", data):
        raise ValueError(f"{flag}: {str(path)!r} holds no PEM {kind} block")
    return data


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens, what it runs in the background, and its limits.

    ``max_concurrent_rpcs`` is the server-wide limit of authenticated unary calls in
    flight (``budgets.calls_total`` is replaced by it); ``budgets`` holds the others
    (per peer, per tenant, streams), ``auth`` the token cache (fresh and stale ages).
    """

    listen: str = "127.0.0.1:50051"
    max_concurrent_rpcs: int = 256
    budgets: Budgets = field(default_factory=Budgets)
    auth: AuthOptions = field(default_factory=AuthOptions)
    tail_interval_s: float = 0.5
    snapshot_interval_s: float = 30.0
    watch_interval_s: float = 0.5
    grace_s: float = 5.0
    limits: Limits = field(default_factory=lambda: LIMITS)
    tls: TlsFiles | None = None
    metrics_listen: str | None = None
    #: What of the event log is kept (None: everything; no compaction runs), and how
    #: often the log is compacted to it.
    retention: Horizon | None = None
    compact_interval_s: float = 600.0
    #: Connections held at most (None: half of ``RLIMIT_NOFILE``; past it gRPC closes new
    #: ones at once), seconds a connection may take to finish its handshake, and seconds
    #: a connection with no call in flight is kept (then closed with GOAWAY; clients
    #: reconnect by themselves).
    max_connections: int | None = None
    handshake_timeout_s: float = 10.0
    connection_idle_s: float = 300.0
    #: How often to check whether to give freed memory back to the system
    #: (``controlplane.rpc.heap``; 0: never).
    heap_check_s: float = 5.0


def grpc_max_connections(nofile: int | None = None) -> int:
    """Half of the process's descriptor limit (at least 64): the rest stays for the
    database, the console and files, so a flood of idle connections never starves them."""
    import resource

    if nofile is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        nofile = 1024 if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)
    return max(64, nofile // 2)


#: ``cachettl serve`` flags of the admission limits: (flag, Budgets/AuthOptions field,
#: type, help).
_ADMISSION_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--max-rpcs-per-tenant", "calls_per_tenant", int, "unary calls in flight per tenant"),
    ("--max-rpcs-per-peer", "calls_per_peer", int, "unary calls in flight per client address"),
    ("--max-streams", "streams_total", int, "WatchSnapshots streams open, server-wide"),
    ("--max-streams-per-tenant", "streams_per_tenant", int, "streams open per tenant"),
    ("--max-streams-per-peer", "streams_per_peer", int, "streams open per client address"),
    ("--message-timeout", "message_timeout_s", float, "seconds from headers to message"),
    (
        "--slow-reader-timeout",
        "slow_reader_s",
        float,
        "seconds a stream's client may take none of its messages before the stream ends",
    ),
    (
        "--max-send-bytes-per-tenant",
        "send_bytes_per_tenant",
        int,
        "bytes of snapshots a tenant's streams may have in gRPC's send buffers",
    ),
    ("--max-send-bytes", "send_bytes_total", int, "the same, all tenants"),
    (
        "--max-arrivals-per-tenant",
        "arrivals_per_tenant_s",
        int,
        "turn arrivals a tenant may report per second (pin coherence)",
    ),
    (
        "--lane-threads",
        "lane_threads",
        int,
        "threads serving the doors' work (ingest, arrivals, inspection), least-served tenant first",
    ),
    (
        "--lane-wait",
        "lane_wait_s",
        float,
        "seconds a call may wait for a lane thread before it is refused with a retry hint",
    ),
    ("--auth-fresh", "fresh_s", float, "seconds a token lookup is trusted as is"),
    (
        "--auth-stale",
        "stale_s",
        float,
        "seconds a known token is still served from memory when the database is down",
    ),
)


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    """The admission limits of controlplane/README.md ("Limits") as ``serve`` flags."""
    budgets, auth = Budgets(), AuthOptions()
    for flag, name, kind, what in _ADMISSION_FLAGS:
        default = getattr(budgets if hasattr(budgets, name) else auth, name)
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (%(default)s)")


def admission_from_args(args: argparse.Namespace) -> tuple[Budgets, AuthOptions]:
    """``Budgets`` and ``AuthOptions`` of the flags; ValueError naming a bad flag."""
    values: dict[str, dict[str, Any]] = {"budgets": {}, "auth": {}}
    for flag, name, _, _ in _ADMISSION_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value!r}")
        values["budgets" if hasattr(Budgets, name) else "auth"][name] = value
    if values["auth"]["fresh_s"] > values["auth"]["stale_s"]:
        raise ValueError("--auth-fresh must be at most --auth-stale")
    return Budgets(**values["budgets"]), AuthOptions(**values["auth"])


_FILES = (
    events_pb2.DESCRIPTOR,
    ttl_pb2.DESCRIPTOR,
    inspect_pb2.DESCRIPTOR,
    model_pb2.DESCRIPTOR,
    cluster_pb2.DESCRIPTOR,
)


class ControlPlaneServer:
    """A started-on-demand aio server over one ``ControlPlane`` (``start``/``stop``)."""

    def __init__(self, plane: ControlPlane, options: ServerOptions | None = None) -> None:
        self.plane = plane
        self.options = options or ServerOptions()
        self.metrics = Metrics()
        self.metrics.track_learning(plane.learning)  # rows skipped, batches refused
        self.metrics.track_database(plane.store.outages)
        self.metrics.track_retention(plane.retention)
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._auth_seq = -1  # the last token change the tail applied (-1: none yet)

    @property
    def servicer(self) -> Servicer:
        """The servicer the RPCs use (built by :meth:`start`)."""
        if "_servicer" not in self.__dict__:
            raise RuntimeError("the server has not been started")
        servicer: Servicer = self.__dict__["_servicer"]
        return servicer

    def _build(self) -> grpc.aio.Server:
        o = self.options
        # No gRPC-level maximum_concurrent_rpcs: it counts calls from their headers on, so
        # calls that never send a message (or long-lived streams) would lock out everyone,
        # health checks included. Admission is the servicer's gate (controlplane.rpc.gate).
        budgets = replace(o.budgets, calls_total=o.max_concurrent_rpcs)
        per_connection = budgets.calls_per_peer + budgets.streams_per_peer
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", per_connection),
                ("grpc.max_send_message_length", MAX_SNAPSHOT_BYTES),
                (
                    "grpc.max_allowed_incoming_connections",
                    o.max_connections or grpc_max_connections(),
                ),
                ("grpc.server_handshake_timeout_ms", int(o.handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(o.connection_idle_s * 1000)),
            ]
        )
        servicer = Servicer(self.plane, self.metrics, o.limits, o.watch_interval_s, budgets, o.auth)
        self._servicer = servicer
        self.metrics.track_streams(servicer)
        server.add_generic_rpc_handlers(generic_handlers(servicer, _FILES))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        self._health = health_servicer
        names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        try:
            if o.tls is None:
                self.port = server.add_insecure_port(o.listen)
            else:
                self.port = server.add_secure_port(o.listen, o.tls.credentials())
        except RuntimeError:  # gRPC's "Failed to bind", whatever the cause
            self.port = 0
        if self.port == 0:
            raise ValueError(f"--listen: cannot bind {o.listen!r}")
        return server

    async def start(self) -> int:
        """Bind, start serving and the background loops; returns the bound port.

        Everything alive now (imported modules, restored models) is collected once and
        moved to the interpreter's permanent generation (``gc.freeze``): a full cyclic
        collection holds the GIL while it visits every tracked object, and with a
        process's whole heap that was 0.2-1.4 s here, the stall of decisions while
        another tenant's heavy requests allocated. Afterwards full collections visit
        only what was created since (refcounting still frees frozen objects; only
        reference cycles among them are never collected).
        """
        await asyncio.to_thread(gc.collect)
        gc.freeze()
        self._server = self._build()
        await self._server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, serving)
        if self.options.metrics_listen:
            host, _, port = self.options.metrics_listen.rpartition(":")
            self.metrics_port = self.metrics.serve(host or "127.0.0.1", int(port))
        outages = self.plane.store.outages
        tail_s, snapshot_s = self.options.tail_interval_s, self.options.snapshot_interval_s
        tail = outages.loop("tail", "tail of the event log", log, f"tried again every {tail_s:g} s")
        snapshot = outages.loop(
            "snapshot", "model snapshot", log, f"tried again every {snapshot_s:g} s"
        )
        self._tasks = [
            asyncio.create_task(self._every(tail_s, self._tail, tail)),
            asyncio.create_task(self._every(snapshot_s, self._snapshot, snapshot)),
        ]
        if self.options.retention is not None:
            compact_s = self.options.compact_interval_s
            compact = outages.loop(
                "compact", "compaction of the log", log, f"every {compact_s:g} s"
            )
            self._tasks.append(asyncio.create_task(self._every(compact_s, self._compact, compact)))
        if self.options.heap_check_s > 0:
            self._tasks.append(asyncio.create_task(self._trim_heap(self.options.heap_check_s)))
        return self.port

    async def _trim_heap(self, interval_s: float) -> None:
        """Give freed memory back to the system when large buffers were released
        (``controlplane.rpc.heap``), checking every ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.servicer.trimmer.maybe_trim()
            except Exception:  # never stop serving over it
                log.exception("giving memory back failed")

    async def _compact(self) -> None:
        """One compaction of the log to the retention horizon (a snapshot first)."""
        assert self.options.retention is not None
        try:
            done = await asyncio.to_thread(self.plane.compact_log, self.options.retention)
        except SnapshotSupersededError as error:  # not an outage: the next round retries
            log.info("log compaction skipped: %s", error)
            return
        log.info(
            "log compacted through %d/%d: %d tool calls and %d program ends deleted",
            done.tool_seq,
            done.end_seq,
            done.tool_rows_deleted,
            done.end_rows_deleted,
        )

    async def _tail(self) -> None:
        """One round of the tail: the log's new rows into the models, then the tenants'
        token changes into the token cache (on the event loop, where the cache is used)."""
        await asyncio.to_thread(self.plane.catch_up)
        self.metrics.model_version.set(self.plane.version)
        changes = await asyncio.to_thread(self.plane.store.tenant_changes, self._auth_seq)
        if changes:
            self.servicer.tenants.apply(changes)
            self._auth_seq = changes[-1].seq

    async def _snapshot(self) -> None:
        await asyncio.to_thread(self.plane.write_snapshot)

    @staticmethod
    async def _every(interval_s: float, job: Any, health: LoopHealth) -> None:
        """Run ``job`` every ``interval_s``; a failed round is told to ``health`` (logged
        once per outage), and the next round retries."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception as error:  # keep serving; the next round retries
                health.failed(error)
            else:
                health.succeeded()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting RPCs, let running ones finish, then write a final snapshot."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(self.options.grace_s if grace_s is None else grace_s)
            self._servicer.close()
        self.metrics.stop()
        try:
            await asyncio.to_thread(self.plane.write_snapshot)
        except Exception:
            log.exception("final snapshot failed")

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


async def until_signalled() -> None:
    """Return at SIGTERM or SIGINT, saying the control plane shuts down."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    print("cachettl control plane: shutting down", flush=True)


async def serve(plane: ControlPlane, options: ServerOptions) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully.

    A serving process lets a thread that wants the interpreter lock in after
    ``SWITCH_INTERVAL_S`` rather than CPython's 5 ms (:mod:`controlplane.rpc.lanes`): the
    event loop answering decisions waits at most that long behind the doors' threads."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = ControlPlaneServer(plane, options)
    port = await server.start()
    print(f"cachettl control plane on port {port} (policy {plane.policy_name})", flush=True)
    await until_signalled()
    await server.stop()
