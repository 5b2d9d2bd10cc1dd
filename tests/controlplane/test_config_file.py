"""``cachettl serve --config FILE``: every flag is a key (read from the parser, so a new flag is
one at once), a file of every key sets every setting, flags and environment variables override
the file, a bad file is one line naming the file and the key, and ``serve`` runs from a file
of every key."""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import build_parser, main
from controlplane.cli.configfile import config_keys, key_kind, parse_with_config
from controlplane.console.cli import ADMIN_TOKEN_ENV
from tests.controlplane.test_cli_tls_metrics import _pki


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def _toml(values: dict[str, Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, list):
            return "[" + ", ".join(one(v) for v in value) + "]"
        return json.dumps(value) if isinstance(value, str) else repr(value)

    return "".join(f"{key} = {one(value)}\n" for key, value in values.items())


def _sample(key: str, action: argparse.Action, tmp_path: Path) -> tuple[Any, Any]:
    """(a value other than the default, as the file writes it; the value the flag gets)."""
    if action.nargs == 0:
        return True, action.const
    if isinstance(action, argparse._AppendAction):  # a repeatable flag: an array
        return [f"value-of-{key}"], [f"value-of-{key}"]
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return choice, choice
    if action.type is int:
        return (action.default or 0) + 3, (action.default or 0) + 3
    if action.type is float:
        value = 2.0 * action.default if action.default else 7.0
        return value, value
    if action.type is Path:
        return str(tmp_path / key), tmp_path / key
    if action.type in (None, str):
        return f"value-of-{key}", f"value-of-{key}"
    assert callable(action.type)
    return "7", action.type("7")  # the flag's own parser (an age: 7 seconds)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parse_with_config(parser, argv, parser.parse_args(argv))


def test_every_flag_of_serve_is_a_key() -> None:
    help_ = subprocess.run(
        [sys.executable, "-m", "controlplane", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flags = {flag[2:] for flag in re.findall(r"(--[a-z][a-z-]+)", help_)} - {"help", "config"}
    keys = config_keys(_serve_parser())
    assert set(keys) == flags
    assert {"db", "listen", "tls-cert", "console", "max-streams"} <= set(keys)
    assert all(key_kind(action) for action in keys.values())


def test_a_file_of_every_key_sets_every_setting(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CACHETTL_DB", raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    keys = config_keys(_serve_parser())
    samples = {key: _sample(key, action, tmp_path) for key, action in keys.items()}
    path = tmp_path / "serve.toml"
    path.write_text(_toml({key: written for key, (written, _) in samples.items()}))
    args = _parse(["serve", "--config", str(path)])
    for key, action in keys.items():
        assert getattr(args, action.dest) == samples[key][1], key
        assert getattr(args, action.dest) != action.default, key


def test_flags_and_the_environment_override_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "serve.toml"
    token_file = tmp_path / "admin-token"
    path.write_text(
        'db = "sqlite:///from-the-file.sqlite3"\nlisten = "0.0.0.0:1"\nmin-samples = 5\n'
        f'ttl-cap = 60\nconsole-admin-token-file = "{token_file}"\n'
    )
    monkeypatch.delenv("CACHETTL_DB", raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    args = _parse(["serve", "--config", str(path), "--listen", "127.0.0.1:2"])
    assert (args.db, args.listen, args.min_samples) == (
        "sqlite:///from-the-file.sqlite3",
        "127.0.0.1:2",
        5,
    )
    assert args.ttl_cap == 60.0
    assert isinstance(args.ttl_cap, float)
    assert args.console_admin_token_file == token_file
    monkeypatch.setenv("CACHETTL_DB", "sqlite:///from-the-environment.sqlite3")
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "a-token-from-the-environment")
    args = _parse(["serve", "--config", str(path)])
    assert args.db is None  # so $CACHETTL_DB is the URL (controlplane.cli.database.db_url)
    assert args.console_admin_token_file is None  # so the token is $CACHETTL_CONSOLE_...
    args = _parse(["serve", "--config", str(path), "--db", "sqlite:///from-the-flag.sqlite3"])
    assert args.db == "sqlite:///from-the-flag.sqlite3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listn = '127.0.0.1:1'\n", "unknown key 'listn' (did you mean 'listen'?)"),
        ("min-samples = '100'\n", "key 'min-samples' must be an integer, got string '100'"),
        ("ttl-cap = true\n", "key 'ttl-cap' must be a number, got boolean true"),
        ("listen = 50051\n", "key 'listen' must be a string, got integer 50051"),
        ("policy = 'fixed'\n", "key 'policy' must be one of 'continuum', 'cachettl'"),
        ("[console]\nlisten = 'x'\n", "key 'console' must be a string, got table"),
        ("log-retention = '7 weeks'\n", "key 'log-retention': '7 weeks' is no age"),
        ("listen = '127.0.0.1:1'\nmin-samples = \n", "not valid TOML: Invalid value (at line 2"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    assert main(["serve", "--config", str(path), "--db", "memory://"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"cachettl: error: {path}: ")
    assert message in err


def test_a_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err
    missing = f"'{tmp_path}/none.toml': No such file or directory"
    assert err == f"cachettl: error: --config: cannot read {missing}\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_serve_runs_from_a_file_of_every_key(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    admin = tmp_path / "admin-token"
    admin.write_text("an-admin-token-of-the-config-test\n")
    metrics = _free_port()
    chosen = {
        "db": f"sqlite:///{tmp_path / 'from-the-file.sqlite3'}",
        "listen": "127.0.0.1:0",
        "metrics": f"127.0.0.1:{metrics}",
        "tls-cert": str(pki["server"]),
        "tls-key": str(pki["server-key"]),
        "tls-client-ca": str(pki["ca"]),
        "console": "127.0.0.1:0",
        "console-admin-token-file": str(admin),
        "max-concurrent-rpcs": 300,
        "log-retention": "30d",
    }
    values = {}
    for key, action in config_keys(_serve_parser()).items():
        if key in chosen:
            values[key] = chosen[key]
        elif action.default is not None and action.nargs != 0:
            values[key] = action.default  # every key present, each valid
        else:
            values[key] = _sample(key, action, tmp_path)[0]
    path = tmp_path / "serve.toml"
    path.write_text(_toml(values))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no CACHETTL_DB
    cmd = [sys.executable, "-m", "controlplane", "serve", "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "control plane on port" in lines[0], (lines, proc.stderr)
        assert "console on port" in lines[1], lines
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as answer:
            assert b"cachettl_" in answer.read()
        assert (tmp_path / "from-the-file.sqlite3").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_the_reference_lists_every_key() -> None:
    """docs/reference/configuration.md, generated at build time: a row for every key."""
    from tests.docs.test_site import _reference

    page = _reference().configuration_markdown()
    section = page[page.index("### Configuration file (`cachettl serve --config FILE`)") :]
    listed = re.findall(r"^\| `([a-z-]+)` \| ([^|]+) \| `--\1` \|$", section, re.MULTILINE)
    keys = config_keys(_serve_parser())
    assert [key for key, _ in listed] == list(keys)
    assert dict(listed) == {key: key_kind(action) for key, action in keys.items()}
