"""TTL-aware routing inside Ray Serve: a local Ray cluster, a deployment whose replicas each
hold a real PinController (the object the engine hook and the simulator run) fed by the
requests they serve, publishing their pins through ``record_routing_stats``, and
``enginehook.routing.ray:TtlAwareRequestRouter`` choosing among them in the handle.

Asserted: a new program goes to the replica with the fewest programs bound to it (every
queue is idle, so waits tie), then the most KV neither used nor pinned; a returning
program's turns go to its pin's holder (even where another replica has more room); a replica
added later takes new programs and no program with a live pin; and once a holder publishes
prefill work that outweighs the recompute elsewhere, the program escapes it and the router
drops the pin through the endpoint the holder publishes in its stats (each replica serves a
real hook endpoint and applies the commands it takes as the hook's scheduler does)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")

from ray.serve.config import (  # type: ignore[import-not-found,unused-ignore]  # noqa: E402
    RequestRouterConfig,
)

from enginehook.core.host import FinishedTurn  # noqa: E402
from enginehook.core.lifecycle import PinController  # noqa: E402
from enginehook.core.pins import Pin, ReleaseReason  # noqa: E402
from enginehook.core.rules import SchedulingRules  # noqa: E402
from enginehook.link.decide import TtlDecider  # noqa: E402
from enginehook.routing import replica_stats  # noqa: E402
from enginehook.vllm.endpoint import serve_metrics  # noqa: E402
from enginehook.vllm.metrics import HookMetrics  # noqa: E402
from enginehook.vllm.pin_commands import PinCommands  # noqa: E402
from estimator import Decision, RequestFacts  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
POOL_BLOCKS = 512
STATS_PERIOD_S = 0.2
SETTLE_S = 2.0  # stats period + the controller's broadcast to the handle's router


class _Host:
    """The replica's KV pool: blocks pinned by the controller come out of the free pool."""

    def __init__(self) -> None:
        self.free_blocks = POOL_BLOCKS

    def free_tokens(self) -> int:
        return self.free_blocks * BLOCK

    def waiting_requests(self) -> list[tuple[str | None, int]]:
        return []

    def waiting_programs(self) -> set[str]:
        return set()

    def pinned_tokens(self, pin: Pin[int]) -> int:
        return pin.blocks * BLOCK

    def pin_released(self, pin: Pin[int], reason: ReleaseReason) -> None:
        self.free_blocks += pin.blocks

    def emit(self, event: object) -> None:
        pass


class _ClientTtl:
    """The hook's decide entry: the client's TTL when set, else the estimator policy."""

    def __init__(self) -> None:
        self.decider = TtlDecider("cachettl")

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return self.decider.decide_facts(facts, turn.pin_ttl_s)


class PinnedReplica:
    def __init__(self) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.host = _Host()
        self.controller: PinController[int] = PinController(
            SchedulingRules(),
            self.host,
            pool_blocks=POOL_BLOCKS,
            decider=_ClientTtl(),
            engine_id=self.replica_id,
        )
        # the hook's endpoint: a router's pin commands, applied before each turn and stats
        self.commands = PinCommands()
        _, port = serve_metrics(HookMetrics(), "127.0.0.1:0", self.commands)
        self.pin_endpoint = f"http://127.0.0.1:{port}"
        self.busy_tokens = 0  # prefill work published as running ahead of every turn

    def _step(self, now: float) -> None:
        self.commands.apply(self.controller, now)
        self.controller.expire(now)

    async def __call__(self, turn: dict[str, Any]) -> dict[str, Any]:
        program, now = str(turn["program"]), time.time()
        self._step(now)
        self.busy_tokens = int(turn.get("busy_tokens", self.busy_tokens))
        self.controller.arrived(program, now, now, prompt_tokens=int(turn["prompt_tokens"]))
        hit = self.controller.admitted(program, now).pin is not None
        blocks = int(turn["prompt_tokens"]) // BLOCK

        def take() -> tuple[int, int]:
            self.host.free_blocks -= blocks
            return blocks, blocks

        finished = FinishedTurn(
            program, "bash", "pytest", int(turn["prompt_tokens"]), pin_ttl_s=120.0
        )
        self.controller.finished(finished, time.time(), take)
        return {
            "replica": self.replica_id,
            "hit": hit,
            "pinned": self.controller.pinned(program),
            "pin_endpoint": self.pin_endpoint,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        now = time.time()
        self._step(now)
        # a call is served whole when it arrives: nothing waits between calls, and only
        # the published busy work runs
        return replica_stats(
            self.controller,
            free_tokens=self.host.free_tokens(),
            prefill_tokens_per_s=1_000.0,
            tokens_per_block=BLOCK,
            now=now,
            running=1 if self.busy_tokens else 0,
            prefilling_tokens=self.busy_tokens,
            waiting=[],
            pin_endpoint=self.pin_endpoint,
        )


def _app(replicas: int) -> Any:
    settings: dict[str, Any] = {
        "request_router_class": "enginehook.routing.ray:TtlAwareRequestRouter",
        "request_router_kwargs": {"credit_decay_s": 60.0, "prefill_tokens_per_s": 1_000.0},
        "request_routing_stats_period_s": STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 5.0,
    }
    config = RequestRouterConfig(**settings)  # its pydantic-v1 signature reads as dicts to mypy
    deployment = serve.deployment(
        PinnedReplica,
        name="pinned",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0},
        request_router_config=config,
    )
    # A fixed code version, so that a new replica count scales the deployment in place:
    # serve.run gives every run a random one otherwise and replaces every replica, pins and
    # all. ``version`` is private in ray 2.60 (``_internal``); `serve deploy` with a config
    # file hashes the config into the version and scales in place the same way.
    return deployment.options(version="1", _internal=True).bind()


@pytest.fixture(scope="module")
def cluster() -> Any:
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def _turn(handle: Any, program: str, tokens: int, **extra: int) -> dict[str, Any]:
    reply: dict[str, Any] = (
        handle.options(session_id=program)
        .remote({"program": program, "prompt_tokens": tokens, **extra})
        .result(timeout_s=60)
    )
    assert reply["pinned"], reply
    return reply


def test_turns_follow_their_pins_and_new_programs_the_fewest_bound(cluster: Any) -> None:
    handle = serve.run(_app(2), name="ttl", route_prefix=None)
    a = _turn(handle, "prog-a", 2_048)["replica"]  # both empty: either
    time.sleep(SETTLE_S)
    b = _turn(handle, "prog-b", 512)["replica"]  # the other one: no program bound to it
    assert b != a
    time.sleep(SETTLE_S)
    # prog-a's holder has less free KV than prog-b's, yet prog-a goes back to it, a hit
    for program, holder in (("prog-a", a), ("prog-b", b), ("prog-a", a)):
        reply = _turn(handle, program, 2_048 if program == "prog-a" else 512)
        assert (reply["replica"], reply["hit"]) == (holder, True), program
        time.sleep(SETTLE_S)
    c = _turn(handle, "prog-c", 256)["replica"]
    # one program bound to each: the tie goes to the most free unpinned KV, prog-b's replica
    # (it pins 512 tokens, prog-a's 2,048)
    assert c == b
    time.sleep(SETTLE_S)

    # a third replica joins: with no program bound (prog-a's holds one, prog-b's two) it
    # takes the next new program; no pinned one moves
    handle = serve.run(_app(3), name="ttl", route_prefix=None)
    time.sleep(SETTLE_S)
    for program, holder, tokens in (("prog-a", a, 2_048), ("prog-b", b, 512), ("prog-c", c, 256)):
        reply = _turn(handle, program, tokens)
        assert (reply["replica"], reply["hit"]) == (holder, True), program
    time.sleep(SETTLE_S)
    d = _turn(handle, "prog-d", 512)["replica"]
    assert d not in {a, b}

    # prog-a's holder takes on 100 s of prefill work: its next turn escapes (2,048 pinned
    # tokens recomputed on an idle replica: 2 s), and the router drops the pin it leaves
    held = _turn(handle, "prog-a", 2_048, busy_tokens=100_000)
    assert (held["replica"], held["hit"]) == (a, True)
    time.sleep(SETTLE_S)
    moved = _turn(handle, "prog-a", 2_048)
    assert moved["replica"] != a
    assert not moved["hit"]
    with urllib.request.urlopen(f"{held['pin_endpoint']}/cachettl/pins/commands") as reply:
        [first] = json.loads(reply.read())["commands"]
    command = _settled(held["pin_endpoint"], first)
    assert (command["action"], command["session"], command["state"]) == (
        "drop",
        "prog-a",
        "applied",
    )


def _settled(endpoint: str, command_id: str) -> dict[str, Any]:
    """The command once its replica settled it (it applies commands at each stats call)."""
    deadline = time.monotonic() + 10 * SETTLE_S
    while True:
        with urllib.request.urlopen(f"{endpoint}/cachettl/pins/commands/{command_id}") as reply:
            command: dict[str, Any] = json.loads(reply.read())
        if command["state"] != "accepted" or time.monotonic() > deadline:
            return command
        time.sleep(STATS_PERIOD_S)
