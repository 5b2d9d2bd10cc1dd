"""Run the docstring examples of the engine-independent modules."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "enginehook.pins",
    "enginehook.pressure",
    "enginehook.priority",
    "enginehook.tracker",
    "enginehook.detect",
    "enginehook.hints",
    "enginehook.decide",
    "enginehook.config",
    "enginehook.snapshot",
    "enginehook.metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
