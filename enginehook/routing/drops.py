"""Telling a pin's holder to drop the pin when the router sends its program elsewhere.

Rule 1 escapes a live pin when the wait saved elsewhere exceeds the recompute
(:attr:`~enginehook.routing.rule.Route.drop_from`); from then on the pin holds KV its
program is not coming back for. A replica that publishes where its pin commands go
(``replica_stats(..., pin_endpoint=URL)``, the engine hook's endpoint) is told: ``POST
{URL}/cachettl/pins/{session}:drop``, answered at once ``accepted`` (202), ``rejected``
(400), busy (429) or ``unsupported`` (501), and settled by the holder's scheduler
(:mod:`enginehook.vllm.pin_commands`). A replica that publishes none keeps the pin until it
expires, or until pin coherence through the control plane drops it.

A drop that finds its holder busy (429) or unreachable is forgotten once counted, so the
next escape of the same pin (the router's next decision on the holder's stale stats) tells
it again: retried as often as routing meets the pin, never in a loop of its own. Any other
answer is final for that pin.

Never on the routing decision's path: :meth:`PinDrops.escaped` only queues (a bounded
queue; when full the drop is counted and let go, never waited for) and one daemon thread
posts, each with a short timeout. Every outcome is counted (:data:`OUTCOMES`), each kind
other than ``sent`` and ``accepted`` is logged once, and nothing is raised into routing.
The router does not poll the settlement: a dropped pin leaves the holder's published stats,
and the router reads holders from there only.

The token (``Authorization: Bearer``) is the router's own setting, never read from the
replicas' stats: stats are broadcast to every router. It is the hooks' pin-command token
(their ``pin_command_token``, scoped to pin commands), never a control-plane token, and it
is not sent over plain HTTP to a host that is not on loopback (counted ``insecure``)
unless ``allow_plaintext`` is on; an ``https://`` endpoint is checked against ``ca_file``
when given (else the system's CAs).

>>> drops = PinDrops()
>>> drops.escaped("p", "replica-1", endpoint=None, expires_at=40.0)
'no_endpoint'
>>> drops.counts()
{'no_endpoint': 1}
"""

from __future__ import annotations

import http.client
import logging
import queue
import ssl
import threading
from collections import Counter, OrderedDict
from urllib.parse import quote, urlsplit

from enginehook.core.tokens import is_loopback_host

__all__ = [
    "DROP_TIMEOUT_S",
    "MAX_QUEUED",
    "OUTCOMES",
    "PINS_PATH",
    "PinDrops",
    "check_endpoint",
]

logger = logging.getLogger("enginehook.routing.drops")

#: The hook's pin-command path prefix (``enginehook.vllm.endpoint.PINS_PATH``; a test keeps
#: the two equal without importing the vLLM adapter here).
PINS_PATH = "/cachettl/pins/"
#: Seconds one drop may take to connect and be answered.
DROP_TIMEOUT_S = 2.0
#: Drops waiting for the worker at most (more are counted as ``overflow``).
MAX_QUEUED = 256
#: Pins already told, remembered so that stale stats do not tell the same pin twice.
MAX_TOLD = 4_096
#: Every outcome counted. On the routing path: ``no_endpoint`` (the holder publishes no
#: ``pin_endpoint``), ``repeated`` (this pin was already told), ``overflow`` (the queue was
#: full). Per post: ``sent``, then the answer: ``accepted`` (202), ``rejected`` (400),
#: ``busy`` (429), ``unsupported`` (501: the holder's hook is off or passing through),
#: ``forbidden`` (403: the token is missing or wrong, or the router is not on loopback to a
#: hook without one), ``failed`` (any other answer), ``unreachable`` (no connection or no
#: answer within the timeout), ``insecure`` (not sent: a token over plain HTTP to a host
#: that is not on loopback).
OUTCOMES = (
    "no_endpoint",
    "repeated",
    "overflow",
    "sent",
    "accepted",
    "rejected",
    "busy",
    "unsupported",
    "forbidden",
    "insecure",
    "failed",
    "unreachable",
)
_BY_STATUS = {202: "accepted", 400: "rejected", 429: "busy", 501: "unsupported", 403: "forbidden"}
#: Outcomes after which the pin is told again at its next escape.
_TRANSIENT = frozenset({"busy", "unreachable"})
#: A pin as the router saw it: (holder, program, expiry).
_Pin = tuple[str, str, float]
#: Bytes of an answer kept for the log.
_DETAIL_BYTES = 512


def check_endpoint(value: object, where: str) -> str:
    """``value`` as a pin endpoint (``http://host:port`` or ``https://``, optionally with a
    path prefix; the trailing ``/`` dropped), or a ``ValueError`` naming ``where``."""
    if not isinstance(value, str):
        raise ValueError(f"{where} must be an http(s) URL string, got {value!r}")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (a port that is not a number raises here)
    except ValueError as e:
        raise ValueError(f"{where} is not a URL: {value!r} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where} must be http://HOST:PORT or https://HOST:PORT, got {value!r}")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"{where} takes no user, query or fragment, got {value!r}")
    return value.rstrip("/")


class PinDrops:
    """Drops of escaped pins, queued on the routing path and posted by one worker thread.

    ``token``: the hooks' pin-command token (empty: none; a hook without one answers
    loopback only). ``ca_file``: the CA that signed the hooks' endpoint certificates
    (``https://`` endpoints). ``allow_plaintext``: send the token over plain HTTP to hosts
    not on loopback. :meth:`counts` reads the outcomes from any thread."""

    def __init__(
        self,
        token: str = "",
        timeout_s: float = DROP_TIMEOUT_S,
        max_queued: int = MAX_QUEUED,
        max_told: int = MAX_TOLD,
        *,
        ca_file: str = "",
        allow_plaintext: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if max_queued < 1 or max_told < 1:
            raise ValueError(f"max_queued and max_told must be >= 1, got {max_queued}, {max_told}")
        self.token = token
        self.allow_plaintext = allow_plaintext
        self._tls = ssl.create_default_context(cafile=ca_file or None)
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.max_told = max_told
        self._queue: queue.Queue[tuple[str, str, _Pin] | None] = queue.Queue(max_queued)
        self._told: OrderedDict[_Pin, None] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def escaped(self, program: str, holder: str, *, endpoint: str | None, expires_at: float) -> str:
        """Rule 1 sent ``program`` away from ``holder``, whose pin expires at
        ``expires_at`` and whose commands go to ``endpoint``: queue the drop. Returns the
        outcome on the routing path: ``queued``, or one of ``no_endpoint``, ``repeated``,
        ``overflow`` (counted). Never blocks, never raises for the endpoint's sake."""
        if endpoint is None:
            return self._count("no_endpoint")
        key = (holder, program, expires_at)
        with self._lock:
            if key in self._told:
                self._counts["repeated"] += 1
                return "repeated"
            self._told[key] = None
            while len(self._told) > self.max_told:
                self._told.popitem(last=False)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="cachettl-pin-drops", daemon=True
                )
                self._worker.start()
        try:
            self._queue.put_nowait((endpoint, program, key))
        except queue.Full:
            with self._lock:
                self._told.pop(key, None)  # a later escape of this pin may try again
            return self._count("overflow", f"{self.max_queued} drops already queued")
        return "queued"

    def counts(self) -> dict[str, int]:
        """The outcomes so far (kinds that never happened are absent)."""
        with self._lock:
            return dict(self._counts)

    def close(self, timeout_s: float = 5.0) -> None:
        """Post what is queued, then stop the worker (waiting at most ``timeout_s``)."""
        with self._lock:
            worker = self._worker
        if worker is None:
            return
        self._queue.put(None, timeout=timeout_s)
        worker.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            endpoint, program, key = item
            self._count("sent")
            try:
                outcome, detail = self._post(endpoint, program)
            except Exception as exc:  # the worker outlives any one holder's fault
                outcome, detail = "failed", f"{type(exc).__name__}: {exc}"
            if outcome in _TRANSIENT:
                with self._lock:
                    self._told.pop(key, None)  # the next escape of this pin tells it again
            self._count(outcome, f"{endpoint}, session {program!r}: {detail}")

    def _post(self, endpoint: str, program: str) -> tuple[str, str]:
        parts = urlsplit(endpoint)
        connection: http.client.HTTPConnection
        if parts.scheme == "https":
            connection = http.client.HTTPSConnection(
                parts.netloc, timeout=self.timeout_s, context=self._tls
            )
        else:
            if (
                self.token
                and not self.allow_plaintext
                and not is_loopback_host(parts.hostname or "")
            ):
                return "insecure", "a token over plain HTTP to a host not on loopback"
            connection = http.client.HTTPConnection(parts.netloc, timeout=self.timeout_s)
        path = f"{parts.path}{PINS_PATH}{quote(program, safe='')}:drop"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            connection.request("POST", path, headers=headers)
            response = connection.getresponse()
            body = response.read(_DETAIL_BYTES).decode(errors="replace")
        except OSError as exc:  # refused, reset, timed out
            return "unreachable", f"{type(exc).__name__}: {exc}"
        except http.client.HTTPException as exc:
            return "failed", f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()
        return _BY_STATUS.get(response.status, "failed"), f"HTTP {response.status} {body}"

    def _count(self, outcome: str, detail: str = "") -> str:
        with self._lock:
            self._counts[outcome] += 1
            first = outcome not in self._logged and outcome not in ("sent", "accepted")
            self._logged.add(outcome)
        if first:
            logger.warning(
                "CacheTTL pin drop %s (%s); further %s drops are counted only",
                outcome,
                detail or "see enginehook.routing.drops.OUTCOMES",
                outcome,
            )
        return outcome
