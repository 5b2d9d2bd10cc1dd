"""``cachettl bench doors`` end to end at a small scale: two real servers, a real flood in
processes of its own, the timed tenant's decisions and viewer measured in every phase."""

from __future__ import annotations

import re

import pytest

from controlplane.cli import main


@pytest.mark.parametrize("attack", ["idle"])
def test_bench_doors_times_three_phases_and_the_viewer_is_served(
    attack: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "doors", "--attack", attack, "--seconds", "1", "--rate", "50"]
    assert main([*args, "--connections", "300", "--attackers", "1"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in re.finditer(r"^(quiet|control|attack) .*$", out, re.M)}
    assert set(rows) == {"quiet", "control", "attack"}
    for row in rows.values():
        kept = re.search(r"(\d+)/(\d+)\s+\d+/\d+", row.group(0))
        assert kept is not None
        assert kept.group(1) == kept.group(2) != "0"
    flood = re.search(r"(\d+)\+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+(\d+)$", rows["attack"].group(0))
    assert flood is not None
    assert int(flood.group(1)) + int(flood.group(2)) > 0
    assert float(flood.group(3)) > 0  # the timed tenant's own ingest was answered
    assert "Traceback" not in out


def test_bench_doors_refuses_bad_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "doors", "--seconds", "0"]) == 2
    assert "--seconds" in capsys.readouterr().err
    assert main(["bench", "doors", "--attackers", "0"]) == 2
    assert "--attackers must be >= 1" in capsys.readouterr().err
