"""Group commit: batches that arrive while another is being written are committed together
by the next writer, each with its own result or error (real SQLite and PostgreSQL)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest

from controlplane.errors import InvalidInputError
from controlplane.learning import NameLimitExceededError, NameLimits
from controlplane.records import AppendResult, Tenant, ToolCall
from controlplane.service import ControlPlane
from controlplane.storage import Store

BACKENDS = ["memory", "sqlite", "postgres"]


def _calls(prefix: str, tool: str, n: int = 3, args: str = "") -> list[ToolCall]:
    return [ToolCall(f"{prefix}-{i}", "p", tool, args, 1.0 + i) for i in range(n)]


class HeldStore:
    """The real store, whose first group commit waits for ``release``; records the
    groups it is asked to commit (tenant and size of each batch)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.release = threading.Event()
        self.groups: list[list[tuple[str, int]]] = []

    def append_batches(self, batches: Sequence[tuple[Tenant, Sequence[ToolCall]]]) -> Any:
        self.groups.append([(t.name, len(c)) for t, c in batches])
        if len(self.groups) == 1:
            assert self.release.wait(30)
        return self.store.append_batches(batches)

    def append_tool_calls(self, tenant: Tenant, calls: Sequence[ToolCall]) -> AppendResult:
        self.groups.append([(tenant.name, len(calls))])
        return self.store.append_tool_calls(tenant, calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _writers(
    plane: ControlPlane,
    held: HeldStore,
    first: Callable[[], object],
    rest: list[Callable[[], object]],
) -> list[object]:
    """Runs ``first`` (whose commit is held), then each of ``rest`` once the one before it
    waits in the queue; releases the commit; every call's result or error, in order."""
    out: list[object] = [None] * (1 + len(rest))

    def run(i: int, call: Callable[[], object]) -> None:
        try:
            out[i] = call()
        except Exception as error:
            out[i] = error

    threads = [threading.Thread(target=run, args=(0, first))]
    threads[0].start()
    _until(lambda: len(held.groups) == 1)
    for i, call in enumerate(rest, 1):
        threads.append(threading.Thread(target=run, args=(i, call)))
        threads[-1].start()
        _until(functools.partial(_queued, plane, i))
    held.release.set()
    for t in threads:
        t.join(30)
    return out


def _queued(plane: ControlPlane, n: int) -> bool:
    """Whether ``n`` batches wait for the write lock (the queue's order is the test's)."""
    return len(plane._queued) == n


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, "not within 30 s"
        time.sleep(0.005)


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_group_commits_each_batch_as_alone(store: Store) -> None:
    """Two tenants' batches in one group: positions in order, a call repeating an
    earlier batch's is that batch's duplicate, each tenant's own ids stay its own."""
    plane = ControlPlane(store)
    acme, _ = plane.create_tenant("acme")
    beta, _ = plane.create_tenant("beta")
    results = store.append_batches(
        [
            (acme, [*_calls("a", "bash", 2), _calls("a", "bash", 1)[0]]),
            (beta, _calls("a", "grep", 2)),  # the same ids, another tenant
            (acme, _calls("a", "bash", 3)),  # a-0 and a-1 are repeats, a-2 is new
        ]
    )
    assert [(r.accepted, r.duplicates) for r in results] == [(2, 1), (2, 0), (1, 2)]
    seqs = [s for r in results for s in r.seqs]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == 5
    rows = store.read_tool_calls(0, 10)
    assert [(r.tenant, r.call.event_id) for r in rows] == [
        ("acme", "a-0"),
        ("acme", "a-1"),
        ("beta", "a-0"),
        ("beta", "a-1"),
        ("acme", "a-2"),
    ]


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_batches_queued_behind_a_write_are_committed_as_one_group(store: Store) -> None:
    """Three batches wait while a fourth is written; the next writer commits them in one
    store call, name limits counting the names of the batches before in the group: the
    batch that would pass the limit fails alone and nothing of it is stored."""
    held = HeldStore(store)
    plane = ControlPlane(cast(Store, held), min_samples=1, name_limits=NameLimits(2, 100))
    acme, _ = plane.create_tenant("acme")
    beta, _ = plane.create_tenant("beta")
    out = _writers(
        plane,
        held,
        lambda: plane.record_tool_calls(acme, _calls("first", "bash")),
        [
            lambda: plane.record_tool_calls(acme, _calls("b", "grep")),  # acme's 2nd tool
            lambda: plane.record_tool_calls(acme, _calls("c", "python")),  # would be 3rd
            lambda: plane.record_tool_calls(beta, _calls("d", "python")),
        ],
    )
    assert held.groups == [[("acme", 3)], [("acme", 3), ("beta", 3)]]
    first, b, c, d = out
    assert isinstance(first, AppendResult)
    assert first.accepted == 3
    assert isinstance(b, AppendResult)
    assert b.accepted == 3
    assert isinstance(c, NameLimitExceededError)
    assert "events[0].tool_name" in str(c)
    assert "nothing was stored" in str(c)
    assert isinstance(d, AppendResult)
    assert d.accepted == 3
    ids = [r.call.event_id for r in store.read_tool_calls(0, 100)]
    assert ids == [f"{p}-{i}" for p in ("first", "b", "d") for i in range(3)]
    assert {t.tool for t in plane.list_tools("acme")} == {"bash", "grep"}
    assert plane.state.tool_seq == 9
    replay = ControlPlane(store, min_samples=1)  # no snapshot: the whole log
    assert replay.list_tools("acme") == plane.list_tools("acme")
    assert replay.list_tools("beta") == plane.list_tools("beta")


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_batch_the_database_refuses_fails_alone(store: Store) -> None:
    """A group the database refuses (a NUL character PostgreSQL cannot store) is written
    again one batch at a time: only that batch fails; the others are committed and
    learned."""
    held = HeldStore(store)
    plane = ControlPlane(cast(Store, held), min_samples=1)
    acme, _ = plane.create_tenant("acme")
    bad = [ToolCall("bad-0", "p", "bash", "ls \x00", 1.0)]
    out = _writers(
        plane,
        held,
        lambda: plane.record_tool_calls(acme, _calls("first", "bash")),
        [
            lambda: plane.record_tool_calls(acme, _calls("b", "bash")),
            lambda: plane.record_tool_calls(acme, bad),
            lambda: plane.record_tool_calls(acme, _calls("d", "bash")),
        ],
    )
    assert held.groups == [[("acme", 3)], [("acme", 3), ("acme", 1), ("acme", 3)]] + [
        [("acme", n)] for n in (3, 1, 3)
    ]
    first, b, refused, d = out
    assert isinstance(refused, InvalidInputError)
    assert all(isinstance(r, AppendResult) and r.accepted == 3 for r in (first, b, d))
    ids = [r.call.event_id for r in store.read_tool_calls(0, 100)]
    assert ids == [f"{p}-{i}" for p in ("first", "b", "d") for i in range(3)]
    assert plane.state.tool_seq == store.read_tool_calls(0, 100)[-1].seq
    replay = ControlPlane(store, min_samples=1)
    assert replay.list_tools("acme") == plane.list_tools("acme")
