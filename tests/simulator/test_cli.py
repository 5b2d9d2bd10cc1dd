"""``cachettl simulate`` / ``trace`` through the real command line entry point."""

import json
from pathlib import Path

import pytest

from controlplane.cli import main
from simulator.trace import read_trace

KEYS = {
    "mean_jct_s",
    "p50_jct_s",
    "p90_jct_s",
    "p99_jct_s",
    "mean_slowdown",
    "throughput_programs_per_s",
    "prefix_hit_rate",
}


def test_simulate_json_has_the_contract_keys(capsys):
    code = main(
        [
            "simulate",
            "--workload",
            "swe",
            "--programs",
            "12",
            "--rate",
            "0.5",
            "--policy",
            "isolated,vllm,cachettl",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["policies"]) == ["isolated", "vllm", "cachettl"]
    for metrics in out["policies"].values():
        assert set(metrics) >= KEYS
    vllm = out["policies"]["vllm"]
    assert vllm["mean_slowdown"] >= 1.0 - 1e-9
    assert vllm["p50_jct_s"] <= vllm["p90_jct_s"] <= vllm["p99_jct_s"]
    assert out["policies"]["isolated"]["mean_jct_s"] <= vllm["mean_jct_s"] + 1e-9


def test_generate_then_simulate_a_trace_file(tmp_path: Path, capsys):
    path = tmp_path / "bfcl.jsonl"
    assert (
        main(
            [
                "trace",
                "generate",
                "--workload",
                "bfcl",
                "--programs",
                "6",
                "--rate",
                "0.1",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    assert len(read_trace(path)) == 6
    assert main(["simulate", "--trace", str(path), "--rate", "1", "--policy", "vllm"]) == 0
    table = capsys.readouterr().out
    assert "6 programs on llama3.1-8b-h100" in table
    assert "vllm" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "vllm,lru"], "unknown policy 'lru'; valid: agentinfer, autellix, cachettl"),
        (["--hardware", "tpu"], "unknown hardware profile 'tpu'; valid: llama3.1-70b"),
        (["--rate", "-1"], "--rate must be a positive number"),
        (["--rate", "0"], "--rate must be a positive number"),
        (["--kv-tokens", "0"], "kv_tokens must hold at least one block"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
        (["--programs", "0"], "--programs must be >= 1"),
        (["--kv-tokens", "4096"], "needs"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code = main(["simulate", "--workload", "swe", "--programs", "3", *argv])
    err = capsys.readouterr()
    assert code == 2
    assert message in err.err
    assert err.out == ""


def test_bad_trace_names_line_and_field(tmp_path: Path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"program_id": "a", "arrival_s": 0, "turns": [{"input_tokens": 5}]}\n')
    assert main(["simulate", "--trace", str(path)]) == 2
    assert "line 1: field 'turns[0].tool'" in capsys.readouterr().err


def test_progress_bar_draws_after_a_second_and_clears():
    import io

    from simulator.studies.report import Progress

    now = [0.0]
    stream = io.StringIO()
    bar = Progress(10, True, stream, clock=lambda: now[0])
    bar.advance(label="vllm")
    assert stream.getvalue() == ""  # short runs print nothing
    now[0] = 1.5
    bar.advance(4)
    assert "5/10 programs" in stream.getvalue()
    assert "vllm" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")
    quiet = io.StringIO()
    Progress(10, False, quiet, clock=lambda: 99.0).advance(10)
    assert quiet.getvalue() == ""


def test_timeline_csv_per_policy(tmp_path: Path, capsys):
    target = tmp_path / "tl"
    argv = [
        "simulate",
        "--workload",
        "swe",
        "--programs",
        "8",
        "--rate",
        "0.5",
        "--kv-tokens",
        "300000",
        "--policy",
        "vllm,oracle",
        "--timeline",
        str(target),
    ]
    assert main(argv) == 0
    rows = (target / "oracle.csv").read_text().splitlines()
    assert rows[0] == "time_s,pinned_share,used_share,running,waiting"
    samples = [tuple(float(x) for x in r.split(",")) for r in rows[1:]]
    assert len(samples) > 10
    assert all(0.0 <= s[1] <= s[2] <= 1.0 for s in samples)  # pins are part of used memory
    assert max(s[1] for s in samples) > 0
    assert all(
        s[1] == 0.0
        for s in (
            tuple(float(x) for x in r.split(","))
            for r in (target / "vllm.csv").read_text().splitlines()[1:]
        )
    )
