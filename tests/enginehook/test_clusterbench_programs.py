"""``cachettl bench cluster --real --real-policies program_scheduling``: the routers it starts
run vllm-router's program scheduling with the bench's settings, and the other policies'
routers do not (a real ``vllm-router`` in front of a real HTTP server that answers its health
checks; the bench itself runs engines for minutes, so it is a command, not a test)."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from enginehook.tools.bench import BenchConfig
from enginehook.tools.clusterbench import (
    PROGRAM_SCHEDULING,
    PROGRAM_SCHEDULING_BY_COUNT,
    RealClusterConfig,
    program_scheduling_config,
    router_for,
)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[str]:
    """An HTTP server whose ``/health`` answers 200, enough for the router to start."""
    root = tmp_path / "worker"
    root.mkdir()
    (root / "health").write_text("ok\n")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _diagnostics(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/scheduling/diagnostics", timeout=5) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())


def _turn(url: str, program: str) -> None:
    """A first turn naming its program the way the bench's clients do."""
    context = {"program_id": program, "step_id": 0, "expected_resume": True}
    body = {"model": "tiny", "prompt": [11, 12], "vllm_xargs": {"agentic_context": context}}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    with contextlib.suppress(urllib.error.HTTPError):  # the worker serves files only
        urllib.request.urlopen(request, timeout=10).close()


def test_each_target_holds_the_engine_kv_pool() -> None:
    settings = program_scheduling_config(BenchConfig(blocks=240, block_size=32))
    assert settings["token_capacity_per_target"] == 240 * 32


def test_only_the_program_scheduling_policy_turns_it_on(worker: str, tmp_path: Path) -> None:
    config = RealClusterConfig()
    scheduled = router_for(config, PROGRAM_SCHEDULING, [worker], tmp_path)
    plain = router_for(config, "cache_aware", [worker], tmp_path)
    try:
        scheduled.start(timeout_s=30)
        plain.start(timeout_s=30)
        _turn(scheduled.url, "p7")  # the router binds the program, whatever the worker says
        status, figures = _diagnostics(scheduled.url)
        assert (status, figures["enabled"]) == (200, True)
        assert (figures["global_queue"], figures["resume_order"]) == (True, "mru")
        [target] = figures["ranks"]
        assert target["configured_token_capacity"] == config.trace.blocks * 32
        assert [p["root_program_id"] for p in target["programs"]] == ["p7"]
        status, figures = _diagnostics(plain.url)
        assert (status, figures["enabled"]) == (404, False)
    finally:
        scheduled.stop()
        plain.stop()


def test_by_count_leaves_the_targets_without_a_token_capacity(worker: str, tmp_path: Path) -> None:
    router = router_for(RealClusterConfig(), PROGRAM_SCHEDULING_BY_COUNT, [worker], tmp_path)
    try:
        router.start(timeout_s=30)
        _turn(router.url, "p8")
        status, figures = _diagnostics(router.url)
        assert (status, figures["enabled"]) == (200, True)
        [target] = figures["ranks"]
        assert target["configured_token_capacity"] is None
        assert [p["root_program_id"] for p in target["programs"]] == ["p8"]
    finally:
        router.stop()
