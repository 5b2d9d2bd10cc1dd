"""vLLM's own v1 core scheduler tests pass against the hook (tests/enginehook/vllm_contract).

Each mode runs the runner's files of the source distribution that matches the installed
wheel (``scripts/setup`` fetches it) and fails on any failure that is neither a listed
exception (``vllm_contract/exceptions.py``, with its reason and expected message) nor one
that stock vLLM shows too, and on any block-pool audit problem. About a minute per mode
on the 2-core machine (two pytest processes, one scheduler at a time each; no engine).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from tests.enginehook.vllm_contract.runner import EXPECTED_TESTS, default_source, run


@pytest.fixture(scope="module")
def source():
    src = default_source()
    if not (src / "tests" / "v1" / "core").is_dir():
        message = f"vLLM's tests are not under {src}: run scripts/setup"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return src


@pytest.mark.parametrize("mode", ["defaults", "active", "pins"])
def test_vllm_scheduler_tests_pass_against_the_hook(source, mode, tiny_model):
    result = run(mode, source, workers=2, model=str(tiny_model))
    summary = result.summary()
    print(summary)
    assert summary["run"] == EXPECTED_TESTS.get(source.name, summary["run"]), summary
    assert summary["passed"] > 0.85 * summary["run"], summary
    assert not result.unexpected, [(t["id"], t.get("message")) for t in result.unexpected]
    assert not result.audit, result.audit
    if mode == "pins":
        assert summary["pins_taken"] > 0, "the pins mode pinned nothing"
