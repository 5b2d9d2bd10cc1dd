"""Start-up guards: untested vLLM versions and unsupported KV layouts are refused."""

from __future__ import annotations

from typing import Any

import pytest

from enginehook.config import HookConfig

vllm = pytest.importorskip("vllm")


def test_tested_version_passes_and_others_are_refused_by_name():
    from enginehook.vllm.compat import TESTED_VERSIONS, check_vllm, compat_problems

    assert compat_problems() == []
    check_vllm()
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.0 is not a tested version.*0\.32\.0"):
        check_vllm("0.31.0")
    assert vllm.__version__ in TESTED_VERSIONS


def test_a_release_without_an_attribute_the_hook_reads_is_refused(tmp_path):
    import shutil
    from pathlib import Path

    from enginehook.vllm.compat import ATTRIBUTES, INTERNALS, source_problems

    installed = Path(vllm.__file__).parent
    files = {path for path, _, _ in INTERNALS} | {path for path, _ in ATTRIBUTES}
    for path in [*files, "v1/core/sched/request_queue.py"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed / path, tmp_path / path)
    assert source_problems(tmp_path) == []
    pool = tmp_path / "v1/core/block_pool.py"
    pool.write_text(pool.read_text().replace("self.hash_block_size", "self.hash_size"))
    request = tmp_path / "v1/request.py"
    request.write_text(request.read_text().replace("self.block_hashes", "self.hashes"))
    manager = tmp_path / "v1/core/kv_cache_manager.py"
    manager.write_text(manager.read_text().replace("self.block_pool", "self.pool"))
    assert source_problems(tmp_path) == [
        "Request.block_hashes attribute missing",
        "KVCacheManager.block_pool attribute missing",
        "BlockPool.hash_block_size attribute missing",
    ]


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kv_layout_guard():
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    from enginehook.vllm.guards import check_kv_layout

    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    chunked = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, attention_chunk_size=64
    )
    check_kv_layout(_config(full))
    check_kv_layout(_config(full, window))  # hybrid (Gemma-3): pinned per group
    with pytest.raises(RuntimeError, match="SlidingWindowSpec only"):
        check_kv_layout(_config(window))
    with pytest.raises(RuntimeError, match="ChunkedLocalAttentionSpec"):
        check_kv_layout(_config(full, chunked))


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"cachettl.budget_share must be in \[0, 1\], got 2"):
        HookConfig.from_additional({"cachettl": {"budget_share": 2}})
    with pytest.raises(ValueError, match="pressure must be one of"):
        HookConfig.from_additional({"cachettl": {"pressure": "soft"}})
    with pytest.raises(ValueError, match="unknown key 'ttl'"):
        HookConfig.from_additional({"cachettl": {"ttl": 1}})
    assert HookConfig.from_additional(None) == HookConfig()


def test_token_from_the_environment_and_never_in_repr(monkeypatch):
    monkeypatch.setenv("CACHETTL_TOKEN", "secret-token")
    config = HookConfig.from_additional({"cachettl": {"control_plane": "127.0.0.1:1"}})
    assert config.token == "secret-token"
    assert "secret-token" not in repr(config)


def test_the_hook_refuses_admission_it_cannot_carry_out():
    from types import SimpleNamespace

    from enginehook.core.rules import SchedulingRules
    from enginehook.vllm.guards import check_engine

    engine = SimpleNamespace(
        cachettl=HookConfig(rules=SchedulingRules(admission="thunderagent")),
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False)),
    )
    with pytest.raises(RuntimeError, match="admission='thunderagent': program-level admission"):
        check_engine(engine)
    engine.cachettl = HookConfig()
    check_engine(engine)  # the default rules pass


def test_an_untested_version_with_matching_internals_starts_with_a_warning():
    from enginehook.vllm.compat import check_vllm

    warning = check_vllm("0.32.1", strict=False)  # the installed 0.32.0's internals
    assert warning is not None
    assert "0.32.1" in warning
    assert "tested: 0.32.0, 0.33.0" in warning
    assert check_vllm(strict=False) is None  # the installed, tested version
    with pytest.raises(RuntimeError, match=r"0\.32\.1 is not a tested version.*strict"):
        check_vllm("0.32.1", strict=True)


def test_the_033_sources_pass_under_another_version_and_a_mismatch_is_refused(tmp_path):
    import shutil

    from enginehook.vllm.compat import ATTRIBUTES, INTERNALS, check_vllm
    from tests.enginehook.vllm_contract.runner import default_source

    package = default_source("0.33.0") / "vllm"
    if not (package / "v1/core/sched/scheduler.py").is_file():
        pytest.skip("vLLM 0.33.0's sources are not unpacked: run scripts/setup")
    warning = check_vllm("0.33.1", strict=False, package=package)
    assert warning is not None
    assert "0.33.1" in warning
    files = {path for path, _, _ in INTERNALS} | {path for path, _ in ATTRIBUTES}
    for path in [*files, "v1/core/sched/request_queue.py"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(package / path, tmp_path / path)
    pool = tmp_path / "v1/core/block_pool.py"
    pool.write_text(pool.read_text().replace("def touch(self, blocks", "def touch(self, b"))
    with pytest.raises(RuntimeError, match=r"BlockPool\.touch parameters changed.*0\.32\.0"):
        check_vllm("0.33.1", strict=False, package=tmp_path)
    with pytest.raises(RuntimeError, match=r"BlockPool\.touch parameters changed"):
        check_vllm("0.33.0", strict=False, package=tmp_path)  # even a tested version string
