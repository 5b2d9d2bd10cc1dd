"""One program's turns counted whole across engines.

Two engines (each a :class:`~enginehook.core.lifecycle.PinController` whose events go
through its own :class:`~enginehook.link.remote.ControlPlaneLink`, and whose moves come
through its own :class:`~enginehook.link.coherence.CoherenceLink`) report to one real
control-plane server on SQLite, PostgreSQL or memory. Each turn's chat body goes through
the real session middleware, which counts its answers as the turn index the engine reads
(:mod:`enginehook.hints.turns`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import inspection
from controlplane.records import ProgramEnd, Tenant
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.state import END_WINDOW_S, ModelState
from controlplane.storage import Store
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.hints.sessions import Message, Receive, Send, SessionIdMiddleware
from enginehook.hints.turns import turn_hint
from enginehook.link.coherence import CoherenceLink
from enginehook.link.remote import ControlPlaneLink
from enginehook.link.spill import EventBuffer
from enginehook.link.transport import GrpcTransport
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost
from tests.support import ServerThread, running

BACKENDS = ["memory", "sqlite", "postgres"]


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


class _LinkedHost(MinimalHost):
    """An engine host whose events go to the control plane through the real link."""

    def __init__(self, link: ControlPlaneLink) -> None:
        super().__init__()
        self.link = link

    def emit(self, event: object) -> None:
        super().emit(event)
        assert isinstance(event, ToolCallReport | ProgramEndReport)
        self.link.submit(event)


class Engine:
    """One engine: its controller, its event link and (optionally) its coherence link."""

    def __init__(self, name: str, server: ServerThread, token: str, spill: Path, coherent: bool):
        transport = GrpcTransport(server.target, token, timeout_s=5.0)
        self.link = ControlPlaneLink(
            transport, EventBuffer(spill / name), flush_interval_s=0.05, send_interval_s=0.05
        )
        self.host = _LinkedHost(self.link)
        self.controller = PinController(
            SchedulingRules(), self.host, pool_blocks=1000, decider=_Fixed(), engine_id=name
        )
        self.coherence = None
        if coherent:
            client = ControlPlaneClient(server.target, token)
            self.coherence = CoherenceLink(client, name, interval_s=0.02, retry_s=0.2)

    def turn(self, program: str, xargs: dict[str, Any], at: float, last: bool = False) -> None:
        """One turn of ``program`` here: arrives with the request's ``vllm_xargs``, is
        admitted and finishes 0.1 s later (calling ``bash`` unless it is the last)."""
        c = self.controller
        c.arrived(program, at, at, turns=turn_hint(xargs))
        if self.coherence is not None:  # reported before the next turn arrives elsewhere
            reported, deadline = self.coherence.reported, time.monotonic() + 5.0
            self.coherence.arrived(program, at)
            while self.coherence.reported == reported and time.monotonic() < deadline:
                time.sleep(0.01)
        c.admitted(program, at)
        tool = None if last else "bash"
        c.finished(FinishedTurn(program, tool, last_turn=last), at + 0.1, lambda: (4, "blocks"))

    def hear_moves(self, seconds: float) -> list[str]:
        """Apply the moves the control plane tells within ``seconds`` (as the hook's
        scheduler does each step); the programs that moved away."""
        assert self.coherence is not None
        deadline, moved = time.monotonic() + seconds, list[tuple[str, float]]()
        while time.monotonic() < deadline and not moved:
            moved = self.coherence.moved()
            time.sleep(0.01)
        moved = [(p, at) for p, at in moved if not p.startswith("probe-")]
        for program, arrived_at in moved:
            self.controller.moved_away(program, arrived_at)
        return [program for program, _ in moved]

    def close(self) -> None:
        if self.coherence is not None:
            self.coherence.close()
        self.link.close()


def chat_xargs(session: str, answers: int) -> dict[str, Any]:
    """The ``vllm_xargs`` the session middleware hands vLLM for a chat body holding
    ``answers`` assistant messages (each after a user or tool message)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug"}]
    for i in range(answers):
        messages.append({"role": "assistant", "content": f"step {i}"})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    status, forwarded = through_middleware(session, {"model": "m", "messages": messages})
    assert status == 200
    return dict(forwarded.get("vllm_xargs") or {})


def through_middleware(
    session: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, Any]]:
    """The status and the body vLLM would get from the session middleware."""
    seen: list[dict[str, Any]] = []
    statuses: list[int] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        message = await receive()
        seen.append(json.loads(message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"x-session-id", session.encode()), (b"content-length", b"%d" % len(raw))],
        "server": ("127.0.0.1", 8000),
    }

    async def receive() -> Message:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    asyncio.run(SessionIdMiddleware(app)(scope, receive, send))
    return statuses[0], seen[0] if seen else {}


@pytest.fixture
def cluster(store: Store, tmp_path: Path) -> Iterator[tuple[Store, ServerThread, str]]:
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with running(plane) as server:
        yield store, server, token


def _ends(store: Store) -> list[ProgramEnd]:
    return [row.end for row in store.read_program_ends(0, 100)]


@pytest.mark.parametrize("answers", [0, 1, 7])
def test_a_chat_body_with_n_answers_gives_turn_index_n(answers: int) -> None:
    xargs = chat_xargs("s-1", answers)
    host = MinimalHost()
    c = PinController(SchedulingRules(), host, pool_blocks=100, decider=_Fixed(), engine_id="e")
    c.arrived("s-1", 0.0, 0.0, turns=turn_hint(xargs))
    c.admitted("s-1", 0.0)
    c.finished(FinishedTurn("s-1", "bash"), 1.0, lambda: (2, "blocks"))
    c.arrived("s-1", 2.0, 2.0)
    c.admitted("s-1", 2.0)
    (call,) = [e for e in host.events if isinstance(e, ToolCallReport)]
    assert call.turn_index == answers
    assert call.event_id == f"e:s-1:0:{answers}"  # the first life here, whatever its index


def test_other_bodies_keep_the_engines_count_unless_the_client_sends_one() -> None:
    prompt = {"model": "m", "prompt": "assistant: step 0"}
    for path in ("/v1/completions", "/v1/responses"):
        assert "turn_index" not in through_middleware("s", prompt, path)[1].get("vllm_xargs", {})
    given = {**prompt, "vllm_xargs": {"turn_index": 3}}
    assert through_middleware("s", given, "/v1/completions")[1]["vllm_xargs"]["turn_index"] == 3
    chat = {"model": "m", "messages": [{"role": "assistant"}] * 2, "vllm_xargs": {"turn_index": 1}}
    assert through_middleware("s", chat)[1]["vllm_xargs"]["turn_index"] == 2  # the larger
    for bad in (-1, "x", 1.5, True, 10**6):
        status, _ = through_middleware("s", {**prompt, "vllm_xargs": {"turn_index": bad}})
        assert status == 400, bad


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_program_moving_a_b_a_ends_with_all_its_turns(cluster, tmp_path: Path) -> None:
    store, server, token = cluster
    a = Engine("engine-a", server, token, tmp_path, coherent=True)
    b = Engine("engine-b", server, token, tmp_path, coherent=True)
    try:
        _until_watching(a, b)
        a.turn("p", chat_xargs("p", 0), time.time())
        a.turn("p", chat_xargs("p", 1), time.time())
        b.turn("p", chat_xargs("p", 2), time.time())  # the router moved it
        assert a.hear_moves(2.0) == ["p"]
        b.turn("p", chat_xargs("p", 3), time.time())
        a.turn("p", chat_xargs("p", 4), time.time())  # ... and back
        assert b.hear_moves(2.0) == ["p"]
        a.turn("p", chat_xargs("p", 5), time.time(), last=True)
        assert a.link.flush(10.0)
        assert b.link.flush(10.0)
        # the engines it left reported no end of their own; the one holding it, all six
        assert [e for e in b.host.events if isinstance(e, ProgramEndReport)] == []
        assert [e.total_turns for e in a.host.events if isinstance(e, ProgramEndReport)] == [6]
        assert [e.total_turns for e in _ends(store)] == [6]
        calls = store.read_tool_calls(0, 100, "acme")
        assert sorted(r.call.turn_index for r in calls) == [0, 1, 2, 3, 4]
        assert {r.call.pin_outcome.label for r in calls if r.call.turn_index in (1, 3)} == {"moved"}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_two_engines_ends_of_one_program_are_one_end_with_the_larger_count(
    cluster, tmp_path: Path
) -> None:
    """Without pin coherence the engine a program left forgets it as abandoned and reports
    the turns it saw; the engine that ends it reports them all. Both ends are stored (the
    log is only appended to); within ``END_WINDOW_S`` of each other they are learned as
    one program with the larger count, whichever arrives first; a rerun of the program id
    later is a program of its own."""
    store, server, token = cluster
    plane = server.server.plane
    a = Engine("engine-a", server, token, tmp_path, coherent=False)
    b = Engine("engine-b", server, token, tmp_path, coherent=False)
    try:
        now = time.time()
        for i in range(3):
            a.turn("p", chat_xargs("p", i), now + i)
        b.turn("p", chat_xargs("p", 3), now + 3)
        b.turn("p", chat_xargs("p", 4), now + 4, last=True)
        assert b.link.flush(10.0)
        assert a.controller.forget_idle(now + 10, idle_s=5.0) == ["p"]  # ends at now + 2.1
        assert a.link.flush(10.0)
        # the other order, on another program: the partial end first, corrected after
        for i in range(2):
            a.turn("q", chat_xargs("q", i), now + i)
        assert a.controller.forget_idle(now + 10, idle_s=5.0) == ["q"]
        assert a.link.flush(10.0)
        b.turn("q", chat_xargs("q", 2), now + 3, last=True)
        assert b.link.flush(10.0)
        ends = [(e.program_id, e.total_turns) for e in _ends(store)]
        assert ends == [("p", 5), ("p", 3), ("q", 2), ("q", 3)]
        assert plane.workload_stats("acme").programs_completed == 2
        assert _learned_lengths(plane) == [5, 3]  # q's count corrected in its place
        a.turn("p", chat_xargs("p", 0), now + END_WINDOW_S + 60, last=True)  # a rerun
        assert a.link.flush(10.0)
        assert plane.workload_stats("acme").programs_completed == 3
        assert _learned_lengths(plane) == [5, 3, 1]
        _replay_learns_the_same(plane, "acme")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_an_end_seen_again_keeps_the_larger_count_and_learns_once(store: Store) -> None:
    """Another engine's view of an end is a row of its own; learning it corrects the
    count learned where it stands (a smaller count changes nothing), and a replay of the
    log learns exactly what the live models did."""
    plane = ControlPlane(store, min_samples=1)
    tenant, _ = plane.create_tenant("acme")
    assert isinstance(tenant, Tenant)
    for turns in (4, 7):  # two other programs before it, so η is defined
        assert plane.record_program_end(tenant, ProgramEnd(f"o{turns}", turns, 900.0))
    assert plane.record_program_end(tenant, ProgramEnd("p", 3, 1000.0)) == 3
    before = plane.tenant_version(tenant)
    assert plane.record_program_end(tenant, ProgramEnd("p", 5, 1000.0 + END_WINDOW_S)) == 4
    assert plane.tenant_version(tenant) == before + 1  # the models changed
    assert plane.record_program_end(tenant, ProgramEnd("p", 4, 999.5)) == 5  # fewer
    assert plane.tenant_version(tenant) == before + 1
    assert plane.record_program_end(tenant, ProgramEnd("p", 9, 1000.0)) is None  # a resend
    assert plane.workload_stats("acme").programs_completed == 3
    assert _learned_lengths(plane) == [4, 7, 5]
    lengths = ModelState.fresh(plane.policy, min_samples=1)  # what 4, 7, 5 alone give
    for turns in (4, 7, 5):
        lengths.models.record_program_end(turns, "acme")
    assert plane.workload_stats("acme").eta == inspection.workload(lengths, "acme").eta
    _replay_learns_the_same(plane, "acme")
    later = 1000.0 + END_WINDOW_S + 0.5
    assert plane.record_program_end(tenant, ProgramEnd("p", 2, later)) == 6  # a rerun
    assert plane.record_program_end(tenant, ProgramEnd("o", 2, 1000.0)) == 7  # another
    assert _learned_lengths(plane) == [4, 7, 5, 2, 2]


def _learned_lengths(plane: ControlPlane) -> list[int]:
    """The program lengths the tenant's remaining-turns window holds, oldest first."""
    return list(plane.state.models.workload("acme").remaining._programs)


def _replay_learns_the_same(plane: ControlPlane, tenant: str) -> None:
    replay = ModelState.fresh(plane.policy, min_samples=1)
    replay.apply_tool_calls(plane.store.read_tool_calls(0, 1000))
    replay.apply_program_ends(plane.store.read_program_ends(0, 1000))
    assert inspection.workload(replay, tenant) == plane.workload_stats(tenant)
    assert list(replay.models.workload(tenant).remaining._programs) == _learned_lengths(plane)


def _until_watching(a: Engine, b: Engine) -> None:
    """Move probe programs between the two links until both hear moves (their watch
    streams are registered), so the test's own moves cannot race the streams' start."""
    assert a.coherence is not None
    assert b.coherence is not None
    for first, second in ((a, b), (b, a)):
        for attempt in range(50):
            probe = f"probe-{first.controller.engine_id}-{attempt}"
            first.coherence.arrived(probe, time.time())  # type: ignore[union-attr]
            time.sleep(0.1)
            second.coherence.arrived(probe, time.time())  # type: ignore[union-attr]
            deadline = time.monotonic() + 0.3
            heard = False
            while time.monotonic() < deadline and not heard:
                heard = any(p == probe for p, _ in first.coherence.moved())  # type: ignore[union-attr]
                time.sleep(0.01)
            if heard:
                break
        else:
            raise AssertionError(f"{first.controller.engine_id} never heard a probe move")
