"""The end of a turn in vLLM: the hook's ``_free_blocks`` and ``_free_request``.

A finished turn of a program (stopped or length-capped) goes to the controller, which may
take its blocks for a pin (:func:`~enginehook.vllm.blocks.take_pinned_blocks`: the blocks the
next turn's prefix hit needs); blocks it does not take, and every other request's, are freed
by vLLM's own path. The pin decision then goes back in the turn's ``kv_transfer_params``
(:data:`~enginehook.hints.replies.REPLY_KEY`), which vLLM writes into the non-streaming
reply. :class:`FinishedTurnHooks` is a mixin of
:class:`~enginehook.vllm.scheduler.CacheTTLMixin` (before vLLM's ``Scheduler``); like the
rest of the hook it never raises into vLLM: a fault is counted and the turn is freed as
without the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request, RequestStatus

from enginehook.config import HookConfig
from enginehook.core.lifecycle import PinController
from enginehook.core.pins import Pin, PinTable
from enginehook.hints.replies import REPLY_KEY, pin_reply
from enginehook.vllm.blocks import take_pinned_blocks
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.requests import ToolCallText, finished_turn
from enginehook.vllm.services import HookServices

__all__ = ["FinishedTurnHooks"]

#: The finishes whose blocks may be pinned (an aborted or errored turn is freed).
_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class FinishedTurnHooks:
    """vLLM's ``_free_blocks`` / ``_free_request`` for the hook: pin a finished turn,
    report the decision in its reply."""

    # Set by CacheTTLMixin and vLLM's Scheduler (for the type checker).
    active: bool
    cachettl: HookConfig
    clock: Callable[[], float]
    controller: PinController[list[Any]]
    pins: PinTable[list[Any]]
    services: HookServices
    metrics: HookMetrics
    kv_cache_manager: Any
    block_size: int
    hash_block_size: int
    requests: dict[str, Request]
    _pool: Any
    _text: ToolCallText

    if TYPE_CHECKING:  # CacheTTLMixin's

        def _fault(self, hook: str, request_id: str | None, exc: Exception) -> None: ...

        def pinned_tokens(self, pin: Pin[list[Any]]) -> int: ...

    def _free_blocks(self, request: Request) -> None:
        if not (self.active and request.session_id and request.status in _PINNABLE):
            super()._free_blocks(request)  # type: ignore[misc]
            return
        taken: list[bool] = []
        try:
            finish = self._finished(request, taken)
        except Exception as exc:
            self._fault("free_blocks", request.request_id, exc)
            if not taken:  # vLLM frees the request's blocks as it would without the hook
                super()._free_blocks(request)  # type: ignore[misc]
            else:
                self.requests.pop(request.request_id, None)
            return
        if not finish.took:
            super()._free_blocks(request)  # type: ignore[misc]
            return
        if finish.pinned:
            self.metrics.pinned()
        elif finish.handle:  # the budget refused the pin
            self._pool.free_blocks(reversed(finish.handle))
        del self.requests[request.request_id]
        self.metrics.set_gauges(pins=len(self.pins), blocks=self.pins.pinned_blocks)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``_free_request``, whose ``kv_transfer_params`` (the connector's, if
        any) gain :data:`~enginehook.hints.replies.REPLY_KEY` when the hook decided this
        turn's pin in the ``_free_blocks`` it calls (after the connector's
        ``request_finished``); a turn whose blocks the connector keeps for now, or that the
        hook did not look at, gains nothing."""
        before = None
        try:
            before = self._pin_before(request)
        except Exception as exc:
            self._fault("free_request", request.request_id, exc)
        params, ec_params = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        if before is None:
            return params, ec_params
        try:
            decided = self._pin_decided(request, before)
        except Exception as exc:
            self._fault("free_request", request.request_id, exc)
            return params, ec_params
        if decided is None:
            return params, ec_params
        return {**(params or {}), REPLY_KEY: decided}, ec_params

    def _pin_before(self, request: Request) -> int | None:
        """The generation of the program's pin before the turn's blocks are freed (0: no
        pin), or ``None`` when the hook will not decide a pin for this turn."""
        if not (self.active and request.session_id and request.status in _PINNABLE):
            return None
        pin = self.pins.get(request.session_id)
        return pin.generation if pin is not None else 0

    def _pin_decided(self, request: Request, before: int) -> dict[str, Any] | None:
        """The decision for the reply: a pin taken since ``before`` (pin generations only
        grow), else not pinned; ``None`` while the request still holds its blocks."""
        if request.request_id in self.requests:
            return None  # a KV connector delays the free: the decision comes later
        assert request.session_id is not None
        engine = self.services.engine_id
        pin = self.pins.get(request.session_id)
        if pin is None or pin.generation == before:
            return pin_reply(engine)
        return pin_reply(engine, pin.ttl_s, pin.expires_at, self.pinned_tokens(pin))

    def _finished(self, request: Request, taken: list[bool]) -> Any:
        """The controller's part of a finished turn (``taken`` gets an entry once its
        blocks have been taken for a pin)."""
        assert request.session_id is not None
        now = self.clock()
        turn = finished_turn(
            request,
            self._text,
            tenant=self.cachettl.tenant,
            cpu_tier=self.services.cpu_tier,
            block_size=self.block_size,
            can_free=self._request_blocks_can_be_freed(request),  # type: ignore[attr-defined]
            now=now,
        )

        def take() -> tuple[int, list[Any]]:
            taken.append(True)
            return self._take_blocks(request)

        finish = self.controller.finished(turn, now, take)
        # The turn's cached prefix, for the divergence check of the program's next turn.
        cached = request.block_hashes[: request.num_computed_tokens // self.hash_block_size]
        self.controller.tracker(self.cachettl.tenant).keep_prefix(request.session_id, cached)
        return finish

    def _take_blocks(self, request: Request) -> tuple[int, list[Any]]:
        """The blocks the next turn's prefix hit needs, for a pin (the rest freed now)."""
        handle = take_pinned_blocks(self.kv_cache_manager, self._pool, request)
        return len(handle), handle
