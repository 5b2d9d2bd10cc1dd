"""`cachettl tools list|show`: what the models learned, as text, JSON or a CDF plot;
`tools show` also counts the tool's returning turns by miss reason."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from controlplane.cli.missview import print_miss_stats, stats_record
from controlplane.cli.terminal import printable, seconds, table
from controlplane.inspection import DistributionView, ToolView, cold_start, miss_stats
from controlplane.learning import NameLimits
from controlplane.records import Tenant
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from estimator import RequestFacts
from estimator.signatures import parse_rules

__all__ = ["TYPICAL_CONTEXTS", "run"]

#: Context sizes (tokens) for which `tools show` prints the policy's TTL.
TYPICAL_CONTEXTS = (2_000, 8_000, 32_000, 128_000)


def _tenant(plane: ControlPlane, name: str) -> Tenant:
    for tenant in plane.store.list_tenants():
        if tenant.name == name:
            return tenant
    return Tenant(0, name, False, 0.0)  # unknown: empty models, cold-start decisions


def run(action: str, args: argparse.Namespace, url: str) -> int:
    store = create_store(url)
    try:
        params: dict[str, float] = {}  # the policy's own defaults (cachettl: its TTL cap)
        limits = NameLimits(args.max_tools_per_tenant, args.max_signatures_per_tenant)
        rules = parse_rules(args.signature_rule)
        plane = ControlPlane(
            store, args.policy, params, args.min_samples, name_limits=limits, signature_rules=rules
        )
        tenant = _tenant(plane, args.tenant)
        if action == "list":
            return _list(plane.list_tools(tenant.name), args.json)
        return _show(plane, tenant, args)
    finally:
        store.close()


def _list(tools: list[ToolView], as_json: bool) -> int:
    if as_json:
        rows = []
        for t in tools:
            row = asdict(t)
            row["pins"]["hit_rate"] = t.pins.hit_rate
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'TOOL':<24} {'SAMPLES':>8} {'SEEN':>8} {'P50 s':>9} {'P90 s':>9} {'P99 s':>9}", end="")
    print(f" {'DRIFTS':>6} {'PINS':>6} {'HIT%':>6}")
    for t in tools:
        p50, p90, p99 = t.quantiles_s
        pins = t.pins.hits + t.pins.expired + t.pins.released_under_pressure
        print(
            f"{printable(t.tool):<24} {t.sample_count:>8} {t.seen_count:>8}"
            f" {p50:>9.3f} {p90:>9.3f} {p99:>9.3f} {t.drift_epoch:>6} {pins:>6}"
            f" {100 * t.pins.hit_rate:>6.1f}"
        )
    return 0


def _decisions(plane: ControlPlane, tenant: Tenant, tool: str, args: str) -> list[dict[str, Any]]:
    rows = []
    for tokens in TYPICAL_CONTEXTS:
        decision, _ = plane.decide(
            tenant, RequestFacts(tool=tool, tool_args=args or None, context_tokens=tokens)
        )
        rows.append(
            {
                "context_tokens": tokens,
                "ttl_s": decision.ttl_s,
                "return_probability": decision.return_probability,
                "benefit_s": decision.benefit_s,
                "basis": decision.basis,
            }
        )
    return rows


def _show(plane: ControlPlane, tenant: Tenant, args: argparse.Namespace) -> int:
    view = plane.tool_distribution(tenant.name, args.tool, args.args, points=200)
    if view is None:
        raise ValueError(f"TOOL: tenant {tenant.name!r} has no samples of tool {args.tool!r}")
    decisions = _decisions(plane, tenant, args.tool, args.args)
    misses = miss_stats(plane.store, tenant.name, args.tool)
    if args.png is not None:
        _plot(view, decisions, args.png)
    if args.json:
        out = asdict(view)
        out.pop("sorted_samples_s")
        out["pins"]["hit_rate"] = view.pins.hit_rate
        out["decisions"] = decisions
        out["misses"] = stats_record(misses)
        print(json.dumps(out, indent=2))
        return 0
    _print_show(plane, tenant, view, decisions)
    print("returning turns by miss reason (cachettl misses --tool lists them):")
    print_miss_stats(misses, indent="  ")
    return 0


def _print_show(
    plane: ControlPlane, tenant: Tenant, view: DistributionView, decisions: list[dict[str, Any]]
) -> None:
    """The text of ``tools show``: the model, its quantiles, the pins, the TTLs."""
    sig = f", signature {printable(view.signature)}" if view.signature else ""
    print(f"tool {printable(view.tool)}{sig} (tenant {printable(tenant.name)})")
    print(
        f"model: the {view.basis} level, {view.sample_count} samples in its window, "
        f"{view.seen_count} seen, {view.drift_epoch} change points"
    )
    print()
    print("durations:")
    names = [f"p{round(100 * q)}" for q, _ in view.quantiles]
    durations = [[seconds(s) for _, s in view.quantiles]]
    for line in table(names, durations, "  ", right=[True] * len(names)):
        print(line)
    print()
    pins = view.pins
    print("pins:")
    headers = ["HITS", "EXPIRED", "RELEASED", "MOVED", "NOT PINNED", "HIT RATE"]
    row = [pins.hits, pins.expired, pins.released_under_pressure, pins.moved, pins.not_pinned]
    for line in table(headers, [[*row, f"{100 * pins.hit_rate:.1f}%"]], "  ", [True] * 6):
        print(line)
    print()
    print(f"TTL the policy {plane.policy_name} chooses now:")
    rows = [
        [
            f"{d['context_tokens']:,}",
            seconds(d["ttl_s"]),
            f"{d['return_probability']:.2f}",
            seconds(d["benefit_s"]),
            d["basis"],
        ]
        for d in decisions
    ]
    headers = ["CONTEXT TOKENS", "TTL", "F(TTL)", "BENEFIT", "BASIS"]
    for line in table(headers, rows, "  ", [True, True, True, True, False]):
        print(line)
    for basis in sorted({d["basis"] for d in decisions}):
        cold = cold_start(view.basis, view.sample_count, plane.min_samples, basis)
        if cold is not None:
            print(f"  {cold.text}")
    print()


def _plot(view: DistributionView, decisions: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    samples = np.asarray(view.sorted_samples_s)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(samples, np.arange(1, samples.size + 1) / samples.size, where="post", label="F(t)")
    for i, d in enumerate(decisions):
        label = f"τ* = {d['ttl_s']:.3g} s @ {d['context_tokens']} tokens"
        ax.axvline(d["ttl_s"], color=f"C{i + 1}", linestyle="--", label=label)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=0.0)
    ax.set_xlabel("tool duration (s)")
    ax.set_ylabel("empirical CDF")
    ax.set_title(f"{view.tool} {view.signature}".strip())
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
