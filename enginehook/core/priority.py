"""What the waiting-queue orderings stand on (:data:`enginehook.core.registries.ORDERINGS`).

:class:`ProgramArrivals` remembers each program's first arrival (the paper's program-level
order serves programs by it, so a program keeps its place in line across turns);
:class:`SortedWaitQueue` is a lazily sorted list with a peek/pop contract that an engine
queue (vLLM's ``RequestQueue``) or a simulator can wrap.

>>> arrivals = ProgramArrivals()
>>> arrivals.observe("old", 100.0), arrivals.observe("old", 106.0), arrivals.first("x", 101.0)
(100.0, 100.0, 101.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["ProgramArrivals", "SortedWaitQueue"]

T = TypeVar("T")


class ProgramArrivals:
    """Each program's first arrival time, forgotten when the program ends."""

    def __init__(self) -> None:
        self._first: dict[str, float] = {}

    def observe(self, program_id: str | None, arrival: float) -> float:
        """Record an arrival; return the program's first arrival (``arrival`` if none)."""
        if program_id is None:
            return arrival
        first = self._first.get(program_id)
        if first is None or arrival < first:
            self._first[program_id] = first = arrival
        return first

    def first(self, program_id: str | None, default: float) -> float:
        """The program's first arrival, or ``default`` for unknown programs."""
        if program_id is None:
            return default
        return self._first.get(program_id, default)

    def forget(self, program_id: str) -> None:
        """The program ended."""
        self._first.pop(program_id, None)

    def __len__(self) -> int:
        return len(self._first)


class SortedWaitQueue(Generic[T]):
    """A waiting queue kept in ``key`` order, sorted lazily.

    ``key(item)`` may change over time (a pin appears or expires); call
    :meth:`mark_dirty` when it might have, and the next peek re-sorts. ``pop()`` returns
    the item the last ``peek()`` returned (if still queued), so a peek-then-pop pair never
    disagrees even if keys change in between. ``prepend`` adds an item that goes first
    until the next re-sort (vLLM re-queues skipped requests this way).

    >>> q = SortedWaitQueue(key=lambda x: x)
    >>> for x in [3, 1, 2]:
    ...     q.add(x)
    >>> q.peek(), q.pop(), list(q)
    (1, 1, [2, 3])
    """

    def __init__(self, key: Callable[[T], Any]) -> None:
        self._key = key
        self._items: list[T] = []
        self._dirty = False
        self._peeked: T | None = None

    def mark_dirty(self) -> None:
        """Keys may have changed: re-sort before the next peek."""
        self._dirty = True

    def add(self, item: T) -> None:
        """Queue ``item`` in key order."""
        self._items.append(item)
        self._dirty = True

    def prepend(self, item: T) -> None:
        """Put ``item`` at the front (until the next re-sort)."""
        self._sort_if_dirty()
        self._items.insert(0, item)

    def extend_front(self, items: Iterable[T]) -> None:
        """Put ``items`` at the front, in their order."""
        self._sort_if_dirty()
        self._items[:0] = list(items)

    def peek(self) -> T:
        """The first item (``IndexError`` when empty)."""
        self._sort_if_dirty()
        if not self._items:
            raise IndexError("peek from an empty queue")
        self._peeked = self._items[0]
        return self._peeked

    def pop(self) -> T:
        """Remove and return the last peeked item, or the first item."""
        peeked, self._peeked = self._peeked, None
        if peeked is not None:
            for i, item in enumerate(self._items):
                if item is peeked:
                    del self._items[i]
                    return item
        self._sort_if_dirty()
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(0)

    def remove(self, item: T) -> None:
        """Remove ``item`` (by identity); ``ValueError`` if absent."""
        for i, queued in enumerate(self._items):
            if queued is item:
                del self._items[i]
                if self._peeked is item:
                    self._peeked = None
                return
        raise ValueError("item not in queue")

    def remove_many(self, items: Iterable[T]) -> None:
        """Remove every item in ``items`` that is queued."""
        drop = {id(x) for x in items}
        self._items = [x for x in self._items if id(x) not in drop]
        if self._peeked is not None and id(self._peeked) in drop:
            self._peeked = None

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        self._sort_if_dirty()
        return iter(list(self._items))

    def __reversed__(self) -> Iterator[T]:
        self._sort_if_dirty()
        return iter(list(reversed(self._items)))

    def _sort_if_dirty(self) -> None:
        if self._dirty:
            self._items.sort(key=self._key)
            self._dirty = False
