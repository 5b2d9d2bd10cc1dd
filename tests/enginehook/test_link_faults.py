"""The link under faults, over a real control plane (gRPC on a port, SQLite): an engine
killed while the control plane is down loses no event, the spill folder is stable and
found again, the spill's bound on disk, TLS and mutual TLS, and no token in clear."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from controlplane.rpc.client import ClientTls
from controlplane.rpc.server import ServerOptions, TlsFiles
from controlplane.service import ControlPlane
from enginehook.config import HookConfig
from enginehook.core.tracker import ProgramEndReport
from enginehook.link.decide import TtlDecider
from enginehook.link.remote import ControlPlaneLink
from enginehook.link.spill import EventBuffer, claim_spill_dir
from enginehook.link.transport import GrpcTransport, is_loopback
from tests.controlplane.test_cli_tls_metrics import _pki
from tests.enginehook.test_cplink import Plane, _call, _free_port, _link, _wait
from tests.support import ServerThread

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import sys, time
    from enginehook.core.tracker import ProgramEndReport
    from enginehook.link.remote import ControlPlaneLink
    from enginehook.link.transport import GrpcTransport
    from enginehook.link.spill import EventBuffer
    from tests.enginehook.test_cplink import _call

    port, token, spill = sys.argv[1], sys.argv[2], sys.argv[3]
    link = ControlPlaneLink(
        GrpcTransport(f"127.0.0.1:{port}", token, timeout_s=2.0),
        EventBuffer(spill),
        None,
        flush_interval_s=0.2,
        send_interval_s=0.2,
    )
    for p in range(4):
        for i in range(19):
            link.submit(_call(i, program=f"p{p}"))
        link.submit(ProgramEndReport(f"eng:p{p}:end", f"p{p}", "default", 19, 5.0))
    print("submitted", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def plane(tmp_path: Path):
    p = Plane(f"sqlite:///{tmp_path / 'cp.sqlite3'}", _free_port())
    yield p
    p.stop()
    p.store.close()


def test_an_engine_killed_while_the_control_plane_is_down_loses_no_event(plane, tmp_path):
    spill = tmp_path / "spill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", _CHILD, str(plane.port), plane.token, str(spill)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"submitted"
        time.sleep(1.0)  # five flush intervals: the rule puts every event on disk in one
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert list(spill.glob("spill-*.jsonl")), "nothing reached the disk before the kill"
    plane.start()
    link = _link(plane, spill)
    assert link.flush(20)
    link.close()
    assert plane.stored() == 76  # every tool call once: ids are idempotent
    assert plane.ends() == 4
    assert list(spill.glob("spill-*.jsonl")) == []


def test_the_default_spill_folder_is_stable_and_found_again(plane, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = HookConfig(control_plane=f"127.0.0.1:{plane.port}", token=plane.token)
    decider = TtlDecider("fixed", {"ttl_s": 1.0})
    first = ControlPlaneLink.from_config(config, decider, "e1")
    folder = first.buffer.spill_dir
    assert folder.is_relative_to(tmp_path / "cache" / "cachettl")
    second = ControlPlaneLink.from_config(config, decider, "e2")  # a second live engine
    assert second.buffer.spill_dir != folder
    second.close(0.5)
    for i in range(5):
        first.submit(_call(i))
    first.close(0.5)  # the control plane is down: the events are spilled
    assert len(list(folder.glob("spill-*.jsonl"))) == 1
    plane.start()
    again = ControlPlaneLink.from_config(config, decider, "e3")
    assert again.buffer.spill_dir == folder
    assert again.flush(20)
    again.close()
    assert plane.stored() == 5


def test_the_spill_keeps_its_bound_and_counts_what_it_drops(tmp_path):
    buffer = EventBuffer(tmp_path, memory_events=1, segment_events=3, max_bytes=4000)
    for i in range(40):
        buffer.put(_call(i))
    buffer.sync()
    files = list(tmp_path.glob("spill-*.jsonl"))
    on_disk = sum(p.stat().st_size for p in files)
    assert on_disk <= 4000
    assert buffer.dropped > 0
    assert len(buffer) + buffer.dropped == 40
    assert buffer.spilled_bytes == on_disk
    first = buffer.peek(1)[0]
    assert first.event_id == "eng:p:0"  # the oldest are kept, the newest dropped


def test_a_torn_last_line_is_skipped_and_counted(tmp_path):
    buffer = EventBuffer(tmp_path, memory_events=1, segment_events=10)
    for i in range(4):
        buffer.put(_call(i))
    buffer.close()
    segment = next(tmp_path.glob("spill-*.jsonl"))
    with segment.open("a", encoding="utf-8") as f:
        f.write('{"kind": "tool_call", "event_id": "eng:p:9"')  # a crash mid-line
    again = EventBuffer(tmp_path, memory_events=1, segment_events=10)
    seen = [e.event_id for e in again.peek(100)]
    assert seen == ["eng:p:1", "eng:p:2", "eng:p:3"]
    assert again.corrupt == 1


def test_a_live_engine_holds_its_spill_folder(tmp_path):
    folder, lock = claim_spill_dir(tmp_path / "spill")
    other, other_lock = claim_spill_dir(tmp_path / "spill")
    assert other == tmp_path / "spill-2"
    lock.close()
    other_lock.close()
    again, again_lock = claim_spill_dir(tmp_path / "spill")
    assert again == folder
    again_lock.close()


def _tls_plane(plane: Plane, tls: TlsFiles) -> ServerThread:
    cp = ControlPlane(plane.store, "continuum", min_samples=3)
    return ServerThread(cp, ServerOptions(listen=f"127.0.0.1:{plane.port}", tls=tls))


def test_the_link_reaches_a_tls_control_plane_with_mutual_tls(plane, tmp_path):
    pki = _pki(tmp_path)
    server = _tls_plane(plane, TlsFiles(pki["server"], pki["server-key"], client_ca=pki["ca"]))
    try:
        config = HookConfig.from_additional(
            {
                "cachettl": {
                    "control_plane": f"localhost:{plane.port}",
                    "token": plane.token,
                    "spill_dir": str(tmp_path / "spill"),
                    "tls_ca_file": str(pki["ca"]),
                    "tls_cert_file": str(pki["client"]),
                    "tls_key_file": str(pki["client-key"]),
                }
            }
        )
        link = ControlPlaneLink.from_config(config, TtlDecider("fixed", {"ttl_s": 1.0}), "e")
        for i in range(3):
            link.submit(_call(i))
        assert link.flush(20)
        link.close()
        assert plane.stored() == 3
        plain = GrpcTransport(f"127.0.0.1:{plane.port}", plane.token, timeout_s=2.0)
        with pytest.raises(Exception, match=r"UNAVAILABLE|Socket closed|failed to connect"):
            plain.send_tool_calls([_call(9)])  # plaintext to a TLS server is refused
        plain.close()
        no_cert = GrpcTransport(
            f"localhost:{plane.port}", plane.token, timeout_s=2.0, tls=ClientTls(pki["ca"])
        )
        with pytest.raises(Exception, match="UNAVAILABLE"):
            no_cert.send_tool_calls([_call(9)])  # the server asks the engine's certificate
        no_cert.close()
        assert plane.stored() == 3
    finally:
        server.stop()


def test_no_token_in_clear_to_another_host(tmp_path):
    with pytest.raises(ValueError, match=r"cachettl\.control_plane=.*in clear.*tls_ca_file"):
        GrpcTransport("cp.example:50051", "secret")
    GrpcTransport("cp.example:50051", "secret", allow_plaintext_token=True).close()
    GrpcTransport("127.0.0.1:50051", "secret").close()
    assert is_loopback("[::1]:50051")
    assert is_loopback("localhost:1")
    assert not is_loopback("10.0.0.1:50051")
    assert not is_loopback("cp.example:1")
    with pytest.raises(ValueError, match=r"tls_ca_file: no file"):
        GrpcTransport("cp:1", "t", tls=ClientTls(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        HookConfig.from_additional({"cachettl": {"tls_ca_file": "ca", "tls_cert_file": "c"}})


def test_events_reach_the_disk_off_the_callers_thread(plane, tmp_path):
    link = _link(plane, tmp_path / "spill")  # the control plane is down
    link.submit(ProgramEndReport("eng:p:end", "p", "default", 1, 5.0))
    assert _wait(lambda: bool(list((tmp_path / "spill").glob("spill-*.jsonl"))), 5)
    link.close(0.2)
