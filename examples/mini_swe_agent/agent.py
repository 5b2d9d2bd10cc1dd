"""mini-swe-agent on a vLLM server with the CacheTTL hook: one program per agent run.

Start the server (see README.md, "Agents: mini-swe-agent on a real model"), then:

    python examples/mini_swe_agent/agent.py --base-url http://127.0.0.1:8000/v1 --programs 3

Each program works in its own small git repository made on the spot (a Python package
with a bug and its tests) and sends its session id in the ``X-Session-ID`` header: the
program id the hook pins KV blocks for between the agent's turns. This is all the wiring
an agent needs; ``enginehook.tools.agentrun.run_agent`` does the same and records timings.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml  # type: ignore[import-untyped]

from enginehook.tools.agentrun import TASKS, make_sandbox

CONFIG = Path(__file__).with_name("config.yaml")


def run_one(config: dict, base_url: str, task: str, workdir: Path) -> dict:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models import get_model

    model_config = copy.deepcopy(config["model"])
    # The one change to the agent's configuration: where the server is, and who is asking.
    model_config["model_kwargs"]["api_base"] = base_url
    model_config["model_kwargs"]["extra_headers"] = {"X-Session-ID": f"mswea-{uuid.uuid4()}"}
    agent = DefaultAgent(
        get_model(config=model_config),
        LocalEnvironment(cwd=str(workdir), **config["environment"]),
        **config["agent"],
    )
    result = agent.run(task)
    session = model_config["model_kwargs"]["extra_headers"]["X-Session-ID"]
    commands = [
        a["command"] for m in agent.messages for a in (m.get("extra") or {}).get("actions", [])
    ]
    return {"session": session, "exit_status": result.get("exit_status"), "commands": commands}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--programs", type=int, default=3)
    parser.add_argument("--config", type=Path, default=CONFIG)
    args = parser.parse_args()
    if args.programs < 1:
        parser.error("--programs must be at least 1")
    config = yaml.safe_load(args.config.read_text())
    with tempfile.TemporaryDirectory(prefix="mswea-") as tmp:

        def one(i: int) -> dict:
            repo = make_sandbox(Path(tmp) / f"repo-{i}")
            return run_one(config, args.base_url, TASKS[i % len(TASKS)], repo)

        with ThreadPoolExecutor(args.programs) as pool:
            for outcome in pool.map(one, range(args.programs)):
                print(outcome)


if __name__ == "__main__":
    main()
