"""The servers the tools and tests start as subprocesses, and the ports they listen on.

- :func:`free_port`: a port free now for a server that binds it later, drawn below the
  kernel's ephemeral range;
- :func:`start_vllm`, :func:`vllm_ready`: ``python -m vllm.entrypoints.openai.api_server``
  with ``--scheduler-cls`` (the hook or stock vLLM);
- :class:`ControlPlaneProcess`: ``cachettl serve`` on SQLite or PostgreSQL;
- :func:`wait_for`, :func:`stop_process`: poll until ready, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PORT_FLOOR",
    "ControlPlaneProcess",
    "free_port",
    "start_vllm",
    "stop_process",
    "vllm_ready",
    "wait_for",
]


#: The lowest port :func:`free_port` hands out.
PORT_FLOOR = 20_000
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives a socket bound to port 0 (Linux; else 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that binds it later (an engine binds
    its ports a minute after it is started).

    Drawn from below the kernel's ephemeral range (``PORT_FLOOR`` up to it), where no socket
    bound to port 0 lands (vLLM's own sockets, clients' connections), so nothing takes the
    port meanwhile but another such choice; never the same port twice in one process. Where
    the range is unknown or leaves too little room, the kernel's choice.
    """
    ceiling = _ephemeral_floor()
    if ceiling - PORT_FLOOR >= 1_000:
        rng = random.Random()
        for _ in range(256):
            port = rng.randrange(PORT_FLOOR, ceiling)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 0.25 s; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)


def start_vllm(
    model: Path,
    port: int,
    log: Path,
    *,
    hook: dict[str, Any] | None,
    blocks: int | None = None,
    max_num_seqs: int = 4,
    served_name: str = "smollm2",
    dev_mode: bool = False,
    eager: bool = True,
    max_model_len: int = 4096,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server for ``model`` on ``port`` (prefix caching, blocks of 32 tokens);
    the CacheTTL scheduler configured by ``hook``, or stock vLLM when ``hook`` is None;
    ``extra_args`` last (e.g. ``--middleware``); ``env``: variables set for the server.
    ``dev_mode``: vLLM's development endpoints (``POST /reset_prefix_cache``). ``eager``:
    no torch.compile (vLLM's compile cache is keyed by the whole config, hook settings
    included, so each new setting would compile for minutes on a small CPU)."""
    from enginehook.vllm.guards import hook_scheduler_cls

    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--block-size", "32"]
    args += ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
    args += ["--max-num-seqs", str(max_num_seqs)]
    if eager:
        args.append("--enforce-eager")
    if blocks is not None:
        args += ["--num-gpu-blocks-override", str(blocks)]
    if hook is not None:
        args += ["--scheduler-cls", hook_scheduler_cls()]
        args += ["--additional-config", json.dumps({"cachettl": hook})]
    args += extra_args
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if dev_mode:
        environ["VLLM_SERVER_DEV_MODE"] = "1"
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environ)


def vllm_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> bool:
    """Whether the server answers ``/health``; ``RuntimeError`` with its log's tail if it died."""
    if proc.poll() is not None:
        text = log.read_text()
        causes = " | ".join([line for line in text.splitlines() if "Error" in line][-4:])
        raise RuntimeError(f"vLLM server exited {proc.returncode}: {causes}\n{text[-3000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@dataclass
class ControlPlaneProcess:
    """``cachettl serve`` on the database at ``db`` (SQLite or PostgreSQL; a tenant created
    first unless ``token`` is given, as for a second replica of one database)."""

    db: str
    port: int
    log: Path
    policy: str = "cachettl"
    min_samples: int = 3
    token: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def cli(self) -> str:
        return str(Path(sys.executable).parent / "cachettl")

    def start(self, tenant: str = "agents") -> None:
        if not self.token:
            made = subprocess.run(
                [self.cli, "tenants", "create", tenant, "--db", self.db],
                check=True,
                capture_output=True,
                text=True,
            )
            self.token = made.stdout.strip()
        args = [self.cli, "serve", "--db", self.db, "--listen", f"127.0.0.1:{self.port}"]
        args += ["--policy", self.policy, "--min-samples", str(self.min_samples)]
        args += ["--snapshot-interval", "1"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"cachettl serve exited: {self.log.read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, 60, "the control plane")

    def stop(self) -> None:
        stop_process(self.proc, 30)
        self.proc = None
