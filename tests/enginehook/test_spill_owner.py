"""The spill under hostile and faulty conditions, over a real control plane (gRPC on a port,
SQLite): a spill folder belongs to the credential it was written under (another tenant's
engine never delivers it), spill files are rotated by size (not one per flush), and events
reach the disk within the flush interval while the control plane accepts connections and
never answers."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from controlplane.service import ControlPlane
from enginehook.config import HookConfig
from enginehook.link.decide import TtlDecider
from enginehook.link.remote import ControlPlaneLink
from enginehook.link.spill import (
    OWNER_FILE,
    EventBuffer,
    ForeignSpillError,
    claim_spill_dir,
    credential_id,
    default_spill_dir,
)
from enginehook.link.transport import GrpcTransport
from tests.enginehook.test_cplink import Plane, _call, _free_port


@pytest.fixture
def plane(tmp_path: Path):
    p = Plane(f"sqlite:///{tmp_path / 'cp.sqlite3'}", _free_port())
    yield p
    p.stop()
    p.store.close()


def _config(plane: Plane, token: str, spill: Path | None = None) -> HookConfig:
    raw = {"control_plane": f"127.0.0.1:{plane.port}", "token": token}
    if spill is not None:
        raw["spill_dir"] = str(spill)
    return HookConfig.from_additional({"cachettl": raw})


def test_the_default_spill_folder_is_keyed_on_the_credential_not_the_tenant_name():
    one = default_spill_dir("cp:7000", "default", "model", token="token-of-acme")
    other = default_spill_dir("cp:7000", "default", "model", token="token-of-globex")
    assert one != other
    assert one == default_spill_dir("cp:7000", "default", "model", token="token-of-acme")
    assert "token-of-acme" not in str(one)


def test_spill_written_under_one_token_is_never_delivered_under_another(plane, tmp_path, caplog):
    """An engine of tenant ``engine`` spills while the control plane is down and dies; the
    next engine on the folder holds another tenant's token (same tenant name in its
    config): it delivers none of those events, says so in one line, and the owner's next
    engine delivers them all under the owner's tenant."""
    other_token = ControlPlane(plane.store).create_tenant("other")[1]
    spill = tmp_path / "spill"
    decider = TtlDecider("continuum")
    first = ControlPlaneLink.from_config(_config(plane, plane.token, spill), decider, "e1")
    for i in range(6):
        first.submit(_call(i, program="owned"))
    first.close(0.3)  # the control plane is down: spilled under the owner's token
    assert list(spill.glob("spill-*.jsonl"))
    assert (spill / OWNER_FILE).read_text().strip() == credential_id(plane.token)
    assert plane.token not in (spill / OWNER_FILE).read_text()

    plane.start()
    with caplog.at_level(logging.WARNING, logger="enginehook.link.spill"):
        intruder = ControlPlaneLink.from_config(_config(plane, other_token, spill), decider, "e2")
    refusals = [r for r in caplog.records if "another credential" in r.getMessage()]
    assert len(refusals) == 1
    assert str(spill) in refusals[0].getMessage()
    assert intruder.buffer.spill_dir != spill
    assert len(intruder.buffer) == 0
    intruder.submit(_call(50, program="theirs"))
    assert intruder.flush(20)
    intruder.close()
    assert plane.store.count_tool_calls("other") == 1  # its own event only
    assert plane.store.count_tool_calls("engine") == 0

    owner = ControlPlaneLink.from_config(_config(plane, plane.token, spill), decider, "e3")
    assert owner.buffer.spill_dir == spill
    assert owner.flush(20)
    owner.close()
    assert plane.store.count_tool_calls("engine") == 6
    assert plane.store.count_tool_calls("other") == 1


def test_a_buffer_refuses_a_folder_another_credential_wrote(tmp_path):
    buffer = EventBuffer(tmp_path, memory_events=1, token="a")
    for i in range(3):
        buffer.put(_call(i))
    buffer.close()
    with pytest.raises(ForeignSpillError, match="another credential"):
        EventBuffer(tmp_path, token="b")
    folder, lock = claim_spill_dir(tmp_path, token="b")
    assert folder != tmp_path
    lock.close()
    assert len(EventBuffer(tmp_path, token="a")) == 2


def test_spill_files_are_rotated_by_size_not_opened_per_flush(tmp_path):
    """While the control plane is down the link spills and syncs at every flush interval:
    300 flushes of a few events each stay in one file until it reaches its size bound."""
    buffer = EventBuffer(tmp_path, memory_events=10)
    for flush in range(300):
        for i in range(3):
            buffer.put(_call(flush * 3 + i))
        buffer.spill_all()
        buffer.sync()
    files = sorted(tmp_path.glob("spill-*.jsonl"))
    total = sum(p.stat().st_size for p in files)
    assert len(files) == 1, f"{len(files)} files for {total} bytes"
    assert len(buffer) == 900
    small = EventBuffer(tmp_path / "small", memory_events=1, segment_events=10**6)
    small.segment_bytes = 16 * 1024
    for i in range(400):
        small.put(_call(i))
        small.spill_all()
    sizes = [p.stat().st_size for p in (tmp_path / "small").glob("spill-*.jsonl")]
    assert 1 < len(sizes) <= sum(sizes) // (16 * 1024) + 1
    assert max(sizes) <= 16 * 1024 + 1024


def _black_hole() -> tuple[socket.socket, int, threading.Event]:
    """A port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop, held = threading.Event(), []

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
        for conn in held:
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1], stop


def test_events_reach_the_disk_within_the_flush_interval_when_sends_hang(tmp_path):
    server, port, stop = _black_hole()
    spill = tmp_path / "spill"
    link = ControlPlaneLink(
        GrpcTransport(f"127.0.0.1:{port}", "t", timeout_s=5.0),
        EventBuffer(spill),
        None,
        flush_interval_s=0.2,
        send_interval_s=0.2,
    )
    try:
        for i in range(20):
            link.submit(_call(i))
        time.sleep(0.3)
        for i in range(20, 30):
            link.submit(_call(i))
        time.sleep(0.7)  # well within one send's 5 s timeout
        lines = [line for p in spill.glob("spill-*.jsonl") for line in p.read_text().splitlines()]
        ids = {line.split('"event_id": "')[1].split('"')[0] for line in lines}
        assert ids >= {f"eng:p:{i}" for i in range(30)}, f"{len(ids)} of 30 on disk"
    finally:
        link.close(0.2)
        stop.set()
        server.close()
