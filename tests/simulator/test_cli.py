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
        (["--policy", "vllm,lru"], "unknown policy 'lru'; valid: autellix, cachettl"),
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
