"""With the hook switched off (``enabled: false``), a real ``vllm serve`` with the session
middleware says nothing about pins: no ``kv_transfer_params``, no pin header (its own
module: one engine per module)."""

from __future__ import annotations

import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehook.tools.tinymodel import random_words
from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for
from tests.enginehook.test_pin_reply import PIN_HEADERS


@pytest.fixture(scope="module")
def base_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("pin-reply-off")
    port, log = free_port(), work / "vllm.log"
    middleware = ("--middleware", "enginehook.sessions.SessionIdMiddleware")
    proc = start_vllm_server(tiny_model, port, {"enabled": False}, log, middleware)
    try:
        wait_for(lambda: vllm_healthy(proc, port, log), 600, "the vLLM server")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_a_reply_with_the_hook_off_carries_nothing(base_url: str, tiny_model: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(9)
    messages: list[Any] = [{"role": "user", "content": random_words(rng, 400)}]
    for xargs in ({"tool": "bash", "tool_args": "ls"}, {"last_turn": 1}):
        raw = client.chat.completions.with_raw_response.create(
            model=str(tiny_model),
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"session_id": "off", "vllm_xargs": xargs, "ignore_eos": True},
        )
        reply = raw.parse()
        assert (reply.model_extra or {})["kv_transfer_params"] is None
        assert [h for h in PIN_HEADERS if h in raw.headers] == []
        assert raw.headers["x-cachettl-engine"] == base_url.split("/")[2]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": random_words(rng, 20)})
