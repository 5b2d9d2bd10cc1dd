"""Tool-by-tool rollout on the real CPU engine with a real control plane (in-process gRPC
server, SQLite store): a tool outside the tenant's rollout is decided and reported, not
pinned; ``cachettl rollout set`` adds it, the engine applies the change with its next
snapshot (no restart) and the tool's next call is pinned. The control plane stores the
first call as a shadow call and the second as a real pin."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import main
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store
from controlplane.storage.rollouts import Rollout
from tests.enginehook.driver import HOOK, Driver, make_llm, shutdown
from tests.support import ServerThread

pytestmark = pytest.mark.slow


def _wait(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll a condition (the snapshot stream's arrival; no TTL is waited for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Store, str]]:
    """``(database URL, store, server target)``: tenant ``acme`` pins only ``pytest``."""
    folder = tmp_path_factory.mktemp("rollout-plane")
    url = f"sqlite:///{folder / 'cachettl.sqlite3'}"
    store = create_store(url)
    plane = ControlPlane(store, min_samples=3)
    token = plane.create_tenant("acme")[1]
    (folder / "token").write_text(token)
    assert main(["rollout", "set", "--tenant", "acme", "--only", "pytest", "--db", url]) == 0
    options = ServerOptions(listen="127.0.0.1:0", watch_interval_s=0.1, tail_interval_s=0.1)
    server = ServerThread(plane, options)
    yield url, store, server.target
    server.stop()
    store.close()


@pytest.fixture(scope="module")
def driver(
    plane: tuple[str, Store, str], tiny_model: Path, inproc: None, tmp_path_factory: Any
) -> Iterator[Driver]:
    from transformers import AutoTokenizer

    url, _, target = plane
    folder = Path(url.removeprefix("sqlite:///")).parent
    hook = {
        **HOOK,
        "tenant": "acme",
        "control_plane": target,
        "token_file": str(folder / "token"),
        "spill_dir": str(tmp_path_factory.mktemp("spill")),
        "coherence": False,
    }
    llm = make_llm(tiny_model, hook)
    drv = Driver(llm, AutoTokenizer.from_pretrained(str(tiny_model)))
    yield drv
    shutdown(llm)


def _rollout(driver: Driver) -> Rollout | None:
    remote: Rollout | None = driver.scheduler.rollout.remote
    return remote


def _turn(driver: Driver, program: str, turn: int, tool: str | None) -> list[int]:
    """One turn of ``program`` (calling ``tool``; ``None``: its last turn); its prompt."""
    ids = driver.words(200)
    xargs = {"tool": tool} if tool else {"last_turn": 1}
    driver.run(f"{program}-{turn}", ids, 8, session=program, xargs=xargs)
    return ids


def test_a_tool_outside_the_rollout_is_not_pinned_until_rollout_set_adds_it(driver, plane):
    url, store, _ = plane
    scheduler = driver.scheduler
    assert _wait(lambda: _rollout(driver) == Rollout.of("only", ["pytest"]))
    _turn(driver, "A", 0, "bash")  # outside the rollout: decided, reported, not pinned
    assert scheduler.pins.get("A") is None
    assert scheduler.metrics.pins_taken == 0
    _turn(driver, "A", 1, None)

    assert main(["rollout", "set", "--tenant", "acme", "--only", "bash,pytest", "--db", url]) == 0
    assert _wait(lambda: _rollout(driver) == Rollout.of("only", ["bash", "pytest"]))
    _turn(driver, "B", 0, "bash")  # the same engine, no restart: now pinned
    pin = scheduler.pins.get("B")
    assert pin is not None
    assert pin.ttl_s == HOOK["policy_params"]["ttl_s"]
    _turn(driver, "B", 1, None)
    assert scheduler.metrics.pins_taken == 1

    assert scheduler.services.sink.flush(20.0)
    calls = {row.call.program_id: row.call for row in store.read_tool_calls(0, 100)}
    assert calls["A"].shadow
    assert calls["A"].chosen_ttl_s == HOOK["policy_params"]["ttl_s"]
    assert calls["A"].pin_outcome.label == "hit"  # it came back within the TTL it would pin
    assert not calls["B"].shadow
    assert calls["B"].pin_outcome.label == "hit"
    assert scheduler.metrics.snapshot()["shadow_pins"]["would_hit"] == 1
    text = scheduler.metrics.prometheus()
    assert 'cachettl_rollout{mode="only",tools="bash,pytest"} 1' in text
    assert "cachettl_shadow_mode 0" in text


def test_a_shadow_rollout_gives_the_waiting_queue_back_to_vllms_order(driver, plane):
    """``rollout set --shadow`` on a running engine: nothing is pinned and the waiting queue
    is vLLM's own (first come, first served), with the requests that were waiting; the
    hook's order returns when the rollout leaves shadow."""
    url, _, _ = plane
    scheduler = driver.scheduler
    ours = type(scheduler.waiting)
    assert ours.__module__.startswith("enginehook.")
    assert main(["rollout", "set", "--tenant", "acme", "--shadow", "--db", url]) == 0
    assert _wait(lambda: _rollout(driver) == Rollout.of("shadow"))
    _turn(driver, "C", 0, "pytest")  # in the rollout before: not pinned in shadow
    assert scheduler.pins.get("C") is None
    assert type(scheduler.waiting).__module__.startswith("vllm.")
    # an old program's returning turn queues behind a newer one's, as in stock vLLM
    driver.finished_order.clear()
    driver.add("D-0", driver.words(50), 2, session="D")
    driver.add("C-1", driver.words(50), 2, session="C", xargs={"last_turn": 1})
    assert [r.request_id.rsplit("-", 1)[0] for r in scheduler.waiting] == ["D-0", "C-1"]
    assert main(["rollout", "set", "--tenant", "acme", "--all", "--db", url]) == 0
    assert _wait(lambda: _rollout(driver) == Rollout.of("all"))
    driver.drain()
    assert type(scheduler.waiting) is ours
    assert sorted(driver.finished_order) == ["C-1", "D-0"]
    assert scheduler.metrics.snapshot()["shadow_pins"]["would_hit"] == 2
