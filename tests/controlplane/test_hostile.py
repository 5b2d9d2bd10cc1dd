"""Fuzz/soak of the service with hostile input: while one tenant sends deeply
nested and huge arguments, floods of new names, control characters, extreme turn indexes,
resends and malformed events, and holds half-open calls and many snapshot streams open
(as do callers without a token), another tenant is served within its latency bound and
health checks answer; no call is answered INTERNAL; afterwards every acknowledged event
is stored exactly once and the server starts again on its database with the same models."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import grpc
import pytest

from controlplane._gen.cachettl.v1 import model_pb2
from controlplane.learning import NameLimits
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store

from .abuse import WATCH, HalfOpen, healthy

BOTH = pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
ATTACKERS, BATCHES = 2, 60
#: The victim's worst call while the attack runs (decisions come from memory).
BOUND_S = 0.5
#: Codes a hostile batch may get: accepted, refused for a bound, or refused as bad input.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
}
LIMITS = NameLimits(max_tools=40, max_signatures=2000)
#: Tool names of ordinary batches (one with control characters in it).
TOOLS = ("bash", "search", "edit", "python", "\x1b[2Jtool\u202e")


def _hostile_args(rng: random.Random) -> str:
    """Arguments of the shapes that broke the service, all within the 4096-char limit."""
    n = rng.randint(1, 4000)
    shapes = [
        lambda: '{"a":' + "[" * n,  # the poison of defect 1
        lambda: '{"a":' + "[" * (n // 2) + "]" * (n // 2) + "}",
        lambda: '{"k": ' + '{"k": ' * (n // 7) + "1" + "}" * (n // 7 + 1),
        lambda: ";" * 4096,
        lambda: "x" * 4096,
        lambda: "'" + "a b " * (n // 4),
        lambda: "\\" * n,
        lambda: "FOO=1 " * (n // 6) + "make",
        lambda: '{"n": ' + "9" * min(n, 4080) + "}",
        lambda: "".join(rng.choice(" ;|&'\"\\\n$x{}[]") for _ in range(n)),
        lambda: f"cmd{rng.randint(0, 10_000)} --flag",  # many signatures
        lambda: '{"' + '": 1, "'.join(f"k{i}" for i in range(rng.randint(1, 60))) + '": 1}',
    ]
    return rng.choice(shapes)()


def _hostile_batch(rng: random.Random, attacker: int, b: int) -> list[ToolCall]:
    calls = []
    flood = rng.random() < 0.25  # a flood of new tool names (refused past the bound)
    for i in range(rng.randint(1, 100)):
        tool = f"new-{attacker}-{b}-{i}" if flood else rng.choice(TOOLS)
        calls.append(
            ToolCall(
                f"a{attacker}-{b}-{i}",
                f"prog-{rng.randint(0, 5)}",
                tool,
                _hostile_args(rng),
                rng.choice([0.0, 1e-9, 0.5, 86400.0]),
                turn_index=rng.choice([0, 2**31, 2**32 - 1]),
            )
        )
    if rng.random() < 0.1:  # a malformed event spoils the batch (nothing of it stored)
        calls[-1] = ToolCall(calls[-1].event_id, "prog", "", "ls", 0.5)
    return calls


def _attack(target: str, token: str, seed: int, acked: set[str], codes: Counter[str]) -> None:
    rng = random.Random(seed)
    with ControlPlaneClient(target, token, timeout_s=60) as client:
        for b in range(BATCHES):
            batch = _hostile_batch(rng, seed, b)
            for _ in range(2 if rng.random() < 0.2 else 1):  # resends now and then
                try:
                    client.record_tool_calls(batch)
                except grpc.RpcError as error:
                    codes[error.code().name] += 1
                    break
                codes["OK"] += 1
                acked.update(call.event_id for call in batch)


def _victim(target: str, token: str, stop: threading.Event, latencies: list[float]) -> None:
    with ControlPlaneClient(target, token) as client:
        i = 0
        while not stop.is_set():
            start = time.perf_counter()
            client.decide_ttl("bash", "pytest -x", context_tokens=8000)
            if i % 10 == 0:
                client.record_tool_calls([ToolCall(f"v{i}", "vp", "bash", "pytest -x", 1.5)])
            latencies.append(time.perf_counter() - start)
            i += 1
            time.sleep(0.005)


def _views(plane: ControlPlane) -> dict[str, object]:
    out: dict[str, object] = {"version": plane.version}
    for name in ("attacker", "victim"):
        out[name] = [(t.tool, t.sample_count, t.signatures) for t in plane.list_tools(name)]
    return out


@BOTH
def test_hostile_ingest_soak(store: Store, db_url: str, serve) -> None:
    plane = ControlPlane(store, min_samples=1, name_limits=LIMITS)
    _, attacker = plane.create_tenant("attacker")
    _, victim = plane.create_tenant("victim", share=True)
    acked: set[str] = set()
    codes: Counter[str] = Counter()
    latencies: list[float] = []
    stop = threading.Event()
    auth = (("authorization", f"Bearer {attacker}"),)
    with serve(plane, tail_interval_s=0.05) as server, grpc.insecure_channel(server.target) as raw:
        anonymous, held = HalfOpen(raw), HalfOpen(raw)
        anonymous.open(64)  # headers without a token, then nothing
        held.open(16, metadata=auth)  # the attacker's own calls, never finished
        watch = raw.unary_stream(WATCH)
        request = model_pb2.WatchSnapshotsRequest().SerializeToString()
        streams = [watch(request, metadata=auth, timeout=120) for _ in range(48)]
        watcher = threading.Thread(target=_victim, args=(server.target, victim, stop, latencies))
        watcher.start()
        threads = [
            threading.Thread(target=_attack, args=(server.target, attacker, s, acked, codes))
            for s in range(ATTACKERS)
        ]
        try:
            for thread in threads:
                thread.start()
            assert healthy(raw)
            for thread in threads:
                thread.join()
            assert healthy(raw)
        finally:
            stop.set()
            watcher.join()
            for stream in streams:
                stream.cancel()
            anonymous.close()
            held.close()
        before = _views(plane)
    print(f"codes {dict(codes)}; victim worst {max(latencies):.3f} s of {len(latencies)}")
    assert set(codes) <= {c.name for c in EXPECTED}, codes
    assert codes["OK"] > 10
    assert plane.learning.refused["tools"] > 0  # the flood reached the name bound
    assert len(latencies) > 20
    assert max(latencies) < BOUND_S, f"victim waited {max(latencies):.3f} s"
    assert not plane.learning.unlearned, plane.learning.unlearned  # nothing had to be skipped

    rows = store.read_tool_calls(0, 1_000_000)
    stored = Counter(r.call.event_id for r in rows if r.tenant == "attacker")
    assert set(stored) == acked  # every acknowledged event, nothing unacknowledged
    assert set(stored.values()) == {1}  # and each once

    again_store = create_store(db_url)  # the server starts again on its database
    try:
        again = ControlPlane(again_store, min_samples=1, name_limits=LIMITS)
        assert _views(again) == before
        tenant = again.authenticate(victim)
        assert tenant is not None
        with serve(again) as server, ControlPlaneClient(server.target, victim) as client:
            assert client.decide_ttl("bash", "pytest -x").basis
    finally:
        again_store.close()
