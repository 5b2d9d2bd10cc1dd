"""Smoke tests of the benchmark commands (the real sweeps are commands, not tests)."""

import json
from pathlib import Path

from controlplane.cli import main


def test_bench_policies_writes_report_and_curves(tmp_path: Path, capsys):
    argv = [
        "bench",
        "policies",
        "--programs",
        "8",
        "--seeds",
        "0",
        "--workloads",
        "bfcl",
        "--hardware",
        "llama3.1-8b-h100",
        "--policy",
        "vllm,cachettl",
        "--studies",
        "load",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = (tmp_path / "policies.md").read_text()
    assert "### bfcl on llama3.1-8b-h100" in report
    assert "| load | vllm | cachettl |" in report
    assert (tmp_path / "jct_bfcl_llama3.1-8b-h100.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "policies.json").read_text())
    assert summary["load"]["bfcl/llama3.1-8b-h100"]["doubling_rate"] > 0


def test_bench_simulator_prints_per_program_cost(capsys):
    assert main(["bench", "simulator", "--programs", "10,20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["programs"] for r in out["runs"]] == [10, 20]
    assert all(r["cpu_s"] > 0 for r in out["runs"])


def test_bench_rejects_bad_arguments(capsys):
    assert main(["bench", "policies", "--studies", "speed"]) == 2
    assert "unknown studies ['speed']" in capsys.readouterr().err
    assert main(["bench", "policies", "--seeds", "a"]) == 2
    assert main(["bench", "simulator", "--programs", "0"]) == 2


def test_rate_for_slowdown_brackets_the_target():
    import pytest

    from simulator.metrics import isolated_jct
    from simulator.studies.bench import _slowdown, rate_for_slowdown
    from simulator.workloads import generate

    hw = "llama3.1-8b-h100"
    programs = generate("bfcl", 20, seed=4)
    traces = [(programs, isolated_jct(programs, hw), 4)]
    rate = rate_for_slowdown(traces, hw, 1.5)
    assert _slowdown(traces, rate * 0.9, hw) < 1.5 + 0.5
    assert _slowdown(traces, rate * 1.05, hw) >= 1.5 - 0.5
    with pytest.raises(ValueError, match="target slowdown must be > 1"):
        rate_for_slowdown(traces, hw, 1.0)
