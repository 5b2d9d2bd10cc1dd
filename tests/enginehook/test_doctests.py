"""The docstring examples run as part of the suite: pytest collects them from every module of
the four packages (``--doctest-modules`` over the ``testpaths`` in ``pyproject.toml``), and
where vLLM is missing the root ``conftest.py`` leaves out exactly the modules that need it."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[2]

#: Imports every module of ours with ``vllm`` made unimportable; prints those that fail.
_PROBE = """
import importlib, json, sys
sys.modules["vllm"] = None
failed = []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        failed.append(name)
print(json.dumps(failed))
"""


def test_doctests_are_collected_from_every_package() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    settings = options["ini_options"]
    assert "--doctest-modules" in settings["addopts"].split()
    assert set(conftest.PACKAGES) <= set(settings["testpaths"])


def test_modules_with_examples_are_not_left_out_where_vllm_is_installed() -> None:
    assert conftest.collect_ignore == []
    with_examples = [
        name for name, path in conftest._modules().items() if ">>>" in path.read_text()
    ]
    assert "enginehook.core.rules" in with_examples
    assert "enginehook.core.admission" in with_examples


def test_without_vllm_exactly_the_modules_that_need_it_are_left_out() -> None:
    names = sorted(n for n in conftest._modules() if not n.endswith("__main__"))
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(names)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    failing = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "enginehook.vllm.scheduler" in failing
    assert failing == conftest.vllm_modules()
