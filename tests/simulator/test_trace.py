import itertools
import json
from pathlib import Path

import pytest

from simulator.trace import Program, Turn, read_trace, redraw_arrivals, scale_turns, write_trace
from simulator.workloads import generate, get_workload, stats

GOOD = {
    "program_id": "swe-17",
    "tenant": "acme",
    "arrival_s": 12.5,
    "turns": [
        {
            "input_tokens": 3000,
            "output_tokens": 180,
            "tool": "bash",
            "tool_args": "pytest -x",
            "tool_duration_s": 6.2,
        },
        {"input_tokens": 850, "output_tokens": 95, "tool": None},
    ],
}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_design_example_reads(tmp_path):
    (program,) = read_trace(_write(tmp_path, [json.dumps(GOOD)]))
    assert program.program_id == "swe-17"
    assert program.tenant == "acme"
    assert program.turns[0].tool_args == "pytest -x"
    assert program.turns[1].tool is None
    assert program.total_tokens == 3000 + 180 + 850 + 95


def test_round_trip_of_generated_trace(tmp_path):
    programs = generate("swe", 20, rate=0.1, seed=3)
    path = tmp_path / "swe.jsonl"
    write_trace(programs, path)
    assert read_trace(path) == programs


def test_defaults_and_unknown_keys(tmp_path):
    obj = dict(GOOD, extra="ignored")
    del obj["tenant"]
    (program,) = read_trace(_write(tmp_path, [json.dumps(obj)]))
    assert program.tenant == "default"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.pop("program_id"), "line 2: field 'program_id'"),
        (
            lambda o: o.update(arrival_s="soon"),
            "line 2: field 'arrival_s': must be a finite number",
        ),
        (lambda o: o.update(arrival_s=-1), "line 2: field 'arrival_s': must be >= 0"),
        (lambda o: o["turns"][0].update(input_tokens=1.5), "field 'turns[0].input_tokens'"),
        (lambda o: o["turns"][1].update(output_tokens=0), "field 'turns[1].output_tokens'"),
        (lambda o: o["turns"][0].update(tool=None), "field 'turns[0].tool': is null but"),
        (lambda o: o["turns"][1].update(tool="ls"), "field 'turns[1].tool': the last turn"),
        (lambda o: o["turns"][0].pop("tool_duration_s"), "field 'turns[0].tool_duration_s'"),
        (lambda o: o.update(turns="x"), "field 'turns': must be a list"),
    ],
)
def test_bad_fields_name_line_and_field(tmp_path, mutate, message):
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    other = dict(GOOD, program_id="first")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_trace(_write(tmp_path, [json.dumps(other), json.dumps(bad)]))


def test_not_json_and_duplicates_and_empty(tmp_path):
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        read_trace(_write(tmp_path, ["{nope"]))
    with pytest.raises(ValueError, match="line 2: field 'program_id': 'swe-17' repeats line 1"):
        read_trace(_write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)]))
    with pytest.raises(ValueError, match="holds no programs"):
        read_trace(_write(tmp_path, [""]))
    with pytest.raises(ValueError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_redraw_keeps_programs_and_checks_rate():
    programs = generate("bfcl", 200, rate=0.1, seed=0)
    redrawn = redraw_arrivals(programs, 2.0, seed=5)
    assert [p.turns for p in redrawn] == [p.turns for p in programs]
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(redrawn)]
    assert 0.4 < sum(gaps) / len(gaps) < 0.6  # mean 1/rate
    assert min(gaps) >= 0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate must be a positive number"):
            redraw_arrivals(programs, bad)


def test_turn_scale_repeats_turns_and_keeps_tokens():
    program = generate("swe", 1, seed=2)[0]
    scaled = scale_turns(program, 3)
    assert len(scaled.turns) == 3 * len(program.turns)
    assert scaled.turns[-1].tool is None
    assert all(t.tool is not None for t in scaled.turns[:-1])
    assert abs(scaled.total_tokens - program.total_tokens) <= 3 * 2 * len(program.turns)
    with pytest.raises(ValueError, match="turn scale"):
        scale_turns(program, 0)


def _first_word(turn: Turn) -> str:
    assert turn.tool_args is not None
    return turn.tool_args.split()[0] if turn.tool == "bash" else turn.tool or ""


def test_swe_matches_table_2():
    s = stats(generate("swe", 1500, seed=11), _first_word)
    assert 10.5 < s["turns_mean"] < 11.3
    assert 1.7 < s["turns_std"] < 2.5
    assert 800 < s["tool_ms_mean"] < 1050
    assert 2800 < s["tool_ms_std"] < 4500
    assert 66_000 < s["tokens_mean"] < 74_000
    assert 16_000 < s["tokens_std"] < 23_000
    assert 0.9 < s["top10_share:cd"] < 0.97  # paper: 94.1 %


def test_bfcl_matches_table_2_within_the_context_cap():
    s = stats(generate("bfcl", 1500, seed=11), _first_word)
    assert 5.9 < s["turns_mean"] < 6.7
    assert 1700 < s["tool_ms_mean"] < 2150
    assert 1800 < s["tool_ms_std"] < 2700
    assert 70_000 < s["tokens_mean"] < 93_256  # capped at the 128k context window
    assert 0.38 < s["top10_share:fetch_url"] < 0.6  # paper: 52.5 %
    assert max(p.total_tokens for p in generate("bfcl", 500, seed=1)) < 131_072


def test_generation_is_deterministic_and_validated():
    assert generate("swe", 5, seed=9) == generate("swe", 5, seed=9)
    assert generate("swe", 5, seed=9) != generate("swe", 5, seed=10)
    with pytest.raises(ValueError, match="unknown workload 'x'; valid: bfcl, swe"):
        get_workload("x")
    with pytest.raises(ValueError, match="programs must be"):
        generate("swe", 0)


def test_program_properties():
    p = Program("a", 0.0, (Turn(10, 2, "ls", None, 0.5), Turn(3, 4)))
    assert p.total_tokens == 19
    assert p.tool_time_s == 0.5
