"""Argument signatures on hostile input: deep nesting, huge tokens, separator floods.

The extractor runs after a batch is committed, so it must never raise, and it must take
time linear in the argument's length.
"""

from __future__ import annotations

import json
import time

import pytest

from estimator.signatures import (
    MAX_JSON_DEPTH,
    MAX_SIGNATURE_CHARS,
    SignatureRegistry,
    command_signature,
    default_signature,
    json_depth,
    json_signature,
    shell_signature,
)


def _seconds(fn: object, *args: object) -> float:
    """Best of three wall-clock timings (the machine is shared)."""
    assert callable(fn)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    "args",
    [
        '{"a":' + "[" * 4000,  # the poison event (4,005 characters)
        '{"a":' + "[" * 4000 + "]" * 4000 + "}",  # the same, valid JSON
        '{"a":' + '{"b":' * 3000 + "1" + "}" * 3001,
        '{"a": ' + "1" * 5000 + "}",  # an integer longer than Python converts
        '{"a": "' + "\\" * 4001 + '"}',
    ],
)
def test_json_extractor_never_raises_on_deep_or_odd_input(args: str) -> None:
    assert json_signature("search", args) == "search"
    assert default_signature("search", args) == ""
    assert command_signature("bash", args) == ""
    assert SignatureRegistry().signature("search", args) == ""


def test_json_depth_bound_keeps_keys_of_ordinary_nesting() -> None:
    nested = '{"q": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + ', "k": 1}'
    assert json_signature("search", nested) == "search(k,q)"
    too_deep = '{"q": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"
    assert json_signature("search", too_deep) == "search"
    # brackets inside strings are not nesting
    assert json_depth(json.dumps({"s": "[[[[{{{{" * 1000}), 4) == 1


def test_shell_signature_of_ordinary_command_lines() -> None:
    cases = {
        "cd repo && pytest -x": "cd+pytest",
        "FOO=1 /usr/bin/python -m x | grep ok; ls": "python+grep+ls",
        "echo 'a b' | wc -l": "echo+wc",
        "'my tool' --flag": "my tool",
        'git commit -m "fix \\"x\\"" && git push': "git+git",
        "\\ls -la": "ls",
        "A=1 B=2": "",
        "'unbalanced foo": "'unbalanced",
        "ls\n\npwd": "ls+pwd",
        "a || b && c | d ; e": "a+b+c+d+e",
        ";;;   ;; ls": "ls",
    }
    assert {args: shell_signature("bash", args) for args in cases} == cases


@pytest.mark.parametrize(
    "make",
    [
        lambda n: "a" * n,  # one huge token (20 MB once ran past 240 s)
        lambda n: ";" * n,  # a flood of separators
        lambda n: "'" + "a" * n,  # an open quote
        lambda n: '"' + "a b " * (n // 4) + '"',
        lambda n: "FOO=1 " * (n // 6),  # assignments only
        lambda n: "\\a" * (n // 2),
    ],
)
def test_shell_signature_is_linear(make: object) -> None:
    assert callable(make)
    small, large = make(500_000), make(2_000_000)
    t_small = _seconds(shell_signature, "bash", small)
    t_large = _seconds(shell_signature, "bash", large)
    # 4x the input: linear gives ~4x, quadratic ~16x; the slack absorbs a shared machine.
    assert t_large <= 8 * t_small + 0.05, (t_small, t_large)
    assert len(shell_signature("bash", large)) <= MAX_SIGNATURE_CHARS


def test_twenty_megabyte_token_is_quick() -> None:
    token = "x" * 20_000_000
    start = time.perf_counter()
    assert shell_signature("bash", token) == "x" * MAX_SIGNATURE_CHARS
    assert default_signature("search", "{" + token) == ""
    assert time.perf_counter() - start < 20.0  # about 1 s here; was more than 240 s


def test_thousand_separator_floods_take_milliseconds() -> None:
    registry = SignatureRegistry()
    start = time.perf_counter()
    for i in range(1000):
        assert registry.signature("bash", f"{i}" + ";" * 4096) == f"{i}"
    assert time.perf_counter() - start < 2.0  # about 6 s once, when quadratic


def test_registry_does_not_cache_huge_arguments() -> None:
    registry = SignatureRegistry()
    registry.signature("bash", "x" * 100_000)
    registry.signature("bash", "ls")
    assert [key[1] for key in registry._cache] == ["ls"]


def _shlex_signature(args: str) -> str:
    """The signature as the quadratic ``shlex`` reading gave it (the reference)."""
    import re
    import shlex

    words = []
    for part in re.split(r"&&|\|\||;|\||\n", args):
        try:
            tokens = shlex.split(part, posix=True)
        except ValueError:
            tokens = part.split()
        tokens = [t for t in tokens if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", t)]
        if tokens:
            words.append(tokens[0].rsplit("/", 1)[-1])
    return "+".join(words)[:MAX_SIGNATURE_CHARS]


def test_shell_signature_reads_command_lines_as_shlex_did() -> None:
    import random

    rng = random.Random(0)
    pieces = ["ls", "-la", "cd", "/tmp/x", "&&", "|", ";", "||", "'a b'", '"c d"', "FOO=1"]
    pieces += ["python", "'import x; y'", "\\n", '"x\\"y"', "$(pwd)", "2>&1", "&", "FOO='x y'"]
    pieces += ["\\", "'", '"', "a\\ b", "/usr/bin/env"]
    for _ in range(3000):
        args = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        assert shell_signature("bash", args) == _shlex_signature(args), args
