"""The smallest engine around a :class:`~enginehook.core.lifecycle.PinController`, for the
controller's unit tests: free tokens, a waiting list, released pins and events recorded."""

from __future__ import annotations

from enginehook.core.pins import Pin, ReleaseReason

__all__ = ["MinimalHost"]


class MinimalHost:
    """An :class:`~enginehook.core.lifecycle.EngineHost` with ``free`` tokens, the waiting
    ``(program, tokens)`` list a test sets, and what the controller told it."""

    def __init__(self, free: int = 1_000, block_size: int = 16) -> None:
        self.free = free
        self.block_size = block_size
        self.waiting: list[tuple[str | None, int]] = []
        self.freed: list[tuple[str, str]] = []
        self.events: list[object] = []

    def free_tokens(self) -> int:
        return self.free

    def waiting_requests(self) -> list[tuple[str | None, int]]:
        return self.waiting

    def waiting_programs(self) -> set[str]:
        return {p for p, _ in self.waiting if p}

    def pinned_tokens(self, pin: Pin[str]) -> int:
        return pin.blocks * self.block_size

    def pin_released(self, pin: Pin[str], reason: ReleaseReason) -> None:
        self.freed.append((pin.program_id, reason.value))

    def emit(self, event: object) -> None:
        self.events.append(event)
