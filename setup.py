"""The package list, found rather than written out (everything else is in pyproject.toml).

Every import package under ``estimator``, ``controlplane``, ``enginehook`` and ``simulator`` is
found with its subpackages, so a new folder ships without an edit here. ``migrations/`` and
``proto/`` ship inside ``controlplane`` (``controlplane.migrations``, ``controlplane.proto``)
so that they never shadow the unrelated PyPI distributions called ``migrations`` or ``proto``.
"""

from setuptools import find_namespace_packages, find_packages, setup

TOP = ["estimator", "controlplane", "enginehook", "simulator"]
MAPPED = {"controlplane.migrations": "migrations", "controlplane.proto": "proto"}


def _inside(name: str, folder: str) -> list[str]:
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [name, *(f"{name}.{sub}" for sub in found)]


setup(
    packages=[
        *find_packages(include=[f"{top}*" for top in TOP]),
        *(package for name, folder in MAPPED.items() for package in _inside(name, folder)),
    ],
    package_dir={name: folder for name, folder in MAPPED.items()},
)
