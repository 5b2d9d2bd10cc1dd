"""The spill on a disk that refuses writes (the kernel's file-size limit, EFBIG, stands for
a full disk): the link's buffer never raises, keeps what reached the disk, counts what did
not, and takes events again once the disk does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys, time
    from enginehook.core.tracker import PinOutcome, ToolCallReport
    from enginehook.link.spill import EventBuffer, REFUSED_RETRY_S

    def _call(i):
        return ToolCallReport(f"eng:p:{i}", "p", "default", "bash", "ls -la", 0.1, 1000.0 + i,
                              i, 2.0, PinOutcome.HIT, 0.01)

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write is an error, not a kill
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))
    buffer = EventBuffer(sys.argv[1], memory_events=1, segment_events=1000)
    for i in range(100):
        buffer.put(_call(i))
    buffer.spill_all()
    buffer.sync()
    refused = {"pending": len(buffer), "dropped": buffer.dropped}
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the disk has room again
    time.sleep(REFUSED_RETRY_S + 0.1)
    for i in range(100, 110):
        buffer.put(_call(i))
    buffer.sync()
    seen = []
    while batch := buffer.peek(50):
        seen += [e.event_id for e in batch]
        buffer.drop(len(batch))
    buffer.close()
    print(json.dumps({"refused": refused, "seen": seen, "dropped": buffer.dropped,
                      "corrupt": buffer.corrupt, "pending": len(buffer)}))
    """
)


def test_a_refusing_disk_drops_and_counts_and_the_spill_goes_on(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "spill")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "Traceback" not in done.stderr
    assert "the disk refused a write (File too large)" in done.stderr
    assert out["refused"]["dropped"] > 0  # the disk refused some
    assert out["refused"]["pending"] > 1  # and kept what reached it
    seen = out["seen"]
    # every event is delivered, dropped and counted, or a torn line counted as corrupt
    assert len(seen) + out["dropped"] + out["corrupt"] == 110
    assert out["pending"] == 0
    assert seen == sorted(seen, key=lambda e: int(e.rsplit(":", 1)[1]))  # oldest first
    assert seen[-10:] == [f"eng:p:{i}" for i in range(100, 110)]  # taken again
