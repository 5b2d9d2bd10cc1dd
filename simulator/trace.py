"""The trace format: JSON Lines, one agent program per line (``program_id``, ``tenant``,
``arrival_s`` and its ``turns``, each with ``input_tokens``, ``output_tokens``, ``tool``,
``tool_args`` and ``tool_duration_s``: :class:`Program` and :class:`Turn`). Unknown keys are
ignored; a missing or ill-typed required key is an error naming the line and the field.

>>> program = Program("swe-1", 0.5, (Turn(3000, 180, "bash", "ls", 0.02), Turn(40, 90)))
>>> parse_program(dump_program(program), 1) == program
True
>>> parse_program('{"program_id": "x", "arrival_s": 1, "turns": []}', 7)
Traceback (most recent call last):
...
ValueError: line 7: field 'turns': must hold at least one turn
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from estimator.signatures import json_depth

__all__ = [
    "Program",
    "Turn",
    "dump_program",
    "parse_program",
    "read_trace",
    "redraw_arrivals",
    "scale_turns",
    "write_trace",
]


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM call: tokens appended before it, tokens it generates, the tool it calls."""

    input_tokens: int
    output_tokens: int
    tool: str | None = None
    tool_args: str | None = None
    tool_duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Program:
    """One agent program: an id, a tenant, its first arrival and its turns."""

    program_id: str
    arrival_s: float
    turns: tuple[Turn, ...]
    tenant: str = "default"

    @property
    def total_tokens(self) -> int:
        """Context of the last turn plus its output (all inputs and outputs)."""
        return sum(t.input_tokens + t.output_tokens for t in self.turns)

    @property
    def tool_time_s(self) -> float:
        """Time spent in tools."""
        return math.fsum(t.tool_duration_s for t in self.turns)


#: Deepest JSON nesting a trace line may have (a valid line needs 3 levels).
MAX_DEPTH = 64
#: Longest integer literal converted (Python refuses more than 4300 digits anyway).
MAX_INT_DIGITS = 100


class _LongInteger:
    """Stands for an integer literal too long to convert (rejected where a number is
    needed, ignored in unknown keys)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(literal: str) -> int | _LongInteger:
    digits = len(literal) - literal.startswith("-")
    return _LongInteger(digits) if digits > MAX_INT_DIGITS else int(literal)


def _fail(line: int, field: str, problem: str) -> ValueError:
    return ValueError(f"line {line}: field {field!r}: {problem}")


def _int(obj: dict[str, Any], key: str, line: int, where: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, _LongInteger):
        raise _fail(line, f"{where}{key}", f"is out of range: {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(line, f"{where}{key}", f"must be an integer, got {value!r}")
    if value < minimum:
        raise _fail(line, f"{where}{key}", f"must be >= {minimum}, got {value}")
    return value


def _number(obj: dict[str, Any], key: str, line: int, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, _LongInteger):
        raise _fail(line, f"{where}{key}", f"is out of range: {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(line, f"{where}{key}", f"must be a finite number, got {value!r}")
    if value < 0:
        raise _fail(line, f"{where}{key}", f"must be >= 0, got {value}")
    return float(value)


def _optional_str(obj: dict[str, Any], key: str, line: int, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise _fail(line, f"{where}{key}", f"must be a string or null, got {value!r}")
    return value


def _parse_turn(obj: object, line: int, index: int, last: bool) -> Turn:
    where = f"turns[{index}]."
    if not isinstance(obj, dict):
        raise _fail(line, f"turns[{index}]", "must be an object")
    tool = _optional_str(obj, "tool", line, where)
    if "tool" not in obj:
        raise _fail(line, f"{where}tool", "is required (null on the last turn)")
    if tool is None and not last:
        raise _fail(line, f"{where}tool", "is null but the program has later turns")
    if tool is not None and last:
        raise _fail(line, f"{where}tool", "the last turn calls no tool: must be null")
    if tool == "":
        raise _fail(line, f"{where}tool", "must not be empty")
    duration = 0.0
    if tool is not None:
        duration = _number(obj, "tool_duration_s", line, where)
    return Turn(
        _int(obj, "input_tokens", line, where, 1 if index == 0 else 0),
        _int(obj, "output_tokens", line, where, 1),
        tool,
        _optional_str(obj, "tool_args", line, where),
        duration,
    )


def parse_program(text: str, line: int) -> Program:
    """One trace line; errors name the line and the field (never a traceback: nesting
    deeper than ``MAX_DEPTH`` and integers too long to convert are errors too)."""
    if json_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError(f"line {line}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {line}: not valid JSON ({error.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line}: must be a JSON object")
    program_id = obj.get("program_id")
    if not isinstance(program_id, str) or not program_id:
        raise _fail(line, "program_id", f"must be a non-empty string, got {program_id!r}")
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise _fail(line, "tenant", f"must be a non-empty string, got {tenant!r}")
    arrival = _number(obj, "arrival_s", line, "")
    turns = obj.get("turns")
    if not isinstance(turns, list):
        raise _fail(line, "turns", f"must be a list, got {turns!r}")
    if not turns:
        raise _fail(line, "turns", "must hold at least one turn")
    parsed = tuple(_parse_turn(t, line, i, i == len(turns) - 1) for i, t in enumerate(turns))
    return Program(program_id, arrival, parsed, tenant)


def _lines(path: str | Path) -> Iterator[str]:
    """The file's lines, split on ``\\n`` only (JSON Lines: U+2028, U+0085 and the other
    characters ``str.splitlines`` breaks at are ordinary characters inside a line)."""
    try:
        with Path(path).open(encoding="utf-8-sig", newline="\n") as handle:
            yield from handle
    except OSError as error:
        raise ValueError(f"cannot read trace {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"trace {str(path)!r} is not UTF-8 text") from None


def read_trace(path: str | Path) -> list[Program]:
    """All programs of a trace file, sorted by arrival (then id); nothing on any error."""
    programs: list[Program] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(_lines(path), start=1):
        if not text.strip(_JSON_BLANKS):
            continue
        program = parse_program(text, number)
        if program.program_id in seen:
            first = seen[program.program_id]
            raise _fail(number, "program_id", f"{program.program_id!r} repeats line {first}")
        seen[program.program_id] = number
        programs.append(program)
    if not programs:
        raise ValueError(f"trace {str(path)!r} holds no programs")
    programs.sort(key=lambda p: (p.arrival_s, p.program_id))
    return programs


_JSON_BLANKS = " \t\r\n"


def dump_program(program: Program) -> str:
    """One trace line (no newline)."""
    turns: list[dict[str, Any]] = []
    for turn in program.turns:
        item: dict[str, Any] = {
            "input_tokens": turn.input_tokens,
            "output_tokens": turn.output_tokens,
            "tool": turn.tool,
        }
        if turn.tool is not None:
            if turn.tool_args is not None:
                item["tool_args"] = turn.tool_args
            item["tool_duration_s"] = turn.tool_duration_s
        turns.append(item)
    obj = {
        "program_id": program.program_id,
        "tenant": program.tenant,
        "arrival_s": program.arrival_s,
        "turns": turns,
    }
    return json.dumps(obj, separators=(", ", ": "))


def write_trace(programs: Iterable[Program], path: str | Path) -> None:
    """Write a trace file (whole file or nothing: written to a temporary name first)."""
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for program in programs:
            handle.write(dump_program(program) + "\n")
    temporary.replace(target)


def redraw_arrivals(programs: Sequence[Program], rate: float, seed: int = 0) -> list[Program]:
    """The same programs, in the same order, with Poisson arrivals at ``rate`` programs/s.

    >>> ps = [Program(str(i), 0.0, (Turn(10, 1),)) for i in range(3)]
    >>> [round(p.arrival_s, 2) for p in redraw_arrivals(ps, 0.5, seed=1)]
    [0.0, 0.94, 1.61]
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of programs per second, got {rate!r}")
    rng = random.Random(f"arrivals:{seed}")
    now = 0.0
    out: list[Program] = []
    for i, program in enumerate(programs):
        if i:
            now += rng.expovariate(rate)
        out.append(replace(program, arrival_s=now))
    return out


def scale_turns(program: Program, factor: int) -> Program:
    """Repeat the program's turns ``factor`` times with token counts divided by ``factor``
    (the paper's turn-scaling study keeps total tokens roughly fixed).

    >>> p = Program("a", 0.0, (Turn(100, 10, "ls", None, 0.1), Turn(50, 10)))
    >>> [t.input_tokens for t in scale_turns(p, 2).turns]
    [50, 25, 50, 25]
    """
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"turn scale must be an integer >= 1, got {factor!r}")
    if factor == 1:
        return program
    turns: list[Turn] = []
    last = program.turns[-1]
    for repeat in range(factor):
        for turn in program.turns:
            scaled = replace(
                turn,
                input_tokens=max(1, turn.input_tokens // factor),
                output_tokens=max(1, turn.output_tokens // factor),
            )
            if turn is last and repeat < factor - 1:
                # The repeated program goes on: the old final turn calls the first tool again.
                first = program.turns[0]
                scaled = replace(
                    scaled,
                    tool=first.tool or "continue",
                    tool_args=first.tool_args,
                    tool_duration_s=first.tool_duration_s,
                )
            turns.append(scaled)
    return replace(program, turns=tuple(turns))
