"""CPU KV tier: detection from real vLLM config objects, the ``cpu_tier`` setting, and TTL
decisions that price a miss as a reload when a tier holds the KV."""

from __future__ import annotations

from typing import Any, Literal

import pytest

from enginehook.config import CpuTierSetting, HookConfig, detect_cpu_tier
from enginehook.core.pressure import PressureRule
from enginehook.link.decide import TtlDecider
from enginehook.vllm.metrics import HookMetrics


def _vllm_config(**kwargs: Any) -> Any:
    from vllm.config import VllmConfig

    return VllmConfig(**kwargs)


def _transfer(
    connector: str,
    role: Literal["kv_producer", "kv_both", "kv_consumer"] = "kv_both",
    **extra: Any,
) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector, kv_role=role, kv_connector_extra_config=dict(extra)
    )


def _multi(*children: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": list(children)},
    )


# -- detection ----------------------------------------------------------------------------


def test_no_connector_means_no_tier():
    tier = detect_cpu_tier("auto", _vllm_config())
    assert not tier.on
    assert "no KV connector" in tier.reason


def test_kv_offloading_size_sets_up_the_native_offloading_connector():
    from vllm.config import CacheConfig

    config = _vllm_config(cache_config=CacheConfig(kv_offloading_size=2.0))
    # vLLM itself turned the cache option into a connector; detection reads that.
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    tier = detect_cpu_tier("auto", config)
    assert tier.on
    assert tier.connectors == ("OffloadingConnector",)
    assert tier.prompt_only  # offload_prompt_only defaults to true
    assert "OffloadingConnector" in tier.reason


def test_offloading_connector_storing_decode_blocks_too():
    config = _vllm_config(
        kv_transfer_config=_transfer(
            "OffloadingConnector", cpu_bytes_to_use=1 << 30, offload_prompt_only=False
        )
    )
    tier = detect_cpu_tier("auto", config)
    assert tier.on
    assert not tier.prompt_only
    assert tier.offloaded_tokens(100, 140, 32) == 128


def test_cache_offloading_size_without_a_resolved_connector():
    """The cache option alone (as read before vLLM resolves it) also means a tier."""
    from vllm.config import CacheConfig

    class Unresolved:
        kv_transfer_config = None
        cache_config = CacheConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")

    tier = detect_cpu_tier("auto", Unresolved())
    assert tier.on
    assert "kv_offloading_size=1.0" in tier.reason
    assert "lmcache" in tier.reason


def test_multiconnector_child_is_found():
    config = _vllm_config(
        kv_transfer_config=_multi(
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
            },
        )
    )
    assert config.kv_transfer_config.has_connector("OffloadingConnector")
    tier = detect_cpu_tier("auto", config)
    assert tier.on
    assert tier.connectors == ("OffloadingConnector",)


def test_multiconnector_without_a_tier_child():
    config = _vllm_config(
        kv_transfer_config=_multi({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
    )
    tier = detect_cpu_tier("auto", config)
    assert not tier.on
    assert "ExampleConnector is not a known CPU tier" in tier.reason
    assert "cpu_tier to on" in tier.reason


def test_lmcache_and_simple_offload_connectors():
    lmcache = _transfer("LMCacheConnectorV1")
    tier = detect_cpu_tier("auto", _vllm_config(kv_transfer_config=lmcache))
    assert tier.on
    assert tier.prompt_only
    simple = _transfer("SimpleCPUOffloadConnector", cpu_bytes_to_use=1 << 30)
    tier = detect_cpu_tier("auto", _vllm_config(kv_transfer_config=simple))
    assert tier.on
    assert not tier.prompt_only


def test_a_consumer_only_connector_stores_nothing_here():
    config = _vllm_config(kv_transfer_config=_transfer("LMCacheConnectorV1", role="kv_consumer"))
    tier = detect_cpu_tier("auto", config)
    assert not tier.on
    assert "'kv_consumer' stores nothing" in tier.reason


def test_on_and_off_override_detection():
    from vllm.config import CacheConfig

    with_tier = _vllm_config(cache_config=CacheConfig(kv_offloading_size=1.0))
    off = detect_cpu_tier("off", with_tier)
    assert not off.on
    assert "ignoring OffloadingConnector" in off.reason
    forced = detect_cpu_tier("on", _vllm_config())
    assert forced.on
    assert forced.prompt_only
    assert "no known CPU-tier connector" in forced.reason


def test_offloaded_tokens_are_whole_blocks():
    tier = CpuTierSetting(True, "", prompt_only=True)
    assert tier.offloaded_tokens(prompt_tokens=95, total_tokens=200, block_size=32) == 64
    assert CpuTierSetting(False, "").offloaded_tokens(95, 200, 32) == 0


# -- the setting --------------------------------------------------------------------------


def test_cpu_tier_setting_is_validated():
    assert HookConfig().cpu_tier == "auto"
    for value in ("auto", "on", "off"):
        assert HookConfig.from_additional({"cachettl": {"cpu_tier": value}}).cpu_tier == value
    for bad in ("yes", "ON", True, 1, None):
        with pytest.raises(ValueError, match=r"cpu_tier must be one of auto, on, off, got"):
            HookConfig.from_additional({"cachettl": {"cpu_tier": bad}})
    with pytest.raises(ValueError, match="cpu_tier must be one of auto, on, off, got 'maybe'"):
        detect_cpu_tier("maybe", None)


def test_metrics_show_the_tier():
    metrics = HookMetrics()
    assert 'cachettl_cpu_tier{connector=""} 0' in metrics.prometheus()
    metrics.set_cpu_tier(True, "OffloadingConnector")
    assert metrics.snapshot()["cpu_tier"] is True
    assert 'cachettl_cpu_tier{connector="OffloadingConnector"} 1' in metrics.prometheus()


# -- decisions ----------------------------------------------------------------------------


def _decider() -> TtlDecider:
    decider = TtlDecider("cachettl", {"ttl_cap_s": 60.0}, min_samples=5)
    for k in range(20):  # `ls` returns after 50-145 ms
        decider.models.record_tool_call("bash", "ls -la", 0.05 + 0.005 * k)
    return decider


def test_a_tier_shortens_the_ttl_because_a_reload_is_cheaper_than_a_prefill():
    decider = _decider()
    cost = decider.models.cost
    context = 16_000
    assert cost.reload_s(context) < cost.prefill_s(context) / 5
    facts: dict[str, Any] = {
        "tool": "bash",
        "tool_args": "ls -la",
        "context_tokens": context,
        "turns_served": 1,
    }
    prefill = decider.decide(**facts)
    reload = decider.decide(**facts, offload=True)
    assert prefill.basis == reload.basis == "invocation"
    assert prefill.benefit_s == pytest.approx(cost.prefill_s(context))
    assert reload.benefit_s == pytest.approx(cost.reload_s(context))
    assert prefill.ttl_s > 0.1  # worth waiting for `ls` when a miss is a full prefill
    assert reload.ttl_s < prefill.ttl_s
    assert reload.ttl_s == 0.0  # a 42 ms reload is not worth holding memory for 50 ms


def test_a_prompt_only_tier_prices_the_recomputed_output_on_top_of_the_reload():
    decider = _decider()
    cost = decider.models.cost
    context, stored = 16_000, 15_872
    facts: dict[str, Any] = {
        "tool": "bash",
        "tool_args": "ls -la",
        "context_tokens": context,
        "turns_served": 1,
    }
    whole = decider.decide(**facts, offload=True)
    partial = decider.decide(**facts, offload=True, offloaded_tokens=stored)
    prefill = decider.decide(**facts)
    expected = cost.reload_s(stored) + cost.prefill_s(context) - cost.prefill_s(stored)
    assert partial.benefit_s == pytest.approx(expected)
    assert whole.benefit_s < partial.benefit_s < prefill.benefit_s
    # Nothing held in the tier: the same price as no tier at all.
    nothing = decider.decide(**facts, offload=True, offloaded_tokens=0)
    assert nothing.benefit_s == pytest.approx(prefill.benefit_s)
    assert nothing.ttl_s == prefill.ttl_s


def test_tier_settings_are_validated_and_replace_the_plain_ones():
    config = HookConfig.from_additional(
        {"cachettl": {"tier_pressure": "running", "tier_order_window_s": 5}}
    )
    assert config.rules.in_force(cpu_tier=True) == (PressureRule.RUNNING, 5.0)
    assert config.rules.in_force(cpu_tier=False) == (PressureRule.RUNNING, 0.0)
    with pytest.raises(ValueError, match="pressure must be one of: running, always, never"):
        HookConfig.from_additional({"cachettl": {"tier_pressure": "sometimes"}})
    with pytest.raises(ValueError, match="tier_order_window_s must be a finite number >= 0"):
        HookConfig.from_additional({"cachettl": {"tier_order_window_s": -1}})
