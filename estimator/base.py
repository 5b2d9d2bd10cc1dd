"""What every estimator shares: parameters stored under their own names, learned state
under ``_``-prefixed names, so that ``clone`` and ``repr`` are generic (as in River)."""

from __future__ import annotations

import copy
from typing import Any, Self

__all__ = ["Estimator"]


class Estimator:
    """Base class: ``clone()`` gives a fresh, unfitted copy with the same parameters."""

    def _get_params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def clone(self) -> Self:
        """A fresh, unfitted estimator with (deep copies of) the same parameters."""
        return type(self)(**copy.deepcopy(self._get_params()))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._get_params().items())
        return f"{type(self).__name__}({params})"
