"""A control plane with the console beside its gRPC server, shared by a test module.

Tenants: ``acme`` (shares; tools ``bash`` and ``find``, misses, two engines named as the
hook names them), ``rival`` (does not share; everything it owns is named ``rival…`` so that
a leak is easy to find) and ``s0``..``s3`` (share ``grep``, so that a shared model of it is
published; ``s0`` also has ``lint``, in its cold start, every call far shorter than the
cold-start TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.console.bench import Client
from controlplane.console.host import Console, ConsoleOptions
from controlplane.records import (
    MissReason,
    NotPinnedCause,
    PinOutcome,
    ProgramEnd,
    ToolCall,
    TurnCache,
)
from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from enginehook.vllm.services import engine_id
from tests.controlplane.conftest import pg_schemas  # noqa: F401 - a fixture used here
from tests.support import ServerThread

ADMIN = "admin-token-for-the-console-tests"
#: acme's engines: the ids their hooks report, from the names they were given.
ENGINES = {n: engine_id([], {"CACHETTL_ENGINE_NAME": n}) for n in ("engine-a", "engine-b")}
#: Calls of s0's ``lint``: fewer than the back-off threshold (K = 100), each 3..8 ms.
LINT_CALLS = 37
#: Strings only the rival tenant's statistics hold.
RIVAL_MARKERS = ("rival-secret-tool", "rivalsig", "rival-prog", "rival-engine")


@dataclass
class Cluster:
    plane: ControlPlane
    thread: ServerThread
    console: Console
    tokens: dict[str, str]

    @property
    def port(self) -> int:
        return self.console.port

    def client(self, tenant: str | None = None) -> Client:
        """A client logged in as ``tenant`` (None: the admin)."""
        client = Client(self.port)
        assert client.login(self.tokens[tenant] if tenant else ADMIN) == 303
        return client


def _calls(prefix: str, tool: str, args: list[str], n: int, seed: int) -> list[ToolCall]:
    rng = random.Random(seed)
    now = time.time() - 3600
    outcomes = [
        (PinOutcome.HIT, TurnCache(MissReason.HIT)),
        (PinOutcome.EXPIRED, TurnCache(MissReason.EXPIRED, expired_by_s=0.8)),
        (PinOutcome.NOT_PINNED, TurnCache(MissReason.NOT_PINNED, NotPinnedCause.TTL_ZERO)),
        (PinOutcome.HIT, TurnCache(MissReason.HIT)),
    ]
    calls = []
    for i in range(n):
        outcome, cache = outcomes[i % 4]
        duration = math.exp(rng.gauss(-0.7, 0.6)) if i % 10 else 30 * rng.random()
        calls.append(
            ToolCall(
                f"{prefix}-e{i}",
                f"{prefix}-prog-{i // 8}",
                tool,
                args[i % len(args)],
                duration,
                now + i * 5.0,
                i % 8,
                1.5,
                outcome,
                0.3,
                cache,
            )
        )
    return calls


def fill(plane: ControlPlane) -> dict[str, str]:
    """The tenants and their statistics; returns each tenant's token."""
    tokens = {}
    for name, share in (("acme", True), ("rival", False), *((f"s{i}", True) for i in range(4))):
        _, tokens[name] = plane.create_tenant(name, share)
    tenants = {t.name: t for t in plane.store.list_tenants()}
    acme, rival = tenants["acme"], tenants["rival"]
    plane.record_tool_calls(acme, _calls("acme", "bash", ["pytest -x", "ls -la", "make"], 400, 1))
    plane.record_tool_calls(acme, _calls("acme-f", "find", [". -name x"], 150, 2))
    rival_calls = _calls("rival", "rival-secret-tool", ['{"command": "rivalsig -q"}'], 300, 3)
    plane.record_tool_calls(rival, rival_calls)
    plane.record_tool_calls(rival, _calls("rival-b", "bash", ["rivalsig"], 200, 4))
    for round_ in range(20):  # the four sharing tenants' grep, interleaved
        for i in range(4):
            call = _calls(f"s{i}-{round_}", "grep", [""], 1, 10 * round_ + i)[0]
            plane.record_tool_calls(tenants[f"s{i}"], [call])
    now = time.time() - 600
    lint = [
        ToolCall(
            f"s0-lint-{i}", f"s0-lp-{i}", "lint", "--fix", 0.003 + i * 0.005 / LINT_CALLS, now + i
        )
        for i in range(LINT_CALLS)
    ]
    plane.record_tool_calls(tenants["s0"], lint)
    for i in range(30):
        plane.record_program_end(acme, ProgramEnd(f"acme-prog-{i}", 8, time.time() - 60 + i))
        plane.record_program_end(rival, ProgramEnd(f"rival-prog-{i}", 3, time.time() - 60 + i))
    return tokens


async def _watch(hub: Any, tenant: str, engine: str) -> asyncio.Task[None]:
    """An engine watching its moves (as ``WatchMoves`` does), until cancelled."""

    async def watch() -> None:
        async for _ in hub.watch(tenant, engine):
            pass

    task = asyncio.create_task(watch())
    await asyncio.sleep(0)  # registered as a watcher
    return task


def _follow(client: ControlPlaneClient) -> None:
    """An engine's snapshot stream, held open until the client's channel closes."""
    with contextlib.suppress(grpc.RpcError):
        for _ in client.watch_snapshots(timeout_s=600):
            pass


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    path: Path = tmp_path_factory.mktemp("console") / "cachettl.sqlite3"
    store = create_store(f"sqlite:///{path}")
    plane = ControlPlane(store)
    tokens = fill(plane)
    thread = ServerThread(plane, ServerOptions(listen="127.0.0.1:0"))
    options = ConsoleOptions("127.0.0.1:0", ADMIN, history_interval_s=0.2)
    console = Console(thread.server, options)
    thread.run(console.start())
    tenants = {t.name: t for t in store.list_tenants()}
    hub = thread.server._servicer.coherence
    acme_engines = (ENGINES["engine-a"], ENGINES["engine-b"])
    for tenant, engines in (("acme", acme_engines), ("rival", ("rival-engine-7",))):
        for engine in engines:
            arrived = [(f"{tenant}-prog-{i}", time.time()) for i in range(5)]
            thread.run(hub.report(tenants[tenant], engine, arrived))
    watching = thread.run(_watch(hub, "acme", ENGINES["engine-b"]))
    moved = [(f"acme-prog-{i}", time.time()) for i in range(3)]
    thread.run(hub.report(tenants["acme"], ENGINES["engine-a"], moved))  # told to engine-b
    snapshots = ControlPlaneClient(thread.target, tokens["acme"])
    streaming = threading.Thread(target=_follow, args=(snapshots,), daemon=True)
    streaming.start()
    _wait_for(lambda: thread.server._servicer._latest.get("acme") is not None)
    try:
        yield Cluster(plane, thread, console, tokens)
    finally:
        thread.loop.call_soon_threadsafe(watching.cancel)
        snapshots.close()
        thread.run(console.stop())
        thread.stop()
        store.close()
