"""The demo's live control plane: served on 127.0.0.1 in a background thread
(:func:`running_control_plane`), a simulator policy whose TTLs and learning live in it
(:class:`RemotePolicy`), and what it learned, as the demo prints it (:func:`learned_lines`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from controlplane.wire import seconds
from enginehook.core.host import FinishedTurn
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.link.transport import to_program_end, to_tool_call
from estimator import Decision, RequestFacts
from simulator.policies import Cachettl

__all__ = ["RemotePolicy", "learned_lines", "running_control_plane"]


@contextlib.contextmanager
def running_control_plane(
    db_url: str, tenants: Sequence[str] = ("demo",)
) -> Iterator[tuple[str, dict[str, str]]]:
    """A control plane serving on 127.0.0.1 in a background thread, with ``tenants``;
    yields (target, token of each tenant)."""
    from controlplane.rpc.server import ControlPlaneServer, ServerOptions
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db_url)
    plane = ControlPlane(store, "cachettl", {}, min_samples=100)
    tokens = {name: plane.create_tenant(name)[1] for name in tenants}
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
        yield f"127.0.0.1:{server.port}", tokens
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

    def learn(self, event: ToolCallReport | ProgramEndReport) -> None:
        """Report the controller's event through the engine hook's own conversion."""
        self.calls += 1
        if isinstance(event, ToolCallReport):
            self.client.record_tool_calls([to_tool_call(event)])
            return
        end = to_program_end(event)
        self.client.record_program_end(end.program_id, end.total_turns, end.finished_at)


def learned_lines(client: Any, context_tokens: int) -> list[str]:
    """The control plane's η, T and per-tool distributions with the TTL each gets now."""
    lines = ["  What the control plane learned:"]
    stats = client.workload_stats()
    queue = seconds(stats.queue_delay)
    lines.append(
        f"    η = {stats.eta:.3f} over {stats.programs_in_window} programs; "
        f"T = {queue:.2f} s over {stats.queue_samples} delays; {stats.tool_calls} tool calls"
    )
    header = f"    {'tool / signature':28s} {'samples':>8s} {'p50 s':>7s} {'p90 s':>7s}"
    lines.append(header + f" {'TTL s':>7s} {'F(TTL)':>7s}  basis   (context {context_tokens})")
    for tool in client.list_tools().tools:
        keys = [(tool.tool_name, "")] + [(tool.tool_name, s) for s in tool.signatures]
        for name, signature in keys:
            dist = client.tool_distribution(name, signature.replace("+", " && "))
            q = {round(x.q, 2): seconds(x.value) for x in dist.quantiles}
            ttl = client.decide_ttl(name, signature.replace("+", " && "), context_tokens)
            label = name if not signature else f"  {signature}"
            lines.append(
                f"    {label[:28]:28s} {dist.sample_count:8d} {q.get(0.5, 0.0):7.2f} "
                f"{q.get(0.9, 0.0):7.2f} {ttl.ttl_s:7.2f} {ttl.return_probability:7.2f}  "
                f"{ttl.basis}"
            )
        if tool.pins.hits + tool.pins.expired + tool.pins.released_under_pressure:
            lines.append(
                f"    {'':28s} pins: {tool.pins.hits} hits, {tool.pins.expired} expired, "
                f"{tool.pins.released_under_pressure} released under pressure"
            )
    return lines
