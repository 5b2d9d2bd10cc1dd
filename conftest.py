"""What pytest collects from the repository root.

``pyproject.toml`` collects the docstring examples of every module of the four packages
(``--doctest-modules`` over ``estimator``, ``controlplane``, ``enginehook``, ``simulator``).
Where vLLM is not installed, the modules that import it when they load (directly or through
another module of ours) are left out, found from their imports rather than listed by hand.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGES = ("estimator", "controlplane", "enginehook", "simulator")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith(
        "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt], package: str) -> Iterator[str]:
    """Modules imported while the module loads: not inside functions or TYPE_CHECKING."""
    for node in body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_type_checking(node):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _load_time_imports(getattr(node, field, []), package)


def vllm_modules() -> set[str]:
    """Our modules that import vLLM when they load, directly or through each other."""
    modules = _modules()
    imports = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports[name] = set(_load_time_imports(ast.parse(path.read_text()).body, package))
    needs = {
        name for name, names in imports.items() if any(n.split(".")[0] == "vllm" for n in names)
    }
    while True:
        more = {name for name, names in imports.items() if names & needs} - needs
        if not more:
            return needs
        needs |= more


collect_ignore = (
    []
    if importlib.util.find_spec("vllm") is not None
    else [str(_modules()[name].relative_to(ROOT)) for name in sorted(vllm_modules())]
)
