"""What the vLLM hook runs beside its pin controller: the TTL decider on the latest model
snapshot, the event sink to the control plane, the metrics and their endpoint, and the CPU
tier detected from the engine's config; the endpoint also takes routers' pin commands
(:mod:`enginehook.vllm.pin_commands`). Engine-independent (nothing here imports vLLM).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from enginehook.config import HookConfig, detect_cpu_tier
from enginehook.core.host import FinishedTurn
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.hints.sessions import ENGINE_ENV
from enginehook.link.base import EventSink
from enginehook.link.decide import TtlDecider
from enginehook.link.sinks import build_sink
from enginehook.vllm.endpoint import EndpointAccess, serve_metrics
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.pin_commands import PinCommands
from estimator import Decision, RequestFacts

__all__ = ["HookServices", "cold_start_warning", "engine_id", "linked_line"]

logger = logging.getLogger("enginehook")


class HookServices:
    """The hook's decider, sink, metrics and CPU tier for one engine (``vllm_config``).

    It is the controller's :class:`~enginehook.core.lifecycle.Decider` (a client's ``pin_ttl_s``
    wins; every decision is counted by basis) and receives its events.
    """

    def __init__(
        self, config: HookConfig, vllm_config: Any, commands: PinCommands | None = None
    ) -> None:
        self.config = config
        self.engine_id = engine_id()
        self.metrics = HookMetrics()
        self.decider = TtlDecider(
            config.policy,
            config.policy_params,
            profile=config.profile,
            tenant=config.tenant,
            min_samples=config.min_samples,
        )
        self.cpu_tier = detect_cpu_tier(config.cpu_tier, vllm_config)
        self.metrics.set_cpu_tier(self.cpu_tier.on, ",".join(self.cpu_tier.connectors))
        logger.info("CacheTTL CPU tier: %s", self.cpu_tier.reason)
        self.sink: EventSink = build_sink(config, self.decider, self.engine_id)
        self.metrics.set_sink(self.sink.counters)
        self._server: Any = None
        #: Where the endpoint answers (``http(s)://host:port``; empty: no endpoint).
        self.endpoint = ""
        if config.metrics_listen:
            access = EndpointAccess(
                token=config.pin_command_token,
                cert_file=config.endpoint_tls_cert_file,
                key_file=config.endpoint_tls_key_file,
                allow_plaintext=config.allow_plaintext_pin_commands,
            )
            self._server, port = serve_metrics(
                self.metrics, config.metrics_listen, commands, access=access
            )
            host = config.metrics_listen.rpartition(":")[0] or "127.0.0.1"
            self.endpoint = f"{'https' if access.tls else 'http'}://{host}:{port}"
        _visible(logger)
        logger.info("%s", linked_line(config, self.endpoint, self.engine_id))
        model = getattr(vllm_config, "model_config", None)
        warning = cold_start_warning(config, getattr(model, "max_model_len", None))
        if warning:
            logger.warning("%s", warning)

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        """The turn's TTL: the client's ``pin_ttl_s`` when it set one, else the policy's.

        A client's TTL is priced like a learned one, so that memory pressure weighs both
        kinds of pin on one scale. Victims go by lowest expected loss F(τ)·B (scaled by
        the share of τ left), and a newcomer's first turn may reclaim only pins whose loss
        is below its wait; a pin without a price (B = 0) would be the first victim of the
        one and never a victim of the other, which let client-TTL pins outlive learned
        ones whenever newcomers pressed on memory. So a client's TTL keeps its promise of
        return (F = 1: it knows its program's next step, the policy only estimates it)
        and takes its price B from the engine's cost model, as the policy would (the
        rebuild cost of its context plus the expected queueing). Between a client pin and
        a learned one of the same size and context, the learned one (F < 1) goes first.
        """
        decision = self.decider.decide_facts(facts, turn.pin_ttl_s)
        if decision.basis == "client" and decision.ttl_s > 0 and decision.benefit_s <= 0:
            priced = self.decider.decide_facts(facts)
            decision = replace(decision, benefit_s=priced.benefit_s)
        self.metrics.decision(decision.basis)
        return decision

    def emit(self, event: ToolCallReport | ProgramEndReport) -> None:
        self.decider.learn_later(event)
        self.sink.submit(event)
        self.metrics.emitted()

    def close(self) -> None:
        self.decider.close()
        self.sink.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


#: Characters of the engine's name kept in its id (event ids begin with the id).
ENGINE_NAME_CHARS = 32


def engine_id(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The id this engine reports to the control plane: its name, then ``#`` and six hex
    digits that tell this start of it from others of the same name (a restart, or two
    engines given one name), which keeps event ids and program locations apart.

    The name is the one the API server's ``X-CacheTTL-Engine`` header gives
    (:data:`enginehook.hints.sessions.ENGINE_ENV`, ``$CACHETTL_ENGINE_NAME``), else the
    server's ``host:port`` from its command line (``--host``, ``--port``; the machine's
    name for an address that listens everywhere, port 8000 by default).

    >>> engine_id([], {"CACHETTL_ENGINE_NAME": "gpu-node-3"})[:11]
    'gpu-node-3#'
    >>> engine_id(["api_server", "--host", "10.0.0.7", "--port=8001"], {})[:14]
    '10.0.0.7:8001#'
    """
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    name = environ.get(ENGINE_ENV, "").strip()
    if not name:
        host, port = _option(argv, "--host"), _option(argv, "--port") or "8000"
        if not host or host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        name = f"{host}:{port}"
    name = "".join(c if c.isprintable() and c != "#" else "?" for c in name)
    return f"{name[:ENGINE_NAME_CHARS]}#{uuid.uuid4().hex[:6]}"


def _option(argv: Sequence[str], flag: str) -> str:
    """The value of ``flag`` in a command line (``--flag V`` or ``--flag=V``; "" if absent)."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word[len(flag) + 1 :]
    return ""


def linked_line(config: HookConfig, endpoint: str, engine_id: str) -> str:
    """The one line the hook logs at start: what it is linked to and with which settings
    (never a token: only whether one is set).

    >>> print(linked_line(HookConfig(), "", "e1"))  # doctest: +NORMALIZE_WHITESPACE
    CacheTTL hook e1: control plane none (events stay on this engine); tenant 'default';
    endpoint off; policy cachettl; rules ...
    """
    if config.control_plane:
        tls = "TLS" if config.tls_ca_file else "plaintext"
        if config.tls_cert_file:
            tls = "mutual TLS"
        token = "token set" if config.token else "no token"
        link = f"control plane {config.control_plane} ({tls}, {token}, coherence "
        link += f"{'on' if config.coherence else 'off'})"
    else:
        link = "control plane none (events stay on this engine)"
    if endpoint:
        commands = (
            "pin commands with pin_command_token"
            if config.pin_command_token
            else ("pin commands from loopback only")
        )
        where = f"endpoint {endpoint}/metrics, {commands}"
    else:
        where = "endpoint off"
    r = config.rules
    rules = (
        f"pressure={r.pressure.value}, ordering={r.ordering}, victim={r.victim}, "
        f"ttl_cap_s={r.ttl_cap_s:g}, budget_share={r.budget_share:g}"
    )
    return (
        f"CacheTTL hook {engine_id}: {link}; tenant {config.tenant!r}; {where}; "
        f"policy {config.policy}; rules {rules}"
    )


def cold_start_warning(config: HookConfig, max_context_tokens: int | None) -> str:
    """A warning when the policy's cold start can never pin on this engine: even a turn of
    ``max_context_tokens`` (the model's longest context) prices a miss below the cold-start
    rule's threshold, so every TTL is 0 until the engine has learned tool durations or
    queueing (empty: it can pin)."""
    if not config.enabled or not max_context_tokens:
        return ""
    probe = TtlDecider(
        config.policy,
        config.policy_params,
        profile=config.profile,
        tenant=config.tenant,
        min_samples=config.min_samples,
    )
    try:
        decision = probe.decide(
            tool="cold-start-probe",
            tool_args=None,
            context_tokens=int(max_context_tokens),
            turns_served=1,
        )
    except Exception:  # a policy that cannot decide without data says so itself later
        return ""
    finally:
        probe.close()
    if decision.ttl_s > 0 or "cold" not in decision.basis:
        return ""
    return (
        f"CacheTTL: policy {config.policy!r} cannot pin on this engine at its cold start: "
        f"a miss of even a {max_context_tokens}-token context costs {decision.benefit_s:.3f} s "
        f"with profile {config.profile!r}, under the cold-start rule's threshold, so every "
        f"TTL is 0 until {config.min_samples} tool calls are learned or returning turns "
        "queue; a client's pin_ttl_s, a fixed policy or a profile of this engine pins sooner"
    )


def _visible(log: logging.Logger) -> None:
    """Give the hook's logger a handler of its own when nothing would show its INFO lines
    (vLLM configures only its own ``vllm`` logger; without a handler Python prints
    warnings and worse only), so the start-up lines reach the engine's log."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
