"""The code stays readable in pieces: no module over 600 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("estimator", "controlplane", "enginehook", "simulator", "tests")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_gen" not in path.parts
    ]


def test_no_module_over_600_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines}"
        for path in _sources()
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    ]
    assert long == []


def test_no_function_over_60_lines() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert long == []
