"""``cachettl demo`` against a real control plane (gRPC on port 0, SQLite in tmp_path): two
workloads side by side, what each tenant learned, and a verdict that ``cachettl bench seeds``
reproduces."""

import json
import re
import shlex
from pathlib import Path

from controlplane.cli import main


def _section(out: str, title: str) -> str:
    start = out.index(f"== {title}")
    end = out.find("\n== ", start + 1)
    return out[start:end]


def test_demo_replays_both_workloads_and_its_verdict_is_the_seed_benchs(tmp_path: Path, capsys):
    db = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    args = ["demo", "--programs", "12", "--long-programs", "6", "--seeds", "6", "--db", db]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "demo.sqlite3").exists()
    swe = _section(out, "SWE-shaped agents")
    long = _section(out, "TraceLab-shaped coding sessions")
    for section, programs in ((swe, 12), (long, 6)):
        assert "gRPC calls to the control plane" in section
        assert f"over {programs} programs" in section  # every program end reached its tenant
        for row in ("cachettl (live control plane)", "fixed 2 s pin (continuum-preview)"):
            assert row in section
        assert "stock vLLM (vllm)" in section
        assert "Verdict over seeds 0-5" in section
    assert "fixed 2 s pin is near the best here" in swe
    # Each tenant learned its own tools: the coding sessions' file tools stay out of SWE's.
    assert "read_file" in long
    assert "read_file" not in swe
    summary = out[out.index("== Where the learned TTL pays") :]
    assert "SWE-shaped agents: " in summary
    assert "TraceLab-shaped coding sessions: " in summary

    # The verdict's command, run as printed, gives the same per-seed means.
    command = re.search(r"(cachettl bench seeds --workload tracelab [^)\n]*)\)", long)
    assert command is not None
    means = re.search(r"mean JCT over the seeds: cachettl ([\d.]+) s; fixed 2 s pin ([\d.]+)", long)
    assert means is not None
    bench = [*shlex.split(command.group(1))[1:], "--out", str(tmp_path / "seeds")]
    assert main(bench) == 0
    runs = json.loads((tmp_path / "seeds.json").read_text())["runs"]
    for spec, shown in (("cachettl", means.group(1)), ("continuum-preview", means.group(2))):
        mean = sum(run[0] for run in runs[spec]) / len(runs[spec])
        assert f"{mean:.1f}" == shown


def test_too_few_seeds_give_no_verdict_but_the_command_for_one(capsys):
    assert main(["demo", "--programs", "3", "--long-programs", "2", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("Verdict: none from 2 seed(s)") == 2
    assert "cachettl bench seeds --workload swe --programs 3 --rate 0.068 --seeds 0-5" in out
    assert "TraceLab-shaped coding sessions: no verdict (too few seeds)" in out


def test_demo_rejects_bad_rates_and_counts(capsys):
    assert main(["demo", "--rate", "0"]) == 2
    assert "--rate must be a positive number" in capsys.readouterr().err
    assert main(["demo", "--long-rate", "-1"]) == 2
    assert "--long-rate must be a positive number" in capsys.readouterr().err
    assert main(["demo", "--long-programs", "0"]) == 2
    assert "--long-programs must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--baselines", "vllm,cachettl"]) == 2
    assert "--baselines names cachettl" in capsys.readouterr().err
