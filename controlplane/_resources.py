"""Where the data shipped with ``controlplane`` lives (``migrations/``, ``proto/``).

A wheel installs them as ``controlplane/migrations`` and ``controlplane/proto``; in a source
checkout or an editable install they are the repository's top-level ``migrations/`` and
``proto/`` folders. Neither has an ``__init__.py``, so neither can shadow an unrelated
top-level package of the same name.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["data_dir"]


def data_dir(name: str) -> Path:
    """The folder of shipped data called ``name`` ("migrations" or "proto")."""
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"controlplane's {name}/ folder is missing from the installation")
