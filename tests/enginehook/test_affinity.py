"""Two CPU engines with the hook behind nginx's consistent hash on ``X-Session-ID``: every
turn of a program reaches the engine that holds its pin, and both engines serve programs.

The hook does not route; this shows the proxy set-up documented in enginehook/README.md.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from enginehook.tools.tinymodel import random_words
from tests.enginehook.processes import (
    free_port,
    settled_events,
    start_vllm_server,
    vllm_healthy,
)

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def _start_engine(model: Path, work: Path, name: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    log = work / f"{name}-events.jsonl"
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 60.0},
        "budget_share": 0.6,
        "event_log": str(log),
    }
    return start_vllm_server(model, port, hook, work / f"{name}.log"), port, log


def _nginx_conf(work: Path, listen: int, backends: list[int]) -> Path:
    temp = work / "nginx-temp"
    temp.mkdir(exist_ok=True)
    servers = "".join(f"    server 127.0.0.1:{p};\n" for p in backends)
    paths = "".join(
        f"  {kind}_temp_path {temp / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = work / "nginx.conf"
    conf.write_text(
        f"daemon off;\nworker_processes 1;\npid {work / 'nginx.pid'};\n"
        f"error_log {work / 'nginx-error.log'};\nevents {{}}\n"
        f"http {{\n  access_log off;\n{paths}"
        f"  upstream vllm {{\n    hash $http_x_session_id consistent;\n{servers}  }}\n"
        f"  server {{\n    listen 127.0.0.1:{listen};\n    location / {{\n"
        f"      proxy_pass http://vllm;\n      proxy_read_timeout 300s;\n"
        f"      add_header X-Upstream $upstream_addr always;\n    }}\n  }}\n}}\n"
    )
    return conf


@pytest.fixture(scope="module")
def proxy(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[Path], list[str]]]:
    work = tmp_path_factory.mktemp("affinity")
    engines = [_start_engine(tiny_model, work, f"engine{i}") for i in range(2)]
    listen = free_port()
    nginx: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 400
        while not all(
            vllm_healthy(p, port, work / f"engine{i}.log") for i, (p, port, _) in enumerate(engines)
        ):
            assert time.monotonic() < deadline, "engines did not start"
            time.sleep(1.0)
        conf = _nginx_conf(work, listen, [port for _, port, _ in engines])
        nginx = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(work)])
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", listen)) != 0:
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.2)
        addresses = [f"127.0.0.1:{port}" for _, port, _ in engines]
        yield f"http://127.0.0.1:{listen}/v1", [log for _, _, log in engines], addresses
    finally:
        if nginx is not None:
            nginx.send_signal(signal.SIGQUIT)
            nginx.wait(30)
        for proc, _, _ in engines:
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in engines:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _client(base_url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _three_per_engine(client: Any, model: str, addresses: list[str]) -> list[list[str]]:
    """Three session names per engine. Where the hash ring puts a name depends on the
    engines' ports, drawn at random, so the names are chosen by asking the proxy (a
    one-token request, no tool, no pin, whose upstream nginx reports)."""
    placed: list[list[str]] = [[], []]
    for i in range(64):
        raw = client.completions.with_raw_response.create(
            model=model, prompt="ping", max_tokens=1, extra_headers={"X-Session-ID": f"prog-{i}"}
        )
        home = placed[addresses.index(raw.headers["x-upstream"])]
        if len(home) < 3:
            home.append(f"prog-{i}")
        if all(len(p) == 3 for p in placed):
            return placed
    raise AssertionError(f"the proxy sent 64 sessions to one engine: {placed}")


def test_sessions_stick_to_the_engine_holding_their_pin(proxy, tiny_model):
    base_url, logs, addresses = proxy
    client = _client(base_url)
    rng = random.Random(5)
    model = str(tiny_model)

    placed = _three_per_engine(client, model, addresses)
    sessions = placed[0] + placed[1]
    prompts = {s: random_words(rng, 250) for s in sessions}
    first: dict[str, str] = {}
    for s in sessions:
        r = client.completions.create(
            model=model,
            prompt=prompts[s],
            max_tokens=16,
            temperature=0,
            extra_body={"vllm_xargs": {"tool": "bash"}, "ignore_eos": True},
            extra_headers={"X-Session-ID": s},
        )
        first[s] = r.choices[0].text

    def filler(i: int) -> None:
        client.completions.create(
            model=model,
            prompt=random_words(random.Random(i), 700),
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Session-ID": f"filler-{i}"},
        )

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(filler, range(12)))
    for s in sessions:
        r = client.completions.create(
            model=model,
            prompt=prompts[s] + " " + first[s] + " " + random_words(rng, 30),
            max_tokens=4,
            temperature=0,
            extra_body={"vllm_xargs": {"last_turn": 1}, "ignore_eos": True},
            extra_headers={"X-Session-ID": s},
        )
        assert r.usage is not None
        details = r.usage.prompt_tokens_details
        assert details is not None
        assert (details.cached_tokens or 0) >= 250 // 32 * 32, s
    served = [
        {e["program_id"] for e in settled_events(log) if e["program_id"].startswith("prog-")}
        for log in logs
    ]
    # Every session was served, pinned and hit, by the engine the proxy routes it to.
    assert served == [set(placed[0]), set(placed[1])]
