"""vLLM tests made pin-aware for the ``pins`` mode, without weakening them.

A few of vLLM's tests assert the pool's free-block count inline, right after a request
finished. With every finished request pinned, the pin holds that request's hashed blocks
on purpose, so the count is short by exactly the pinned blocks. :func:`pin_aware_copy`
copies vLLM's ``tests/`` and, only inside the functions of :data:`PIN_AWARE`, counts the
pinned blocks with the free ones: the assertion still fails for any block that is neither
free nor pinned (a leak), and the block-pool audit after each test releases the pins and
checks that every block is then free or held by a live request. Nothing else changes.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

__all__ = ["PIN_AWARE", "pin_aware_copy"]

#: test file -> functions whose inline free-block counts become pin-aware.
PIN_AWARE = {
    "tests/v1/core/test_scheduler.py": (
        "test_kv_connector_basic",
        "test_kv_connector_unable_to_allocate",
        "test_kv_connector_handles_preemption",
    ),
}
_FREE = "scheduler.kv_cache_manager.block_pool.get_num_free_blocks()"
_FREE_OR_PINNED = f"({_FREE} + scheduler.pins.pinned_blocks)"


def _rewrite(text: str, functions: tuple[str, ...]) -> tuple[str, int]:
    lines = text.splitlines(keepends=True)
    changed = 0
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            assert node.end_lineno is not None
            for i in range(node.lineno - 1, node.end_lineno):
                if _FREE in lines[i] and "NUM_TOTAL_BLOCKS = " not in lines[i]:
                    lines[i] = lines[i].replace(_FREE, _FREE_OR_PINNED)
                    changed += 1
    return "".join(lines), changed


def pin_aware_copy(src: Path, into: Path) -> Path:
    """A copy of ``src/tests`` under ``into`` with :data:`PIN_AWARE` applied; returns the
    new root (``into``). Raises if a listed function has no free-block count to adapt
    (the test changed upstream: look at it again)."""
    if (into / "tests").exists():
        shutil.rmtree(into / "tests")
    shutil.copytree(src / "tests", into / "tests", symlinks=True)
    for name, functions in PIN_AWARE.items():
        path = into / name
        text, changed = _rewrite(path.read_text(encoding="utf-8"), functions)
        if changed < len(functions):
            raise RuntimeError(f"{name}: only {changed} free-block counts adapted in {functions}")
        path.write_text(text, encoding="utf-8")
    return into
