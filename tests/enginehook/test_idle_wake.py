"""The idle engine's wake-ups (enginehook.vllm.idle): none is lost to the engine thread."""

from __future__ import annotations

import queue
from typing import Any

from enginehook.vllm.idle import IdleExpiry


def _idle() -> tuple[IdleExpiry, queue.Queue[Any]]:
    inbox: queue.Queue[Any] = queue.Queue()
    return IdleExpiry(inbox, pins_held=lambda: 0, schedule_calls=lambda: 0, interval_s=60), inbox


def test_a_wake_is_taken_once_and_each_sends_the_engine_a_message() -> None:
    idle, inbox = _idle()
    try:
        assert not idle.take()
        idle.wake()
        idle.wake()
        assert inbox.qsize() == 2
        assert idle.take()
        assert not idle.take()  # both asked before the take: one expiry serves them
        idle.wake()
        assert idle.take()
    finally:
        idle.stop()


class _WakeDuringTake(IdleExpiry):
    """Another thread's wake-up lands right after ``take`` read the count: the
    interleaving that lost a wake-up when ``take`` tested a flag and then cleared it."""

    armed = False

    @property
    def _asked(self) -> int:
        value = int(self.__dict__.get("asked", 0))
        if self.armed:
            self.armed = False
            self.wake()  # reads the count again (disarmed) and raises it
        return value

    @_asked.setter
    def _asked(self, value: int) -> None:
        self.__dict__["asked"] = value


def test_a_wake_asked_while_the_engine_thread_takes_is_seen_at_its_next_take() -> None:
    inbox: queue.Queue[Any] = queue.Queue()
    idle = _WakeDuringTake(inbox, pins_held=lambda: 0, schedule_calls=lambda: 0, interval_s=60)
    try:
        idle.wake()
        idle.armed = True
        assert idle.take()  # the first wake-up; the second lands during this take
        assert inbox.qsize() == 2
        assert idle.take()  # the second one's message finds it still asked
        assert not idle.take()
    finally:
        idle.stop()
