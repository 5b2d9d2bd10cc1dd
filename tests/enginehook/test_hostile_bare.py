"""No client request stops the engine without the session middleware (as in the hook
README's first example): every hostile case reaches vLLM and the hook unchecked; whatever
vLLM answers, the engine serves a normal request after each. Hints the hook cannot read are
ignored with a warning (the request is served); a seeded fuzzer of KV-hint payloads
through the HTTP server leaves the engine serving and the hook without a fault. Requests
that well-formed clients send and the hook's own path rarely sees (parallel samples of one
pinned turn, one session's turns in flight together, a stream the client walks away from)
leave one pin per session, drop-able, and no fault."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginehook.hostile import CASES, Case, Engine, fuzz_body, running_engine

pytestmark = pytest.mark.slow

_FUZZ_S = 30.0
#: Cases whose hints reach the hook unless vLLM's own checks refuse them.
_REACH_THE_HOOK = {c.name for c in CASES if c.name.startswith("xargs-")}


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from running_engine(tiny_model, tmp_path_factory.mktemp("hostile"), middleware=False)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_field_leaves_the_engine_serving(engine: Engine, case: Case) -> None:
    status, text = engine.post(case.body(engine), list(case.headers))
    if case.name in _REACH_THE_HOOK:  # served with the hints ignored, or vLLM's own 400
        assert status in (200, 400), text[:500]
    assert status < 500 or case.name.startswith("body-"), text[:500]
    engine.serves()


def test_fuzzed_hint_payloads_leave_the_engine_serving(engine: Engine) -> None:
    rng = random.Random(7)
    deadline, sent = time.monotonic() + _FUZZ_S, 0
    while time.monotonic() < deadline:
        engine.post(fuzz_body(engine, rng))
        sent += 1
        if sent % 25 == 0:
            engine.serves()
    assert sent >= 50
    engine.serves()
    assert "cachettl_hook_faults_total{" not in engine.metrics()


_JSON = {"Content-Type": "application/json"}


def _running(engine: Engine) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def _replaced(engine: Engine) -> int:
    """The hook's count of pins released because their program pinned again."""
    for line in engine.metrics().splitlines():
        if line.startswith('cachettl_pin_releases_total{reason="replaced"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _pin_command(engine: Engine, method: str, path: str) -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", engine.metrics_port, timeout=10)
    try:
        conn.request(method, f"/cachettl/pins/{path}")
        answer: dict[str, object] = json.loads(conn.getresponse().read())
        return answer
    finally:
        conn.close()


def _dropped_blocks(engine: Engine, session: str) -> object:
    """Drop ``session``'s pin through the hook's endpoint; the blocks the drop freed (the
    settled command's ``blocks``), or its state when nothing was applied."""
    command = _pin_command(engine, "POST", f"{session}:drop")
    deadline = time.monotonic() + 10
    while (settled := _pin_command(engine, "GET", f"commands/{command['id']}"))[
        "state"
    ] == "accepted":
        assert time.monotonic() < deadline, settled
        time.sleep(0.05)
    return settled["blocks"] if settled["state"] == "applied" else settled["state"]


def test_parallel_samples_shared_sessions_and_dropped_streams_leave_one_pin_each(
    engine: Engine,
) -> None:
    pin = {"tool": "bash", "tool_args": "ls", "pin_ttl_s": 600}
    prompt = [{"role": "user", "content": "hello there " * 40}]  # a few full blocks
    # n = 3: three sampled turns of one program finish; each pin replaces the one before
    body = engine.chat(session_id="par", n=3, max_tokens=4, messages=prompt, vllm_xargs=pin)
    replaced = _replaced(engine)
    status, text = engine.post(json.dumps(body).encode())
    assert status == 200, text[:500]
    assert len(json.loads(text)["choices"]) == 3
    assert _replaced(engine) == replaced + 2
    # four turns of one session in flight together
    answers: list[int] = []

    def post() -> None:
        answers.append(engine.post(json.dumps({**body, "session_id": "twin", "n": 1}).encode())[0])

    posters = [threading.Thread(target=post) for _ in range(4)]
    for t in posters:
        t.start()
    for t in posters:
        t.join(120)
    assert answers == [200] * 4
    # a streamed turn whose client leaves after the first chunk: vLLM aborts it, unpinned;
    # the same turn read to its end is pinned
    for session, leave in (("gone", True), ("stayed", False)):
        streamed = {**body, "session_id": session, "n": 1, "stream": True}
        streamed |= {"max_tokens": 1_500, "ignore_eos": True}  # seconds of decoding
        conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(streamed), _JSON)
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"data: ")
            if not leave:
                assert response.read().rstrip().endswith(b"data: [DONE]")
        finally:
            conn.close()
    deadline = time.monotonic() + 60
    while _running(engine) > 0:  # the aborted turn leaves the engine
        assert time.monotonic() < deadline, "the left stream still runs"
        time.sleep(0.1)
    engine.serves()
    for session in ("par", "twin"):
        blocks = _dropped_blocks(engine, session)
        assert isinstance(blocks, int), (session, blocks)
        assert blocks > 0, session
        assert _dropped_blocks(engine, session) == "expired"  # one pin, now gone
    assert isinstance(_dropped_blocks(engine, "stayed"), int)
    assert _dropped_blocks(engine, "gone") == "expired"  # an aborted turn is not pinned
    engine.serves()
    assert "cachettl_hook_faults_total{" not in engine.metrics()
