"""Every file in results/ names the command that made it, ``scripts/results`` makes (or keeps,
for run logs) every one of them, and what it writes opens with its provenance."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

from simulator.studies import provenance

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results"


def _script() -> ModuleType:
    loader = SourceFileLoader("results_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("results_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    loader.exec_module(module)
    return module


def test_every_results_page_names_its_command() -> None:
    """Every page names the command that makes it; a page that opens with a provenance
    record names the command scripts/results reruns, with its commit, date and load."""
    script = _script()
    jobs, missing = script.jobs()
    assert missing == [], "results pages that name no command"
    for job in jobs:
        assert job.command.startswith("cachettl "), job.md.name
        record = provenance.read(job.md.read_text())
        if record is not None:
            named = record["command"]
            assert job.command in (named, script._with_out(named, job.md.stem)), job.md.name
            assert {"commit", "date", "load", "cpus"} <= set(record), job.md.name


def test_the_list_covers_every_results_file() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--list"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    listed = {line.split()[1] for line in out.stdout.splitlines()}
    files = {f"results/{p.name}" for p in (ROOT / "results").iterdir() if p.is_file()}
    assert files == listed


def test_a_file_made_by_a_command_is_found_and_one_made_by_none_is_an_orphan(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script()
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    (tmp_path / "a.md").write_text("# A\n\nCommand: `cachettl bench seeds --seeds 1-3`\n")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "stray.png").write_bytes(b"")
    (tmp_path / "b.md").write_text("# B, with no command\n")
    (tmp_path / "c_before.json").write_text('{"command": "cachettl bench controlplane"}')
    (tmp_path / "d.json").write_text('{"figures": []}')
    jobs, missing = script.jobs()
    assert [(j.command, j.kind) for j in jobs] == [
        ("cachettl bench seeds --seeds 1-3 --out results/a", "sim"),
        ("cachettl bench controlplane", "frozen"),  # data naming its own command
    ]
    assert missing == [tmp_path / "b.md"]
    assert script.orphans(jobs) == [tmp_path / "b.md", tmp_path / "d.json", tmp_path / "stray.png"]
    assert script.quick(jobs[0].command).startswith("cachettl bench seeds --seeds 1,2 --out")


def test_quick_mode_shrinks_every_size_a_study_takes() -> None:
    quick = _script().quick
    learning = (
        "cachettl bench learning --families step,tracelab --loads 1,1.2 --programs 100 "
        "--seeds 1000-1002 --pre 2000 --horizon 60 --replicates 12"
    )
    assert quick(learning) == (
        "cachettl bench learning --families step,tracelab --loads 1 --programs 100 "
        "--seeds 1000,1001 --pre 500 --horizon 20 --replicates 2"
    )  # families keep their programs
    cluster = "cachettl bench cluster --workload swe --programs 64 --loads 0.8,1,1.2 --seeds 0-15"
    assert quick(cluster) == (
        "cachettl bench cluster --workload swe --programs 20 --loads 0.8 --seeds 0,1"
    )


def test_quick_mode_can_keep_a_studys_programs() -> None:
    quick = _script().quick
    cluster = "cachettl bench cluster --workload bfcl --engines 4 --programs 40 --seeds 0-15"
    assert quick(cluster, keep_programs=True) == (
        "cachettl bench cluster --workload bfcl --engines 4 --programs 40 --seeds 0,1"
    )


def test_a_quick_study_too_small_for_its_load_is_run_with_its_own_programs(
    tmp_path: Path,
) -> None:
    """20 programs on 4 engines never load vLLM behind round_robin to slowdown 3 (the study
    fails, saying so): the quick run takes the study's own 40 programs, and succeeds."""
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--only",
            "^cluster_bfcl_4.md$",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--programs 20" in out.stdout  # tried small first
    assert "failed (2)" in out.stdout
    record = provenance.read((tmp_path / "cluster_bfcl_4.md").read_text())
    assert record is not None
    assert "--programs 40 --seeds 0,1" in record["command"]


def test_stamping_records_command_commit_date_and_load_once(tmp_path: Path) -> None:
    md, js = tmp_path / "x.md", tmp_path / "x.json"
    md.write_text("# X\n\nfigures\n")
    js.write_text(json.dumps({"runs": [1, 2]}))
    record = provenance.current("cachettl bench seeds --out x", started_load=[1.0, 2.0, 3.0])
    assert provenance.stamp(md, record)
    assert provenance.stamp(js, record)
    assert not provenance.stamp(tmp_path / "x.png", record)
    again = provenance.current("cachettl bench seeds --out y")
    provenance.stamp(md, again)
    text = md.read_text()
    assert text.count("<!-- provenance:") == 1
    assert text.endswith("# X\n\nfigures\n")
    read = provenance.read(text)
    assert read is not None
    assert read["command"] == "cachettl bench seeds --out y"
    assert read["cpus"] == os.cpu_count()
    assert read["date"].endswith(" UTC")
    assert len(read["commit"].rstrip("+")) >= 7
    assert "at commit" in text.splitlines()[1]
    assert f"on {os.cpu_count()} CPUs" in text
    data = json.loads(js.read_text())
    assert data["provenance"]["load"] == [1.0, 2.0, 3.0]
    assert data["runs"] == [1, 2]


def test_quick_mode_reruns_a_study_small_and_stamps_it(tmp_path: Path) -> None:
    only = "^first_turn_over_pins_swe_1.md$"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--only", only, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    record = provenance.read((tmp_path / "first_turn_over_pins_swe_1.md").read_text())
    assert record is not None
    assert "--programs 20 --seeds 20,21" in record["command"]
    assert record["command"].endswith(f"--out {tmp_path}/first_turn_over_pins_swe_1")
    data = json.loads((tmp_path / "first_turn_over_pins_swe_1.json").read_text())
    assert data["provenance"] == record
    assert data["seeds"] == [20, 21]


def test_bench_seeds_stamps_what_it_writes(tmp_path: Path) -> None:
    from controlplane.cli import main

    out = tmp_path / "s"
    args = ["bench", "seeds", "--workload", "swe", "--programs", "4", "--seeds", "0-1"]
    assert main([*args, "--rate", "0.1", "--against", "vllm", "--out", str(out)]) == 0
    record = provenance.read((tmp_path / "s.md").read_text())
    assert record is not None
    assert record["command"].startswith("cachettl bench seeds --workload swe --programs 4")
    assert record["command"].endswith(f"--out {out}")
    assert record["cpus"] == os.cpu_count()
    assert len(record["load"]) == 3
    assert json.loads((tmp_path / "s.json").read_text())["provenance"] == record
