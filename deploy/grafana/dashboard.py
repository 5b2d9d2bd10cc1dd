"""Build the CacheTTL Grafana dashboard, ``deploy/grafana/cachettl.json``.

    python deploy/grafana/dashboard.py            # write cachettl.json beside this file
    python deploy/grafana/dashboard.py --check    # exit 1 if cachettl.json is not current

The dashboard answers an operator's questions in rows: are pins hitting, what do they save,
how much KV they hold, are decisions fast, is the link from the engines to the control plane
healthy, how the control plane and the router are doing. It is templated by the Prometheus
data source, the tenant (a target label set on each engine's scrape target: the hook's
metrics carry none), the engine (the ``instance`` of the hook's ``/metrics``) and the
control-plane server (``instance`` of ``cachettl serve --metrics``). Every panel returns
data on a healthy cluster: a series that appears only under a fault is written
``... or vector(0)`` so the panel shows 0 rather than "No data"
(``tests/enginehook/test_cluster_real.py`` checks every query against a real scrape).

Plain dictionaries, no SDK: Grafana's dashboard JSON (schema 39) is the contract, and the
test ``tests/test_observability.py`` checks that the committed file is this script's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("cachettl.json")
DS = {"type": "prometheus", "uid": "${datasource}"}

#: Selectors of the template variables, for engine and control-plane metrics.
ENG = 'tenant=~"$tenant", instance=~"$engine"'
CP = 'instance=~"$control_plane"'
RI = "$__rate_interval"

Panel = dict[str, Any]


def target(expr: str, legend: str = "") -> dict[str, Any]:
    """One Prometheus query of a panel (``legend``: Grafana's legend format)."""
    return {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "range": True}


def series(title: str, desc: str, targets: list[dict[str, Any]], unit: str = "short") -> Panel:
    """A time-series panel."""
    return {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["last"]}},
    }


def stat(title: str, desc: str, expr: str, unit: str = "short") -> Panel:
    """A single-value panel of the latest value."""
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": DS,
        "targets": [{**target(expr), "instant": True, "range": False}],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
    }


def rate(metric: str, selector: str = ENG, by: str = "instance") -> str:
    """Per-second rate of a counter, summed ``by`` labels."""
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RI}]))"


def pins() -> list[Panel]:
    hits = "cachettl_pinned_prefix_hits_total"
    return [
        stat(
            "Pin hit ratio",
            "Returning turns that found their pin, per pin taken (selected engines).",
            f"sum(rate({hits}{{{ENG}}}[5m])) / sum(rate(cachettl_pins_taken_total{{{ENG}}}[5m]))",
            "percentunit",
        ),
        series(
            "Pin hit ratio by engine",
            "Hits per pin taken. Low: programs return late (`ttl` releases), elsewhere "
            "(`moved`), or pins are released for memory (see Releases by reason).",
            [target(f"{rate(hits)} / {rate('cachettl_pins_taken_total')}", "{{instance}}")],
            "percentunit",
        ),
        series(
            "Returning turns by reason",
            "Every returning turn by what it found of its previous turn's KV.",
            [target(rate("cachettl_returning_turns_total", by="reason"), "{{reason}}")],
            "reqps",
        ),
        series(
            "Misses by reason and cause",
            "Returning turns that re-prefilled. `diverged`: the client changed the prefix.",
            [
                target(
                    f"{rate('cachettl_turn_misses_total', by='reason, cause')} or vector(0)",
                    "{{reason}} {{cause}}",
                )
            ],
            "reqps",
        ),
    ]


def savings() -> list[Panel]:
    cached = f'cachettl_returning_turns_total{{{ENG}, reason=~"hit|prefix_cache"}}'
    return [
        series(
            "Re-prefills saved by pins",
            "Returning turns admitted onto their pinned prefix, per second: each one skipped "
            "the prefill of its whole context.",
            [target(rate("cachettl_pinned_prefix_hits_total"), "{{instance}}")],
            "reqps",
        ),
        series(
            "Returning turns that found their KV",
            "Share of returning turns served from a pin or vLLM's own prefix cache.",
            [
                target(
                    f"sum by (instance) (rate({cached}[{RI}])) / "
                    f"{rate('cachettl_returning_turns_total')}",
                    "{{instance}}",
                )
            ],
            "percentunit",
        ),
        series(
            "How late expired turns came back",
            "Median and 90th percentile of how long after its pin's expiry an expired turn "
            "returned: small values mean slightly longer TTLs would have hit.",
            [
                target(
                    f"histogram_quantile({q}, sum by (le) (rate("
                    f"cachettl_pin_expired_by_seconds_bucket{{{ENG}}}[{RI}])))",
                    f"p{int(q * 100)}",
                )
                for q in (0.5, 0.9)
            ],
            "s",
        ),
    ]


def memory() -> list[Panel]:
    return [
        series(
            "KV pool held only by pins",
            "vLLM's `kv_cache_usage_perc` counts these blocks as free.",
            [target(f"cachettl_kv_pinned_perc{{{ENG}}}", "{{instance}}")],
            "percentunit",
        ),
        series(
            "Pins held and their blocks",
            "Pins held now, and the KV blocks they hold.",
            [
                target(f"sum by (instance) (cachettl_pins_held{{{ENG}}})", "pins {{instance}}"),
                target(
                    f"sum by (instance) (cachettl_pinned_blocks{{{ENG}}})", "blocks {{instance}}"
                ),
            ],
        ),
        series(
            "Pins taken and released by reason",
            "`hit` and `program_end` should dominate; `ttl` above `hit` means TTLs too short; "
            "`pressure`/`budget`: memory binds.",
            [
                target(rate("cachettl_pins_taken_total", by="tenant"), "taken"),
                target(rate("cachettl_pin_releases_total", by="reason"), "{{reason}}"),
            ],
            "ops",
        ),
    ]


def decisions() -> list[Panel]:
    bucket = f'cachettl_rpc_latency_seconds_bucket{{{CP}, method="DecideTtl"}}'
    return [
        series(
            "DecideTtl latency",
            "The control plane's answer time to routers' and tools' decisions (healthy p99: "
            "1-2 ms). Engines decide locally from snapshots and do not call it.",
            [
                target(
                    f"histogram_quantile({q}, sum by (le) (rate({bucket}[{RI}]))) or vector(0)",
                    f"p{int(q * 100)}",
                )
                for q in (0.5, 0.99)
            ],
            "s",
        ),
        series(
            "RPC latency p99 by method",
            "All of the control plane's RPCs.",
            [
                target(
                    "histogram_quantile(0.99, sum by (method, le) (rate("
                    f"cachettl_rpc_latency_seconds_bucket{{{CP}}}[{RI}])))",
                    "{{method}}",
                )
            ],
            "s",
        ),
        series(
            "TTL decisions by basis (engines)",
            "Which model level decided: `cold-start` falling as samples arrive.",
            [target(rate("cachettl_ttl_decisions_total", by="basis"), "{{basis}}")],
            "ops",
        ),
    ]


def link() -> list[Panel]:
    failures = (
        "cachettl_control_plane_send_failures_total",
        "cachettl_control_plane_spill_dropped_total",
        "cachettl_control_plane_events_rejected_total",
        "cachettl_event_log_dropped_total",
        "cachettl_coherence_arrivals_dropped_total",
        "cachettl_control_plane_snapshot_failures_total",
        "cachettl_hook_faults_total",
    )
    return [
        series(
            "Events waiting on the engines",
            "In memory and spilled, not yet delivered: the ingest lag. Growing: the "
            "control plane is away.",
            [target(f"cachettl_control_plane_events_pending{{{ENG}}}", "{{instance}}")],
        ),
        series(
            "Events delivered and ingested",
            "Engines' deliveries against the control plane's stored events and repeats.",
            [
                target(rate("cachettl_control_plane_events_delivered_total", by="tenant"), "sent"),
                target(f"sum(rate(cachettl_events_ingested_total{{{CP}}}[{RI}]))", "stored"),
                target(f"sum(rate(cachettl_events_duplicate_total{{{CP}}}[{RI}]))", "repeats"),
            ],
            "ops",
        ),
        series(
            "Spill on disk",
            "Bytes of undelivered events spilled (bound: `spill_max_bytes`, 256 MiB).",
            [target(f"cachettl_control_plane_spill_bytes{{{ENG}}}", "{{instance}}")],
            "bytes",
        ),
        series(
            "Snapshot versions",
            "The snapshot each engine decides on, against the control plane's models.",
            [
                target(f"cachettl_control_plane_snapshot_version{{{ENG}}}", "{{instance}}"),
                target(f"cachettl_model_version{{{CP}}}", "models {{instance}}"),
            ],
        ),
        series(
            "Link failures and losses",
            "Sends retried, events lost or refused, arrivals dropped, snapshots not applied, "
            "hook faults: all 0 when healthy.",
            [
                target(
                    f"sum(increase({name}{{{ENG}}}[{RI}])) or vector(0)",
                    name.removeprefix("cachettl_").removesuffix("_total"),
                )
                for name in failures
            ],
        ),
        series(
            "Pin coherence",
            "Arrivals reported to the control plane, and moves heard (a program went to "
            "another engine: its pin is dropped here).",
            [
                target(rate("cachettl_coherence_arrivals_reported_total", by="tenant"), "arrivals"),
                target(rate("cachettl_coherence_moves_received_total", by="tenant"), "moves"),
            ],
            "ops",
        ),
    ]


def control_plane() -> list[Panel]:
    return [
        series(
            "RPCs by method and code",
            "`RESOURCE_EXHAUSTED`: a tenant at its caps; `UNAUTHENTICATED`: a bad token.",
            [target(rate("cachettl_rpc_total", CP, "method, code"), "{{method}} {{code}}")],
            "reqps",
        ),
        series(
            "Database and streams",
            "Database reachable (1), snapshot streams open, batches refused at a name bound.",
            [
                target(f"min(cachettl_database_reachable{{{CP}}})", "database reachable"),
                target(f"sum(cachettl_snapshot_streams{{{CP}}})", "snapshot streams"),
                target(
                    f"sum(increase(cachettl_batches_refused_total{{{CP}}}[{RI}])) or vector(0)",
                    "batches refused",
                ),
            ],
        ),
        series(
            "Resident memory",
            "Of each control-plane server.",
            [
                target(
                    f"process_resident_memory_bytes{{{CP}}} "
                    "and on (instance) cachettl_model_version",
                    "{{instance}}",
                )
            ],
            "bytes",
        ),
        series(
            "Requests routed per engine (vllm-router)",
            "vllm-router's count of requests sent to each worker.",
            [
                target(
                    f"sum by (worker) (rate(vllm_router_processed_requests_total[{RI}]))",
                    "{{worker}}",
                )
            ],
            "reqps",
        ),
    ]


ROWS = (
    ("Are pins hitting?", pins),
    ("What do they save?", savings),
    ("How much KV is pinned?", memory),
    ("Are decisions fast?", decisions),
    ("Is the link healthy?", link),
    ("Control plane and router", control_plane),
)


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A multi-value query variable with "All" meaning any value, the label absent too."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def templating() -> list[dict[str, Any]]:
    """The data source, tenant, engine and control-plane variables."""
    source = {"name": "datasource", "label": "Data source", "type": "datasource"}
    return [
        {**source, "query": "prometheus", "current": {}},
        variable("tenant", "Tenant", "label_values(cachettl_pins_held, tenant)"),
        variable(
            "engine", "Engine", 'label_values(cachettl_pins_held{tenant=~"$tenant"}, instance)'
        ),
        variable(
            "control_plane", "Control plane", "label_values(cachettl_model_version, instance)"
        ),
    ]


def dashboard() -> dict[str, Any]:
    """The whole dashboard, laid out two panels to a line under one row per question."""
    panels: list[Panel] = []
    y = 0
    for title, build in ROWS:
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": []})
        panels[-1]["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
        y += 1
        built = build()
        for i, panel in enumerate(built):
            panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            for ref, query in zip("ABCDEFGHIJ", panel["targets"], strict=False):
                query["refId"] = ref
            panels.append(panel)
        y += 8 * ((len(built) + 1) // 2)
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
    return {
        "uid": "cachettl",
        "title": "CacheTTL",
        "description": "Pins, what they save, pinned KV, decisions and the control plane.",
        "tags": ["cachettl", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": templating()},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The dashboard as the committed file holds it."""
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not current: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
