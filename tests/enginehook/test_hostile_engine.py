"""No client request stops the engine, behind the session middleware: every hostile case
(every field a client can send, past every bound) is an HTTP 400 naming its field, with a
short message, and the engine serves a normal request after each; a seeded fuzzer of KV-hint
payloads gets 200 or 400, never a server error, and the engine still serves."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginehook.hostile import CASES, Case, Engine, fuzz_body, running_engine

pytestmark = pytest.mark.slow

_FUZZ_S = 25.0


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from running_engine(tiny_model, tmp_path_factory.mktemp("hostile-mw"), middleware=True)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_field_is_a_400_naming_it_and_the_engine_serves_on(
    engine: Engine, case: Case
) -> None:
    status, text = engine.post(case.body(engine), list(case.headers))
    assert status == 400, text[:500]
    error = json.loads(text)["error"]
    assert error["param"] == case.field, error
    assert case.field in error["message"]
    assert len(text) < 2000  # a short prefix of the value at most, never the value
    engine.serves()


def test_printable_unicode_session_ids_are_served(engine: Engine) -> None:
    for headers in ([("X-Dynamo-Session-ID", "Zürich-会话-€".encode())], []):
        body = engine.chat(session_id="セッション-1") if not headers else engine.chat()
        status, text = engine.post(json.dumps(body).encode(), headers)
        assert status == 200, text[:500]


def test_a_body_over_the_pass_through_bound_cannot_stop_the_engine(engine: Engine) -> None:
    """Past 32 MiB the middleware passes the body on unread: the engine's own bounds and
    guard hold (the hints are ignored, the request is served)."""
    deep = "[" * 100_000 + "]" * 100_000
    body = engine.chat(vllm_xargs={"cachettl_kv_hints": deep}, pad="p" * (33 * 2**20))
    status, text = engine.post(json.dumps(body).encode())
    assert status == 200, text[:500]
    engine.serves()
    status, text = engine.post(json.dumps(body).encode(), [("X-Session-ID", "h" * 10_000)])
    assert status == 400, text[:300]
    assert json.loads(text)["error"]["param"] == "x-session-id"


def test_fuzzed_hint_payloads_get_200_or_400_and_the_engine_serves(engine: Engine) -> None:
    rng = random.Random(20241202)
    deadline, sent, statuses = time.monotonic() + _FUZZ_S, 0, set()
    while time.monotonic() < deadline:
        status, text = engine.post(fuzz_body(engine, rng))
        assert status in (200, 400), text[:500]
        statuses.add(status)
        sent += 1
        if sent % 25 == 0:
            engine.serves()
    assert sent >= 50
    assert statuses == {200, 400}
    engine.serves()
