"""``cachettl bench cluster --real``'s report: the hook settings it ran under are named, and
by default the hook engines run the engine's own rules, which are safe behind a router (the
bench itself runs engines and a router for minutes, so it is a command, not a test)."""

from __future__ import annotations

from dataclasses import asdict

from enginehook.config import HookConfig
from enginehook.tools.bench import hook_settings
from enginehook.tools.clusterbench import CLUSTER_SETTINGS, RealClusterConfig, markdown


def _report(config: RealClusterConfig) -> dict[str, object]:
    run = {"mean_jct_s": 20.0, "first_turn_wait_p90_s": 2.0, "prefix_hit_share": 0.5}
    ratios = [{"mean_jct": 0.5, "first_turn_wait_p90": 1.5}]
    figures = {
        "stock": [run],
        "hook": [{**run, "mean_jct_s": 10.0, "first_turn_wait_p90_s": 3.0}],
        "ratios": ratios,
        "median_mean_jct_ratio": 0.5,
        "median_wait_p90_ratio": 1.5,
    }
    return {"config": asdict(config), "policies": {"cache_aware": figures}}


def test_by_default_the_hook_engines_put_new_programs_ahead_of_pins() -> None:
    """Behind a router a new session must not wait behind pinned returning turns: the bench's
    hook engines get that from the engine's defaults, with no override of their own."""
    config = RealClusterConfig(runs=1)
    assert CLUSTER_SETTINGS == {} == config.hook_settings
    engine = HookConfig.from_additional({"cachettl": {**hook_settings(config.trace)}})
    assert engine.rules.first_turn_over_pins is True
    text = markdown(_report(config))
    assert "hook settings on top of the engine bench's: `{}`" in text
    assert "| cache_aware | 0 | 20.00 / 10.00 | 0.50 | 2.00 / 3.00 | 1.50 | 50% / 50% |" in text


def test_settings_given_replace_the_recommended_ones() -> None:
    config = RealClusterConfig(hook_settings={"first_turn_over_pins": False})
    assert '`{"first_turn_over_pins": false}`' in markdown(_report(config))
