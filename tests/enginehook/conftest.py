"""Fixtures for the real-engine tests: the tiny model (built once per session) and an
in-process engine core, so that tests reach the scheduler."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from enginehook.tools.tinymodel import build_tiny_llama

    cache = os.environ.get("CACHETTL_TINY_MODEL_DIR")
    path = Path(cache) if cache else tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_llama(path)


@pytest.fixture(scope="module")
def inproc() -> Iterator[None]:
    """Run the engine core in this process so tests can reach the scheduler."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
