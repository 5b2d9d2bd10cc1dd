"""``cachettl demo``: a live control plane learns from a simulated SWE-agent workload.

1. Start the control plane (gRPC, port chosen by the OS) on an embedded SQLite database
   in a temporary directory (``--db`` keeps one), and create a tenant.
2. Replay a SWE-bench-shaped trace through the simulator. Its engine asks the live control
   plane for every TTL (``TtlService.DecideTtl``) and reports every finished tool call with
   the chosen TTL, the pin's outcome and the next turn's admission delay
   (``ToolEventService.RecordToolCalls``) and every program end (``RecordProgramEnd``).
3. Show what the control plane learned (``InspectService``: per-tool distributions, the
   TTL it now gives each, η, T) and the JCT table against the baselines (run in-process on
   the same trace).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controlplane.wire import seconds
from enginehook.core.lifecycle import FinishedTurn
from enginehook.core.tracker import ProgramEndEvent, ToolCallEvent
from enginehook.link.remote import to_program_end, to_tool_call
from estimator import DEFAULT_PROFILE, Decision, RequestFacts
from simulator.policies import Cachettl

__all__ = ["RemotePolicy", "register", "running_control_plane"]

BASELINES = "vllm,autellix,continuum-preview,continuum,thunderagent,llmd-fairness,sglang-session"


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl demo``."""
    parser = commands.add_parser(
        "demo", help="live control plane + simulated SWE agents: what it learns, JCT vs baselines"
    )
    parser.add_argument("--programs", type=int, default=150, help="programs to replay")
    parser.add_argument("--rate", type=float, default=0.068, help="program arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default=DEFAULT_PROFILE)
    parser.add_argument("--baselines", default=BASELINES, help="policies to compare against")
    parser.add_argument("--db", default=None, help="database URL (default: a temporary SQLite)")
    parser.set_defaults(handler=_run)


@contextlib.contextmanager
def running_control_plane(db_url: str) -> Iterator[tuple[str, str]]:
    """A control plane serving on 127.0.0.1 in a background thread; yields (target, token)."""
    from controlplane.rpc.server import ControlPlaneServer, ServerOptions
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db_url)
    plane = ControlPlane(store, "cachettl", {}, min_samples=100)
    _, token = plane.create_tenant("demo")
    loop = asyncio.new_event_loop()
    server = ControlPlaneServer(plane, ServerOptions(listen="127.0.0.1:0", tail_interval_s=0.2))
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="control-plane", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("the control plane did not start within 30 s")
    try:
        yield f"127.0.0.1:{server.port}", token
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        store.close()


class RemotePolicy(Cachettl):
    """``cachettl`` scheduling whose TTLs and learning live in a remote control plane."""

    name = "cachettl (control plane)"

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client
        self.calls = 0

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        self.calls += 1
        d = self.client.decide(facts)  # the engine's facts, load signals included
        return Decision(d.ttl_s, d.return_probability, d.expected_benefit_s, d.basis, d.benefit_s)

    def learn(self, event: ToolCallEvent | ProgramEndEvent) -> None:
        """Report the controller's event through the engine hook's own conversion."""
        self.calls += 1
        if isinstance(event, ToolCallEvent):
            self.client.record_tool_calls([to_tool_call(event)])
            return
        end = to_program_end(event)
        self.client.record_program_end(end.program_id, end.total_turns, end.finished_at)


def _learned(client: Any, context_tokens: int) -> list[str]:
    lines = ["What the control plane learned:", ""]
    stats = client.workload_stats()
    queue = seconds(stats.queue_delay)
    lines.append(
        f"  η = {stats.eta:.3f} over {stats.programs_in_window} programs; "
        f"T = {queue:.2f} s over {stats.queue_samples} delays; {stats.tool_calls} tool calls"
    )
    lines.append("")
    header = f"  {'tool / signature':28s} {'samples':>8s} {'p50 s':>7s} {'p90 s':>7s}"
    lines.append(header + f" {'TTL s':>7s} {'F(TTL)':>7s}  basis   (context {context_tokens})")
    for tool in client.list_tools().tools:
        keys = [(tool.tool_name, "")] + [(tool.tool_name, s) for s in tool.signatures]
        for name, signature in keys:
            dist = client.tool_distribution(name, signature.replace("+", " && "))
            q = {round(x.q, 2): seconds(x.value) for x in dist.quantiles}
            ttl = client.decide_ttl(name, signature.replace("+", " && "), context_tokens)
            label = name if not signature else f"  {signature}"
            lines.append(
                f"  {label:28s} {dist.sample_count:8d} {q.get(0.5, 0.0):7.2f} "
                f"{q.get(0.9, 0.0):7.2f} {ttl.ttl_s:7.2f} {ttl.return_probability:7.2f}  "
                f"{ttl.basis}"
            )
        if tool.pins.hits + tool.pins.expired + tool.pins.released_under_pressure:
            lines.append(
                f"  {'':28s} pins: {tool.pins.hits} hits, {tool.pins.expired} expired, "
                f"{tool.pins.released_under_pressure} released under pressure"
            )
    return lines


def _run(args: argparse.Namespace) -> int:
    from controlplane.rpc.client import ControlPlaneClient
    from simulator.engine import EngineConfig
    from simulator.metrics import isolated_jct, summarise
    from simulator.sim import Simulation
    from simulator.studies.report import format_table, parse_policies, run_policies
    from simulator.workloads import generate

    if args.programs < 1:
        raise ValueError(f"--programs must be >= 1, got {args.programs}")
    if not args.rate > 0:
        raise ValueError(
            f"--rate must be a positive number of programs per second, got {args.rate}"
        )
    baselines = parse_policies(args.baselines)
    programs = generate("swe", args.programs, rate=args.rate, seed=args.seed)
    config = EngineConfig()
    with contextlib.ExitStack() as stack:
        db = args.db
        if db is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cachettl-demo-"))
            db = f"sqlite:///{Path(folder) / 'cachettl.sqlite3'}"
        target, token = stack.enter_context(running_control_plane(db))
        print(f"control plane on {target} ({db})")
        client = stack.enter_context(ControlPlaneClient(target, token, timeout_s=30.0))
        policy = RemotePolicy(client)
        print(f"replaying {len(programs)} SWE-shaped programs at {args.rate}/s on {args.hardware}")
        sim = Simulation(programs, policy, args.hardware, config)
        remote = sim.run()
        print(f"  {policy.calls} gRPC calls to the control plane")
        print()
        print("\n".join(_learned(client, 30_000)))
    isolated = isolated_jct(programs, args.hardware, config)
    results = run_policies(
        programs, ["isolated", *baselines], args.hardware, config, None, isolated
    )
    results[policy.name] = summarise(remote, isolated)
    print()
    print(format_table(results))
    return 0
