"""Every tool-call event the tracker can make is one the control plane accepts: over every
pin story (pinned and handed over, expired, released under pressure, never pinned) and every
cache observation (full hit, partial hit, none, a prompt that diverged), the event passes the
server's own validation. A refused event is lost for good (the link drops what the server
calls malformed), so no combination may be refused."""

from __future__ import annotations

import itertools

import pytest

from controlplane._gen.cachettl.v1 import events_pb2
from controlplane.records import NotPinnedCause
from controlplane.rpc.client import to_event
from controlplane.validation import tool_calls
from enginehook.core.pins import ReleaseReason
from enginehook.core.tracker import CacheSeen, ToolCallTracker
from enginehook.link.transport import to_tool_call

BS = 16
PREVIOUS = [f"h{i}" for i in range(10)]
SEEN = {
    "full-hit": CacheSeen(160, 200, [*PREVIOUS, "n1", "n2"], BS),
    "partial": CacheSeen(64, 200, [*PREVIOUS, "n1", "n2"], BS),
    "none": CacheSeen(0, 200, [*PREVIOUS, "n1", "n2"], BS),
    "diverged-served": CacheSeen(96, 200, [*PREVIOUS[:6], "x", "y"], BS),
    "diverged-missed": CacheSeen(0, 200, [*PREVIOUS[:6], "x", "y"], BS),
    "unobserved": None,
}
STORIES = {
    "held": (True, None),
    "expired": (True, ReleaseReason.TTL),
    "pressure": (True, ReleaseReason.PRESSURE),
    "never": (False, None),
}


@pytest.mark.parametrize(("story", "seen"), list(itertools.product(STORIES, SEEN)))
def test_the_control_plane_accepts_the_event(story: str, seen: str) -> None:
    pinned, released = STORIES[story]
    tracker = ToolCallTracker("engine-a")
    tracker.turn_finished(
        "p",
        1.0,
        tool="bash",
        tool_args="ls",
        ttl_s=2.0 if pinned else 0.0,
        pinned=pinned,
        not_pinned=NotPinnedCause.TTL_ZERO,
    )
    tracker.keep_prefix("p", PREVIOUS)
    if released is not None:
        tracker.pin_released("p", released)
    tracker.arrived("p", 5.0)
    turn = tracker.returned("p", 5.5, pin_held=pinned and released is None, seen=SEEN[seen])
    assert turn is not None
    assert turn.event is not None
    request = events_pb2.RecordToolCallsRequest(events=[to_event(to_tool_call(turn.event))])
    [call] = tool_calls(request)  # raises InvalidInputError naming the field if refused
    assert call.cache.reason == turn.event.cache.reason
