"""Snapshots fit their message limit by construction: a tenant at its name caps, every
model full, every name at its length limit in 4-byte UTF-8, still receives its snapshot
through a real server and ``ControlPlaneClient.watch_snapshots`` (before: 12.7 MB here, 57
MB with full windows, against gRPC's default 4 MiB receive limit; the stream failed for
good)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from controlplane import inspection
from controlplane.errors import OverloadedError
from controlplane.learning import NameLimitExceededError, NameLimits
from controlplane.records import Tenant, ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.snapshots import (
    MAX_SNAPSHOT_BYTES,
    SnapshotPayloads,
    dumps_off_process,
    points_per_model,
)
from controlplane.state import ModelState
from controlplane.storage import create_store
from estimator import Level

TOOLS, SIGNATURES = 1000, 10_000  # the default name caps
PER_TOOL = SIGNATURES // TOOLS
CLEF = "\U0001d11e"  # 4 bytes in UTF-8


def _name(i: int) -> str:
    return CLEF * 123 + f"{i:05d}"  # 128 characters, 497 bytes


def _at_caps(plane: ControlPlane, tenant: Tenant) -> None:
    """Every tool and signature the default caps allow, each model past its points."""
    n = 0
    for k in range(points_per_model(1 + TOOLS + SIGNATURES)):
        batch = []
        for i in range(TOOLS):
            for j in range(PER_TOOL):
                n += 1
                args = json.dumps({"command": _name(j)})  # names a command: a signature
                batch.append(ToolCall(f"e{n}", "p", _name(i), args, 1 + (k % 3) / 100))
                if len(batch) == 1000:
                    plane.record_tool_calls(tenant, batch)
                    batch = []
    with pytest.raises(NameLimitExceededError):  # at the caps: one more name is refused
        plane.record_tool_calls(tenant, [ToolCall("x", "p", _name(TOOLS), "", 1.0)])


@pytest.mark.slow
def test_a_tenant_at_its_caps_receives_its_snapshot(serve: Callable[..., Any]) -> None:
    assert (NameLimits().max_tools, NameLimits().max_signatures) == (TOOLS, SIGNATURES)
    plane = ControlPlane(create_store("memory://"), min_samples=1)
    tenant, token = plane.create_tenant("acme")
    _at_caps(plane, tenant)
    points = points_per_model(1 + TOOLS + SIGNATURES)
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        snapshot = next(client.watch_snapshots(timeout_s=60))
    assert snapshot.version == plane.tenant_version(tenant)
    assert len(snapshot.models) == 1 + TOOLS + SIGNATURES
    for m in snapshot.models:
        assert len(m.sorted_durations_seconds) == min(points, m.sample_count)
    full = sum(len(m.sorted_durations_seconds) == points for m in snapshot.models)
    assert full >= SIGNATURES  # every invocation model at its share at least
    size = snapshot.ByteSize()
    print(f"at the caps: {len(snapshot.models)} models, {points} points each, {size} bytes")
    assert 4 * 2**20 < size < 14_000_000 < MAX_SNAPSHOT_BYTES  # the README's worst case


def test_a_snapshot_past_the_limit_is_refused_naming_it() -> None:
    plane = ControlPlane(create_store("memory://"), min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    plane.record_tool_calls(tenant, [ToolCall(f"e{i}", "p", f"t{i}", "", 1.0) for i in range(50)])
    payloads = SnapshotPayloads(max_bytes=1000)
    refused = r"snapshot: 51 models make \d+ bytes, over the limit of 1000 bytes"
    with pytest.raises(OverloadedError, match=refused):
        payloads.build(plane.state, threading.RLock(), "acme", False)
    version, payload = SnapshotPayloads().build(plane.state, threading.RLock(), "acme", False)
    assert version == 50
    assert len(payload) < 2000


def test_a_written_snapshot_pickled_by_a_child_restores_the_same_models() -> None:
    plane = ControlPlane(create_store("memory://"), min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    calls = [ToolCall(f"e{i}", "p", f"t{i % 7}", f"run {i % 3}", 0.1 * i) for i in range(1, 300)]
    plane.record_tool_calls(tenant, calls)
    lock = threading.RLock()
    expected = plane.state.dumps(lock)
    for timeout_s in (60.0, 0.0):  # 0: the child is killed and the state pickled here
        payload, tool_seq, end_seq = dumps_off_process(plane.state, lock, timeout_s)
        assert (tool_seq, end_seq) == expected[1:]
        restored = ModelState.loads(payload)
        assert restored.tenant_version("acme", False) == 299
        for tool in plane.state.tools_of("acme"):
            key = (Level.TOOL, tool, "")
            mine = inspection.stored_model(plane.state, "acme", key)
            theirs = inspection.stored_model(restored, "acme", key)
            assert mine is not None
            assert theirs is not None
            assert theirs.sorted_samples().tolist() == mine.sorted_samples().tolist()
