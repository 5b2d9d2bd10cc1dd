"""The hook's settings, read from ``--additional-config '{"cachettl": {...}}'``.

Every key is optional; unknown keys are an error that lists the valid ones (a typo must
not silently turn pinning off).

>>> HookConfig.from_additional({"cachettl": {"policy": "fixed", "policy_params": {"ttl_s": 1}}})
HookConfig(enabled=True, policy='fixed', policy_params={'ttl_s': 1}, ...)
>>> HookConfig.from_additional({"cachettl": {"ttl_cap": 3}})
Traceback (most recent call last):
...
ValueError: additional_config.cachettl: unknown key 'ttl_cap'; valid: ...
>>> HookConfig.from_additional({"cachettl": {"pressure": "always"}}).rules.pressure
<PressureRule.ALWAYS: 'always'>
>>> HookConfig.from_additional({"cachettl": {"order_window_s": -1}})
Traceback (most recent call last):
...
ValueError: additional_config.cachettl.order_window_s must be a finite number >= 0, got -1
>>> HookConfig.from_additional({"cachettl": {"pin_tools": "bash,pytest"}}).rollout()
RolloutState(own='only bash, pytest', control plane='none')
>>> HookConfig.from_additional({"cachettl": {"mode": "watch"}})
Traceback (most recent call last):
...
ValueError: additional_config.cachettl.mode must be one of pin, shadow, got 'watch'
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from enginehook.core.rollout import Rollout, RolloutState, parse_tools
from enginehook.core.rules import SchedulingRules
from enginehook.core.tokens import read_token
from estimator import DEFAULT_PROFILE

__all__ = [
    "CONFIG_KEY",
    "CPU_TIER_CONNECTORS",
    "CPU_TIER_SETTINGS",
    "MODES",
    "MODE_ENV",
    "PIN_COMMAND_TOKEN_ENV",
    "PIN_TOOLS_ENV",
    "SKIP_TOOLS_ENV",
    "TOKEN_ENV",
    "CpuTierSetting",
    "HookConfig",
    "detect_cpu_tier",
]

logger = logging.getLogger("enginehook")

#: The environment variable the control-plane token is read from (unless ``token_file``).
TOKEN_ENV = "CACHETTL_TOKEN"
#: The environment variable the pin-command token is read from (unless
#: ``pin_command_token_file``).
PIN_COMMAND_TOKEN_ENV = "CACHETTL_PIN_COMMAND_TOKEN"

#: Values of ``mode``: ``pin`` (pin and order) or ``shadow`` (decide and report only).
MODES = ("pin", "shadow")
#: The environment variables ``mode``, ``pin_tools`` and ``skip_tools`` are read from when
#: ``additional_config`` does not set them.
MODE_ENV = "CACHETTL_MODE"
PIN_TOOLS_ENV = "CACHETTL_PIN_TOOLS"
SKIP_TOOLS_ENV = "CACHETTL_SKIP_TOOLS"

#: The key under vLLM's ``additional_config`` that holds the hook's settings.
CONFIG_KEY = "cachettl"
_PREFIX = f"additional_config.{CONFIG_KEY}"

#: Values of ``cpu_tier``.
CPU_TIER_SETTINGS = ("auto", "on", "off")

#: vLLM 0.32 KV connectors that keep a host-memory copy of the blocks they store, so a
#: block evicted from the GPU pool can be reloaded instead of recomputed. ``--kv-offloading-size``
#: sets up the first (or ``SimpleCPUOffloadConnector`` with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``,
#: or ``LMCacheMPConnector`` with ``--kv-offloading-backend lmcache``).
CPU_TIER_CONNECTORS = frozenset(
    {
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "FlexKVConnectorV1",
    }
)

#: Connectors among those that also store decode-phase blocks by default (the others store
#: the prompt's blocks only: ``OffloadingConnector``'s ``offload_prompt_only`` defaults to
#: true, LMCache's ``save_decode_cache`` to false).
_STORES_DECODE = frozenset({"SimpleCPUOffloadConnector"})

#: Roles in which a connector stores this engine's blocks.
_STORING_ROLES = ("kv_producer", "kv_both")


@dataclass(frozen=True)
class HookConfig:
    """Settings of the engine hook.

    ``enabled``: pin and reorder at all (off: the stock scheduler's behaviour).
    ``policy`` / ``policy_params``: the estimator TTL policy and its parameters.
    ``profile``: hardware profile of the cost model used until prefill timings arrive.
    ``min_samples``: cold-start threshold K of the duration models.
    ``rules``: the :class:`~enginehook.core.rules.SchedulingRules` (pressure rules, order and
    its windows, pin budget, TTL cap, victims); in ``additional_config`` each rule is a key
    of its own (``"pressure": "always"``, ``"ttl_cap_s": 60``, ...).
    ``tenant``: the tenant this engine's events and decisions belong to.
    ``control_plane``: ``host:port`` of the control plane (empty: none).
    ``token``: bearer token for the control plane, read from ``token_file`` (a file
    holding it, surrounding whitespace stripped) or from the environment variable
    :data:`TOKEN_ENV`; a literal ``token`` in ``additional_config`` works but vLLM prints
    its arguments at start and they sit on the process's command line, so it is warned of.
    The token is never shown in the config's repr. ``tls_ca_file`` (PEM of the control
    plane's CA: the link uses TLS) and ``tls_cert_file`` / ``tls_key_file`` (the engine's
    own certificate and key, for mutual TLS). A token is refused over a plaintext channel
    to any host but a loopback address unless ``allow_plaintext_token`` is on.
    ``spill_dir``: where undelivered events are spilled (default: a folder per engine
    under the user's cache directory, :func:`enginehook.link.spill.default_spill_dir`).
    ``spill_max_bytes``: the spill's bound on disk. ``coherence``: with a control plane,
    report this engine's turn arrivals and drop at once the pin of a program whose next turn
    arrived at another engine (:mod:`enginehook.link.coherence`; on by default).
    ``strict_vllm_version``: refuse a
    vLLM version that was not tested even when its internals match (off: start with a
    warning). ``event_log``: a JSON Lines file that
    receives every tool-call and program-end event (empty: none). ``metrics_listen``:
    ``host:port`` where the hook serves ``/metrics`` in Prometheus format and routers' pin
    commands (empty: off). ``pin_command_token``: the credential pin commands (and their
    outcomes) need on that endpoint, scoped to them and never the control-plane token; read
    from ``pin_command_token_file`` or :data:`PIN_COMMAND_TOKEN_ENV` like ``token`` (unset:
    commands only from loopback peers). ``endpoint_tls_cert_file`` /
    ``endpoint_tls_key_file``: serve that endpoint over TLS. A token sent over plain HTTP
    from a peer that is not on loopback is refused (403) unless
    ``allow_plaintext_pin_commands`` is on.
    ``idle_program_s``: a program whose tool call has not returned for this long is
    forgotten, and its end reported with the turns it was served. ``cpu_tier``: whether
    a miss is priced as a reload from a CPU copy of the KV instead of a full prefill:
    ``auto`` (detected from the engine's KV connector and offloading options,
    :func:`detect_cpu_tier`), ``on`` or ``off``; while it is on the rules' tier settings
    apply.
    ``mode``: ``pin`` (default) or ``shadow``: the engine measures, learns, decides and
    reports every pin it would make (events with ``shadow``: the TTL and whether the
    program came back within it) but pins nothing and keeps vLLM's own order, step for
    step; read from :data:`MODE_ENV` when unset. ``pin_tools`` / ``skip_tools``: pin only
    these tools, or every tool but these (a list or ``"bash,pytest"``; one of the two; read
    from :data:`PIN_TOOLS_ENV` / :data:`SKIP_TOOLS_ENV` when unset); a tool outside is
    handled as in shadow mode. A tenant's rollout from the control plane
    (``cachettl rollout set``) replaces these lists once it arrives; ``mode: shadow`` wins
    over it (:mod:`enginehook.core.rollout`).
    """

    enabled: bool = True
    policy: str = "cachettl"
    policy_params: dict[str, Any] = field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    min_samples: int = 100
    rules: SchedulingRules = field(default_factory=SchedulingRules)
    tenant: str = "default"
    control_plane: str = ""
    token: str = field(default="", repr=False)
    token_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    allow_plaintext_token: bool = False
    spill_dir: str = ""
    spill_max_bytes: int = 256 * 1024 * 1024
    coherence: bool = True
    event_log: str = ""
    metrics_listen: str = ""
    pin_command_token: str = field(default="", repr=False)
    pin_command_token_file: str = ""
    endpoint_tls_cert_file: str = ""
    endpoint_tls_key_file: str = ""
    allow_plaintext_pin_commands: bool = False
    idle_program_s: float = 3600.0
    cpu_tier: str = "auto"
    strict_vllm_version: bool = False
    mode: str = "pin"
    pin_tools: list[str] = field(default_factory=list)
    skip_tools: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.rules, SchedulingRules):
            raise ValueError(f"{_PREFIX}.rules must be SchedulingRules, got {self.rules!r}")
        if not isinstance(self.cpu_tier, str) or self.cpu_tier not in CPU_TIER_SETTINGS:
            raise ValueError(
                f"{_PREFIX}.cpu_tier must be one of "
                f"{', '.join(CPU_TIER_SETTINGS)}, got {self.cpu_tier!r}"
            )
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"{_PREFIX}.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.pin_tools and self.skip_tools:
            raise ValueError(
                f"{_PREFIX}.pin_tools and skip_tools exclude each other: pin only some tools, "
                "or every tool but some"
            )
        value = self.idle_program_s
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{_PREFIX}.idle_program_s must be >= 0, got {value!r}")
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int):
            raise ValueError(f"{_PREFIX}.min_samples must be an integer, got {self.min_samples!r}")
        if not isinstance(self.policy_params, Mapping):
            raise ValueError(f"{_PREFIX}.policy_params must be an object")
        for name in (
            "allow_plaintext_token",
            "allow_plaintext_pin_commands",
            "strict_vllm_version",
            "coherence",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_PREFIX}.{name} must be true or false")
        spill = self.spill_max_bytes
        if isinstance(spill, bool) or not isinstance(spill, int) or spill < 1024 * 1024:
            raise ValueError(f"{_PREFIX}.spill_max_bytes must be an integer >= 1048576")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"{_PREFIX}.tls_cert_file and tls_key_file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError(f"{_PREFIX}.tls_cert_file needs tls_ca_file (the server's CA)")
        if bool(self.endpoint_tls_cert_file) != bool(self.endpoint_tls_key_file):
            raise ValueError(
                f"{_PREFIX}.endpoint_tls_cert_file and endpoint_tls_key_file go together"
            )
        if self.pin_command_token and self.pin_command_token == self.token:
            raise ValueError(
                f"{_PREFIX}.pin_command_token must not be the control-plane token: it is "
                "sent by routers and scoped to pin commands"
            )

    @property
    def shadow(self) -> bool:
        """The engine's own shadow mode: nothing pinned, vLLM's order kept."""
        return self.mode == "shadow"

    def rollout(self) -> RolloutState:
        """A fresh :class:`~enginehook.core.rollout.RolloutState` of this engine's own
        setting (the control plane's rollout joins it when a snapshot carries one)."""
        own = Rollout()
        if self.pin_tools:
            own = Rollout.of("only", self.pin_tools)
        elif self.skip_tools:
            own = Rollout.of("except", self.skip_tools)
        return RolloutState(own, shadow=self.shadow)

    @classmethod
    def keys(cls) -> list[str]:
        """The keys ``additional_config.cachettl`` accepts: the settings and the rules."""
        own = [f.name for f in dataclasses.fields(cls) if f.name != "rules"]
        return own + list(SchedulingRules.names())

    @classmethod
    def from_additional(cls, additional: Mapping[str, Any] | None) -> HookConfig:
        """Read ``additional[CONFIG_KEY]`` (missing: defaults)."""
        raw = (additional or {}).get(CONFIG_KEY) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"{_PREFIX} must be an object, got {raw!r}")
        valid = cls.keys()
        for key in raw:
            if key not in valid:
                raise ValueError(f"{_PREFIX}: unknown key {key!r}; valid: {', '.join(valid)}")
        rule_names = set(SchedulingRules.names())
        values = {k: v for k, v in raw.items() if k not in rule_names}
        try:
            values["rules"] = SchedulingRules.parse(
                {k: v for k, v in raw.items() if k in rule_names}
            )
        except ValueError as error:
            raise ValueError(f"{_PREFIX}.{error}") from None
        if "mode" not in values and os.environ.get(MODE_ENV, "").strip():
            values["mode"] = os.environ[MODE_ENV].strip()
            if values["mode"] not in MODES:
                raise ValueError(
                    f"${MODE_ENV} must be one of {', '.join(MODES)}, got {values['mode']!r}"
                )
        for key, env in (("pin_tools", PIN_TOOLS_ENV), ("skip_tools", SKIP_TOOLS_ENV)):
            listed = values.get(key)
            where = f"{_PREFIX}.{key}"
            if listed is None or listed == "":
                listed, where = os.environ.get(env, "").strip(), f"${env}"
            values[key] = list(parse_tools(listed, where)) if listed else []
        if values.get("token"):
            logger.warning(
                "%s.token is given literally: vLLM logs its arguments and they show on the "
                "process's command line; use token_file or $%s instead",
                _PREFIX,
                TOKEN_ENV,
            )
        elif values.get("token_file"):
            values["token"] = read_token(str(values["token_file"]))
        else:
            values["token"] = os.environ.get(TOKEN_ENV, "").strip()
        if values.get("pin_command_token"):
            logger.warning(
                "%s.pin_command_token is given literally: vLLM logs its arguments; use "
                "pin_command_token_file or $%s instead",
                _PREFIX,
                PIN_COMMAND_TOKEN_ENV,
            )
        elif values.get("pin_command_token_file"):
            where = f"{_PREFIX}.pin_command_token_file"
            values["pin_command_token"] = read_token(str(values["pin_command_token_file"]), where)
        else:
            values["pin_command_token"] = os.environ.get(PIN_COMMAND_TOKEN_ENV, "").strip()
        return cls(**values)


@dataclass(frozen=True)
class CpuTierSetting:
    """Whether the engine keeps a CPU copy of finished requests' KV blocks.

    ``on``: misses are priced as a reload (``RequestFacts.offload``). ``reason``: why, in
    words (logged at start). ``connectors``: the CPU-tier connectors found.
    ``prompt_only``: the tier holds the prompt's blocks only (the turn's output is
    recomputed on a miss).
    """

    on: bool
    reason: str
    connectors: tuple[str, ...] = ()
    prompt_only: bool = True

    def offloaded_tokens(self, prompt_tokens: int, total_tokens: int, block_size: int) -> int:
        """Tokens of a finished request whose KV the tier holds: its full blocks of the
        prompt (``prompt_only``) or of everything computed (all tokens but the last
        sampled one, whose KV is never written).

        >>> CpuTierSetting(True, "", prompt_only=True).offloaded_tokens(100, 140, 32)
        96
        >>> CpuTierSetting(True, "", prompt_only=False).offloaded_tokens(100, 140, 32)
        128
        """
        if not self.on:
            return 0
        covered = prompt_tokens if self.prompt_only else max(prompt_tokens, total_tokens - 1)
        size = max(1, block_size)
        return covered // size * size


def _connector_entries(transfer: Any) -> list[tuple[str, str | None, Mapping[str, Any]]]:
    """``(name, role, extra_config)`` of every configured KV connector; the children of a
    ``MultiConnector`` (each with its own role, else the parent's)."""
    if transfer is None or not getattr(transfer, "kv_connector", None):
        return []
    name = str(transfer.kv_connector)
    role = getattr(transfer, "kv_role", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    if name != "MultiConnector":
        return [(name, role, extra)]
    entries: list[tuple[str, str | None, Mapping[str, Any]]] = []
    for child in extra.get("connectors", []) or []:
        if isinstance(child, Mapping) and child.get("kv_connector"):
            entries.append(
                (
                    str(child["kv_connector"]),
                    child.get("kv_role", role),
                    child.get("kv_connector_extra_config") or {},
                )
            )
    return entries


def _stores_decode(name: str, extra: Mapping[str, Any]) -> bool:
    if name == "OffloadingConnector":
        return not bool(extra.get("offload_prompt_only", True))
    return name in _STORES_DECODE


def detect_cpu_tier(setting: str, vllm_config: Any) -> CpuTierSetting:
    """Resolve ``cpu_tier`` against the engine's ``VllmConfig``.

    ``auto`` is on when a connector of :data:`CPU_TIER_CONNECTORS` is configured in a
    storing role (``kv_producer`` / ``kv_both``), directly or as a ``MultiConnector``
    child, or when ``cache_config.kv_offloading_size`` is set (vLLM turns that into such a
    connector). Unknown connectors do not count: set ``cpu_tier`` to ``on`` for a custom
    connector that keeps a CPU copy.
    """
    if setting not in CPU_TIER_SETTINGS:
        raise ValueError(
            f"additional_config.cachettl.cpu_tier must be one of {', '.join(CPU_TIER_SETTINGS)}, "
            f"got {setting!r}"
        )
    entries = _connector_entries(getattr(vllm_config, "kv_transfer_config", None))
    tiers = [
        (n, extra)
        for n, role, extra in entries
        if n in CPU_TIER_CONNECTORS and role in _STORING_ROLES
    ]
    names = tuple(n for n, _ in tiers)
    prompt_only = not any(_stores_decode(n, extra) for n, extra in tiers)
    cache = getattr(vllm_config, "cache_config", None)
    size = getattr(cache, "kv_offloading_size", None)
    if setting == "off":
        ignored = f" (ignoring {', '.join(names)})" if names else ""
        return CpuTierSetting(False, f"cpu_tier=off{ignored}: misses priced as a full prefill")
    if setting == "on":
        found = ", ".join(names) if names else "no known CPU-tier connector configured"
        return CpuTierSetting(
            True, f"cpu_tier=on ({found}): misses priced as a CPU reload", names, prompt_only
        )
    if tiers:
        return CpuTierSetting(
            True,
            f"auto: KV connector {', '.join(names)} keeps a CPU copy; misses priced as a reload",
            names,
            prompt_only,
        )
    if size is not None:
        backend = getattr(cache, "kv_offloading_backend", "native")
        return CpuTierSetting(
            True,
            f"auto: kv_offloading_size={size} GiB ({backend}); misses priced as a reload",
            (),
            True,
        )
    if not entries:
        return CpuTierSetting(False, "auto: no KV connector; misses priced as a full prefill")
    parts = []
    for name, role, _ in entries:
        if name in CPU_TIER_CONNECTORS:
            parts.append(f"{name} in role {role!r} stores nothing from this engine")
        else:
            parts.append(f"{name} is not a known CPU tier")
    return CpuTierSetting(
        False,
        f"auto: {'; '.join(parts)} (set cpu_tier to on if it keeps a CPU copy); "
        "misses priced as a full prefill",
    )
