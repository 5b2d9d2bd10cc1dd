"""The router contract of the simulated cluster, and the registry every router is in.

A router sees each turn of a program as a :class:`TurnRequest` and the live engines as
:class:`EngineView` objects (their load, memory and pins: the signals the field's routers
read from engine metrics or KV events, and the routing stats a CacheTTL replica
publishes), and names the engine that serves it. It is told of
engines joining and leaving, of turns finishing and of pins ending, and may hold a request
back (return ``None``) and hand it over later through :meth:`ClusterHost.submit`.

Routers are chosen by ``name`` or ``name(key=value,...)`` from :data:`ROUTERS`; the error
lists the valid names.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from enginehook.core.pins import Pin

__all__ = [
    "ROUTERS",
    "ClusterHost",
    "EngineMetrics",
    "EngineView",
    "Params",
    "Router",
    "TurnRequest",
    "get_router",
    "register_router",
    "stable_hash",
]


def stable_hash(text: str) -> int:
    """A 64-bit hash that does not change between runs (Python's ``hash`` does).

    >>> stable_hash("engine-0") == stable_hash("engine-0")
    True
    """
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn of a program, as the router sees it."""

    program_id: str
    turn: int
    prompt_tokens: int
    #: Tokens of the earlier turns: a prefix of this prompt (0 on a first turn).
    context_tokens: int
    now: float


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What an engine's ``/metrics`` says at one moment: ``vllm:kv_cache_usage_perc`` (a
    share of the KV pool), ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
    A block held by a request counts as used, a cached block no request holds as free; a
    pinned block counts as used only where its controller's rule ``pins_in_kv_usage`` says
    so (:meth:`ClusterEngine.metrics`)."""

    kv_usage: float
    running: int
    waiting: int


class EngineView(Protocol):
    """What a router may read of one engine."""

    engine_id: int

    @property
    def name(self) -> str: ...
    def inflight(self) -> int: ...
    def waiting_count(self) -> int: ...
    def queued_tokens(self) -> int: ...
    def free_blocks(self) -> int: ...
    def active_blocks(self) -> int: ...
    def block_size(self) -> int: ...
    def kv_tokens(self) -> int: ...
    def pin_of(self, program_id: str) -> Pin[int] | None: ...
    def cached_tokens(self, program_id: str) -> int: ...
    @property
    def replica_id(self) -> str: ...
    def routing_stats(self, now: float) -> dict[str, Any]: ...
    def metrics(self) -> EngineMetrics: ...


class ClusterHost(Protocol):
    """What a router may ask of the cluster."""

    def submit(self, program_id: str, engine_id: int, now: float) -> None: ...
    def drop_pin(self, engine_id: int, program_id: str) -> None: ...
    def call_at(self, at: float, action: Callable[[float], None]) -> None: ...
    def engine(self, engine_id: int) -> EngineView | None: ...


#: ``{key: (type, default, help)}`` of a router's ``name(key=value)`` parameters.
Params = dict[str, tuple[type, Any, str]]


class Router:
    """Base class: ``route`` picks an engine; the hooks default to doing nothing."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    PARAMS: ClassVar[Params] = {}

    def __init__(self, seed: int = 0, **params: Any) -> None:
        for key in params:
            if key not in self.PARAMS:
                valid = ", ".join(sorted(self.PARAMS)) or "none"
                raise ValueError(f"router {self.name!r}: unknown parameter {key!r}; valid: {valid}")
        for key, (kind, default, _) in self.PARAMS.items():
            value = params.get(key, default)
            try:
                value = _convert(kind, value)
            except ValueError:
                raise ValueError(
                    f"router {self.name!r}: parameter {key!r} must be {kind.__name__}, "
                    f"got {value!r}"
                ) from None
            setattr(self, key, value)
        self.seed = seed
        self.label = self.name
        self.host: ClusterHost | None = None

    def attach(self, host: ClusterHost) -> None:
        self.host = host

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        raise NotImplementedError

    def joined(self, engine: EngineView, now: float) -> None:
        """An engine joined (it is in ``engines`` from the next route on)."""

    def left(self, engine: EngineView, now: float) -> None:
        """An engine left (drained: it takes nothing new)."""

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        """A turn of the program finished on ``engine`` (``context`` tokens so far)."""

    def pin_ended(self, engine: EngineView, program_id: str, now: float) -> None:
        """The program's pin on ``engine`` ended (hit, expiry, pressure, drop)."""

    def program_ended(self, program_id: str, now: float) -> None:
        """The program's last turn finished (routers the end never reaches ignore it)."""

    def binding(self, program_id: str, now: float) -> int | None:
        """The engine this router would send the program's next turn to if it is bound to
        one (affinity state, a hash), else ``None``: what a topology change can remap."""
        return None


def _convert(kind: type, value: Any) -> Any:
    if kind is bool and isinstance(value, str):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ValueError(value)
    return kind(value)


ROUTERS: dict[str, type[Router]] = {}


def register_router(cls: type[Router]) -> type[Router]:
    """Class decorator: make a router available by ``cls.name``."""
    if not cls.name or cls.name in ROUTERS:
        raise ValueError(f"a router named {cls.name!r} is already registered (or no name)")
    ROUTERS[cls.name] = cls
    return cls


_SPEC = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\((.*)\))?\s*$")


def get_router(spec: str, seed: int = 0) -> Router:
    """A fresh router from ``name`` or ``name(key=value,...)``; errors list valid names."""
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"cannot read router {spec!r}; expected NAME or NAME(key=value,...)")
    name, arguments = match.group(1), match.group(2)
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; valid: {', '.join(sorted(ROUTERS))}")
    given: dict[str, Any] = {}
    for item in (arguments or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"router {spec!r}: expected key=value, got {item.strip()!r}")
        given[key.strip()] = value.strip()
    router = ROUTERS[name](seed, **given)
    router.label = spec.strip() if arguments else name
    return router


def least(engines: Sequence[EngineView], key: Callable[[EngineView], Any]) -> EngineView:
    """The engine with the smallest ``key`` (ties: lowest engine id)."""
    return min(engines, key=lambda e: (key(e), e.engine_id))
