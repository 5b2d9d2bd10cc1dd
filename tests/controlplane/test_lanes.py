"""Fair lanes (controlplane.rpc.lanes): the doors' work shared across tenants in server
time, on real threads, and a flood refused with a retry hint by a real server that stores
nothing of what it refused (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from controlplane.errors import RETRY_AFTER_KEY, OverloadedError, retry_after_s
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.rpc.gate import Budgets
from controlplane.rpc.lanes import Lanes
from controlplane.service import ControlPlane
from controlplane.storage import Store
from tests.support import running


def _spin(seconds: float) -> str:
    """CPU work (charged to the caller's tenant as server time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    return "done"


def test_the_least_served_tenant_goes_next() -> None:
    """One thread; a tenant with six calls queued has used server time, a tenant that
    sends one call has not: that call runs as soon as the thread is free, second."""

    async def main() -> list[str]:
        lanes = Lanes(workers=1)
        finished: list[str] = []

        async def call(tenant: str) -> None:
            await lanes.run(tenant, _spin, 0.03)
            finished.append(tenant)

        try:
            flood = [asyncio.ensure_future(call("flood")) for _ in range(6)]
            await asyncio.sleep(0.01)  # the first of the flood is running
            await asyncio.gather(call("light"), *flood)
        finally:
            lanes.close()
        assert lanes.usage()["flood"] >= 6 * 0.03 * 0.9
        return finished

    assert asyncio.run(main()) == ["flood", "light"] + ["flood"] * 5


def test_one_tenant_leaves_a_thread_for_the_others() -> None:
    """Two threads; a tenant whose calls all block takes one of them, never both: another
    tenant's call runs while they still block."""
    release = threading.Event()

    async def main() -> None:
        lanes = Lanes(workers=2)
        try:
            stuck = [asyncio.ensure_future(lanes.run("stuck", release.wait, 10)) for _ in range(4)]
            await asyncio.sleep(0.05)
            assert await asyncio.wait_for(lanes.run("other", str.upper, "ran"), 5) == "RAN"
            assert lanes.queued("stuck") == 3  # one runs, three wait for its own thread
            release.set()
            assert await asyncio.gather(*stuck) == [True] * 4
        finally:
            release.set()
            lanes.close()

    asyncio.run(main())


def test_a_call_that_waited_too_long_is_refused_unrun_with_a_retry_hint() -> None:
    ran: list[int] = []

    async def main() -> None:
        lanes = Lanes(workers=1, max_wait_s=0.05)
        try:
            first = asyncio.ensure_future(lanes.run("acme", _spin, 0.2))
            await asyncio.sleep(0.01)
            with pytest.raises(OverloadedError) as refused:
                await lanes.run("acme", ran.append, 1)
            assert await first == "done"
        finally:
            lanes.close()
        error = refused.value
        assert "tenant 'acme'" in str(error)
        assert "waited" in str(error)
        assert 0.1 > error.retry_after_s >= 0.05 / 2  # type: ignore[attr-defined]
        assert lanes.refused == {"acme": 1}

    asyncio.run(main())
    assert ran == []


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_a_flood_is_refused_with_a_retry_hint_and_stores_nothing_it_refused(
    store: Store,
) -> None:
    """Eight concurrent batches of 1,000 events on a server with one lane thread that lets
    a call wait 1 ms: some are answered RESOURCE_EXHAUSTED with the retry hint, the others
    stored whole, and the store holds exactly the events acknowledged."""
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("flood")
    budgets = Budgets(lane_threads=1, lane_wait_s=0.001)
    args = "pytest " + "x" * 2000

    def send(client: ControlPlaneClient, b: int) -> grpc.RpcError | int:
        calls = [ToolCall(f"e{b}-{i}", f"p{i % 20}", "bash", args, 0.5) for i in range(1000)]
        try:
            return client.record_tool_calls(calls).accepted
        except grpc.RpcError as error:
            return error

    with (
        running(plane, budgets=budgets) as server,
        ControlPlaneClient(server.target, token) as c,
        ThreadPoolExecutor(8) as pool,
    ):
        answers = list(pool.map(lambda b: send(c, b), range(8)))
    refused = [a for a in answers if isinstance(a, grpc.RpcError)]
    stored = [a for a in answers if isinstance(a, int)]
    assert refused, answers
    assert stored, answers
    for error in refused:
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waited" in str(error.details())
        hints = [v for k, v in error.trailing_metadata() or () if k == RETRY_AFTER_KEY]
        assert len(hints) == 1
        assert int(hints[0]) >= 1
        assert retry_after_s(error) == int(hints[0]) / 1000
    assert stored == [1000] * len(stored)
    assert store.count_tool_calls("flood") == 1000 * len(stored)
