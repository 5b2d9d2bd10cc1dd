"""`cachettl bench controlplane --decide-rate R` at a tiny size: two real `serve` processes,
a real ingest process; every arm's figures printed, in order, and sane."""

from __future__ import annotations

import re

import pytest

from controlplane.cli import main

ARM = re.compile(
    r"^  (none|same|other) +\(.*\): p50 ([\d.]+) ms  p99 ([\d.]+) ms  max ([\d.]+) ms  "
    r"n (\d+)  ingest ([\d,]+) events/s \(([\d, ]+)\)  load ([\d., ]+)$"
)
RATIO = re.compile(r"^  same / other: p50 ([\d.]+)  p99 ([\d.]+)  \(target")


def test_decide_bench_prints_every_arm_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "controlplane", "--decide-rate", "100", "--ingest-rate", "400"]
    argv += ["--ingest-to", "none,same,other", "--seconds", "1", "--rounds", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("DecideTtl at 100 req/s beside 400 events/s of ingest")
    arms = [ARM.match(line) for line in out[start + 1 : start + 4]]
    assert all(arms), out
    figures = {m[1]: m for m in arms if m}
    assert list(figures) == ["none", "same", "other"]
    for arm, m in figures.items():
        p50, p99, worst = float(m[2]), float(m[3]), float(m[4])
        assert 0.0 < p50 <= p99 <= worst < 1000.0
        assert int(m[5]) == 2 * 100  # two turns of one second at 100/s
        ingest = int(m[6].replace(",", ""))
        turns = [int(x) for x in m[7].split(", ")]
        assert len(turns) == 2
        if arm == "none":
            assert ingest == 0
            assert turns == [0, 0]
        else:  # every turn stores new events (one that repeated the last one's ids: 0)
            assert all(100 <= t <= 600 for t in turns), (arm, turns)
            assert abs(ingest - sum(turns) / 2) <= 1
        assert len(m[8].split(", ")) == 2  # each turn's load average
    ratio = RATIO.match(out[start + 4])
    assert ratio is not None, out
    same, other = figures["same"], figures["other"]
    assert float(ratio[2]) == pytest.approx(float(same[3]) / float(other[3]), abs=0.006)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ingest-to", "same,elsewhere"], "--ingest-to: name distinct arms"),
        (["--rounds", "0"], "--rounds must be in 1..100"),
        (["--ingest-rate", "5"], "--ingest-rate must be in 100..100000"),
    ],
)
def test_decide_bench_refuses_bad_flags(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "controlplane", "--decide-rate", "500", *flags]) == 2
    assert message in capsys.readouterr().err
