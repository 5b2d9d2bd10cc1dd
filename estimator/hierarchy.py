"""Duration models at every level of the back-off hierarchy.

Each event updates, for its tenant: the invocation ``(tool, signature)``, the tool, and
the tenant's pool of all tools; when the tenant shares, also the cross-tenant model of the
tool. A lookup walks a list of levels and uses the first whose model holds more than
``min_samples`` samples (K = 100 in the paper).

Backing off assumes a thin level resembles its parent. When its own samples clearly say
otherwise (a two-sample Kolmogorov–Smirnov test rejects "same distribution" at
``contradiction_alpha``, with at least :data:`MIN_CONTRADICTING_SAMPLES` of them), the
lookup keeps the thin level: ``pytest`` with 39 samples around 9 s does not get the TTL of
``bash``, whose calls take milliseconds. ``contradiction_alpha=0`` is the plain back-off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from estimator._checks import check_duration
from estimator.base import Estimator
from estimator.durations import DurationModel
from estimator.signatures import SignatureRegistry

__all__ = [
    "CONTRADICTION_ALPHA",
    "MIN_CONTRADICTING_SAMPLES",
    "Chain",
    "DurationHierarchy",
    "Level",
    "Lookup",
    "NameLimitError",
    "contradicts",
]

#: Significance at which a thin level's own samples overrule the back-off.
CONTRADICTION_ALPHA = 0.001
#: The fewest samples with which a thin level can contradict its parent.
MIN_CONTRADICTING_SAMPLES = 10


def contradicts(child: DurationModel, parent: DurationModel, alpha: float) -> bool:
    """Whether ``child``'s samples reject "drawn from ``parent``'s distribution" at
    significance ``alpha``: the two-sample Kolmogorov–Smirnov statistic D = sup |F_c − F_p|
    against its asymptotic critical value c(α)·√((n + m)/(n·m)), c(α) = √(−ln(α/2)/2).
    The parent pools the child's samples, which only makes the test more cautious.

    >>> fast, slow = DurationModel(), DurationModel()
    >>> for i in range(40):
    ...     fast.update(0.01 + i * 1e-4)
    ...     slow.update(9.0 + i * 0.1)
    >>> contradicts(slow, fast, 0.001), contradicts(fast, fast, 0.001)
    (True, False)
    """
    n, m = child.n_samples, parent.n_samples
    if alpha <= 0 or n < MIN_CONTRADICTING_SAMPLES or m == 0:
        return False
    a, b = child.sorted_samples(), parent.sorted_samples()
    points = np.concatenate((a, b))
    d = np.max(
        np.abs(np.searchsorted(a, points, "right") / n - np.searchsorted(b, points, "right") / m)
    )
    critical = math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))
    return bool(d > critical)


class NameLimitError(ValueError):
    """Learning a call would give its tenant more distinct tool names (``what`` =
    ``"tool names"``) or argument signatures (``"signatures"``) than the hierarchy allows."""

    def __init__(self, what: str, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} already has {limit} distinct {what}, the limit")
        self.what = what
        self.tenant = tenant
        self.limit = limit


class Level(StrEnum):
    """A level of the back-off hierarchy; its value is the ``basis`` users see."""

    INVOCATION = "invocation"  # (tenant, tool, argument signature)
    TOOL = "tool"  # (tenant, tool)
    TENANT = "all-tools"  # (tenant, every tool)
    SHARED = "shared"  # (tool) over every sharing tenant


@dataclass(frozen=True, slots=True)
class Lookup:
    """The model chosen for a request, and the level it came from (None: none qualified)."""

    model: DurationModel | None
    level: Level | None
    total_samples: int  # samples the tenant has over all tools


@dataclass(frozen=True, slots=True)
class Chain:
    """What the back-off saw on its way to a model: the levels it skipped for having too
    few samples (``thin``, most specific first, each with at least one sample) and the
    level it chose (``chosen``; its model is None when no level qualified)."""

    thin: tuple[tuple[Level, DurationModel], ...]
    chosen: Lookup


_Key = tuple[str, str, str]  # (level-scope, tool, signature)


def _key(level: Level, tool: str, signature: str, tenant: str) -> _Key:
    """Where one level's model of a call is stored."""
    if level is Level.SHARED:
        return ("shared", tool, "")
    if level is Level.TENANT:
        return (f"t:{tenant}", "", "")
    if level is Level.TOOL:
        return (f"t:{tenant}", tool, "")
    return (f"t:{tenant}", tool, signature)


class DurationHierarchy(Estimator):
    """All duration models of all tenants, keyed by level.

    >>> h = DurationHierarchy(min_samples=2)
    >>> for d in [1.0, 2.0, 3.0]:
    ...     h.update("bash", "pytest -x", d, tenant="acme")
    >>> h.lookup("bash", "pytest tests", tenant="acme").level
    <Level.INVOCATION: 'invocation'>
    >>> h.lookup("bash", "ls", tenant="acme").level
    <Level.TOOL: 'tool'>
    >>> h.lookup("bash", "ls", tenant="other").level is None
    True
    """

    def __init__(
        self,
        min_samples: int = 100,
        window: int = 2000,
        forget_on_drift: bool = True,
        signatures: SignatureRegistry | None = None,
        max_tools: int | None = None,
        max_signatures: int | None = None,
        detector: str = "adwin",
        drift_prior: float = 0.0,
    ) -> None:
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 0:
            raise ValueError(f"min_samples must be an integer >= 0, got {min_samples!r}")
        self.min_samples = min_samples
        self.window = window
        self.forget_on_drift = forget_on_drift
        self.signatures = signatures if signatures is not None else SignatureRegistry()
        #: Bounds per tenant on distinct tool names and (tool, signature) pairs (None: none).
        self.max_tools = max_tools
        self.max_signatures = max_signatures
        self.detector = detector
        self.drift_prior = drift_prior
        self._prototype = DurationModel(
            window=window,
            forget_on_drift=forget_on_drift,
            detector=detector,
            drift_prior=drift_prior,
        )
        # The tool, tenant and shared levels pool signatures whose mix follows the
        # workload's phase: a fast detector would take a change of the mix for a change of
        # regime (on SWE-shaped runs: a dozen forgettings of the tenant level per 1,000
        # calls). They keep ADWIN (checked every 32 samples) and no prior.
        self._pooled_prototype = (
            self._prototype
            if detector == "adwin" and drift_prior == 0.0
            else DurationModel(window=window, forget_on_drift=forget_on_drift)
        )
        self._models: dict[_Key, DurationModel] = {}
        self._tenant_totals: dict[str, int] = {}
        self._names: dict[str, list[int]] = {}  # tenant -> [tool names, signatures]

    def _model(self, key: _Key) -> DurationModel:
        model = self._models.get(key)
        if model is None:
            prototype = self._prototype if key[2] else self._pooled_prototype
            model = self._models[key] = prototype.clone()
            self._count_new(key)
        return model

    def _count_new(self, key: _Key) -> None:
        scope, tool, signature = key
        if scope.startswith("t:") and tool:
            counts = self._names.setdefault(scope[2:], [0, 0])
            counts[1 if signature else 0] += 1

    def forget_invocations(self) -> None:
        """Drop every invocation model (their signatures were derived by other rules);
        the tool, tenant and shared levels stay."""
        self._models = {key: model for key, model in self._models.items() if not key[2]}
        for counts in self._names.values():
            counts[1] = 0

    def name_counts(self, tenant: str) -> tuple[int, int]:
        """``(distinct tool names, distinct (tool, signature) pairs)`` learned for ``tenant``."""
        tools, signatures = self._names.get(tenant, (0, 0))
        return tools, signatures

    def knows(self, tool: str, signature: str = "", tenant: str = "default") -> bool:
        """Whether ``tenant`` has a model of ``tool`` (of that invocation, with a signature)."""
        return (f"t:{tenant}", tool, signature) in self._models

    def check_room(self, tool: str, signature: str, tenant: str) -> None:
        """Raise ``NameLimitError`` if learning this call would pass a bound on names."""
        tools, signatures = self.name_counts(tenant)
        if (
            self.max_tools is not None
            and tools >= self.max_tools
            and not self.knows(tool, "", tenant)
        ):
            raise NameLimitError("tool names", tenant, self.max_tools)
        if (
            signature
            and self.max_signatures is not None
            and signatures >= self.max_signatures
            and not self.knows(tool, signature, tenant)
        ):
            raise NameLimitError("signatures", tenant, self.max_signatures)

    def __setstate__(self, state: dict[str, object]) -> None:
        # Pickles written before the bounds existed: unbounded, names counted from the keys.
        state.setdefault("max_tools", None)
        state.setdefault("max_signatures", None)
        state.setdefault("_pooled_prototype", state["_prototype"])  # one detector for all
        self.__dict__.update(state)
        if "_names" not in state:
            self._names = {}
            for key in self._models:
                self._count_new(key)

    def update(
        self,
        tool: str,
        args: str | None,
        duration_s: float,
        tenant: str = "default",
        share: bool = False,
    ) -> None:
        """Learn one tool call of ``tenant``; ``share`` also feeds the cross-tenant model.

        Raises ``NameLimitError`` (having changed nothing) when the call would give the
        tenant more distinct tool names or signatures than ``max_tools`` /
        ``max_signatures``.
        """
        if not tool:
            raise ValueError("tool must be a non-empty string")
        duration_s = check_duration("duration_s", duration_s)  # nothing half-updated
        signature = self.signatures.signature(tool, args)
        self.check_room(tool, signature, tenant)
        levels = [Level.TENANT, Level.TOOL]
        if signature:
            levels.append(Level.INVOCATION)
        if share:
            levels.append(Level.SHARED)
        for level in levels:
            self._model(_key(level, tool, signature, tenant)).update(duration_s)
        self._tenant_totals[tenant] = self._tenant_totals.get(tenant, 0) + 1

    def restore(
        self,
        level: Level,
        samples: Iterable[float],
        tool: str = "",
        signature: str = "",
        tenant: str = "default",
        n_seen: int | None = None,
    ) -> DurationModel:
        """Replace one level's model by a fresh one that learned ``samples`` in order
        (for example a snapshot's window). For ``Level.TENANT``, ``n_seen`` (default: the
        number of samples) becomes the tenant's total call count.

        >>> h = DurationHierarchy(min_samples=1)
        >>> _ = h.restore(Level.INVOCATION, [0.1, 0.2], tool="bash", signature="ls")
        >>> h.lookup("bash", "ls -la").level
        <Level.INVOCATION: 'invocation'>
        """
        if level is Level.INVOCATION and not signature:
            raise ValueError("signature must be non-empty for Level.INVOCATION")
        key = _key(level, tool, signature, tenant)
        if level is not Level.TENANT and not tool:
            raise ValueError(f"tool must be a non-empty string for {level!r}")
        model = (self._prototype if key[2] else self._pooled_prototype).clone()
        count = 0
        for value in samples:
            model.update(value)
            count += 1
        return self.install(
            level, model, tool, signature, tenant, count if n_seen is None else n_seen
        )

    def install(
        self,
        level: Level,
        model: DurationModel,
        tool: str = "",
        signature: str = "",
        tenant: str = "default",
        n_seen: int | None = None,
    ) -> DurationModel:
        """Put ``model`` (built elsewhere, e.g. from a snapshot's compact summary) in one
        level's place. For ``Level.TENANT``, ``n_seen`` (default: the model's
        ``n_seen``) becomes the tenant's total call count.

        >>> h = DurationHierarchy(min_samples=1)
        >>> m = DurationModel()
        >>> m.update(0.5); m.update(0.7)
        >>> _ = h.install(Level.TOOL, m, tool="bash")
        >>> h.lookup("bash").model is m
        True
        """
        if level is Level.INVOCATION and not signature:
            raise ValueError("signature must be non-empty for Level.INVOCATION")
        if level is not Level.TENANT and not tool:
            raise ValueError(f"tool must be a non-empty string for {level!r}")
        key = _key(level, tool, signature, tenant)
        if key not in self._models:
            self._count_new(key)
        self._models[key] = model
        if level is Level.TENANT:
            self._tenant_totals[tenant] = model.n_seen if n_seen is None else n_seen
        return model

    def model(
        self, level: Level, tool: str = "", args: str | None = None, tenant: str = "default"
    ) -> DurationModel | None:
        """The model of one level for this call, or None if it has no samples yet."""
        signature = self.signatures.signature(tool, args) if level is Level.INVOCATION else ""
        if level is Level.INVOCATION and not signature:
            return None
        return self._models.get(_key(level, tool, signature, tenant))

    def lookup(
        self,
        tool: str,
        args: str | None = None,
        tenant: str = "default",
        levels: Sequence[Level] = (Level.INVOCATION, Level.TOOL, Level.TENANT, Level.SHARED),
        contradiction_alpha: float = 0.0,
    ) -> Lookup:
        """The first level in ``levels`` whose model holds more than ``min_samples`` (or a
        thinner one whose samples contradict it, see :meth:`chain`)."""
        return self.chain(tool, args, tenant, levels, contradiction_alpha).chosen

    def chain(
        self,
        tool: str,
        args: str | None = None,
        tenant: str = "default",
        levels: Sequence[Level] = (Level.INVOCATION, Level.TOOL, Level.TENANT, Level.SHARED),
        contradiction_alpha: float = 0.0,
    ) -> Chain:
        """:meth:`lookup`, plus the thinner levels it passed over on the way. With
        ``contradiction_alpha`` > 0 the most specific thin level whose samples
        :func:`contradict <contradicts>` the qualified level's is chosen instead.

        >>> h = DurationHierarchy(min_samples=2)
        >>> for d in [1.0, 2.0, 3.0]:
        ...     h.update("bash", "ls", d)
        >>> h.update("bash", "pytest -x", 30.0)
        >>> c = h.chain("bash", "pytest tests")
        >>> [level.value for level, _ in c.thin], c.chosen.level
        (['invocation'], <Level.TOOL: 'tool'>)
        """
        thin: list[tuple[Level, DurationModel]] = []
        for level in levels:
            model = self.model(level, tool, args, tenant)
            if model is None or model.n_samples == 0:
                continue
            if model.trusted_samples > self.min_samples:
                for i, (thin_level, thin_model) in enumerate(thin):
                    if contradicts(thin_model, model, contradiction_alpha):
                        total = self.tenant_samples(tenant)
                        return Chain(tuple(thin[:i]), Lookup(thin_model, thin_level, total))
                return Chain(tuple(thin), Lookup(model, level, self.tenant_samples(tenant)))
            thin.append((level, model))
        return Chain(tuple(thin), Lookup(None, None, self.tenant_samples(tenant)))

    def tenant_samples(self, tenant: str) -> int:
        """Tool calls learned for ``tenant`` over all tools (forgotten ones included)."""
        return self._tenant_totals.get(tenant, 0)

    def tools(self, tenant: str = "default") -> list[str]:
        """Tool names ``tenant`` has called, sorted."""
        scope = f"t:{tenant}"
        return sorted({k[1] for k in self._models if k[0] == scope and k[1] and not k[2]})

    def signatures_of(self, tool: str, tenant: str = "default") -> list[str]:
        """Argument signatures seen for ``tool`` of ``tenant``, sorted."""
        scope = f"t:{tenant}"
        return sorted(k[2] for k in self._models if k[0] == scope and k[1] == tool and k[2])

    def tenants(self) -> list[str]:
        """Tenants with at least one learned call, sorted."""
        return sorted(self._tenant_totals)

    def items(self) -> Iterable[tuple[_Key, DurationModel]]:
        """Every ``(key, model)`` pair, for snapshots."""
        return self._models.items()

    def __len__(self) -> int:
        return len(self._models)
