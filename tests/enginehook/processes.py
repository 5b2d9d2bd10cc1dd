"""Real vLLM OpenAI servers with the hook, as subprocesses, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginehook.tools.servers import free_port, wait_for
from enginehook.vllm.guards import hook_scheduler_cls
from tests.enginehook.driver import DTYPE

__all__ = ["free_port", "settled_events", "start_vllm_server", "vllm_healthy", "wait_for"]


def settled_events(path: Path, quiet_s: float = 0.5, timeout_s: float = 30.0) -> list[Any]:
    """The records of a server's event log once it has stopped growing for ``quiet_s``
    (its writer thread may lag the HTTP replies by a moment); ``[]`` if it never appears."""
    deadline = time.monotonic() + timeout_s
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_size = path.stat().st_size if path.exists() else -1
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.05)
    if size < 0:
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def start_vllm_server(
    model: Path, port: int, hook: dict[str, Any], log: Path, extra_args: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """The tiny model behind vLLM's OpenAI server on ``port`` (96 blocks of 32 tokens,
    four sequences) with the CacheTTL scheduler configured by ``hook``, then
    ``extra_args`` (e.g. ``--middleware``); output to ``log``."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPE]
    args += ["--max-model-len", "2048", "--block-size", "32", "--num-gpu-blocks-override", "96"]
    args += ["--enable-prefix-caching", "--max-num-seqs", "4", "--enable-prompt-tokens-details"]
    args += ["--scheduler-cls", hook_scheduler_cls()]
    args += ["--additional-config", json.dumps({"cachettl": hook}), "--seed", "0"]
    args += extra_args
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)


def vllm_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> bool:
    """Whether the server answers ``/health``; fails with its log's tail if it died."""
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False
