"""The OpenAI-compatible server with the hook, driven by the ``openai`` client as an agent
would (multi-turn tool calls, ``session_id``), with a real control plane that is killed
and restarted in the middle of the run."""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).parent / "cachettl")


@dataclass
class ControlPlaneProcess:
    db: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [CLI, "serve", "--db", self.db, "--listen", f"127.0.0.1:{self.port}"]
        args += ["--policy", "continuum", "--min-samples", "3", "--snapshot-interval", "1"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, 60, "the control plane")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None


@dataclass
class Stack:
    base_url: str
    model: str
    plane: ControlPlaneProcess
    event_log: Path
    metrics_port: int
    token: str  # the hook's pin-command token: a router's pin commands carry it

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("server")
    db = f"sqlite:///{work / 'cp.sqlite3'}"
    token = subprocess.run(
        [CLI, "tenants", "create", "engine", "--db", db], check=True, capture_output=True, text=True
    ).stdout.strip()
    plane = ControlPlaneProcess(db, free_port(), work / "cp.log")
    plane.start()
    event_log = work / "events.jsonl"
    metrics_port = free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False},
        "control_plane": f"127.0.0.1:{plane.port}",
        "token": token,
        "spill_dir": str(work / "spill"),
        "event_log": str(event_log),
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        "pin_command_token": (pin_token := secrets.token_urlsafe(24)),
    }
    port = free_port()
    server = start_vllm_server(tiny_model, port, hook, work / "vllm.log")
    try:
        wait_for(lambda: vllm_healthy(server, port, work / "vllm.log"), 300, "the vLLM server")
        url = f"http://127.0.0.1:{port}/v1"
        yield Stack(url, str(tiny_model), plane, event_log, metrics_port, pin_token)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        if plane.proc is not None:
            plane.kill()


def _words(rng: Any, n: int) -> str:
    from enginehook.tools.tinymodel import random_words

    return random_words(rng, n)


def _fillers(stack: Stack, rng: Any, n: int = 8) -> None:
    client = stack.client()
    prompts = [_words(rng, 700) for _ in range(n)]

    def one(text: str) -> None:
        client.completions.create(model=stack.model, prompt=text, max_tokens=4, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, prompts))


class Agent:
    """A tool-calling agent: each turn ends in a ``bash`` call whose output comes back."""

    def __init__(self, stack: Stack, name: str, rng: Any, pin: bool = True, header: bool = False):
        self.stack, self.name, self.rng, self.pin, self.header = stack, name, rng, pin, header
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": _words(rng, 40)},
            {"role": "user", "content": _words(rng, 450)},
        ]
        self.turns = 0

    def turn(self, last: bool = False) -> int:
        """One LLM call; returns the cached prompt tokens the server reported."""
        xargs: dict[str, Any] = {"last_turn": int(last), "pin": int(self.pin)}
        if not last:
            xargs["tool"] = "bash"
            xargs["tool_args"] = "ls -la"
        body: dict[str, Any] = {"vllm_xargs": xargs, "ignore_eos": True}
        headers = {}
        if self.header:
            headers["X-Session-ID"] = self.name
        else:
            body["session_id"] = self.name
        r = self.stack.client().chat.completions.create(
            model=self.stack.model,
            messages=self.messages,
            max_tokens=24,
            temperature=0,
            extra_body=body,
            extra_headers=headers,
        )
        self.turns += 1
        call_id = f"call_{self.name}_{self.turns}"
        self.messages.append(
            {
                "role": "assistant",
                "content": r.choices[0].message.content,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
                    }
                ],
            }
        )
        self.messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": _words(self.rng, 60)}
        )
        details = r.usage.prompt_tokens_details if r.usage else None
        return int(details.cached_tokens or 0) if details else 0


def _metrics(stack: Stack) -> dict[str, str]:
    """The hook's metrics endpoint, as ``{series: value}``."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def _events(stack: Stack) -> list[dict[str, Any]]:
    if not stack.event_log.exists():
        return []
    return [json.loads(line) for line in stack.event_log.read_text().splitlines()]


def test_pinned_agent_gets_cached_prefix_and_unpinned_does_not(stack):
    import random

    rng = random.Random(1)
    pinned, plain = (
        Agent(stack, "agent-A", rng),
        Agent(stack, "agent-B", rng, pin=False, header=True),
    )
    cached: dict[str, list[int]] = {"A": [], "B": []}
    for k in range(3):
        last = k == 2
        cached["A"].append(pinned.turn(last))
        cached["B"].append(plain.turn(last))
        if not last:
            _fillers(stack, rng)
    assert cached["A"][0] == 0
    assert cached["A"][1] >= 480 // 32 * 32  # at least the first prompt's full blocks
    assert cached["A"][2] > cached["A"][1]
    assert cached["B"][1:] == [0, 0]
    wait_for(lambda: sum(e["kind"] == "program_end" for e in _events(stack)) >= 2, 30, "events")
    by_program: dict[str, list[str]] = {}
    for e in _events(stack):
        if e["kind"] == "tool_call":
            by_program.setdefault(e["program_id"], []).append(e["pin_outcome"])
    assert by_program["agent-A"] == ["hit", "hit"]
    assert by_program["agent-B"] == ["not_pinned", "not_pinned"]
    lines = _metrics(stack)
    assert int(lines["cachettl_pinned_prefix_hits_total"]) >= 2
    assert int(lines['cachettl_ttl_decisions_total{basis="fixed"}']) >= 2


def test_control_plane_killed_mid_run_serving_continues_no_event_lost(stack):
    import random

    from controlplane.storage import create_store

    rng = random.Random(2)
    agent = Agent(stack, "agent-C", rng)
    agent.turn()
    stack.plane.kill()
    _fillers(stack, rng, 4)
    assert agent.turn() > 0  # still pinned and served with the control plane down
    agent.turn(last=True)
    wait_for(
        lambda: any(
            e.get("program_id") == "agent-C" and e["kind"] == "program_end" for e in _events(stack)
        ),
        30,
        "agent-C's end",
    )
    stack.plane.start()
    events = _events(stack)
    calls = {e["event_id"] for e in events if e["kind"] == "tool_call"}
    ends = {e["program_id"] for e in events if e["kind"] == "program_end"}
    store = create_store(stack.plane.db)
    try:
        wait_for(
            lambda: (
                store.count_tool_calls() == len(calls)
                and len(store.read_program_ends(0, 1000)) == len(ends)
            ),
            90,
            "delivery after the restart",
        )
        stored = {c.call.event_id for c in store.read_tool_calls(0, 1000)}
        assert stored == calls
        assert store.count_tool_calls() == len(calls)
    finally:
        store.close()
    # The endpoint tells what became of the events: the outage, then all delivered.
    wait_for(lambda: _metrics(stack)["cachettl_control_plane_events_pending"] == "0", 30, "drain")
    lines = _metrics(stack)
    assert int(lines["cachettl_control_plane_send_failures_total"]) >= 1
    assert int(lines["cachettl_control_plane_events_delivered_total"]) >= len(calls) + len(ends)
    assert lines["cachettl_control_plane_events_rejected_total"] == "0"
    assert int(lines["cachettl_event_log_written_total"]) >= len(events)
    assert lines["cachettl_event_log_dropped_total"] == "0"


def _command(
    stack: Stack, method: str, path: str, body: bytes | None = None, token: str | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.metrics_port}/cachettl/pins/{path}",
        body,
        {"Authorization": f"Bearer {stack.token if token is None else token}"},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as error:
        return dict(json.loads(error.read()))


def test_a_router_extends_then_drops_a_live_pin_on_an_idle_engine(stack):
    import random
    import time

    rng = random.Random(3)
    agent = Agent(stack, "agent-D", rng)
    agent.turn()  # pinned for 60 s; nothing else runs, so the engine goes idle
    extend = _command(stack, "POST", "agent-D:extend", b'{"ttl_seconds": 120}')
    assert extend["state"] == "accepted"
    wait_for(
        lambda: _command(stack, "GET", f"commands/{extend['id']}")["state"] != "accepted",
        2,
        "the extend settled on the idle engine",
    )
    settled = _command(stack, "GET", f"commands/{extend['id']}")
    assert settled["state"] == "applied"
    assert settled["expires_at"] > time.time() + 100  # held for 120 s from now, not 60
    drop = _command(stack, "POST", "agent-D:drop")
    wait_for(
        lambda: _command(stack, "GET", f"commands/{drop['id']}")["state"] == "applied",
        2,
        "the pin dropped within 2 s",
    )
    assert int(_metrics(stack)['cachettl_pin_releases_total{reason="dropped"}']) == 1
    again = _command(stack, "POST", "agent-D:drop")  # nothing left to drop
    wait_for(
        lambda: _command(stack, "GET", f"commands/{again['id']}")["state"] == "expired",
        2,
        "a second drop settles as expired",
    )
    assert _command(stack, "POST", "agent-D:offload")["state"] == "unsupported"
    assert _command(stack, "POST", "agent-D:drop", token="wrong") == {
        "error": "pin commands need the hook's pin-command token (pin_command_token)"
    }
