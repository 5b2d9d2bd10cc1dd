"""``cachettl tenants`` and ``serve`` as an operator meets them: re-running ``create`` writes
nothing and says how to get a new token, ``rotate`` re-issues one (the old one stops
working), and bad TLS material is one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main
from controlplane.storage import create_store, hash_token


def _db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cp.sqlite3'}"


def test_create_again_refuses_and_keeps_the_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    assert (
        main(["tenants", "create", "acme", "--db", _db(tmp_path), "--token-file", str(token)]) == 0
    )
    first = token.read_text().strip()
    assert first.startswith("cttl_")
    assert capsys.readouterr().out == ""
    assert token.stat().st_mode & 0o777 == 0o600
    assert (
        main(["tenants", "create", "acme", "--db", _db(tmp_path), "--token-file", str(token)]) == 2
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "already exists" in captured.err
    assert "cachettl tenants rotate acme" in captured.err
    assert token.read_text().strip() == first  # nothing written


def test_rotate_issues_a_new_token_and_the_old_one_stops_working(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _db(tmp_path)
    assert main(["tenants", "create", "acme", "--db", db]) == 0
    old = capsys.readouterr().out.strip()
    assert main(["tenants", "revoke", "acme", "--db", db]) == 0
    capsys.readouterr()
    assert main(["tenants", "rotate", "acme", "--db", db]) == 0
    new = capsys.readouterr().out.strip()
    assert new.startswith("cttl_")
    assert new != old
    store = create_store(db)
    try:
        assert store.tenant_by_token_hash(hash_token(old)) is None
        tenant = store.tenant_by_token_hash(hash_token(new))
        assert tenant is not None
        assert tenant.name == "acme"
        assert tenant.revoked_at is None
    finally:
        store.close()
    assert main(["tenants", "rotate", "nobody", "--db", db]) == 2
    assert "no tenant named 'nobody'" in capsys.readouterr().err


def test_rotate_is_documented_in_the_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controlplane", "tenants", "rotate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "old token" in out
    assert "streams" in out


def _pem(path: Path, kind: str) -> Path:
    path.write_text(f"-----BEGIN {kind}-----\nnot base64 at all\n-----END {kind}-----\n")
    return path


@pytest.mark.parametrize("bad", ["cert", "key"])
def test_bad_tls_material_is_one_line_naming_the_flag(tmp_path: Path, bad: str) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    other = ec.generate_private_key(ec.SECP256R1())
    key_file.write_bytes(
        other.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )  # a key, but not the certificate's
    if bad == "cert":
        _pem(cert_file, "CERTIFICATE")
    args = ["--tls-cert", str(cert_file), "--tls-key", str(key_file)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane",
            "serve",
            "--db",
            "memory://",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    flag = "--tls-cert" if bad == "cert" else "--tls-key"
    assert lines[0].startswith(f"cachettl: error: {flag}:")
