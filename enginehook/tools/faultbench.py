"""``cachettl bench fault-engine-death``: an engine with the hook killed and restarted behind
vllm-router, as its clients see it.

One control plane (SQLite), two CPU engines with the hook (the tiny model, a fixed 60 s TTL,
the session middleware) and, for each router setting, one ``vllm-router`` with the
``sticky_least_loaded`` policy of the deploy page. Each phase:

1. opens ``sessions`` programs through the router (a first turn that calls a tool: pinned);
2. kills the engine holding most of them (SIGKILL to the server and its engine-core process,
   as the kernel's out-of-memory killer or a lost node would);
3. sends the next turn of each of its programs once a second until each is answered,
   recording every answer the client gets (HTTP status and body, or the connection error)
   and the time since the kill, and one turn of each program on the other engine;
4. restarts the engine on the same port, and opens a new program a second until the
   router sends one there (it is back in the rotation).

Nothing here is asserted: the figures are printed (``results/fault_engine_death.md``;
docs/operations.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.tools import faultstore
from enginehook.tools.cluster import ClusterEngine, Router
from enginehook.tools.servers import ControlPlaneProcess, free_port, wait_for
from enginehook.tools.tinymodel import build_tiny_llama, random_words

__all__ = ["SETTINGS", "Answer", "Phase", "format_report", "register", "run_fault_engine_death"]

#: Router settings compared: vllm-router 0.1.17's defaults (health checks every 60 s, a
#: worker unhealthy after 3 failed checks; circuit breaker open after 10 failures, for 60 s;
#: 5 retries from 50 ms backing off 1.5x), and shorter ones.
SETTINGS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "short": (
        "--health-check-interval-secs",
        "5",
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        "--cb-failure-threshold",
        "3",
        "--cb-timeout-duration-secs",
        "10",
    ),
}


@dataclass(frozen=True)
class Answer:
    """What the client got for one turn: HTTP status (0: no HTTP answer), the body's start
    (or the connection error), the seconds since the kill, the answering engine, the prompt
    tokens it found cached."""

    session: str
    status: int
    body: str
    at_s: float
    engine: str = ""
    cached_tokens: int = 0


@dataclass
class Program:
    """One program: its session id and messages so far."""

    name: str
    messages: list[dict[str, Any]]
    engine: str = ""


@dataclass
class Phase:
    """One router setting's figures."""

    setting: str
    args: tuple[str, ...]
    sessions: int = 0
    victim_sessions: int = 0
    answers: list[Answer] = field(default_factory=list)
    others: list[Answer] = field(default_factory=list)
    restart_s: float = 0.0
    readmitted_s: float | None = None
    new_failed: int = 0
    returning: list[Answer] = field(default_factory=list)


def _turn(base_url: str, program: Program, t0: float, tool: bool = True) -> Answer:
    """One turn of ``program`` through ``base_url``; on success the answer joins its
    messages. Never raises for an HTTP error or a refused connection: it is the figure."""
    body = {
        "model": "tiny",
        "messages": program.messages,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": {"tool": "bash", "tool_args": "pytest -x"} if tool else {},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("X-Session-ID", program.name)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            reply = json.loads(r.read().decode())
            engine = r.headers.get("x-cachettl-engine", "")
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")[:160]
        return Answer(program.name, error.code, " ".join(text.split()), time.monotonic() - t0)
    except OSError as error:
        return Answer(program.name, 0, str(error)[:160], time.monotonic() - t0)
    usage = reply.get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    text = reply["choices"][0]["message"]["content"] or ""
    program.messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "3 passed"},
    ]
    program.engine = engine
    return Answer(program.name, 200, "", time.monotonic() - t0, engine, cached)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (Linux: every ``/proc/N/stat``'s parent field)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_tree(engine: ClusterEngine) -> None:
    """SIGKILL to the engine's server and every process under it (vLLM's engine core)."""
    assert engine.proc is not None
    for pid in [*_descendants(engine.proc.pid), engine.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    engine.proc.wait(30)
    engine.proc = None


def _open(router: Router, count: int, prefix: str, rng: random.Random) -> list[Program]:
    programs = []
    for i in range(count):
        program = Program(
            f"{prefix}-{i}",
            [
                {"role": "system", "content": random_words(rng, 40)},
                {"role": "user", "content": random_words(rng, 120)},
            ],
        )
        answer = _turn(router.url, program, time.monotonic())
        if answer.status != 200:
            raise RuntimeError(f"{program.name}'s first turn failed: {answer}")
        programs.append(program)
    return programs


def _outage(
    router: Router, victims: list[Program], phase: Phase, t0: float, limit_s: float
) -> None:
    """Send each victim program's next turn once a second until each is answered."""
    pending = list(victims)
    while pending and time.monotonic() - t0 < limit_s:
        for program in list(pending):
            answer = _turn(router.url, program, t0)
            phase.answers.append(answer)
            if answer.status == 200:
                pending.remove(program)
        time.sleep(1.0)


def _readmission(
    router: Router, victim: ClusterEngine, phase: Phase, rng: random.Random, limit_s: float
) -> None:
    """After the restart: a new program a second until one lands on the victim (a new
    program the router fails is counted in ``phase.new_failed``)."""
    since = time.monotonic()
    n = 0
    while time.monotonic() - since < limit_s:
        program = Program(
            f"{phase.setting}-new{n}", [{"role": "user", "content": random_words(rng, 60)}]
        )
        n += 1
        answer = _turn(router.url, program, since)
        if answer.status != 200:
            phase.new_failed += 1
        elif answer.engine == victim.address:
            phase.readmitted_s = answer.at_s
            return
        time.sleep(1.0)


def _phase(
    setting: str,
    router: Router,
    engines: list[ClusterEngine],
    sessions: int,
    limits: tuple[float, float],
) -> Phase:
    phase = Phase(setting, SETTINGS[setting], sessions)
    rng = random.Random(setting)
    router.start()
    try:
        programs = _open(router, sessions, setting, rng)
        held = Counter(p.engine for p in programs)
        victim = max(engines, key=lambda e: held[e.address])
        victims = [p for p in programs if p.engine == victim.address]
        phase.victim_sessions = len(victims)
        t0 = time.monotonic()
        kill_tree(victim)
        _outage(router, victims, phase, t0, limits[0])
        others = [p for p in programs if p not in victims]
        phase.others = [_turn(router.url, p, t0) for p in others]
        started = time.monotonic()
        victim.log.rename(victim.log.with_name(f"{victim.name}-killed-{setting}.log"))
        victim.start()
        wait_for(victim.ready, 600, f"{victim.name} restarted")
        phase.restart_s = time.monotonic() - started
        _readmission(router, victim, phase, rng, limits[1])
        phase.returning = [_turn(router.url, p, t0) for p in victims]
    finally:
        router.stop()
    return phase


def run_fault_engine_death(
    work: Path,
    settings: list[str],
    sessions: int = 6,
    outage_limit_s: float = 240.0,
    readmit_limit_s: float = 240.0,
) -> list[Phase]:
    """Start the control plane and two engines in ``work``, run one phase per router
    setting (a name of :data:`SETTINGS`), stop everything; the phases' figures."""
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"--settings: unknown {unknown}; choose from {sorted(SETTINGS)}")
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(work / "tiny")
    plane = ControlPlaneProcess(f"sqlite:///{work}/cp.sqlite3", free_port(), work / "cp.log")
    routers = {s: Router("sticky_least_loaded", [], work, SETTINGS[s]) for s in settings}
    env = {"CACHETTL_ROUTER_URLS": ",".join(r.url for r in routers.values())}
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False},
        "control_plane": f"127.0.0.1:{plane.port}",
        "token_file": str(work / "token"),
    }
    engines = [ClusterEngine(f"engine{i}", model, work, hook, env=env) for i in (1, 2)]
    plane.start()
    (work / "token").write_text(plane.token)
    try:
        for engine in engines:
            engine.start()
        wait_for(lambda: all(e.ready() for e in engines), 900, "two engines")
        phases = []
        for setting, router in routers.items():
            router.workers = [e.url for e in engines]
            limits = (outage_limit_s, readmit_limit_s)
            phases.append(_phase(setting, router, engines, sessions, limits))
        return phases
    finally:
        for engine in engines:
            if engine.proc is not None:
                engine.stop()
        plane.stop()


def _answer_kinds(answers: list[Answer]) -> list[str]:
    """The distinct answers (status and body) with their count and first and last time."""
    kinds: dict[tuple[int, str], list[float]] = {}
    for a in answers:
        kinds.setdefault((a.status, a.body if a.status != 200 else ""), []).append(a.at_s)
    rows = []
    for (status, body), times in kinds.items():
        what = f"HTTP {status}" if status else "no HTTP answer"
        rows.append(
            f"  {what} x{len(times)} at {min(times):.1f}-{max(times):.1f} s"
            + (f": {body}" if body else "")
        )
    return rows


def format_report(phases: list[Phase]) -> str:
    """The phases' figures as text (seconds since the kill unless said)."""
    lines = []
    for p in phases:
        args = " ".join(p.args) or "(none)"
        lines.append(f"## router {p.setting}: sticky_least_loaded {args}")
        lines.append(f"sessions {p.sessions}, on the killed engine {p.victim_sessions}")
        lines.append("client answers to the killed engine's sessions until each was served:")
        lines += _answer_kinds(p.answers)
        served = [a for a in p.answers if a.status == 200]
        back = sorted(a.at_s for a in served)
        if back:
            lines.append(
                f"sessions served again: {len(back)}/{p.victim_sessions}, first at "
                f"{back[0]:.1f} s, last at {back[-1]:.1f} s; cached tokens "
                f"{[a.cached_tokens for a in served]} (the pins died with the engine)"
            )
        else:
            lines.append(f"sessions served again: 0/{p.victim_sessions} within the limit")
        ok = sum(a.status == 200 for a in p.others)
        hits = [a.cached_tokens for a in p.others]
        lines.append(
            f"the other engine's sessions meanwhile: {ok}/{len(p.others)} OK, cached {hits}"
        )
        lines.append(f"engine restart to /health: {p.restart_s:.1f} s")
        readmit = "not within the limit" if p.readmitted_s is None else f"{p.readmitted_s:.1f} s"
        lines.append(
            f"restart healthy to the router's first new session there: {readmit} "
            f"(new sessions failed meanwhile: {p.new_failed})"
        )
        where = Counter(a.engine or f"HTTP {a.status}" for a in p.returning)
        lines.append(f"the killed engine's sessions after its return went to: {dict(where)}")
        lines.append("")
    return "\n".join(lines)


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl bench fault-engine-death``."""
    p = bench.add_parser(
        "fault-engine-death",
        help="an engine with the hook killed and restarted behind vllm-router: what clients "
        "get, and how long until its sessions are served again (two real CPU engines)",
    )
    p.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"router settings to compare, comma-separated (of {', '.join(SETTINGS)})",
    )
    p.add_argument("--sessions", type=int, default=6, help="programs open at the kill")
    p.add_argument("--work", default="", help="folder for logs and the model (default: a temp)")
    p.set_defaults(handler=_bench)
    faultstore.register(bench)


def _bench(args: argparse.Namespace) -> int:
    if args.sessions < 2:
        raise ValueError(f"--sessions: at least 2 (one per engine), got {args.sessions}")
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise ValueError(f"--settings: unknown {unknown}; choose from {sorted(SETTINGS)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="cachettl-fault-"))
    started = time.monotonic()
    phases = run_fault_engine_death(work, settings, args.sessions)
    print(format_report(phases))
    print(f"(work folder {work}; {time.monotonic() - started:.0f} s in all)")
    return 0
