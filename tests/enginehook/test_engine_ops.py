"""A real vLLM OpenAI server with the hook and a real control plane: the token read from a
file never shows in the server's log or on any of its processes' command lines, and an
engine that gets no more requests still expires its pins (the metrics say so)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for
from tests.enginehook.test_cplink import Plane

pytestmark = pytest.mark.slow


def _pins_held(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("cachettl_pins_held "):
                return int(float(line.split()[1]))
    raise AssertionError("no cachettl_pins_held")


def _answered(port: int) -> int:
    """Events the control plane answered (stored or refused): it took the token."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    names = ("delivered_total", "rejected_total")
    return sum(
        int(line.split()[1])
        for line in lines
        if line.startswith("cachettl_control_plane_events_") and line.split()[0].endswith(names)
    )


def _family(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _turn(port: int, model: str, session: str, messages: list[dict[str, str]]) -> None:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "session_id": session,
        "vllm_xargs": {"tool": "bash", "tool_args": "ls", "pin": 1},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200


def test_token_kept_out_of_logs_and_pins_expire_on_an_idle_engine(tiny_model, tmp_path):
    plane = Plane(f"sqlite:///{tmp_path / 'cp.sqlite3'}", free_port())
    plane.start()
    token_file = tmp_path / "token"
    token_file.write_text(plane.token + "\n")
    metrics_port, port = free_port(), free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 1.0, "skip_slow_tools": False},
        "control_plane": f"127.0.0.1:{plane.port}",
        "token_file": str(token_file),
        "spill_dir": str(tmp_path / "spill"),
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }
    log = tmp_path / "vllm.log"
    server = start_vllm_server(tiny_model, port, hook, log)
    try:
        wait_for(lambda: vllm_healthy(server, port, log), 300, "the vLLM server")
        for pid in _family(server.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert plane.token.encode() not in cmdline, pid
        messages = [{"role": "user", "content": "list the files " * 40}]
        _turn(port, str(tiny_model), "agent", messages)
        pinned_at = time.monotonic()
        assert _pins_held(metrics_port) == 1
        wait_for(lambda: _pins_held(metrics_port) == 0, 10, "the idle engine's pin expiry")
        took = time.monotonic() - pinned_at
        assert took <= 3.0, f"pins_held went to 0 {took:.1f}s after the pin, TTL 1s"
        messages += [{"role": "assistant", "content": "ls"}, {"role": "user", "content": "ok"}]
        _turn(port, str(tiny_model), "agent", messages)  # the return completes a tool call
        wait_for(lambda: _answered(metrics_port) >= 1, 30, "the control plane's answer")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        plane.stop()
        plane.store.close()
    text = log.read_text(errors="replace")
    assert "token_file" in text  # vLLM printed the hook's arguments: the file's name only
    assert plane.token not in text
