"""The code stays readable in pieces: no module over 600 lines, no function over 60."""

from __future__ import annotations

import argparse
import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("estimator", "controlplane", "enginehook", "simulator", "tests")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_gen" not in path.parts
    ]


def test_no_module_over_600_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines}"
        for path in _sources()
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    ]
    assert long == []


def test_no_function_over_60_lines() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert long == []


# --- Layering: which part of the house may import which --------------------------------------
#
# Every module belongs to the first part whose prefixes match its dotted name (a prefix is a
# module or a package: ``controlplane.rpc`` holds ``controlplane.rpc.server``). A part may
# import itself, the parts in ``may_import`` and any outside library except those in
# ``forbid``. Imports are read with ``ast``: module level, inside functions, under
# ``TYPE_CHECKING``, ``importlib.import_module("literal")``, ``__import__("literal")`` and any
# string that is the dotted path of a module of ours (``"a.b"`` or ``"a.b:attr"``: a name
# kept for a later dynamic import) all count. Entry points (``pyproject.toml``) are run-time
# imports by the module that loads their group: see ``test_entry_points_follow_the_layers``.

LAYER_PACKAGES = ("estimator", "controlplane", "enginehook", "simulator")


@dataclass(frozen=True)
class Part:
    name: str
    prefixes: tuple[str, ...]
    may_import: tuple[str, ...]
    forbid: tuple[str, ...] = ()


_VOCABULARY = ("records", "errors", "kvhints", "wire", "doors", "_resources", "_gen")
_DOMAIN = (
    "service",
    "learning",
    "state",
    "sharing",
    "snapshots",
    "inspection",
    "validation",
    "coherence",
)
_CONTROLPLANE = ("cp vocabulary", "cp storage", "cp domain", "cp rpc")
_CORE = ("enginehook core", "enginehook face")

#: The rule table, bottom to top. Part names starting ``cp`` are the control plane's layers.
PARTS = (
    Part("estimator", ("estimator",), (), forbid=("vllm",)),
    Part("cp vocabulary", tuple(f"controlplane.{n}" for n in _VOCABULARY), ("estimator",)),
    Part("cp storage", ("controlplane.storage",), ("cp vocabulary", "estimator")),
    Part(
        "cp domain", tuple(f"controlplane.{n}" for n in _DOMAIN), (*_CONTROLPLANE[:2], "estimator")
    ),
    Part("cp rpc", ("controlplane.rpc",), (*_CONTROLPLANE[:3], "estimator")),
    # The cli's face loads the ``cachettl.commands`` entry points, naming no package.
    Part("cp cli", ("controlplane",), (*_CONTROLPLANE, "estimator")),
    Part("enginehook core", ("enginehook.core",), ("cp vocabulary", "estimator"), forbid=("vllm",)),
    # The vLLM hook's settings: read by the link and the vLLM wing, and by the tools.
    Part("enginehook config", ("enginehook.config",), ("enginehook core", "estimator")),
    Part("enginehook hints", ("enginehook.hints",), (*_CORE, *_CONTROLPLANE, "estimator")),
    Part(
        "enginehook link",
        ("enginehook.link",),
        (*_CORE, "enginehook config", *_CONTROLPLANE, "estimator"),
    ),
    Part(
        "enginehook vllm",
        ("enginehook.vllm", "enginehook.scheduler"),
        (
            *_CORE,
            "enginehook config",
            "enginehook hints",
            "enginehook link",
            "cp vocabulary",
            "estimator",
        ),
    ),
    Part("enginehook tools", ("enginehook.tools",), ("*",)),
    # TTL-aware routing in a router's extension point (Ray Serve's RequestRouter).
    Part(
        "enginehook routing",
        ("enginehook.routing",),
        (*_CORE, *_CONTROLPLANE, "estimator"),
        forbid=("vllm",),
    ),
    # ``enginehook`` itself re-exports the core and the flat hints; ``enginehook.sessions``
    # is the stable path vLLM's --middleware flag names.
    Part("enginehook face", ("enginehook",), ("enginehook core", "enginehook hints"), ("vllm",)),
    Part("simulator studies", ("simulator.studies",), ("*",)),
    # The cluster hosts the TTL-aware router the routing wing ships.
    Part(
        "simulator cluster",
        ("simulator.cluster",),
        ("simulator model", *_CORE, "enginehook routing", "estimator"),
        ("vllm",),
    ),
    Part("simulator model", ("simulator",), ("simulator model", *_CORE, "estimator"), ("vllm",)),
)
PART_NAMES = {part.name for part in PARTS}


def _part(module: str) -> Part:
    for part in PARTS:
        if any(module == p or module.startswith(p + ".") for p in part.prefixes):
            return part
    raise AssertionError(f"{module}: no part of the rule table holds it")


def _module_files() -> dict[str, Path]:
    files = {}
    for package in LAYER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_gen" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


MODULES = _module_files()


def _imported(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``; ``from a import b`` names ``a.b``
    when that is a module of ours, else ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    read: set[int] = set()  # the literals of import calls, counted once
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield node.lineno, full if full in MODULES else base
        elif (
            isinstance(node, ast.Call)
            and _called(node.func) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            read.add(id(node.args[0]))
            yield node.lineno, node.args[0].value
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in read
        ):
            named = node.value.partition(":")[0]
            if "." in named and named in MODULES:
                yield node.lineno, named


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _ours(name: str) -> str | None:
    """The module of ours that ``name`` lands in (its longest known prefix), or None."""
    if name.split(".")[0] not in LAYER_PACKAGES:
        return None
    if name.startswith("controlplane._gen"):
        return "controlplane._gen"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module of ours it imports: first line}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for line, name in _imported(path, module):
            target = _ours(name)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_rule_table_names_known_parts() -> None:
    unknown = {
        (part.name, other)
        for part in PARTS
        for other in part.may_import
        if other != "*" and other not in PART_NAMES
    }
    assert unknown == set()
    assert sorted(m for m in MODULES if m.split(".")[0] in LAYER_PACKAGES) == sorted(MODULES)


def test_no_import_loop_between_files() -> None:
    graph = _import_graph()
    loops = [
        " <-> ".join(f"{m} (imports {', '.join(sorted(set(c) & set(graph[m])))})" for m in c)
        for c in _cycles(graph)
    ]
    assert loops == []


def test_every_import_follows_the_layers() -> None:
    broken = []
    for module, path in MODULES.items():
        part = _part(module)
        for line, name in _imported(path, module):
            target = _ours(name)
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if target is None:
                if name.split(".")[0] in part.forbid:
                    broken.append(f"{where}: {part.name} never imports {name.split('.')[0]}")
                continue
            allowed = {part.name, *part.may_import}
            if "*" not in allowed and _part(target).name not in allowed:
                broken.append(
                    f"{where} ({_part(target).name}): {part.name} may import only "
                    + ", ".join(sorted(allowed))
                )
    assert broken == []


def test_the_layering_check_sees_hidden_imports(tmp_path: Path) -> None:
    """The reader counts imports in functions, under TYPE_CHECKING and by importlib."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from enginehook.core.pins import Pin\n"
        "def f():\n    import vllm.v1.request\n"
        "    return importlib.import_module('enginehook.link.remote')\n"
        "from . import wire\n"
        "g = __import__('simulator.sim')\n"
        "LATER = ('simulator.studies.commands', 'enginehook.routing.ray:TtlAwareRequestRouter')\n"
        "NOT_A_MODULE = ('enginehook', 'simulator.nope', 'estimator.ttl is pure')\n"
    )
    names = sorted(name for _, name in _imported(source, "controlplane.probe"))
    expected = ["controlplane.wire", "enginehook.core.pins", "enginehook.link.remote"]
    expected += ["simulator.sim", "simulator.studies.commands", "enginehook.routing.ray"]
    assert names == sorted([*expected, "typing", "vllm.v1.request"])
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]
    ]
    assert _part("enginehook.core.pins").forbid == ("vllm",)


def test_proto_headers_name_the_real_generation_command() -> None:
    """Each .proto file's header names the command that writes its generated code."""
    wrong = []
    for proto in sorted((ROOT / "proto").rglob("*.proto")):
        lines = [line for line in proto.read_text().splitlines() if "Code generation" in line]
        command = lines[0].partition("): ")[2].split() if lines else []
        if command[-1:] != ["scripts/gen_proto.py"] or not (ROOT / command[-1]).is_file():
            wrong.append(f"{proto.relative_to(ROOT)}: {lines}")
    assert wrong == []


def _entry_points() -> dict[str, dict[str, str]]:
    """``{group: {name: "module:attr"}}`` as ``pyproject.toml`` declares them."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        groups: dict[str, dict[str, str]] = tomllib.load(handle)["project"].get("entry-points", {})
    return groups


def _loaders(group: str) -> list[str]:
    """The modules of ours that name ``group`` (and so load its entry points)."""
    return [
        module
        for module, path in MODULES.items()
        if any(
            isinstance(node, ast.Constant) and node.value == group
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]


def test_entry_points_follow_the_layers() -> None:
    """An entry point is imported at run time by the module that loads its group. That
    edge must follow the layers one way or the other: the loader may import the target (an
    ordinary downward import), or the target may import the loader (a plugin registering
    itself into a host below it, which names no plugin). A loader that reaches across the
    layers through an entry point fails here."""
    groups = _entry_points()
    assert groups, "pyproject.toml declares no entry points"
    broken = []
    for group, entries in groups.items():
        loaders = _loaders(group)
        assert loaders, f"no module of ours loads the entry-point group {group!r}"
        for name, target in entries.items():
            module = target.partition(":")[0]
            assert module in MODULES, f"{group}.{name}: {module} is not a module of ours"
            low, high = _part(module), None
            for loader in loaders:
                high = _part(loader)
                down = {high.name, *high.may_import}
                up = {low.name, *low.may_import}
                if not ("*" in down or low.name in down or "*" in up or high.name in up):
                    broken.append(f"{group}.{name} = {target}: {high.name} <-> {low.name}")
    assert broken == []


def test_the_cli_offers_every_command_through_its_entry_points() -> None:
    """Every package's subcommands reach ``cachettl`` through the installed entry points
    (the metadata the editable install or the wheel carries), none by a module name."""
    from importlib.metadata import entry_points

    from controlplane.cli import GROUP, build_parser

    declared = {name: target for name, target in _entry_points()[GROUP].items()}
    installed = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    assert installed == declared, "reinstall the package: pip install --no-deps -e ."

    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(sub[0].choices) if sub else {}

    top = choices(build_parser())
    offered = {f"{name} {sub}".strip() for name, p in top.items() for sub in [*choices(p), ""]}
    expected = {
        "serve", "db upgrade", "tenants create", "tenants list", "tenants revoke",
        "tools list", "tools show", "misses", "simulate", "trace generate", "trace stats",
        "demo",
        *(f"bench {b}" for b in (
            "ablation", "agent", "cluster", "controlplane", "estimator", "fidelity",
            "frontier", "learning", "policies", "router", "seeds", "simulator", "vllm",
        )),
    }  # fmt: skip
    assert expected - offered == set()
