"""The command line (tenants, tools, serve with SIGTERM), TLS / mutual TLS, and /metrics."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controlplane.__main__ import main
from controlplane.rpc.client import ClientTls, ControlPlaneClient, ToolCall
from controlplane.rpc.server import TlsFiles
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.support import running


def test_tenants_and_tools_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    assert main(["tenants", "create", "acme", "--share", "--db", db]) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("cttl_")
    assert main(["tenants", "create", "acme", "--db", db]) == 2
    assert "tenant 'acme' already exists" in capsys.readouterr().err
    store = create_store(db)
    plane = ControlPlane(store, min_samples=3)
    tenant = plane.authenticate(token)
    assert tenant is not None
    calls = [ToolCall(f"e{i}", "p", "bash", "pytest -x", 0.1 * (i + 1)) for i in range(20)]
    plane.record_tool_calls(tenant, calls)
    store.close()
    assert main(["tools", "list", "--tenant", "acme", "--json", "--db", db]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["tool"], row["sample_count"], row["signatures"]) == ("bash", 20, ["pytest"])
    png = tmp_path / "cdf.png"
    args = ["tools", "show", "bash", "--args", "pytest -q", "--tenant", "acme"]
    assert main([*args, "--min-samples", "3", "--json", "--png", str(png), "--db", db]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["basis"], shown["signature"], shown["sample_count"]) == (
        "invocation",
        "pytest",
        20,
    )
    assert [d["context_tokens"] for d in shown["decisions"]] == [2000, 8000, 32000, 128000]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["tools", "show", "grep", "--tenant", "acme", "--db", db]) == 2
    assert "no samples of tool 'grep'" in capsys.readouterr().err
    assert main(["tenants", "revoke", "acme", "--db", db]) == 0
    assert main(["tenants", "list", "--db", db]) == 0
    assert "acme" in capsys.readouterr().out.splitlines()[-1].split()[0]


def test_serve_stops_gracefully_on_sigterm(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'serve.sqlite3'}"
    store = create_store(db)
    _, token = ControlPlane(store).create_tenant("acme")
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db, "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    target = f"127.0.0.1:{int(line.split('on port')[1].split()[0])}"
    with ControlPlaneClient(target, token) as client:
        client.record_tool_calls([ToolCall("e1", "p", "ls", "", 0.2)])
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "shutting down" in out
    snapshot = store.latest_snapshot("cachettl")  # the final snapshot was written
    assert snapshot is not None
    assert snapshot.tool_seq == 1
    store.close()


def _cert(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey]
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0] if issuer[0] else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if name == "ca":
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), False)
    return builder.sign(issuer[1], hashes.SHA256())


def _pki(tmp: Path) -> dict[str, Path]:
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "server", "client")}
    ca = _cert("ca", keys["ca"], (x509.Name([]), keys["ca"]))
    files = {}
    for name, key in keys.items():
        cert = ca if name == "ca" else _cert(name, key, (ca.subject, keys["ca"]))
        files[name] = tmp / f"{name}.pem"
        files[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{name}-key"] = tmp / f"{name}-key.pem"
        files[f"{name}-key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return files


def test_mutual_tls(tmp_path: Path, store) -> None:
    pki = _pki(tmp_path)
    plane = ControlPlane(store)
    _, token = plane.create_tenant("acme")
    tls = TlsFiles(pki["server"], pki["server-key"], client_ca=pki["ca"])
    with running(plane, tls=tls) as server:
        target = f"localhost:{server.port}"
        good = ClientTls(pki["ca"], pki["client"], pki["client-key"])
        with ControlPlaneClient(target, token, tls=good) as client:
            assert client.decide_ttl("ls").basis == "cold-start"
        with (
            ControlPlaneClient(target, token, tls=ClientTls(pki["ca"]), timeout_s=3) as client,
            pytest.raises(grpc.RpcError) as error,
        ):
            client.decide_ttl("ls")  # no client certificate
        assert error.value.code() is grpc.StatusCode.UNAVAILABLE


def test_metrics_endpoint(store) -> None:
    plane = ControlPlane(store)
    _, token = plane.create_tenant("acme")
    with (
        running(plane, metrics_listen="127.0.0.1:0") as server,
        ControlPlaneClient(server.target, token) as client,
    ):
        client.record_tool_calls([ToolCall("e1", "p", "ls", "", 0.2)])
        client.decide_ttl("ls")
        port = server.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    assert 'cachettl_rpc_total{code="OK",method="DecideTtl"} 1.0' in text
    assert "cachettl_events_ingested_total 1.0" in text
    assert 'cachettl_decisions_total{basis="cold-start"} 1.0' in text
    assert 'cachettl_rpc_latency_seconds_count{method="RecordToolCalls"} 1.0' in text


def _serve_refused(tmp_path: Path, *flags: str) -> str:
    """``serve`` with ``flags``: exits 2 at once with one line on stderr (the message)."""
    db = f"sqlite:///{tmp_path / 'tls.sqlite3'}"
    argv = [sys.executable, "-m", "controlplane", "serve", "--listen", "127.0.0.1:0"]
    done = subprocess.run(
        [*argv, "--db", db, *flags], capture_output=True, text=True, timeout=60, check=False
    )
    assert "on port" not in done.stdout, "started a server"
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def test_contradictory_tls_flags_are_refused(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    line = _serve_refused(tmp_path, "--tls-client-ca", str(pki["ca"]))
    assert "--tls-client-ca requires --tls-cert and --tls-key" in line
    assert "plaintext" in line
    line = _serve_refused(tmp_path, "--tls-cert", str(pki["server"]))
    assert "--tls-cert and --tls-key go together" in line


def test_bad_tls_files_name_the_flag_and_file(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    missing = tmp_path / "nowhere.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    unreadable = tmp_path / "unreadable.pem"
    unreadable.mkdir()  # a folder: reading it fails even as root
    good = {"--tls-cert": pki["server"], "--tls-key": pki["server-key"]}
    cases = [
        ("--tls-cert", missing, "cannot read"),
        ("--tls-key", garbage, "holds no PEM PRIVATE KEY block"),
        ("--tls-client-ca", unreadable, "cannot read"),
        ("--tls-cert", pki["server-key"], "holds no PEM CERTIFICATE block"),
    ]
    for flag, path, what in cases:
        files = {**good, flag: path}
        line = _serve_refused(tmp_path, *(x for kv in files.items() for x in map(str, kv)))
        assert line.startswith(f"cachettl: error: {flag}: "), line
        assert str(path) in line
        assert what in line
