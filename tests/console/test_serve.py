"""``cachettl serve --console``: the console in the server's process, over TLS too."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
from pathlib import Path

from controlplane.cli import main
from controlplane.console.bench import Client
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.controlplane.test_cli_tls_metrics import _pki

ADMIN = "an-admin-token-of-the-serve-test"


def test_serve_runs_the_console_over_tls(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'serve.sqlite3'}"
    store = create_store(db)
    _, token = ControlPlane(store).create_tenant("acme")
    store.close()
    pki = _pki(tmp_path)
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")
    cmd = [
        *(sys.executable, "-m", "controlplane", "serve", "--db", db),
        *("--listen", "127.0.0.1:0", "--console", "127.0.0.1:0"),
        *("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server-key"])),
        *("--console-admin-token-file", str(admin_file)),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grpc_line, console_line = proc.stdout.readline(), proc.stdout.readline()
        assert "console on port" in console_line, (grpc_line, console_line)
        port = int(console_line.split("on port")[1].split()[0])
        tls = ssl.create_default_context(cafile=str(pki["ca"]))
        client = Client(port, tls=tls)
        _, headers, _ = client.request("GET", "/login")
        assert "Secure" in headers["set-cookie"]
        assert headers["strict-transport-security"].startswith("max-age=")
        assert client.login(token) == 303
        status, headers, body = client.request("GET", "/tools")
        assert status == 200
        assert b"Tools of" in body
        admin = Client(port, tls=tls)
        assert admin.login(ADMIN) == 303
        assert b"acme" in admin.get("/tenants")[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "shutting down" in out
    assert "GET /tools" in err  # the access log is on ...
    assert token not in out + err  # ... and names no token
    assert ADMIN not in out + err


def test_a_bad_console_address_is_refused(tmp_path: Path, capsys) -> None:
    db = f"sqlite:///{tmp_path / 'serve.sqlite3'}"
    assert main(["serve", "--db", db, "--listen", "127.0.0.1:0", "--console", "nowhere"]) == 2
    assert "--console: expected HOST:PORT, got 'nowhere'" in capsys.readouterr().err
    short = tmp_path / "short"
    short.write_text("tooshort")
    flags = ["--console", "127.0.0.1:0", "--console-admin-token-file", str(short)]
    assert main(["serve", "--db", db, "--listen", "127.0.0.1:0", *flags]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
