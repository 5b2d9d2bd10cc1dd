"""What the hook does on an engine it cannot pin for: it passes through (vLLM's own
scheduling, no pins) with one warning and the ``cachettl_passthrough`` metric; and the
queue contract it keeps where it is active (vLLM's prepend order, ``queue[i]``).

Real vLLM schedulers on the tiny local model, built as vLLM's own scheduler tests build
theirs (no engine, no model runner).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")


def _scheduler(model: Any, *, prefix_caching: bool, chunked: bool = False) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from enginehook.vllm.scheduler import CacheTTLScheduler

    model_config = ModelConfig(model=str(model), dtype="float16", seed=0, max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=prefix_caching),
    )
    spec: dict[str, Any] = dict(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(**spec))]
    if chunked:
        local = ChunkedLocalAttentionSpec(**spec, attention_chunk_size=64)
        groups.append(KVCacheGroupSpec(["local"], local))
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    config.cache_config.num_gpu_blocks = 64
    register_all_kvcache_specs(config)  # type: ignore[no-untyped-call]
    return CacheTTLScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=16,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
    )


def _requests(n: int) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4)
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[i] * 8,
            sampling_params=params,
            pooling_params=None,
        )
        for i in range(n)
    ]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "passes through" in r.getMessage()]


def test_without_prefix_caching_the_hook_passes_through_with_one_warning(tiny_model, caplog):
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    with caplog.at_level(logging.WARNING, logger="enginehook"):
        scheduler = _scheduler(tiny_model, prefix_caching=False)
    assert scheduler.active is False
    assert isinstance(scheduler.waiting, FCFSRequestQueue)  # vLLM's own order
    (warning,) = _warnings(caplog)
    assert "--enable-prefix-caching" in warning
    text = scheduler.metrics.prometheus()
    assert 'cachettl_passthrough{reason="no_prefix_caching"} 1' in text
    scheduler.shutdown()


def test_a_layout_it_cannot_pin_passes_through_instead_of_refusing(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="enginehook"):
        scheduler = _scheduler(tiny_model, prefix_caching=True, chunked=True)
    assert scheduler.active is False
    assert "ChunkedLocalAttentionSpec" in _warnings(caplog)[0]
    assert 'cachettl_passthrough{reason="kv_layout"} 1' in scheduler.metrics.prometheus()
    scheduler.shutdown()


def test_with_prefix_caching_the_hook_is_active_and_its_queue_keeps_vllms_contract(
    tiny_model, caplog
):
    from enginehook.vllm.requests import ProgramRequestQueue

    with caplog.at_level(logging.WARNING, logger="enginehook"):
        scheduler = _scheduler(tiny_model, prefix_caching=True)
    assert scheduler.active is True
    assert _warnings(caplog) == []
    assert "cachettl_passthrough" not in scheduler.metrics.prometheus()
    queue = scheduler.waiting
    assert isinstance(queue, ProgramRequestQueue)
    a, b, c, d = _requests(4)
    queue.add_request(d)
    # vLLM collects skipped requests with appendleft and hands them to prepend_requests,
    # whose FCFS deque puts them in front in reverse (extendleft): [c, b, a] -> a, b, c.
    queue.prepend_requests([c, b, a])
    assert [queue[i].request_id for i in range(len(queue))] == ["r0", "r1", "r2", "r3"]
    assert queue[-1] is d
    assert queue.peek_request() is a
    scheduler.shutdown()


def test_the_version_guard_names_every_tested_version():
    from enginehook.vllm.compat import TESTED_VERSIONS, check_vllm

    assert TESTED_VERSIONS == ("0.32.0", "0.33.0", "0.34.0")
    tested = r"0\.32\.0, 0\.33\.0, 0\.34\.0"
    with pytest.raises(RuntimeError, match=r"0\.35\.0 is not a tested version.*" + tested):
        check_vllm("0.35.0")
