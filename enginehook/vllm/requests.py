"""The vLLM request side of the hook: the waiting queue in the controller's order, and a
finished request as the controller's :class:`~enginehook.core.lifecycle.FinishedTurn` (client
hints and KV-hint envelopes, the tool call detected in its output). Imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from enginehook.config import CpuTierSetting
from enginehook.core.host import FinishedTurn
from enginehook.core.priority import SortedWaitQueue
from enginehook.hints.flat import Hints, request_hints
from enginehook.vllm.detect import detect_tool_call

__all__ = [
    "ADDED_ATTR",
    "ADMITTED_ATTR",
    "HINTS_ATTR",
    "PREEMPTIONS_ATTR",
    "ProgramRequestQueue",
    "ToolCallText",
    "finished_turn",
    "read_hints",
]

#: Where a request's :class:`Hints` are kept (set at ``add_request``).
HINTS_ATTR = "_cachettl_hints"
#: Where the time the hook first saw a request is kept (the scheduler's clock).
ADDED_ATTR = "_cachettl_added_at"
#: Where the time of a request's admission is kept.
ADMITTED_ATTR = "_cachettl_admitted_at"
#: Where a request's ``num_preemptions`` at its last admission is kept.
PREEMPTIONS_ATTR = "_cachettl_preemptions"

logger = logging.getLogger("enginehook")

#: Output tokens of a turn decoded for tool-call detection (its tail).
_MAX_DECODE_TOKENS = 2048


class ProgramRequestQueue(RequestQueue):
    """vLLM's ``RequestQueue`` over :class:`SortedWaitQueue` (the controller's order).

    It keeps the contract of vLLM's FCFS deque where vLLM or a plugin relies on it:
    ``prepend_requests`` puts the requests in front in reverse order (``extendleft``,
    vLLM collects skipped requests with ``appendleft`` for that), and ``queue[i]`` is the
    i-th request in queue order.
    """

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._queue: SortedWaitQueue[Request] = SortedWaitQueue(key)
        self._dirty = False
        #: Seconds spent sorting (part of the hook's own cost).
        self.sort_seconds = 0.0

    def mark_dirty(self) -> None:
        self._queue.mark_dirty()
        self._dirty = True

    def add_request(self, request: Request) -> None:
        self._queue.add(request)
        self._dirty = True

    def pop_request(self) -> Request:
        return self._queue.pop()

    def peek_request(self) -> Request:
        if not self._dirty:
            return self._queue.peek()
        started = time.perf_counter()
        try:
            return self._queue.peek()
        finally:
            self._dirty = False
            self.sort_seconds += time.perf_counter() - started

    def prepend_request(self, request: Request) -> None:
        self._queue.prepend(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._queue.extend_front(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self._queue.remove_many(requests)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        """The ``index``-th request in queue order (a sorted copy: O(n) per call)."""
        return list(self._queue)[index]


class ToolCallText:
    """The text of a finished request's output (its last tokens), or ``None`` without a
    tokenizer (client hints still work then)."""

    def __init__(self, model_config: Any) -> None:
        self._tokenizer: Any = None
        if model_config.skip_tokenizer_init:
            return
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
            )
        except Exception as exc:  # the hint still works without a tokenizer
            logger.warning("CacheTTL: no tokenizer for tool-call detection (%s)", exc)

    def __call__(self, request: Request) -> str | None:
        if self._tokenizer is None:
            return None
        tokens = list(request.output_token_ids)[-_MAX_DECODE_TOKENS:]
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))


def read_hints(request: Request) -> Hints:
    """The client's hints of ``request``: ``vllm_xargs`` and the retention action of its
    KV-hint envelope (``Request.kv_hints``, or the one an HTTP body carried in
    ``vllm_xargs``; :func:`enginehook.hints.flat.request_hints`). Bad hints are logged and
    ignored, never fatal to the request (the HTTP middleware refuses them with a 400
    before they get here)."""
    try:
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        return request_hints(extra, getattr(request, "kv_hints", None))
    except ValueError as exc:
        logger.warning("request %s: ignoring hints: %s", request.request_id, exc)
        return Hints()


def finished_turn(
    request: Request,
    text: ToolCallText,
    *,
    tenant: str,
    cpu_tier: CpuTierSetting,
    block_size: int,
    can_free: bool,
    now: float,
) -> FinishedTurn:
    """A finished request as the controller sees it (``can_free``: vLLM may free its
    blocks now, i.e. no KV connector still reads them)."""
    assert request.session_id is not None
    hints: Hints = getattr(request, HINTS_ATTR, None) or Hints()
    ends = hints.last_turn or hints.release  # a released session ends with this turn
    call = None if ends else detect_tool_call(text(request), hint=hints.tool)
    return FinishedTurn(
        request.session_id,
        call.name if call is not None else None,
        hints.tool_args or (call.arguments if call is not None else None),
        context_tokens=request.num_tokens,
        tenant=tenant,
        last_turn=ends,
        pin=hints.pin and can_free,
        offloaded_tokens=cpu_tier.offloaded_tokens(
            request.num_prompt_tokens, request.num_tokens, block_size
        ),
        service_s=now - getattr(request, ADMITTED_ATTR, now),
        output_tokens=request.num_output_tokens,
        pin_ttl_s=hints.pin_ttl_s,
        pin_ttl_max_s=hints.pin_ttl_max_s,
    )
