"""The documentation site builds strictly, its reference pages match the registries they are
generated from, the operations page lists every metric, and no relative link in any Markdown
file of the repository is broken."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.docs.pages import DOCS, ROOT, anchors, relative_links

GENERATED = {DOCS / "reference" / "configuration.md", DOCS / "reference" / "grpc.md"}
_SKIP_DIRS = {".git", ".venv", "node_modules", "site", "build", "dist", "__pycache__"}


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(value: Any) -> str:
    """A default as the reference must show it (written here apart from the generator)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else f"{value:g}"
    if value == "":
        return "(empty)"
    return str(value)


def _rows(markdown: str, heading: str, after: str = "") -> dict[str, tuple[str, str]]:
    """``key -> (default, meaning)`` of the first table under ``heading`` (the first such
    heading after the line ``after``, when given)."""
    lines = markdown.splitlines()
    start = lines.index(heading, lines.index(after) if after else 0)
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        cells = re.match(r"^\| `([^`]+)` \| `([^`]*)` \| (.*) \|$", line)
        if cells:
            rows[cells.group(1)] = (cells.group(2).replace("\\|", "|"), cells.group(3))
    return rows


def test_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, or a page left out, fails."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("quickstart", "deploy", "reference/configuration", "reference/grpc"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
    assert (tmp_path / "site" / "results" / "frontier.png").exists()


def test_reference_pages_are_generated_not_copied() -> None:
    assert not any(path.exists() for path in GENERATED)


def test_configuration_reference_lists_every_hook_key_with_its_default() -> None:
    from enginehook.config import HookConfig
    from enginehook.core.rules import SchedulingRules

    rows = _rows(_reference().configuration_markdown(), "## Engine hook")
    assert list(rows) == HookConfig.keys()
    config, rules = HookConfig(), SchedulingRules()
    for field in dataclasses.fields(HookConfig):
        if field.name not in ("rules", "token"):
            assert rows[field.name][0] == _text(getattr(config, field.name)), field.name
    for name, help_ in SchedulingRules.help().items():
        assert rows[name] == (_text(getattr(rules, name)), " ".join(help_.split())), name
    assert all(meaning.strip() for _, meaning in rows.values())


def test_configuration_reference_lists_every_simulator_policy_parameter() -> None:
    from simulator.policies import POLICIES

    page = _reference().configuration_markdown()
    for name, cls in POLICIES.items():
        rows = _rows(page, f"### `{name}`", after="## Simulator policies")
        assert set(rows) == set(cls.PARAMS), name
        for key, param in cls.PARAMS.items():
            default = param.default if not isinstance(param.default, dict | list) else None
            if default is not None or param.default is None:
                assert rows[key][0] == _text(param.default).replace("(empty)", ""), (name, key)


def test_configuration_reference_lists_every_ttl_policy_and_serve_flag() -> None:
    from estimator import POLICIES

    page = _reference().configuration_markdown()
    for name in POLICIES:
        assert f"### `{name}`" in page
    assert "| `ttl_s` | `2` |" in page  # the fixed policy's parameter
    serve = _rows(page, "## Control plane: `cachettl serve`")
    help_ = subprocess.run(
        [str(Path(sys.executable).parent / "cachettl"), "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    flags = set(re.findall(r"(--[a-z][a-z-]+)", help_)) - {"--help"}
    assert set(serve) == flags


def test_grpc_reference_has_every_rpc_message_and_field() -> None:
    reference = _reference()
    page = reference.grpc_markdown()
    for file in reference.proto_descriptors().file:
        if not file.name.startswith("cachettl/"):
            continue
        for service in file.service:
            for method in service.method:
                assert f"| `{method.name}` |" in page, method.name
        for message in file.message_type:
            assert f"### {message.name} " in page, message.name
            for field in message.field:
                assert f"| `{field.name}` | {field.number} |" in page, (message.name, field.name)
    assert "Decides the TTL for one finished LLM turn that called a tool." in page  # a comment


def _hook_metric_names() -> set[str]:
    from controlplane.records import MissReason, TurnCache
    from enginehook.vllm.metrics import HookMetrics

    metrics = HookMetrics()
    metrics.decision("cold-start")
    metrics.released("ttl")
    metrics.fault("schedule")
    metrics.set_passthrough("no_prefix_caching")
    metrics.returned(TurnCache(MissReason.EXPIRED, expired_by_s=1.0))
    names = set(re.findall(r"^# TYPE (\S+)", metrics.prometheus(), re.M))
    for path in (ROOT / "enginehook" / "link").glob("*.py"):  # the sinks' counters
        names |= set(re.findall(r'\("(cachettl_[a-z_]+)", "(?:counter|gauge)"', path.read_text()))
    return names


def _control_plane_metric_names() -> set[str]:
    from controlplane.learning import LearningCounters, RetentionCounters
    from controlplane.rpc.metrics import Metrics
    from controlplane.storage.base import Compaction

    metrics = Metrics()
    metrics.track_learning(LearningCounters())
    retention = RetentionCounters()
    retention.counted(Compaction("cachettl", 1, 1, 0.0, None, 0.0, 1.0))
    metrics.track_retention(retention)
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.registry.collect()
    }


def test_operations_page_explains_every_metric() -> None:
    page = (DOCS / "operations.md").read_text()
    names = _hook_metric_names() | _control_plane_metric_names()
    assert len(names) > 30
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert missing == []


def _markdown_files() -> list[Path]:
    return sorted(
        path
        for path in ROOT.rglob("*.md")
        if not (_SKIP_DIRS & set(path.relative_to(ROOT).parts))
        and not any(p.endswith(".egg-info") for p in path.relative_to(ROOT).parts)
    )


def _resolve(source: Path, target: str) -> Path:
    path = (source.parent / target).resolve()
    if path.is_relative_to(DOCS / "results"):  # the site serves results/ there
        path = ROOT / "results" / path.relative_to(DOCS / "results")
    return path


def test_no_broken_relative_link_in_any_markdown_file() -> None:
    broken = []
    files = _markdown_files()
    assert ROOT / "README.md" in files
    assert DOCS / "index.md" in files
    for source in files:
        for line, link in relative_links(source):
            target, _, anchor = link.partition("#")
            path = _resolve(source, target) if target else source
            if path in GENERATED:
                continue
            where = f"{source.relative_to(ROOT)}:{line}: {link}"
            if not path.exists():
                broken.append(f"{where} (no such file)")
            elif (
                anchor
                and path.suffix == ".md"
                and not path.is_relative_to(DOCS)  # the site's own anchors: the strict build
                and anchor not in anchors(path)
            ):
                broken.append(f"{where} (no such heading)")
    assert broken == []


@pytest.mark.parametrize("heading", ["Cluster: pins behind a router", "The 2026 peers (`x.py`)"])
def test_heading_anchors_follow_github(heading: str) -> None:
    from tests.docs.pages import slug

    assert slug(heading) in ("cluster-pins-behind-a-router", "the-2026-peers-xpy")


def test_generator_examples() -> None:
    """The generator's docstring examples (docs/ is outside pytest's doctest paths)."""
    import doctest

    result = doctest.testmod(_reference(), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3
    assert result.failed == 0
