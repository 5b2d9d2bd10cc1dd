"""How the engine's events reach the control plane: the :class:`Transport` contract
:class:`~enginehook.link.remote.ControlPlaneLink` delivers through, its gRPC implementation
(:class:`GrpcTransport`), the checked gRPC client (:func:`checked_client`: no token in clear
to another host, TLS files present) and :func:`to_tool_call` / :func:`to_program_end`, the one
conversion of the hook's events to the control plane's records (the simulator's demo
reports through them too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from controlplane.records import ProgramEnd, ToolCall
from enginehook.core.tokens import is_loopback_host
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.link.snapshot import SnapshotData, SnapshotFollower, follow

if TYPE_CHECKING:
    from controlplane.rpc.client import ClientTls, ControlPlaneClient
    from enginehook.config import HookConfig

__all__ = [
    "GrpcTransport",
    "PermanentError",
    "Transport",
    "checked_client",
    "client_from_config",
    "is_loopback",
    "tls_from_config",
    "to_program_end",
    "to_tool_call",
]


class PermanentError(Exception):
    """The control plane refused an event for good (bad input, or a limit it marks final,
    such as a tenant's bound on distinct tool names): retrying cannot help."""


class Transport(Protocol):
    """How batches reach the control plane; every call may raise on failure."""

    def send_tool_calls(self, events: Sequence[ToolCallReport]) -> None: ...

    def send_program_end(self, event: ProgramEndReport) -> None: ...

    def watch(self, after_version: int) -> Iterator[SnapshotData]: ...

    def close(self) -> None: ...


def to_tool_call(event: ToolCallReport) -> ToolCall:
    """The control plane's record of a hook's tool-call event (``RecordToolCalls``).

    Every field travels but ``tenant`` (the server takes it from the token) and ``basis``;
    the returning turn's cache report (miss reason and details) and the shadow flag too.
    The admission delay is sent whatever the outcome: the server, like the hook's own
    learner, counts it as a sample of T only when ``PinOutcome.feeds_queue_delay``.
    """
    return ToolCall(
        event_id=event.event_id,
        program_id=event.program_id,
        tool=event.tool,
        tool_args=event.tool_args or "",
        duration_s=event.duration_s,
        finished_at=event.finished_at,
        turn_index=event.turn_index,
        chosen_ttl_s=event.chosen_ttl_s,
        pin_outcome=event.pin_outcome,
        admission_delay_s=event.admission_delay_s,
        cache=event.cache,
        shadow=event.shadow,
    )


def to_program_end(event: ProgramEndReport) -> ProgramEnd:
    """The control plane's record of a hook's program end (``RecordProgramEnd``)."""
    return ProgramEnd(event.program_id, event.total_turns, event.finished_at)


def is_loopback(target: str) -> bool:
    """Whether gRPC ``target`` ("host:port", "[v6]:port", "unix:...") stays on this host."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rpartition(":")[0] if ":" in target else target
    return is_loopback_host(host.strip("[]"))


def tls_from_config(config: HookConfig) -> ClientTls | None:
    from controlplane.rpc.client import ClientTls

    if not config.tls_ca_file:
        return None
    cert = Path(config.tls_cert_file) if config.tls_cert_file else None
    key = Path(config.tls_key_file) if config.tls_key_file else None
    return ClientTls(Path(config.tls_ca_file), cert, key)


def checked_client(
    target: str,
    token: str,
    timeout_s: float = 5.0,
    tls: ClientTls | None = None,
    allow_plaintext_token: bool = False,
) -> ControlPlaneClient:
    """A client of the control plane at ``target``, refused (``ValueError`` naming the
    setting) when the token would travel in clear to another host or a TLS file is missing."""
    from controlplane.rpc.client import ControlPlaneClient

    if tls is None and token and not allow_plaintext_token and not is_loopback(target):
        raise ValueError(
            f"additional_config.cachettl.control_plane={target!r}: the token would travel "
            "in clear to another host; set tls_ca_file (TLS) or allow_plaintext_token"
        )
    if tls is not None:
        for name, path in (("tls_ca_file", tls.ca), ("tls_cert_file", tls.cert)):
            if path is not None and not path.is_file():
                raise ValueError(f"additional_config.cachettl.{name}: no file {str(path)!r}")
        if tls.key is not None and not tls.key.is_file():
            raise ValueError(f"additional_config.cachettl.tls_key_file: no file {tls.key}")
    return ControlPlaneClient(target, token, timeout_s=timeout_s, tls=tls)


def client_from_config(config: HookConfig, timeout_s: float = 5.0) -> ControlPlaneClient:
    """:func:`checked_client` for the hook's ``control_plane``, token and TLS settings."""
    return checked_client(
        config.control_plane,
        config.token,
        timeout_s,
        tls_from_config(config),
        config.allow_plaintext_token,
    )


class GrpcTransport:
    """:class:`Transport` over ``controlplane.rpc.client.ControlPlaneClient``."""

    def __init__(
        self,
        target: str,
        token: str,
        timeout_s: float = 5.0,
        *,
        tls: ClientTls | None = None,
        allow_plaintext_token: bool = False,
    ) -> None:
        self._client = checked_client(target, token, timeout_s, tls, allow_plaintext_token)
        self._follower = SnapshotFollower()  # compact snapshots: deltas merged here

    @staticmethod
    def _check(exc: Exception) -> None:
        """Raise :class:`PermanentError` for an answer that retrying cannot cure: bad input,
        or a limit the server marks final (a tenant's name bound)."""
        import grpc

        from controlplane.errors import RETRYABLE_KEY

        if not isinstance(exc, grpc.RpcError):
            return
        trailer = dict(exc.trailing_metadata() or ())
        final = trailer.get(RETRYABLE_KEY) == "false"
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or final:
            raise PermanentError(str(exc.details())) from exc

    def send_tool_calls(self, events: Sequence[ToolCallReport]) -> None:
        try:
            self._client.record_tool_calls([to_tool_call(e) for e in events])
        except Exception as exc:
            self._check(exc)
            raise

    def send_program_end(self, event: ProgramEndReport) -> None:
        end = to_program_end(event)
        try:
            self._client.record_program_end(end.program_id, end.total_turns, end.finished_at)
        except Exception as exc:
            self._check(exc)
            raise

    def watch(self, after_version: int) -> Iterator[SnapshotData]:
        """Whole snapshots: compact ones with their deltas merged
        (:func:`enginehook.link.snapshot.follow`)."""
        yield from follow(self._client, after_version, self._follower)

    def close(self) -> None:
        self._client.close()
