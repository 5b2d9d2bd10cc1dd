"""mini-swe-agent on a real model, end to end: SmolLM2-135M-Instruct (from its PyPI wheel)
behind vLLM's OpenAI server with the hook, a control plane (``cachettl serve`` on SQLite),
and three real agent programs whose commands run in a git sandbox.

Checks what a user would: one program per agent run, tool calls detected from the model's
own output (the commands the agent ran), pins hit on the next turn, tool durations
measured by the engine and learned by the control plane, and ``cachettl tools list`` /
``tools show`` (the real CLI) naming the commands with TTLs that fit their durations.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from enginehook.tools.agentrun import (
    TASKS,
    AgentRun,
    load_agent_config,
    make_sandbox,
    run_agent,
)
from enginehook.tools.servers import (
    ControlPlaneProcess,
    free_port,
    start_vllm,
    stop_process,
    vllm_ready,
    wait_for,
)
from enginehook.vllm.detect import SUBMIT_MARKER
from tests.enginehook.processes import settled_events

pytestmark = pytest.mark.slow

AGENTS = 3
STEPS = 4
TTL_S = 30.0
TENANT = "agents"


@dataclass
class Finished:
    runs: list[AgentRun]
    events: list[dict[str, Any]]
    metrics: dict[str, str]
    plane: ControlPlaneProcess

    def calls(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "tool_call"]

    def cli(self, *args: str) -> Any:
        cmd = [self.plane.cli, "tools", *args, "--db", self.plane.db, "--tenant", TENANT]
        cmd += ["--policy", "continuum", "--min-samples", "3", "--json"]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(done.stdout)


def _events(path: Path) -> list[dict[str, Any]]:
    return settled_events(path)


def _metrics(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def _run_agents(base_url: str, work: Path) -> list[AgentRun]:
    config = load_agent_config()

    def one(i: int) -> AgentRun:
        sandbox = make_sandbox(work / f"repo-{i}")
        return run_agent(
            config,
            base_url=base_url,
            session_id=f"agent-{i}",
            workdir=sandbox,
            task=TASKS[i % len(TASKS)],
            step_limit=STEPS,
        )

    with ThreadPoolExecutor(AGENTS) as pool:
        return list(pool.map(one, range(AGENTS)))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Finished]:
    from controlplane.storage import create_store
    from enginehook.tools.realmodel import smollm2

    model = smollm2()
    work = tmp_path_factory.mktemp("agent")
    plane = ControlPlaneProcess(f"sqlite:///{work / 'cp.sqlite3'}", free_port(), work / "cp.log")
    plane.policy = "continuum"
    plane.start(TENANT)
    event_log, metrics_port, port = work / "events.jsonl", free_port(), free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": TTL_S, "skip_slow_tools": False},
        "control_plane": f"127.0.0.1:{plane.port}",
        "token": plane.token,
        "spill_dir": str(work / "spill"),
        "event_log": str(event_log),
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }
    server = start_vllm(model, port, work / "vllm.log", hook=hook)
    try:
        wait_for(lambda: vllm_ready(server, port, work / "vllm.log"), 600, "the vLLM server")
        runs = _run_agents(f"http://127.0.0.1:{port}/v1", work)
        calls = sum(e["kind"] == "tool_call" for e in _events(event_log))
        store = create_store(plane.db)
        try:
            wait_for(lambda: store.count_tool_calls() >= calls, 60, "the control plane's store")
        finally:
            store.close()
        yield Finished(runs, _events(event_log), _metrics(metrics_port), plane)
    finally:
        stop_process(server)
        plane.stop()


def test_one_program_per_agent_run(finished):
    sessions = {run.session_id for run in finished.runs}
    assert sessions == {f"agent-{i}" for i in range(AGENTS)}
    for run in finished.runs:
        assert 1 <= run.turns <= STEPS, (run.session_id, run.turns)
        assert run.exit_status in {"LimitsExceeded", "Submitted"}, run.exit_status
    assert {e["program_id"] for e in finished.calls()} <= sessions
    for run in finished.runs:
        mine = [e for e in finished.calls() if e["program_id"] == run.session_id]
        # A tool call is reported when the next turn arrives: one per turn that ran a
        # command (mini-swe-agent's submit command ends the program) and was not the last.
        expected = [
            k
            for k, command in enumerate(run.turn_commands[:-1])
            if command is not None and SUBMIT_MARKER not in command
        ]
        assert [e["turn_index"] for e in mine] == expected, (run.turn_commands, mine)


def test_tool_calls_detected_from_the_models_own_output(finished):
    calls = finished.calls()
    assert calls, [run.commands for run in finished.runs]
    ran = {run.session_id: run.commands for run in finished.runs}
    for event in calls:
        assert event["tool"] == "bash"
        assert event["tool_args"] in ran[event["program_id"]], event


def test_pinned_turn_hits_on_the_next_turn(finished):
    outcomes = [e["pin_outcome"] for e in finished.calls()]
    assert "hit" in outcomes, outcomes
    assert int(finished.metrics["cachettl_pinned_prefix_hits_total"]) == outcomes.count("hit")
    assert int(finished.metrics['cachettl_ttl_decisions_total{basis="fixed"}']) >= len(outcomes)
    # The server reports the pinned prefix as cached prompt tokens of the returning turns.
    assert sum(run.cached_tokens for run in finished.runs) > 0


def test_durations_measured_and_learned_by_the_control_plane(finished):
    from controlplane.storage import create_store

    calls = finished.calls()
    for event in calls:
        # Next arrival − finish: the command plus the agent's own work, well under the TTL.
        assert 0 < event["duration_s"] < TTL_S, event
    store = create_store(finished.plane.db)
    try:
        stored = {c.call.event_id: c.call for c in store.read_tool_calls(0, 1000, TENANT)}
    finally:
        store.close()
    assert set(stored) == {e["event_id"] for e in calls}
    for event in calls:
        assert stored[event["event_id"]].duration_s == pytest.approx(event["duration_s"])
        assert stored[event["event_id"]].tool_args == event["tool_args"]


def test_tools_cli_lists_the_real_commands_with_ttls_that_fit_them(finished):
    from estimator.signatures import SignatureRegistry

    calls = finished.calls()
    tools = {t["tool"]: t for t in finished.cli("list")}
    assert set(tools) == {"bash"}, tools
    assert tools["bash"]["sample_count"] == len(calls)
    assert tools["bash"]["pins"]["hits"] == sum(e["pin_outcome"] == "hit" for e in calls)
    # The commands, as the control plane keys them (the program a shell line runs).
    registry = SignatureRegistry()
    ran = {registry.signature("bash", e["tool_args"]) for e in calls}
    assert set(tools["bash"]["signatures"]) == ran, ran
    durations = sorted(e["duration_s"] for e in calls)
    command = max({e["tool_args"] for e in calls}, key=[e["tool_args"] for e in calls].count)
    shown = finished.cli("show", "bash", "--args", command)
    assert shown["sample_count"] >= 1
    for decision in shown["decisions"]:
        # The policy waits at most as long as the slowest return it saw, never past it.
        assert 0.0 <= decision["ttl_s"] <= durations[-1] + 1e-9, decision
    # For a long context a miss costs seconds of prefill: worth holding for the tool.
    assert len(calls) >= 3  # the cold-start threshold the CLI is asked about
    longest = shown["decisions"][-1]
    assert longest["basis"] != "cold-start", longest
    assert longest["ttl_s"] >= durations[0], (longest, durations)


def test_bench_arrivals_and_summary():
    import doctest

    import enginehook.tools.agentbench as bench

    result = doctest.testmod(bench, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1
    assert result.failed == 0
    runs = [AgentRun("a", turns=2, started_s=0.0, finished_s=4.0, latencies_s=[1.0, 0.5])]
    runs.append(AgentRun("b", turns=1, started_s=1.0, finished_s=3.0, latencies_s=[0.25]))
    runs[0].prompt_tokens, runs[0].cached_tokens = 300, 150
    summary = bench.summarize(runs)
    assert summary["mean_jct_s"] == 3.0
    assert summary["p90_jct_s"] == 4.0
    assert summary["first_turn_p90_s"] == 1.0
    assert summary["prefix_hit_share"] == 0.5
    assert summary["turns"] == 3.0
