"""The event loop: a heap of timed events, each handled once, returning follow-ups.

Same-time order (the rule is part of the contract and tested): events at equal times run
by ``rank`` — step ends (0) before request arrivals (1) before step starts (2) — then in
the order they were scheduled. So a step that ends at ``t`` frees or pins its memory
before anything arriving at ``t`` joins the queue, and the next step, which starts at
``t`` too, sees both.

>>> log = []
>>> class Note(Event):
...     def __init__(self, time, rank, text):
...         super().__init__(time, rank)
...         self.text = text
...     def handle(self, loop):
...         log.append(self.text)
...         return []
>>> loop = EventLoop()
>>> loop.schedule(Note(1.0, STEP_START, "start"))
>>> loop.schedule(Note(1.0, ARRIVAL, "arrival"))
>>> loop.schedule(Note(1.0, STEP_END, "end"))
>>> loop.run()
>>> log
['end', 'arrival', 'start']
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

__all__ = ["ARRIVAL", "STEP_END", "STEP_START", "Event", "EventLoop"]

STEP_END = 0
ARRIVAL = 1
STEP_START = 2


class Event:
    """Something that happens at ``time``; ``handle`` returns the events it causes."""

    __slots__ = ("rank", "time")

    def __init__(self, time: float, rank: int) -> None:
        self.time = time
        self.rank = rank

    def handle(self, loop: EventLoop) -> Iterable[Event]:
        raise NotImplementedError


class EventLoop:
    """Runs events in (time, rank, scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.handled = 0

    def schedule(self, event: Event) -> None:
        """Queue an event; it may not lie in the past."""
        if not math.isfinite(event.time) or event.time < self.now:
            raise ValueError(f"event time {event.time} is before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.rank, self._seq, event))

    def next_time(self) -> float:
        """Time of the next queued event (inf when none)."""
        return self._heap[0][0] if self._heap else math.inf

    def run(self, until: float = math.inf) -> None:
        """Handle events in order until none are left (or the next lies past ``until``)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, _, event = heapq.heappop(heap)
            self.now = time
            self.handled += 1
            for follow in event.handle(self):
                self.schedule(follow)
