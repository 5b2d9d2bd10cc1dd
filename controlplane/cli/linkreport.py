"""The figures of `cachettl bench controlplane --links N` (:mod:`controlplane.cli.linkbench`):
convergence lag from the links' records, the per-setup summary, the table and the Markdown.

A link's record holds its acknowledgements ``(t, version, accepted, latency_s)`` and the
snapshots its stream received ``(t, version, bytes)``, in ``time.monotonic`` seconds (one
clock for every process of the machine). A tenant's model version counts its events
learned, on every replica, so a snapshot of version ≥ a batch's acknowledged version holds
that batch (the acknowledged version may already count later batches: the lag is then
over-, never under-stated).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["convergence", "details", "markdown", "ratios", "summarize", "table"]


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    p50, p99 = np.percentile(values, [50, 99])
    return {"n": len(values), "p50": float(p50), "p99": float(p99), "max": float(max(values))}


def convergence(records: list[dict[str, Any]]) -> tuple[dict[str, list[float]], int]:
    """Per (replica written → replica streaming): for every acknowledged batch, the lag
    to the last of that replica's links to stream a snapshot including it; and how many
    (batch, link) pairs never saw one."""
    streams = []
    for r in records:
        versions = [v for _, v, _ in r["snaps"]]
        streams.append((r["replica"], versions, [t for t, _, _ in r["snaps"]]))
    lags: dict[str, list[float]] = {}
    missing = 0
    for r in records:
        for acked, version, _, _ in r["acks"]:
            worst: dict[str, float] = {}
            for replica, versions, times in streams:
                k = bisect.bisect_left(versions, version)
                if k == len(versions):
                    missing += 1
                    continue
                worst[replica] = max(worst.get(replica, float("-inf")), times[k] - acked)
            for replica, lag in worst.items():
                lags.setdefault(f"{r['replica']}->{replica}", []).append(lag)
            if worst:
                lags.setdefault("all", []).append(max(worst.values()))
    return lags, missing


def summarize(
    setup: str, load: dict[str, Any], records: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """One setup's figures (the JSON's entry). ``load``: ``offered_per_s``, ``seconds``
    and ``seed_version`` (the tenant's version before the load)."""
    acks = [a for r in records for a in r["acks"]]
    accepted = sum(a[2] for a in acks)
    last = max((a[0] for a in acks), default=usage["start_at"])
    window = max(last - usage["start_at"], load["seconds"])
    lags, missing = convergence(records)
    cpu = sum(usage["cpu_s"].values())
    snaps = [s for r in records for s in r["snaps"]]
    errors: dict[str, int] = {}
    for r in records:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    return {
        "setup": setup,
        "servers": len(usage["cpu_s"]),
        "links": len(records),
        "events_offered_per_s": load["offered_per_s"],
        "events_accepted": accepted,
        "events_per_s": accepted / window,
        "batches": len(acks),
        "errors": errors,
        "ack_latency_ms": {
            k: v * 1e3 if k != "n" else v for k, v in _quantiles([a[3] for a in acks]).items()
        },
        "convergence_lag_s": {k: _quantiles(v) for k, v in sorted(lags.items())},
        "convergence_missing": missing,
        "links_converged": sum(
            1
            for r in records
            if r["snaps"] and r["snaps"][-1][1] >= load["seed_version"] + accepted
        ),
        "stream_errors": [r["stream_error"] for r in records if r["stream_error"]],
        "server_cpu_s": usage["cpu_s"],
        "server_cpu_s_per_1000_events": 1000 * cpu / max(accepted, 1),
        "client_cpu_s": usage["client_cpu_s"],
        "peak_rss_mib": usage["peak_rss_mib"],
        "rss_before_load_mib": usage["rss_before_load_mib"],
        "snapshots_streamed": len(snaps),
        "snapshot_bytes_streamed": sum(s[2] for s in snaps),
        "snapshot_bytes_mean": float(np.mean([s[2] for s in snaps])) if snaps else 0.0,
        "snapshot_bytes_per_link_per_s": sum(s[2] for s in snaps) / max(len(records), 1) / window,
        "full_snapshots": sum(r.get("full_snapshots", 0) for r in records),
        "missed_deltas": sum(r.get("missed_deltas", 0) for r in records),
        "arrivals_reported": sum(r["arrivals"] for r in records),
        "foreign_arrivals": sum(r["foreign"] for r in records),
        "moves": sum(r["moved"] for r in records),
    }


def _lag_text(lag: dict[str, float]) -> str:
    return f"{lag['p50']:.2f} / {lag['p99']:.2f} / {lag['max']:.2f}"


def table(report: dict[str, Any]) -> list[str]:
    """The report as Markdown table rows (printed and written)."""
    head = (
        "| setup | links | events/s accepted (offered) | ack p50 / p99 ms | lag to every "
        "link p50 / p99 / max s | lag by replica written → streaming, p99 s | server CPU s "
        "per 1,000 events | peak RSS MiB | snapshots streamed (MiB) | bytes per link per s |"
    )
    rows = [head, "|" + " --- |" * 10]
    for s in report["setups"]:
        lags = s["convergence_lag_s"]
        by_replica = ", ".join(f"{k} {v['p99']:.2f}" for k, v in lags.items() if k != "all")
        rss = " + ".join(f"{v:.0f}" for v in s["peak_rss_mib"].values())
        rows.append(
            f"| {s['setup']} | {s['links']} | {s['events_per_s']:,.0f} "
            f"({s['events_offered_per_s']:,.0f}) | {s['ack_latency_ms']['p50']:.1f} / "
            f"{s['ack_latency_ms']['p99']:.1f} | {_lag_text(lags['all'])} | {by_replica} | "
            f"{s['server_cpu_s_per_1000_events']:.2f} | {rss} | "
            f"{s['snapshots_streamed']:,} ({s['snapshot_bytes_streamed'] / 2**20:.1f}) | "
            f"{s['snapshot_bytes_per_link_per_s']:,.0f} |"
        )
    return rows


def details(report: dict[str, Any]) -> list[str]:
    """Per setup, what the table leaves out."""
    lines = []
    for s in report["setups"]:
        cpu = ", ".join(f"{k} {v:.1f} s" for k, v in s["server_cpu_s"].items())
        rss = ", ".join(f"{k} {v:.0f}" for k, v in s["rss_before_load_mib"].items())
        lines.append(
            f"- {s['setup']}: {s['events_accepted']:,} events in {s['batches']:,} batches, "
            f"errors {s['errors'] or 'none'}; server CPU {cpu}; RSS before the load "
            f"{rss} MiB (streams open); client processes "
            f"{s['client_cpu_s']:.1f} s; mean snapshot {s['snapshot_bytes_mean'] / 1024:.1f} "
            f"KiB; {s['links_converged']} of {s['links']} links converged "
            f"({s['convergence_missing']} batch-link pairs never seen); arrivals "
            f"{s['arrivals_reported']:,}, of which {s['foreign_arrivals']} on another "
            f"link's engine, moves told {s['moves']}; full snapshots {s['full_snapshots']}, "
            f"deltas on a base not held {s['missed_deltas']}."
        )
    return lines


def ratios(report: dict[str, Any]) -> list[str]:
    """Replicas against one server, when the report has both."""
    by = {s["setup"]: s for s in report["setups"]}
    one = by.get("postgres:1")
    lines = []
    for name, many in (("Two", by.get("postgres:2")), ("Four", by.get("postgres:4"))):
        if one is None or many is None:
            continue
        cpu = many["server_cpu_s_per_1000_events"] / one["server_cpu_s_per_1000_events"]
        lag = many["convergence_lag_s"]["all"]["p99"] / one["convergence_lag_s"]["all"]["p99"]
        lines.append(
            f"{name} replicas against one server (same run, same load): server CPU per event "
            f"×{cpu:.2f}, convergence lag p99 ×{lag:.2f}."
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """results/controlplane_links.md."""
    c = report["config"]
    lines = [
        "# The control plane under engine links",
        "",
        f"`{report['command']}` — {report['date']}, {report['cpus']} CPUs, load average "
        f"{report['load_before']:.1f} before, {report['load_after']:.1f} after.",
        "",
        f"{c['links']} links, each a gRPC channel: a batch of {c['batch']} tool calls every "
        f"{c['flush_s']} s ({c['link_rate']} events/s; what falls due while a batch waits for "
        "its acknowledgement goes in the next, larger batch), their turns' arrivals reported "
        f"every {c.get('arrivals_s', c['flush_s'])} s (ReportArrivals), and a WatchSnapshots "
        f"stream; {c['seconds']} s of load, run by "
        f"{c['client_procs']} client processes (threads inside).",
        "",
        *table(report),
        "",
        *ratios(report),
        "",
        *details(report),
        "",
        "Lag: from a batch's acknowledgement to the first snapshot containing it on the "
        "slowest link's stream (A->B: written through replica A, streamed by B). Server "
        "CPU: utime + stime of the `serve` processes over the load and the convergence "
        "after it, both replicas together (the database server's CPU is not counted).",
        "",
    ]
    return "\n".join(lines)
