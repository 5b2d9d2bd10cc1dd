"""Which tools an engine pins now: its own setting and the control plane's rollout.

An engine's own setting (``mode``, ``pin_tools`` / ``skip_tools`` in
:class:`enginehook.config.HookConfig`, or ``CACHETTL_MODE``, ``CACHETTL_PIN_TOOLS``,
``CACHETTL_SKIP_TOOLS``) and the tenant's rollout from the control plane
(:class:`controlplane.storage.rollouts.Rollout`, in every snapshot while one is set) meet
here. Which wins:

1. the engine's own ``mode: shadow`` always: it never pins, whatever the control plane
   says (the setting of an engine under watch must not be undone from afar);
2. else the control plane's rollout, once the engine has received one;
3. else the engine's own tool lists (no control plane, a server from before rollouts,
   or none set for the tenant): by default every tool.

A call of a tool outside the rollout in force is a *shadow* call: the policy decides its
TTL as usual, nothing is pinned, and its event reports the TTL it would have pinned for and
what that pin would have met (:meth:`enginehook.core.tracker.ToolCallTracker.turn_finished`
with ``shadow``).

>>> state = RolloutState(Rollout.of("except", ["web_search"]))
>>> state.pins("bash"), state.pins("web_search")
(True, False)
>>> state.remote = Rollout.of("only", ["pytest"])  # the control plane's wins
>>> state.pins("bash"), state.pins("pytest"), state.keeps_vllm_order
(False, True, False)
>>> RolloutState(shadow=True, remote=Rollout()).pins("pytest")  # local shadow wins
False
"""

from __future__ import annotations

from controlplane.records import Rollout, RolloutMode, parse_tools

__all__ = ["SHADOW", "Rollout", "RolloutMode", "RolloutState", "parse_tools"]

#: The rollout of shadow mode: nothing pinned, vLLM's order kept.
SHADOW = Rollout(RolloutMode.SHADOW)


class RolloutState:
    """The engine's own setting and the control plane's latest rollout.

    ``remote`` is replaced whole by the control-plane link's thread (one attribute
    assignment: the scheduler reads either the old or the new rollout, never a mix);
    ``None`` until a snapshot carried one.
    """

    def __init__(
        self, local: Rollout | None = None, *, shadow: bool = False, remote: Rollout | None = None
    ) -> None:
        self.local = local or Rollout()
        self.shadow = shadow
        self.remote = remote

    def in_force(self) -> Rollout:
        """The rollout that applies now (see the module docstring for which wins)."""
        if self.shadow:
            return SHADOW
        remote = self.remote
        return remote if remote is not None else self.local

    def pins(self, tool: str) -> bool:
        """Whether a call of ``tool`` may be pinned now."""
        return self.in_force().pins(tool)

    @property
    def keeps_vllm_order(self) -> bool:
        """Shadow mode in force: the waiting queue keeps vLLM's own order."""
        return self.in_force().shadow

    def __repr__(self) -> str:
        remote = self.remote.describe() if self.remote is not None else "none"
        own = "shadow" if self.shadow else self.local.describe()
        return f"RolloutState(own={own!r}, control plane={remote!r})"
