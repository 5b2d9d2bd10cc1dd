"""A real cluster on one machine: vllm-router in front of vLLM engines with the hook and one
control plane, each its own process, as users run them (enginehook/README.md, "Cluster").

- :class:`ClusterEngine`: ``vllm serve`` of a model with the hook (or stock), the session
  middleware, its event log and metrics endpoint;
- :class:`Router`: ``vllm-router`` (PyPI, a binary wheel) with a policy, and its admin calls
  (``/add_worker``, ``/remove_worker``, ``/finish_session``) and Prometheus counters;
- :func:`chat_turn`: one turn of a program through the router, as an agent sends it
  (``X-Session-ID``; the hint keys in ``vllm_xargs``), with what the engine found in cache.

Used by ``tests/enginehook/test_cluster_real.py`` and ``cachettl bench cluster --real``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.core.tokens import read_token
from enginehook.tools.servers import free_port, start_vllm, stop_process, vllm_ready, wait_for

__all__ = [
    "ClusterEngine",
    "Router",
    "Turn",
    "chat_turn",
    "prometheus",
    "router_binary",
]

MIDDLEWARE = ("--middleware", "enginehook.sessions.SessionIdMiddleware")


def prometheus(url: str) -> dict[str, float]:
    """A Prometheus text endpoint's samples by their full name with labels."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue
    return samples


def router_binary() -> str:
    """The ``vllm-router`` console script beside this Python, else on ``PATH``."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
    return found


@dataclass
class ClusterEngine:
    """One engine: vLLM's OpenAI server with the session middleware and, when ``hook`` is
    given, the CacheTTL scheduler (its event log and metrics endpoint set here)."""

    name: str
    model: Path
    work: Path
    hook: dict[str, Any] | None
    blocks: int = 96
    max_model_len: int = 2048
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """How the engine names itself in ``X-CacheTTL-Engine``."""
        return f"127.0.0.1:{self.port}"

    @property
    def events_path(self) -> Path:
        return self.work / f"{self.name}-events.jsonl"

    @property
    def log(self) -> Path:
        return self.work / f"{self.name}.log"

    def start(self) -> None:
        hook = None
        if self.hook is not None:
            hook = {
                **self.hook,
                "event_log": str(self.events_path),
                "metrics_listen": f"127.0.0.1:{self.metrics_port}",
            }
        self.proc = start_vllm(
            self.model,
            self.port,
            self.log,
            hook=hook,
            blocks=self.blocks,
            served_name="tiny",
            max_model_len=self.max_model_len,
            extra_args=(*MIDDLEWARE, "--enable-scale-out"),
            env=self.env,
        )

    def ready(self) -> bool:
        assert self.proc is not None
        return vllm_ready(self.proc, self.port, self.log)

    def metrics(self) -> dict[str, float]:
        """The hook's metrics (``{}`` for a stock engine)."""
        if self.hook is None:
            return {}
        return prometheus(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def events(self) -> list[dict[str, Any]]:
        """The hook's events so far (tool calls and program ends)."""
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def drop_pin(self, session: str) -> Any:
        """Ask the hook to drop ``session``'s pin (its pin-command endpoint, with the hook's
        pin-command token when it has one); the endpoint's answer."""
        token_file = (self.hook or {}).get("pin_command_token_file")
        token = read_token(token_file) if token_file else ""
        session = urllib.parse.quote(session, safe="")
        url = f"http://127.0.0.1:{self.metrics_port}/cachettl/pins/{session}:drop"
        try:
            return _post(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        except urllib.error.HTTPError as error:  # rejected or unsupported: the answer says why
            return json.loads(error.read().decode() or "{}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


def _post(
    url: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST", headers=headers or {})
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        text = r.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass
class Router:
    """``vllm-router --policy POLICY --worker-urls ...`` on a free port."""

    policy: str
    workers: list[str]
    work: Path
    extra: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / f"router-{self.policy}-{self.port}.log"

    def finished_sessions(self) -> list[str]:
        """Sessions ``sticky_least_loaded`` logged as finished (``/finish_session``)."""
        marker = "SLL: finished session '"
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [
            line.split(marker, 1)[1].split("'", 1)[0]
            for line in text.splitlines()
            if marker in line
        ]

    def start(self, timeout_s: float = 120.0) -> None:
        args = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--policy", self.policy, "--worker-urls", *self.workers]
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        args += ["--worker-startup-check-interval", "1", "--log-level", "info", *self.extra]
        log = self.log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/liveness", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(up, timeout_s, f"vllm-router ({self.policy})")

    def add_worker(self, url: str) -> None:
        _post(f"{self.url}/add_worker?url={urllib.parse.quote(url, safe='')}")

    def remove_worker(self, url: str) -> None:
        _post(f"{self.url}/remove_worker?url={urllib.parse.quote(url, safe='')}")

    def workers_listed(self) -> list[str]:
        with urllib.request.urlopen(f"{self.url}/list_workers", timeout=5) as r:
            return list(json.loads(r.read().decode()).get("urls", []))

    def metrics(self) -> dict[str, float]:
        return prometheus(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.proc = None


@dataclass(frozen=True)
class Turn:
    """One turn's answer: the reply text, the prompt's tokens and how many were cached,
    the time it took (seconds) and the engine that answered (``X-CacheTTL-Engine``)."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    engine: str


def chat_turn(
    base_url: str,
    program: str,
    messages: list[dict[str, Any]],
    *,
    xargs: dict[str, Any] | None = None,
    max_tokens: int = 8,
    timeout_s: float = 300.0,
) -> Turn:
    """One chat turn of ``program`` (sent as ``X-Session-ID``) at ``base_url``."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": xargs or {},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("X-Session-ID", program)
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        reply = json.loads(r.read().decode())
        engine = r.headers.get("x-cachettl-engine", "")
    usage = reply.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Turn(
        reply["choices"][0]["message"]["content"] or "",
        int(usage.get("prompt_tokens", 0)),
        int(cached),
        time.monotonic() - started,
        engine,
    )
