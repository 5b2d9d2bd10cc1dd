"""mini-swe-agent programs on a real model, served by vLLM with the hook (the agent extra).

What a user wires, in one place, for ``examples/mini_swe_agent``, ``cachettl bench agent``
and the end-to-end test:

- :func:`make_sandbox`: a small git repository made on the spot (a Python package with a
  bug, its pytest suite, a README) in which the agent's commands really run;
- :func:`load_agent_config` and :func:`run_agent`: mini-swe-agent's ``DefaultAgent`` with
  its ``LocalEnvironment`` and its litellm text model, configured by the example's YAML; the
  one change to an agent's configuration is ``model.model_kwargs``: ``api_base`` of the
  vLLM server and an ``X-Session-ID`` header per agent run (the program id the hook keys
  pins on);
- the servers it runs against (vLLM with or without the hook, ``cachettl serve``) are
  started by :mod:`enginehook.tools.servers`.

A 135M model follows the format loosely: a reply without exactly one ```` ```bash ```` block
gets mini-swe-agent's own format-error turn, which is a turn like any other.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CONFIG",
    "TASKS",
    "AgentRun",
    "load_agent_config",
    "make_sandbox",
    "run_agent",
]

#: The example's mini-swe-agent configuration (templates, environment, model wiring).
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "mini_swe_agent" / "config.yaml"

#: Tasks for the sandbox repository (one per agent program, cycled).
TASKS = (
    "The test test_remove in tests/test_stock.py fails. Find the bug in inventory/stock.py.",
    "Find where the text report of the stock is made and run the tests.",
    "List the files of the repository, read README.md and run the test suite.",
    "Find the TODO in the inventory package and show the lines around it.",
)

_SANDBOX_FILES = {
    "README.md": "# inventory\n\nA tiny stock-keeping library. Tests: `python -m pytest -q`.\n",
    "inventory/__init__.py": 'from inventory.stock import Stock\n\n__all__ = ["Stock"]\n',
    "inventory/stock.py": '''\
        """Item counts of a store."""


        class Stock:
            def __init__(self):
                self.counts = {}

            def add(self, item, n=1):
                self.counts[item] = self.counts.get(item, 0) + n

            def remove(self, item, n=1):
                # TODO: refuse to go below zero
                self.counts[item] = self.counts.get(item, 0) + n

            def total(self):
                return sum(self.counts.values())
        ''',
    "inventory/report.py": '''\
        """Text report of a Stock."""


        def report(stock):
            lines = [f"{item}: {n}" for item, n in sorted(stock.counts.items())]
            return "\\n".join(lines)
        ''',
    "tests/test_stock.py": """\
        from inventory import Stock


        def test_add():
            s = Stock()
            s.add("apple", 3)
            assert s.total() == 3


        def test_remove():
            s = Stock()
            s.add("apple", 3)
            s.remove("apple", 2)
            assert s.counts["apple"] == 1
        """,
}


def make_sandbox(path: Path) -> Path:
    """A git repository with the ``inventory`` package and its tests at ``path``."""
    for name, text in _SANDBOX_FILES.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
    git = ["git", "-c", "user.name=inventory", "-c", "user.email=inventory@example.com"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "inventory"]):
        subprocess.run(git + cmd, cwd=path, check=True, capture_output=True)
    return path


def load_agent_config(path: Path = DEFAULT_CONFIG) -> dict[str, Any]:
    """The mini-swe-agent configuration at ``path`` (sections agent, environment, model)."""
    import yaml  # type: ignore[import-untyped]

    if not path.is_file():
        raise FileNotFoundError(f"agent config: {path} does not exist")
    config = yaml.safe_load(path.read_text())
    missing = [k for k in ("agent", "environment", "model") if k not in (config or {})]
    if missing:
        raise ValueError(f"agent config {path}: missing section(s) {', '.join(missing)}")
    return dict(config)


@dataclass
class AgentRun:
    """One agent program: its session id, exit status, and per-turn figures."""

    session_id: str
    exit_status: str = ""
    turns: int = 0
    format_errors: int = 0
    turn_commands: list[str | None] = field(default_factory=list)  # None: format error
    started_s: float = 0.0
    finished_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # each model call, request → reply
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def commands(self) -> list[str]:
        """The commands the agent ran, in order."""
        return [c for c in self.turn_commands if c is not None]

    @property
    def jct_s(self) -> float:
        return self.finished_s - self.started_s


def _model_config(config: dict[str, Any], base_url: str, session_id: str) -> dict[str, Any]:
    model = copy.deepcopy(config["model"])
    kwargs = model.setdefault("model_kwargs", {})
    kwargs["api_base"] = base_url
    kwargs["extra_headers"] = {**kwargs.get("extra_headers", {}), "X-Session-ID": session_id}
    return dict(model)


def run_agent(
    config: dict[str, Any],
    *,
    base_url: str,
    session_id: str,
    workdir: Path,
    task: str,
    step_limit: int | None = None,
) -> AgentRun:
    """Run one mini-swe-agent program to its end (submitted, step limit, format errors)."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models import get_model

    agent_cfg = dict(config["agent"])
    if step_limit is not None:
        agent_cfg["step_limit"] = step_limit
    env_cfg = copy.deepcopy(config["environment"])
    # The sandbox's `python` and `pytest` are this interpreter's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env_cfg["env"] = {**env_cfg.get("env", {}), "PATH": path}
    model = get_model(config=_model_config(config, base_url, session_id))
    run = AgentRun(session_id, started_s=time.monotonic())
    _time_queries(model, run)
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(workdir), **env_cfg), **agent_cfg)
    try:
        result = agent.run(task)
        run.exit_status = str(result.get("exit_status", ""))
    except Exception as error:  # e.g. the context window: the program ends there, as in use
        run.exit_status = type(error).__name__
    finally:
        run.finished_s = time.monotonic()
    _tally(run, agent.messages)
    return run


def _time_queries(model: Any, run: AgentRun) -> None:
    """Record each model call's latency (request → reply) in ``run.latencies_s``."""
    query = model.query

    def timed(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        sent = time.monotonic()
        try:
            return query(messages, **kwargs)
        finally:
            run.latencies_s.append(time.monotonic() - sent)

    model.query = timed


def _tally(run: AgentRun, messages: list[dict[str, Any]]) -> None:
    """Each model turn in order: the command it ran, or ``None`` (a format error)."""
    for message in messages:
        extra = message.get("extra") or {}
        response = extra.get("response")
        if not isinstance(response, dict):
            continue  # not a model turn (templates, observations)
        run.turns += 1
        usage = response.get("usage") or {}
        run.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        run.cached_tokens += int(details.get("cached_tokens") or 0)
        actions = extra.get("actions") or []
        if extra.get("interrupt_type") == "FormatError" or not actions:
            run.format_errors += 1
            run.turn_commands.append(None)
        else:
            run.turn_commands.append(str(actions[0].get("command", "")))
