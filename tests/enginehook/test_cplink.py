"""Event delivery to a real control plane (in-process gRPC server, SQLite store): batches,
spill beyond the memory bound, the control plane down and back, snapshots in."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.learning import NameLimits
from controlplane.records import PinOutcome, ProgramEnd, ToolCall
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.link.decide import TtlDecider
from enginehook.link.remote import ControlPlaneLink
from enginehook.link.spill import EventBuffer
from enginehook.link.transport import GrpcTransport, to_program_end, to_tool_call
from tests.support import ServerThread


def _call(i: int, program: str = "p", outcome: PinOutcome = PinOutcome.HIT) -> ToolCallReport:
    return ToolCallReport(
        event_id=f"eng:{program}:{i}",
        program_id=program,
        tenant="default",
        tool="bash",
        tool_args="ls -la",
        duration_s=0.1 + i * 0.01,
        finished_at=1000.0 + i,
        turn_index=i,
        chosen_ttl_s=2.0,
        pin_outcome=outcome,
        admission_delay_s=0.01,
        basis="cold-start",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class Plane:
    """A control plane on a fixed port that can be stopped and started again."""

    def __init__(self, db: str, port: int, name_limits: NameLimits | None = None) -> None:
        self.db, self.port, self.name_limits = db, port, name_limits
        self.store = create_store(db)
        self.token = ControlPlane(self.store).create_tenant("engine")[1]
        self.server: ServerThread | None = None

    def start(self) -> None:
        limits = self.name_limits or NameLimits()
        plane = ControlPlane(self.store, "continuum", min_samples=3, name_limits=limits)
        opts = ServerOptions(
            listen=f"127.0.0.1:{self.port}", watch_interval_s=0.2, tail_interval_s=0.1
        )
        self.server = ServerThread(plane, opts)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def stored(self) -> int:
        return self.store.count_tool_calls()

    def ends(self) -> int:
        return len(self.store.read_program_ends(0, 1000))


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    p = Plane(f"sqlite:///{tmp_path / 'cp.sqlite3'}", _free_port())
    yield p
    p.stop()
    p.store.close()


def _link(
    plane: Plane, spill: Path, decider: TtlDecider | None = None, memory: int = 5
) -> ControlPlaneLink:
    transport = GrpcTransport(f"127.0.0.1:{plane.port}", plane.token, timeout_s=2.0)
    return ControlPlaneLink(
        transport,
        EventBuffer(spill, memory_events=5, segment_events=4),
        decider,
        batch_events=7,
        flush_interval_s=0.05,
        send_interval_s=0.05,
        max_backoff_s=0.3,
    )


def test_buffer_spills_past_the_memory_bound_and_survives_a_restart(tmp_path):
    buf = EventBuffer(tmp_path, memory_events=3, segment_events=2)
    for i in range(8):
        buf.put(_call(i))
    assert buf.in_memory == 3
    assert len(buf) == 8
    assert len(list(tmp_path.glob("spill-*.jsonl"))) == 3
    assert [e.event_id for e in buf.peek(10)] == ["eng:p:0", "eng:p:1", "eng:p:2"]
    buf.drop(3)
    assert [e.event_id for e in buf.peek(10)] == ["eng:p:3", "eng:p:4"]
    buf.put(ProgramEndReport("eng:p:end", "p", "default", 9, 5.0))
    assert buf.spill_all() == 2
    again = EventBuffer(tmp_path, memory_events=3, segment_events=2)
    assert len(again) == 6
    seen = []
    while len(again):
        batch = again.peek(10)
        seen += [e.event_id for e in batch]
        again.drop(len(batch))
    assert sorted(seen) == [f"eng:p:{i}" for i in range(3, 8)] + ["eng:p:end"]
    assert list(tmp_path.glob("spill-*.jsonl")) == []


def test_events_delivered_in_batches_once(plane, tmp_path):
    plane.start()
    link = _link(plane, tmp_path / "spill")
    try:
        for i in range(20):
            link.submit(_call(i))
        link.submit(ProgramEndReport("eng:p:end", "p", "default", 21, 1100.0))
        assert link.flush(20.0)
        assert plane.stored() == 20
        assert plane.ends() == 1
        link.submit(_call(3))  # a repeat (as after a lost acknowledgement)
        assert link.flush(20.0)
        assert plane.stored() == 20
    finally:
        link.close()


def test_a_tenants_name_bound_is_final_for_new_names_only(tmp_path):
    """A batch refused for the tenant's bound on distinct tool names (RESOURCE_EXHAUSTED,
    marked final) is not retried forever: the link splits it, the events of known names are
    delivered, those of new names counted as rejected, and later events still flow."""
    bounded = Plane(f"sqlite:///{tmp_path / 'cp.sqlite3'}", _free_port(), NameLimits(2, 100))
    bounded.start()
    link = _link(bounded, tmp_path / "spill")
    try:
        for i, tool in enumerate(["t0", "t1", "t2", "t0", "t3"]):
            link.submit(dataclasses.replace(_call(i), tool=tool))
        assert link.flush(20.0)  # nothing left queued: no retry loop at the head
        assert bounded.stored() == 3  # t0, t1, t0 again
        assert link.rejected == 2  # t2, t3
        link.submit(dataclasses.replace(_call(9), tool="t1"))
        assert link.flush(20.0)
        assert bounded.stored() == 4
    finally:
        link.close()
        bounded.stop()
        bounded.store.close()


def test_control_plane_down_then_back_no_loss_no_duplicates(plane, tmp_path):
    link = _link(plane, tmp_path / "spill")
    try:
        for i in range(30):
            link.submit(_call(i))
        assert _wait(lambda: link.failures >= 2)
        assert len(link.buffer) == 30
        assert list((tmp_path / "spill").glob("spill-*.jsonl"))
        plane.start()
        assert link.flush(30.0)
        assert plane.stored() == 30
        plane.stop()  # killed mid-run: later events wait for it
        for i in range(30, 45):
            link.submit(_call(i))
        link.submit(ProgramEndReport("eng:p:end", "p", "default", 46, 2000.0))
        assert not link.flush(0.5)
        plane.start()
        assert link.flush(30.0)
        assert plane.stored() == 45
        assert plane.ends() == 1
        assert link.rejected == 0
        counters = {name: value for name, _, value in link.counters()}
        assert counters["cachettl_control_plane_events_delivered_total"] >= 46
        assert counters["cachettl_control_plane_events_pending"] == 0
        assert counters["cachettl_control_plane_send_failures_total"] >= 2
    finally:
        link.close()


def test_snapshots_replace_the_local_models(plane, tmp_path):
    plane.start()
    decider = TtlDecider("continuum", min_samples=1000)
    link = _link(plane, tmp_path / "spill", decider)
    try:
        for i in range(10):
            link.submit(_call(i))
        assert link.flush(20.0)
        assert _wait(lambda: link.snapshots >= 1 and decider.snapshot_version != "")
        assert _wait(lambda: decider.models.durations.lookup("bash", "ls").level is not None)
        decision = decider.decide(
            tool="bash", tool_args="ls", context_tokens=1000, turns_served=1, reload_cost_s=1.0
        )
        assert decision.basis in ("invocation", "tool")
        assert decision.ttl_s > 0
    finally:
        link.close()


def test_one_conversion_every_field_and_outcome_arrives(plane, tmp_path):
    """Each outcome, admission delay and chosen TTL is stored as the hook reported it, and
    a spill segment written by an earlier release (outcome labels "pressure", "other")
    is delivered with the same vocabulary."""
    events = [_call(i, outcome=o) for i, o in enumerate(PinOutcome)]
    assert to_tool_call(events[1]) == ToolCall(
        event_id="eng:p:1",
        program_id="p",
        tool="bash",
        tool_args="ls -la",
        duration_s=0.11,
        finished_at=1001.0,
        turn_index=1,
        chosen_ttl_s=2.0,
        pin_outcome=PinOutcome.HIT,
        admission_delay_s=0.01,
    )
    end = ProgramEndReport("eng:p:end", "p", "default", 9, 1200.0)
    assert to_program_end(end) == ProgramEnd("p", 9, 1200.0)
    spill = tmp_path / "spill"
    spill.mkdir()
    old = {
        **{k: getattr(_call(7), k) for k in ToolCallReport.__slots__ if k != "cache"},
        "kind": "tool_call",
        "event_id": "eng:old:7",
    }
    lines = [json.dumps({**old, "outcome": "pressure"})]
    lines.append(json.dumps({**old, "event_id": "eng:old:8", "outcome": "other"}))
    (spill / "spill-000000001.jsonl").write_text("\n".join(lines) + "\n")
    plane.start()
    link = _link(plane, spill)
    try:
        for event in events:
            link.submit(event)
        link.submit(end)
        assert link.flush(20.0)
    finally:
        link.close()
    stored = {r.call.event_id: r.call for r in plane.store.read_tool_calls(0, 100)}
    assert stored["eng:old:7"].pin_outcome is PinOutcome.RELEASED_UNDER_PRESSURE
    assert stored["eng:old:8"].pin_outcome is PinOutcome.UNSPECIFIED
    for event in events:
        call = stored[event.event_id]
        assert call.pin_outcome is event.pin_outcome
        assert (call.chosen_ttl_s, call.admission_delay_s) == (2.0, 0.01)
        assert call.duration_s == pytest.approx(event.duration_s, abs=1e-9)
    assert plane.store.read_program_ends(0, 10)[0].end.total_turns == 9
