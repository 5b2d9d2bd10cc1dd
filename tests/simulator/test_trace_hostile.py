"""The trace reader on hostile lines: every error names the line
(and the field), never a traceback, and valid lines are read whatever they hold."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import main
from simulator.trace import MAX_DEPTH, read_trace

GOOD = {
    "program_id": "p",
    "arrival_s": 0.5,
    "turns": [
        {"input_tokens": 30, "output_tokens": 5, "tool": "bash", "tool_args": "ls"},
        {"input_tokens": 8, "output_tokens": 5, "tool": None},
    ],
}


def _trace(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _program(**changes: object) -> dict[str, object]:
    obj: dict[str, Any] = json.loads(json.dumps(GOOD))
    obj["turns"][0]["tool_duration_s"] = 1.0
    obj.update(changes)
    return obj


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000, 100_000])
def test_deep_nesting_is_an_error_naming_the_line(tmp_path: Path, depth: int) -> None:
    deep = json.dumps(_program()).replace(
        '"turns"', '"x": ' + "[" * depth + "]" * depth + ', "turns"'
    )
    path = _trace(tmp_path, json.dumps(_program(program_id="ok")), deep)
    with pytest.raises(ValueError, match=f"^line 2: JSON nested deeper than {MAX_DEPTH} levels$"):
        read_trace(path)


def test_moderate_nesting_in_unknown_keys_is_read(tmp_path: Path) -> None:
    obj = _program(extra=json.loads("[" * 50 + "]" * 50))
    (program,) = read_trace(_trace(tmp_path, json.dumps(obj)))
    assert program.program_id == "p"


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u0085"])  # raw in valid JSON
def test_line_breaks_other_than_newline_are_ordinary_characters(tmp_path: Path, char: str) -> None:
    obj = _program(program_id=f"a{char}b")
    obj["turns"][0]["tool_args"] = f"echo {char} x"  # type: ignore[index]
    raw = json.dumps(obj, ensure_ascii=False)
    assert char in raw
    (program,) = read_trace(_trace(tmp_path, raw))
    assert program.program_id == f"a{char}b"
    assert program.turns[0].tool_args == f"echo {char} x"


def test_crlf_and_bom_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_program()).encode() + b"\r\n\r\n")
    assert [p.program_id for p in read_trace(path)] == ["p"]


def test_huge_integer_is_an_error_naming_line_and_field(tmp_path: Path) -> None:
    bad = json.dumps(_program()).replace('"input_tokens": 30', '"input_tokens": ' + "9" * 5000)
    path = _trace(tmp_path, json.dumps(_program(program_id="ok")), bad)
    message = (
        r"^line 2: field 'turns\[0\].input_tokens': is out of range: an integer of 5000 digits$"
    )
    with pytest.raises(ValueError, match=message):
        read_trace(path)
    arrival = json.dumps(_program()).replace('"arrival_s": 0.5', '"arrival_s": -' + "1" * 5000)
    with pytest.raises(ValueError, match=r"^line 1: field 'arrival_s': is out of range"):
        read_trace(_trace(tmp_path, arrival))


def test_huge_integer_in_an_unknown_key_is_ignored(tmp_path: Path) -> None:
    raw = json.dumps(_program()).replace("{", '{"big": ' + "7" * 5000 + ", ", 1)
    assert [p.program_id for p in read_trace(_trace(tmp_path, raw))] == ["p"]


def test_simulating_a_twenty_megabyte_argument_is_quick(tmp_path: Path, capsys) -> None:
    obj = _program()
    obj["turns"][0]["tool_args"] = "x" * 20_000_000  # type: ignore[index]
    path = _trace(tmp_path, json.dumps(obj))
    start = time.perf_counter()
    assert main(["simulate", "--trace", str(path), "--policy", "cachettl", "--quiet"]) == 0
    assert time.perf_counter() - start < 60.0  # a few seconds; ran past 240 s before
    assert "cachettl" in capsys.readouterr().out
