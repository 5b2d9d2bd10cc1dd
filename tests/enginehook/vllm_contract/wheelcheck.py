"""Does a vLLM wheel's Python equal its source distribution's?

The 0.33 checks run the release's sources (:mod:`overlay`); they stand for the GPU wheel
users install only if the wheel ships the same Python. :func:`wheel_differences` compares
every ``vllm/**/*.py`` of the wheel with the unpacked sources: a file in both must be
byte-identical, and a file only in the wheel must be one of the kernel packages the wheel
build vendors (:data:`VENDORED`), never scheduler or cache code.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

__all__ = ["VENDORED", "wheel_differences"]

#: Folders the wheel build adds (GPU kernels vendored from other projects).
VENDORED = ("vllm/third_party/", "vllm/vllm_flash_attn/")


def wheel_differences(wheel: Path, sources: Path) -> tuple[list[str], int, int]:
    """``(problems, files compared, vendored files only in the wheel)`` for ``wheel``
    against ``sources`` (the folder that holds the release's ``vllm/``)."""
    problems: list[str] = []
    compared = vendored = 0
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        for name in names:
            source = sources / name
            if not source.exists():
                if name.startswith(VENDORED):
                    vendored += 1
                else:
                    problems.append(f"{name}: only in the wheel")
                continue
            compared += 1
            if archive.read(name) != source.read_bytes():
                problems.append(f"{name}: differs from the source distribution")
    in_wheel = set(names)
    for path in (sources / "vllm").rglob("*.py"):
        name = path.relative_to(sources).as_posix()
        if name not in in_wheel:
            problems.append(f"{name}: only in the source distribution")
    return problems, compared, vendored
