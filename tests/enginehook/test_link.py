"""The hook's JSON Lines event log: ``submit`` never waits for the disk.

A FIFO that nobody reads yet stalls the writer in ``open`` (as a stalled mount would);
the tests write less than a pipe holds (64 KiB), so a reader need not keep up.
``/dev/full`` fails every write with ``ENOSPC``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.records import PinOutcome
from enginehook.core.tracker import ProgramEndReport, ToolCallReport, event_record
from enginehook.link.sinks import JsonlSink
from enginehook.vllm.metrics import HookMetrics


def _call(i: int) -> ToolCallReport:
    return ToolCallReport(
        event_id=f"eng:p:{i}",
        program_id="p",
        tenant="default",
        tool="bash",
        tool_args="ls",
        duration_s=0.5,
        finished_at=1000.0 + i,
        turn_index=i,
        chosen_ttl_s=2.0,
        pin_outcome=PinOutcome.HIT,
        admission_delay_s=0.0,
    )


def _submit(sink: JsonlSink, turns: range) -> None:
    for i in turns:
        sink.submit(_call(i))


def _returns_within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result; fails (instead of hanging) if it takes longer than ``seconds``."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"blocked for more than {seconds}s"
    return result[0] if result else None


@contextlib.contextmanager
def _stalled(path: Path) -> Iterator[Callable[[], int]]:
    """A FIFO at ``path`` with no reader; yields ``attach()``, which opens the reading end
    (non-blocking) and returns its descriptor. Attached at exit in any case, so that a
    writer stalled in ``open`` is released."""
    os.mkfifo(path)
    fds: list[int] = []

    def attach() -> int:
        if not fds:
            fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        return fds[0]

    try:
        yield attach
    finally:
        attach()
        os.close(fds[0])


def _drain(fd: int) -> list[dict[str, Any]]:
    """The lines available on the non-blocking descriptor ``fd``."""
    data = b""
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


def test_submit_returns_at_once_while_the_writer_is_stalled(tmp_path: Path) -> None:
    with _stalled(tmp_path / "events.jsonl") as attach:
        sink = _returns_within(2.0, lambda: JsonlSink(tmp_path / "events.jsonl"))
        _returns_within(2.0, lambda: _submit(sink, range(50)))
        assert (sink.written, sink.queued, sink.dropped) == (0, 50, 0)
        fd = attach()
        assert sink.flush(10.0)  # lines arrive while the sink stays open
        assert [e["turn_index"] for e in _drain(fd)] == list(range(50))
        assert (sink.written, sink.queued) == (50, 0)
        sink.close()


def test_a_full_queue_drops_and_counts_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inner = JsonlSink(tmp_path / "inner.jsonl")
    with _stalled(tmp_path / "events.jsonl") as attach:
        sink = JsonlSink(tmp_path / "events.jsonl", inner=inner, max_queued=20)
        with caplog.at_level(logging.WARNING, logger="enginehook.link.sinks"):
            _returns_within(2.0, lambda: _submit(sink, range(100)))
        assert (sink.queued, sink.dropped) == (20, 80)
        assert len([r for r in caplog.records if "dropping events" in r.message]) == 1
        fd = attach()
        assert sink.flush(10.0)
        sink.submit(_call(100))  # room again
        sink.close()
        lines = _drain(fd)
    assert [e["turn_index"] for e in lines] == [*range(20), 100]
    assert (sink.written, sink.dropped) == (21, 80)
    metrics = HookMetrics()
    metrics.set_sink(sink.counters)
    text = metrics.prometheus()
    assert (
        "# TYPE cachettl_event_log_dropped_total counter\ncachettl_event_log_dropped_total 80"
        in text
    )
    assert "cachettl_event_log_written_total 21\n" in text
    assert "cachettl_event_log_queued 0\n" in text
    # the inner sink got every event, queued or dropped
    inner_lines = (tmp_path / "inner.jsonl").read_text().splitlines()
    assert [json.loads(line)["turn_index"] for line in inner_lines] == [*range(100), 100]


def test_the_bound_holds_memory(tmp_path: Path) -> None:
    import tracemalloc

    with _stalled(tmp_path / "events.jsonl") as attach:
        sink = JsonlSink(tmp_path / "events.jsonl", max_queued=50)
        events = [_call(i) for i in range(5000)]
        for event in events[:50]:
            sink.submit(event)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for event in events[50:]:
            sink.submit(event)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert (sink.queued, sink.dropped) == (50, 4950)
        assert grown < 10_000, grown  # 4,950 more events would hold several hundred kB
        attach()
        sink.close()
        assert (sink.written, sink.dropped) == (50, 4950)


def test_close_writes_everything_queued_in_order(tmp_path: Path) -> None:
    with _stalled(tmp_path / "events.jsonl") as attach:
        sink = JsonlSink(tmp_path / "events.jsonl")
        for i in range(40):
            sink.submit(_call(i))
        sink.submit(ProgramEndReport("eng:p:end", "p", "default", 41, 2000.0))
        assert sink.queued == 41
        fd = attach()
        sink.close()
        assert (sink.written, sink.queued, sink.dropped) == (41, 0, 0)
        lines = _drain(fd)
    assert [e.get("turn_index") for e in lines[:-1]] == list(range(40))
    assert lines[-1]["kind"] == "program_end"
    sink.submit(_call(99))  # after close: dropped and counted
    assert sink.dropped == 1
    sink.close()  # idempotent


def test_a_write_error_is_counted_and_later_events_are_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "events.jsonl"
    log.symlink_to("/dev/full")
    sink = JsonlSink(log)
    with caplog.at_level(logging.ERROR, logger="enginehook.link.sinks"):
        for i in range(3):
            sink.submit(_call(i))
            assert sink.flush(10.0)
    assert (sink.written, sink.dropped) == (0, 3)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "No space left on device" in errors[0].getMessage()
    log.unlink()  # the disk has room again: the writer reopens the path
    for i in range(3, 6):
        sink.submit(_call(i))
    sink.close()
    assert (sink.written, sink.dropped) == (3, 3)
    assert [json.loads(line)["turn_index"] for line in log.read_text().splitlines()] == [3, 4, 5]


def test_a_bad_bound_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_queued must be >= 1, got 0"):
        JsonlSink(tmp_path / "events.jsonl", max_queued=0)


def test_a_line_reaches_a_reader_promptly(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    sink = JsonlSink(log)
    sink.submit(_call(7))
    deadline = time.monotonic() + 10.0
    while not log.exists() or not log.read_text():
        assert time.monotonic() < deadline, "the line was not written"
        time.sleep(0.01)
    assert json.loads(log.read_text())["turn_index"] == 7
    sink.close()


_TORN = """
import json, resource, signal, sys
from enginehook.link.sinks import JsonlSink
from enginehook.core.tracker import event_record
from tests.enginehook.test_link import _call

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the size limit: EFBIG, not a signal
line = len(json.dumps(event_record(_call(0)))) + 1
resource.setrlimit(resource.RLIMIT_FSIZE, (line * 3 // 2, resource.RLIM_INFINITY))
sink = JsonlSink(sys.argv[1])
sink.submit(_call(0))
sink.submit(_call(1))
assert sink.flush(10.0)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
sink.submit(_call(2))
sink.close()
print(sink.written, sink.dropped)
"""


def test_a_line_torn_by_a_failed_write_does_not_spoil_the_next(tmp_path: Path) -> None:
    import subprocess
    import sys

    log = tmp_path / "events.jsonl"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _TORN, str(log)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "1"]  # written, dropped (the torn one)
    first, torn, last = log.read_text().splitlines()
    assert json.loads(first)["turn_index"] == 0
    assert torn
    assert json.dumps(event_record(_call(1))).startswith(torn)
    assert json.loads(last)["turn_index"] == 2
