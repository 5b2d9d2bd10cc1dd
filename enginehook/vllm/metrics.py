"""The hook's counters: pins held, pinned blocks, hits on pinned prefixes, expiries,
pressure releases, decisions by basis, returning turns and their misses by reason (with
how long after its pin's expiry an expired turn came back), whether misses are priced
as CPU reloads, and what became of the events (the event log's and the control-plane
link's counters, read from the sink at each scrape). Rendered as Prometheus text by
:meth:`HookMetrics.prometheus` (served on the hook's own endpoint when configured).

>>> m = HookMetrics()
>>> from controlplane.records import MissReason
>>> m.decision("cold-start"); m.released("ttl"); m.set_gauges(pins=2, blocks=7)
>>> m.snapshot()["expiries"], m.snapshot()["pinned_blocks"]
(1, 7)
>>> print(m.prometheus().splitlines()[0])
# TYPE cachettl_pins_held gauge
>>> m.returned(TurnCache(MissReason.EXPIRED, expired_by_s=3.0))
>>> [l for l in m.prometheus().splitlines() if l.startswith("cachettl_turn_misses")]
['cachettl_turn_misses_total{reason="expired",cause=""} 1']
>>> m.set_cpu_tier(True, "OffloadingConnector")
>>> print(m.prometheus().splitlines()[-1])
cachettl_cpu_tier{connector="OffloadingConnector"} 1
"""

from __future__ import annotations

import bisect
import hmac
import ipaddress
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import unquote

from controlplane.kvhints import loads_bounded
from controlplane.records import NotPinnedCause, TurnCache
from enginehook.core.commands import BUSY, PinCommands

__all__ = [
    "EXPIRED_BY_BUCKETS_S",
    "METRICS_MAX_CONNECTIONS",
    "METRICS_THREADS",
    "PINS_PATH",
    "HookMetrics",
    "serve_metrics",
]

#: Upper bounds (seconds) of the expired-by histogram's buckets (then +Inf).
EXPIRED_BY_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class HookMetrics:
    """Thread-safe counters (written in ``schedule()``, read by an endpoint thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pins_held = 0
        self.pinned_blocks = 0
        self.pins_taken = 0
        self.pinned_prefix_hits = 0
        self.hit_tokens = 0
        self.releases: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.events_emitted = 0
        self.schedule_calls = 0
        self.hook_seconds = 0.0
        self.vllm_schedule_seconds = 0.0
        self.cpu_tier = False
        self.cpu_tier_connectors = ""
        self.passthrough = ""
        #: Returning turns by reason; misses by (reason, not-pinned cause or "").
        self.returning: Counter[str] = Counter()
        self.misses: Counter[tuple[str, str]] = Counter()
        self.expired_by_buckets = [0] * (len(EXPIRED_BY_BUCKETS_S) + 1)
        self.expired_by_sum = 0.0
        self._sink_counters: Callable[[], list[tuple[str, str, int]]] = list
        #: Exceptions of the hook's own code caught before vLLM, by hook.
        self.faults: Counter[str] = Counter()

    def set_cpu_tier(self, on: bool, connectors: str = "") -> None:
        """Whether TTL decisions price a miss as a reload from a CPU tier, and the KV
        connector(s) that keep it (comma-separated; empty when none was detected)."""
        with self._lock:
            self.cpu_tier, self.cpu_tier_connectors = on, connectors

    def set_sink(self, counters: Callable[[], list[tuple[str, str, int]]]) -> None:
        """Where the event sink's ``(name, type, value)`` counters are read at each scrape
        (:meth:`enginehook.link.sinks.EventSink.counters`)."""
        self._sink_counters = counters

    def set_passthrough(self, reason: str) -> None:
        """The hook passes through on this engine for ``reason`` (e.g. ``no_prefix_caching``)."""
        with self._lock:
            self.passthrough = reason

    def set_gauges(self, *, pins: int, blocks: int) -> None:
        """Current pins held and blocks they hold."""
        with self._lock:
            self.pins_held, self.pinned_blocks = pins, blocks

    def decision(self, basis: str) -> None:
        """A TTL decision was taken on ``basis``."""
        with self._lock:
            self.decisions[basis] += 1

    def pinned(self) -> None:
        """A pin was taken."""
        with self._lock:
            self.pins_taken += 1

    def hit(self, cached_tokens: int) -> None:
        """A returning request was admitted while its program's pin was live."""
        with self._lock:
            self.pinned_prefix_hits += 1
            self.hit_tokens += cached_tokens

    def returned(self, cache: TurnCache) -> None:
        """A returning turn was admitted; ``cache``: what it found of its previous turn's."""
        reason = cache.reason.label
        with self._lock:
            self.returning[reason] += 1
            if cache.reason.missed:
                cause = cache.not_pinned_cause
                label = cause.label if cause is not NotPinnedCause.UNSPECIFIED else ""
                self.misses[(reason, label)] += 1
            if cache.expired_by_s is not None:
                i = bisect.bisect_left(EXPIRED_BY_BUCKETS_S, cache.expired_by_s)
                self.expired_by_buckets[i] += 1
                self.expired_by_sum += cache.expired_by_s

    def released(self, reason: str) -> None:
        """A pin ended for ``reason`` (a :class:`~enginehook.core.pins.ReleaseReason` value)."""
        with self._lock:
            self.releases[reason] += 1

    def scheduled(self, hook_seconds: float, vllm_seconds: float = 0.0) -> None:
        """One ``schedule()`` call: ``hook_seconds`` of the hook's own work and
        ``vllm_seconds`` in vLLM's ``schedule()`` (queue sorting excluded)."""
        with self._lock:
            self.schedule_calls += 1
            self.hook_seconds += hook_seconds
            self.vllm_schedule_seconds += vllm_seconds

    def fault(self, hook: str) -> None:
        """The hook's own code raised in ``hook`` (caught: the engine went on)."""
        with self._lock:
            self.faults[hook] += 1

    def emitted(self) -> None:
        """An event left for the control plane's queue."""
        with self._lock:
            self.events_emitted += 1

    def snapshot(self) -> dict[str, Any]:
        """All counters as a plain dict."""
        with self._lock:
            return {
                "pins_held": self.pins_held,
                "pinned_blocks": self.pinned_blocks,
                "pins_taken": self.pins_taken,
                "pinned_prefix_hits": self.pinned_prefix_hits,
                "hit_tokens": self.hit_tokens,
                "expiries": self.releases["ttl"],
                "pressure_releases": self.releases["pressure"] + self.releases["budget"],
                "releases": dict(self.releases),
                "decisions": dict(self.decisions),
                "events_emitted": self.events_emitted,
                "schedule_calls": self.schedule_calls,
                "vllm_schedule_s": self.vllm_schedule_seconds,
                "cpu_tier": self.cpu_tier,
                "cpu_tier_connectors": self.cpu_tier_connectors,
                "passthrough": self.passthrough,
                "faults": dict(self.faults),
                "returning_turns": dict(self.returning),
                "turn_misses": {f"{r}/{c}" if c else r: n for (r, c), n in self.misses.items()},
                "expired_by_buckets": list(self.expired_by_buckets),
                "expired_by_sum_s": self.expired_by_sum,
                "hook_us_per_schedule": (
                    1e6 * self.hook_seconds / self.schedule_calls if self.schedule_calls else 0.0
                ),
            }

    def prometheus(self) -> str:
        """The counters in Prometheus text exposition format."""
        s = self.snapshot()
        lines = [
            "# TYPE cachettl_pins_held gauge",
            f"cachettl_pins_held {s['pins_held']}",
            "# TYPE cachettl_pinned_blocks gauge",
            f"cachettl_pinned_blocks {s['pinned_blocks']}",
            "# TYPE cachettl_pins_taken_total counter",
            f"cachettl_pins_taken_total {s['pins_taken']}",
            "# TYPE cachettl_pinned_prefix_hits_total counter",
            f"cachettl_pinned_prefix_hits_total {s['pinned_prefix_hits']}",
            "# TYPE cachettl_pin_releases_total counter",
        ]
        lines += [
            f'cachettl_pin_releases_total{{reason="{r}"}} {n}'
            for r, n in sorted(s["releases"].items())
        ]
        lines.append("# TYPE cachettl_ttl_decisions_total counter")
        lines += [
            f'cachettl_ttl_decisions_total{{basis="{b}"}} {n}'
            for b, n in sorted(s["decisions"].items())
        ]
        lines += self._turn_lines(s)
        lines.append("# TYPE cachettl_hook_faults_total counter")
        lines += [
            f'cachettl_hook_faults_total{{hook="{h}"}} {n}' for h, n in sorted(s["faults"].items())
        ]
        lines += [
            "# TYPE cachettl_cpu_tier gauge",
            f'cachettl_cpu_tier{{connector="{s["cpu_tier_connectors"]}"}} {int(s["cpu_tier"])}',
        ]
        if s["passthrough"]:
            lines += [
                "# TYPE cachettl_passthrough gauge",
                f'cachettl_passthrough{{reason="{s["passthrough"]}"}} 1',
            ]
        for name, kind, value in self._sink_counters():
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def _turn_lines(self, s: dict[str, Any]) -> list[str]:
        """Returning turns by reason, misses by reason and cause, and the expired-by
        histogram (cumulative buckets, Prometheus style)."""
        lines = ["# TYPE cachettl_returning_turns_total counter"]
        lines += [
            f'cachettl_returning_turns_total{{reason="{r}"}} {n}'
            for r, n in sorted(s["returning_turns"].items())
        ]
        lines.append("# TYPE cachettl_turn_misses_total counter")
        with self._lock:
            misses = sorted(self.misses.items())
        lines += [
            f'cachettl_turn_misses_total{{reason="{r}",cause="{c}"}} {n}' for (r, c), n in misses
        ]
        lines.append("# TYPE cachettl_pin_expired_by_seconds histogram")
        total = 0
        bounds = [*(f"{b:g}" for b in EXPIRED_BY_BUCKETS_S), "+Inf"]
        for bound, n in zip(bounds, s["expired_by_buckets"], strict=True):
            total += n
            lines.append(f'cachettl_pin_expired_by_seconds_bucket{{le="{bound}"}} {total}')
        lines.append(f"cachettl_pin_expired_by_seconds_sum {s['expired_by_sum_s']}")
        lines.append(f"cachettl_pin_expired_by_seconds_count {total}")
        return lines


#: Threads that answer the metrics endpoint, connections it holds at most (answered or
#: waiting for a thread; a connection past that is closed at once and counted), and how
#: long one connection may take to send its request.
METRICS_THREADS = 4
METRICS_MAX_CONNECTIONS = 64
METRICS_TIMEOUT_S = 5.0


#: The pin commands' path prefix: ``POST {PINS_PATH}{session}:drop`` or ``:extend``,
#: ``GET {PINS_PATH}commands/{id}``.
PINS_PATH = "/cachettl/pins/"
#: The largest command body read (``{"ttl_seconds": 30}``).
COMMAND_MAX_BYTES = 1024
#: HTTP status of each immediate answer.
_STATUS = {"accepted": 202, "rejected": 400, "unsupported": 501}


def serve_metrics(
    metrics: HookMetrics,
    listen: str,
    commands: PinCommands | None = None,
    token: str = "",
    clock: Callable[[], float] = time.time,
) -> tuple[Any, int]:
    """Serve ``GET /metrics`` (Prometheus text) on ``listen`` ("host:port", port 0: any)
    from a daemon thread; returns the server and its port. With ``commands``, a router's
    pin commands too (:mod:`enginehook.core.commands`): ``POST /cachettl/pins/{session}:drop``,
    ``POST /cachettl/pins/{session}:extend`` with ``{"ttl_seconds": N}``, answered with the
    command as JSON (202 ``accepted``, 400 or 429 ``rejected``, 501 ``unsupported``), and
    ``GET /cachettl/pins/commands/{id}`` for its outcome. A command needs
    ``Authorization: Bearer TOKEN`` when the hook has a token, and comes from a loopback
    address when it has none. Requests are answered by :data:`METRICS_THREADS` threads; at
    most :data:`METRICS_MAX_CONNECTIONS` connections are held (more are closed and counted
    in the server's ``refused``), each for at most :data:`METRICS_TIMEOUT_S` seconds of
    silence."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"additional_config.cachettl.metrics_listen must be HOST:PORT, got {listen!r}"
        )

    attributes = {"hook_metrics": metrics, "commands": commands, "token": token}
    handler = type("Handler", (_Endpoint,), {**attributes, "clock": staticmethod(clock)})
    try:
        server = _PooledHTTPServer((host or "127.0.0.1", int(port)), handler)
    except OSError as error:
        raise OSError(
            error.errno,
            f"additional_config.cachettl.metrics_listen: cannot listen on {listen!r}: "
            f"{error.strerror}",
        ) from None
    threading.Thread(target=server.serve_forever, name="cachettl-metrics", daemon=True).start()
    return server, int(server.server_address[1])


class _Endpoint(BaseHTTPRequestHandler):
    """The hook's endpoint (:func:`serve_metrics` gives each server its own subclass)."""

    timeout = METRICS_TIMEOUT_S
    hook_metrics: HookMetrics
    commands: PinCommands | None
    token: str
    clock: Callable[[], float]

    def do_GET(self) -> None:
        if self.commands is not None and self.path.startswith(PINS_PATH + "commands/"):
            answer = self.commands.get(unquote(self.path[len(PINS_PATH) + len("commands/") :]))
            if answer is None:
                self._json(404, {"error": "no such command (unknown or too old)"})
            else:
                self._json(200, answer)
            return
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = self.hook_metrics.prometheus().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.commands is None or not self.path.startswith(PINS_PATH):
            self.send_error(404)
            return
        if not self._authorized():
            self._json(403, {"error": "pin commands need the hook's bearer token"})
            return
        session, colon, action = unquote(self.path[len(PINS_PATH) :]).rpartition(":")
        if not colon:
            self._json(404, {"error": "expected /cachettl/pins/{session}:{drop|extend}"})
            return
        try:
            ttl = self._ttl()
        except ValueError as error:
            self._json(400, {"state": "rejected", "detail": str(error)})
            return
        answer = self.commands.submit(action, session, self.clock(), ttl)
        busy = answer.get("detail") == BUSY
        self._json(429 if busy else _STATUS[answer["state"]], answer)

    def _authorized(self) -> bool:
        if self.token:
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())
        return ipaddress.ip_address(self.client_address[0]).is_loopback

    def _ttl(self) -> float | None:
        declared = self.headers.get("Content-Length") or "0"
        if not declared.isdigit():
            raise ValueError(f"Content-Length must be a byte count, got {declared[:32]!r}")
        length = int(declared)
        if length > COMMAND_MAX_BYTES:
            raise ValueError(f"body over {COMMAND_MAX_BYTES} bytes")
        if length == 0:
            return None
        body = loads_bounded(self.rfile.read(length), "body", max_chars=COMMAND_MAX_BYTES)
        if not isinstance(body, dict) or set(body) - {"ttl_seconds"}:
            raise ValueError('body must be {"ttl_seconds": N} or empty')
        ttl = body.get("ttl_seconds")
        if ttl is None:
            return None
        if isinstance(ttl, bool) or not isinstance(ttl, int | float):
            raise ValueError(f"ttl_seconds must be a number, got {ttl!r}")
        return float(ttl)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


class _PooledHTTPServer(HTTPServer):
    """An HTTP server whose requests run on a fixed pool of threads, holding a bounded
    number of connections."""

    request_queue_size = 128  # accept promptly; the bound is kept after accepting

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before binding: a failed bind closes the server, which shuts the pool down.
        self._pool = ThreadPoolExecutor(METRICS_THREADS, thread_name_prefix="cachettl-metrics")
        self._slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)
        #: Connections closed unanswered because the bound was reached.
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._handle, request, client_address)

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)
