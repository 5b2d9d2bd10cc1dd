"""A router's drop / extend of a session's pin: answered at once (accepted, rejected,
unsupported), settled on the scheduler's thread (applied, failed, expired), served over the
hook's real HTTP endpoint."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ToolCallReport
from enginehook.vllm.endpoint import serve_metrics
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.pin_commands import HISTORY, MAX_PENDING, PinCommands
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


def _engine(cap_s: float = 300.0) -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost(block_size=16)
    rules = SchedulingRules(ttl_cap_s=cap_s)
    controller = PinController(rules, host, pool_blocks=100, decider=_Fixed(), engine_id="a")
    return controller, host


def _got(commands: PinCommands, command_id: str) -> dict[str, Any]:
    answer = commands.get(command_id)
    assert answer is not None
    return answer


def _pinned_turn(c: PinController[str], program: str = "s1", at: float = 0.0) -> None:
    c.arrived(program, at, at)
    c.admitted(program, at)
    c.finished(FinishedTurn(program, "bash", "pytest -x", 160), at + 1.0, lambda: (10, "b"))
    assert c.pinned(program)  # until at + 31 s


def test_drop_releases_the_pin_now_and_reports_the_call_until_then() -> None:
    c, host = _engine()
    _pinned_turn(c)
    commands = PinCommands()
    assert commands.submit("drop", "s1", now=4.0)["state"] == "accepted"
    assert c.pinned("s1")  # nothing happens off the scheduler's thread
    commands.apply(c, now=4.5)
    assert not c.pinned("s1")
    assert host.freed == [("s1", "dropped")]
    [call] = [e for e in host.events if isinstance(e, ToolCallReport)]
    assert call.duration_s == 3.5  # finished at 1.0, dropped (sent elsewhere) at 4.5
    [first] = commands.ids()
    assert commands.get(first) == {
        "id": first,
        "action": "drop",
        "session": "s1",
        "state": "applied",
        "settled_at": 4.5,
        "blocks": 10,
    }


def test_extend_holds_the_pin_longer_within_the_cap_and_never_shortens_it() -> None:
    c, _ = _engine(cap_s=60.0)
    _pinned_turn(c)  # expires at 31.0
    commands = PinCommands()
    commands.submit("extend", "s1", now=20.0, ttl_s=500.0)  # capped at 60 s
    commands.submit("extend", "s1", now=21.0, ttl_s=1.0)  # would shorten it: kept
    commands.apply(c, now=21.0)
    first, second = commands.ids()
    assert _got(commands, first)["expires_at"] == 81.0  # 21 + 60 (the rules' cap)
    assert _got(commands, second)["expires_at"] == 81.0
    c.expire(50.0)  # past the old expiry: still held
    assert c.pinned("s1")
    c.expire(81.5)
    assert not c.pinned("s1")


def test_a_session_without_a_pin_settles_as_expired() -> None:
    c, _ = _engine()
    _pinned_turn(c)
    c.expire(40.0)  # its pin expired at 31.0
    commands = PinCommands()
    commands.submit("drop", "s1", now=41.0)
    commands.submit("extend", "unknown", now=41.0, ttl_s=5.0)
    commands.apply(c, now=41.0)
    assert [_got(commands, i)["state"] for i in commands.ids()] == ["expired", "expired"]


def test_a_command_that_raises_settles_as_failed_and_the_rest_still_apply() -> None:
    c, _ = _engine()
    _pinned_turn(c)

    class Broken(PinController[str]):
        def extend(self, program_id: str, ttl_s: float, now: float) -> Any:
            raise RuntimeError("table busy")

    c.__class__ = Broken
    commands = PinCommands()
    commands.submit("extend", "s1", now=2.0, ttl_s=5.0)
    commands.submit("drop", "s1", now=2.0)
    commands.apply(c, now=2.0)
    first, second = commands.ids()
    assert _got(commands, first)["state"] == "failed"
    assert _got(commands, first)["detail"] == "RuntimeError: table busy"
    assert _got(commands, second)["state"] == "applied"


@pytest.mark.parametrize(
    ("action", "session", "ttl", "state", "detail"),
    [
        ("offload", "s1", None, "unsupported", "action 'offload' is not one of drop, extend"),
        ("drop", "", None, "rejected", "session id must be 1-256 printable characters"),
        ("drop", "a\nb", None, "rejected", "session id must be 1-256 printable characters"),
        ("drop", "x" * 257, None, "rejected", "session id must be 1-256 printable characters"),
        ("drop", "s1", 5.0, "rejected", "drop takes no ttl_seconds"),
        ("extend", "s1", None, "rejected", "ttl_seconds must be a finite number > 0, got None"),
        ("extend", "s1", float("inf"), "rejected", "ttl_seconds must be a finite number > 0"),
        ("extend", "s1", 0.0, "rejected", "ttl_seconds must be a finite number > 0, got 0.0"),
    ],
)
def test_bad_commands_are_answered_at_once_and_never_queued(
    action: str, session: str, ttl: float | None, state: str, detail: str
) -> None:
    commands = PinCommands()
    answer = commands.submit(action, session, now=1.0, ttl_s=ttl)
    assert answer["state"] == state
    assert answer["detail"].startswith(detail)
    assert not commands  # nothing queued for the scheduler


def test_an_engine_that_does_not_pin_answers_unsupported() -> None:
    answer = PinCommands(supported=False).submit("drop", "s1", now=1.0)
    assert answer["state"] == "unsupported"
    assert "does not pin" in answer["detail"]


def test_the_queue_and_the_history_are_bounded() -> None:
    woken: list[int] = []
    commands = PinCommands(on_submit=lambda: woken.append(1))
    answers = [commands.submit("drop", f"s{i}", now=0.0) for i in range(MAX_PENDING + 3)]
    states = [a["state"] for a in answers]
    assert states.count("accepted") == MAX_PENDING
    assert states[-3:] == ["rejected"] * 3
    assert len(woken) == MAX_PENDING  # the engine is woken for each queued command only
    for _ in range(HISTORY):
        commands.submit("offload", "s", now=0.0)
    assert commands.get(answers[0]["id"]) is None  # the oldest left the history
    assert len(commands.ids()) == HISTORY
    assert commands.get(commands.ids()[-1]) is not None


# -- over HTTP, on the hook's endpoint ----------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[tuple[int, PinCommands]]:
    commands = PinCommands()
    server, port = serve_metrics(HookMetrics(), "127.0.0.1:0", commands, clock=lambda: 7.0)
    yield port, commands
    server.shutdown()
    server.server_close()


def _call(
    port: int, method: str, path: str, body: bytes | None = None, token: str = ""
) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    payload = json.loads(response.read() or b"{}")
    connection.close()
    return response.status, payload


def test_http_drop_then_poll_until_applied(endpoint: tuple[int, PinCommands]) -> None:
    port, commands = endpoint
    c, _ = _engine()
    _pinned_turn(c, "agent/7 run")
    status, answer = _call(port, "POST", "/cachettl/pins/agent%2F7%20run:drop")
    assert (status, answer["state"], answer["session"]) == (202, "accepted", "agent/7 run")
    assert _call(port, "GET", f"/cachettl/pins/commands/{answer['id']}")[1]["state"] == "accepted"
    commands.apply(c, now=8.0)  # the scheduler's next step
    status, settled = _call(port, "GET", f"/cachettl/pins/commands/{answer['id']}")
    assert (status, settled["state"], settled["blocks"]) == (200, "applied", 10)
    assert not c.pinned("agent/7 run")


def test_http_extend_takes_its_ttl_from_the_body(endpoint: tuple[int, PinCommands]) -> None:
    port, commands = endpoint
    c, _ = _engine()
    _pinned_turn(c)
    status, answer = _call(port, "POST", "/cachettl/pins/s1:extend", b'{"ttl_seconds": 90}')
    assert (status, answer["ttl_seconds"]) == (202, 90.0)
    commands.apply(c, now=7.0)
    assert _got(commands, answer["id"])["expires_at"] == 97.0


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/cachettl/pins/s1:extend", b"{", 400, "body must be a JSON object"),
        ("/cachettl/pins/s1:extend", b"[" * 300 + b"]" * 300, 400, "body must nest at most"),
        ("/cachettl/pins/s1:extend", b'{"ttl": 3}', 400, 'body must be {"ttl_seconds": N}'),
        ("/cachettl/pins/s1:extend", b'{"ttl_seconds": "3"}', 400, "must be a number"),
        ("/cachettl/pins/s1:extend", b'{"ttl_seconds": true}', 400, "must be a number"),
        ("/cachettl/pins/s1:extend", b"x" * 2000, 400, "body over 1024 bytes"),
        ("/cachettl/pins/s1:extend", None, 400, "ttl_seconds must be a finite number"),
        ("/cachettl/pins/s1:offload", None, 501, "is not one of drop, extend"),
        ("/cachettl/pins/s1", None, 404, "expected /cachettl/pins/{session}"),
    ],
)
def test_http_bad_commands_say_what_was_wrong(
    endpoint: tuple[int, PinCommands], path: str, body: bytes | None, status: int, message: str
) -> None:
    port, commands = endpoint
    got, answer = _call(port, "POST", path, body)
    assert got == status
    assert message in (answer.get("detail") or answer.get("error", ""))
    assert not commands


def test_http_unknown_command_and_paths(endpoint: tuple[int, PinCommands]) -> None:
    port, _ = endpoint
    assert _call(port, "GET", "/cachettl/pins/commands/c999")[0] == 404
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("POST", "/metrics")
    assert connection.getresponse().status == 404
    connection.close()


def test_http_commands_need_the_token_when_the_hook_has_one() -> None:
    commands = PinCommands()
    server, port = serve_metrics(HookMetrics(), "127.0.0.1:0", commands, token="s3cret")
    try:
        assert _call(port, "POST", "/cachettl/pins/s1:drop")[0] == 403
        assert _call(port, "POST", "/cachettl/pins/s1:drop", token="wrong")[0] == 403
        assert _call(port, "POST", "/cachettl/pins/s1:drop", token="s3cret")[0] == 202
    finally:
        server.shutdown()
        server.server_close()


def test_http_full_queue_answers_429(endpoint: tuple[int, PinCommands]) -> None:
    port, commands = endpoint
    for i in range(MAX_PENDING):
        commands.submit("drop", f"s{i}", now=0.0)
    status, answer = _call(port, "POST", "/cachettl/pins/late:drop")
    assert (status, answer["state"]) == (429, "rejected")


def test_the_history_is_bounded_in_bytes_at_any_input() -> None:
    import tracemalloc

    from enginehook.vllm.pin_commands import CLIENT_STRING_CHARS, HISTORY_MAX_BYTES

    tracemalloc.start()
    try:
        commands = PinCommands()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4_200):  # four-byte characters: the costliest strings
            huge = f"{i}" + "\U0001f600" * 60_000
            answer = commands.submit(huge, huge, now=0.0)
            del huge
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000_000
    assert commands._history_bytes <= HISTORY_MAX_BYTES
    assert len(answer["action"]) <= CLIENT_STRING_CHARS + 20
    assert answer["action"].endswith("chars]")
    assert len(commands.ids()) < HISTORY  # the byte bound, not the count, held
