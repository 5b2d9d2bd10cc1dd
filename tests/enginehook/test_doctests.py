"""Run the docstring examples of the engine-independent modules."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "enginehook.core.pins",
    "enginehook.core.pressure",
    "enginehook.core.priority",
    "enginehook.core.tracker",
    "enginehook.core.detect",
    "enginehook.hints.flat",
    "enginehook.core.decide",
    "enginehook.core.config",
    "enginehook.link.snapshot",
    "enginehook.vllm.metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
