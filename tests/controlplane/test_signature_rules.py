"""Argument signatures through a real control plane: free text never becomes one, an
operator's rule reaches the engines in every snapshot, and a store whose models keyed free
text learns them again on restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from controlplane.records import ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from controlplane.storage.base import Horizon
from enginehook.link.snapshot import SnapshotFollower, follow, models_from_snapshot
from estimator import Level, RequestFacts, get_policy
from estimator.signatures import SignatureRegistry, auto_signature, parse_rules

#: (tool, arguments, duration s) as agents send them; each is called CALLS times.
SHAPES = [
    ("web_search", "python decimal rounding", 1.5),
    ("web_search", '{"query": "vllm prefix caching", "max_results": 5}', 1.2),
    ("grep", "def count_stock", 0.05),
    ("grep", '{"pattern": "class Foo", "path": "src"}', 0.04),
    ("bash", "pytest -x", 9.0),
    ("bash", "git status", 0.02),
]
CALLS = 12


def _calls(prefix: str) -> list[ToolCall]:
    now = time.time() - 60
    return [
        ToolCall(f"{prefix}-{i}-{k}", f"{prefix}-p{k}", tool, args, d * (1 + k / 50), now + k)
        for i, (tool, args, d) in enumerate(SHAPES)
        for k in range(CALLS)
    ]


def _signatures(client: ControlPlaneClient) -> dict[str, list[str]]:
    return {t.tool_name: list(t.signatures) for t in client.list_tools().tools}


def _learn_as_earlier_releases(plane: ControlPlane) -> None:
    """Make ``plane``'s models key signatures as releases before the rules did (every
    argument read as a command line), with the configuration they stored."""
    legacy = SignatureRegistry(default=auto_signature)
    legacy.version = 1
    plane.state.models.durations.signatures = legacy
    plane.state.config = plane.state.config[:3]


def test_free_text_gives_no_signature_and_commands_still_do(
    tmp_path: Path, serve: Callable[..., Any]
) -> None:
    plane = ControlPlane(create_store(f"sqlite:///{tmp_path / 'db.sqlite3'}"), min_samples=5)
    _, token = plane.create_tenant("acme")
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        assert client.record_tool_calls(_calls("a")).accepted == len(SHAPES) * CALLS
        assert _signatures(client) == {"bash": ["git", "pytest"], "grep": [], "web_search": []}
        assert client.decide_ttl("bash", "pytest -x -q", 8000).basis == "invocation"
        assert client.decide_ttl("web_search", "python decimal rounding", 8000).basis == "tool"
        shown = client.tool_distribution("grep", "def count_stock")
        assert (shown.signature, shown.basis) == ("", "tool")
    plane.store.close()


def test_an_operators_rule_reaches_the_engine_in_every_snapshot(
    serve: Callable[..., Any],
) -> None:
    rules = parse_rules(["grep=regex:^(def|class) ", "bash=none"])
    plane = ControlPlane(create_store("memory://"), min_samples=5, signature_rules=rules)
    tenant, token = plane.create_tenant("acme")
    plane.record_tool_calls(tenant, _calls("a"))
    policy = get_policy("cachettl")
    with (
        serve(plane, watch_interval_s=0.05) as server,
        ControlPlaneClient(server.target, token) as client,
    ):
        assert _signatures(client) == {"bash": [], "grep": ["def"], "web_search": []}
        for compact in (True, False):
            snapshot = next(follow(client, 0, SnapshotFollower(compact=compact)))
            assert snapshot.signature_rules == ("grep=regex:^(def|class) ", "bash=none")
            models = models_from_snapshot(snapshot, policy, tenant="acme")
            for tool, args, level in [
                ("grep", "def count_stock", Level.INVOCATION),
                ("bash", "pytest -x", Level.TOOL),
            ]:
                facts = RequestFacts(tool=tool, tool_args=args, context_tokens=8000, tenant="acme")
                assert models.durations.lookup(tool, args, "acme").level is level
                engine = policy.decide(facts, models)
                server_side = client.decide_ttl(tool, args, 8000)
                assert engine.basis == server_side.basis == level.value
                assert engine.ttl_s == pytest.approx(server_side.ttl_s, rel=0.05, abs=1e-3)


@pytest.mark.parametrize("compacted", [False, True])
def test_a_store_that_keyed_free_text_learns_again_on_restart(
    tmp_path: Path, serve: Callable[..., Any], compacted: bool
) -> None:
    """Events and a model snapshot written as earlier releases keyed them (``python``
    for a web search, ``def`` for a grep pattern): a restarted server shows none of
    those signatures. With the whole log it learns it again; with a log compacted past
    a replay it keeps the snapshot's tool models and drops its invocation models."""
    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    store = create_store(url)
    old = ControlPlane(store, min_samples=5)
    _learn_as_earlier_releases(old)
    tenant, token = old.create_tenant("acme")
    old.record_tool_calls(tenant, _calls("a"))
    learned = {t.tool: t.signatures for t in old.list_tools("acme")}
    assert learned["web_search"] == ["python", "web_search(max_results,query)"]
    assert learned["grep"] == ["def", "grep(path,pattern)"]
    assert old.write_snapshot()
    if compacted:
        record = store.latest_snapshot("cachettl")  # as the earlier release compacted
        assert record is not None
        store.compact_log(record, Horizon(max_rows=1), time.time(), False)
        assert store.log_compaction() is not None
    store.close()

    store = create_store(url)
    plane = ControlPlane(store, min_samples=5)
    with serve(plane) as server, ControlPlaneClient(server.target, token) as client:
        signatures = _signatures(client)
        assert signatures["web_search"] == signatures["grep"] == []
        assert signatures["bash"] == ([] if compacted else ["git", "pytest"])
        counts = {t.tool_name: t.sample_count for t in client.list_tools().tools}
        assert counts == {"bash": 2 * CALLS, "grep": 2 * CALLS, "web_search": 2 * CALLS}
        client.record_tool_calls([ToolCall("b-1", "b-p", "bash", "pytest -q", 8.0)])
        assert "pytest" in _signatures(client)["bash"]
    store.close()


def test_a_bad_rule_stops_the_server_in_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.__main__ import main

    db = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    assert main(["serve", "--db", db, "--signature-rule", "bash=shell"]) == 2
    err = capsys.readouterr().err.strip()
    assert "signature rule 'bash=shell': the kind must be command, keys, none or regex:" in err
    assert len(err.splitlines()) == 1
    config = tmp_path / "serve.toml"
    config.write_text('signature-rule = ["grep=regex:("]\n')
    assert main(["serve", "--config", str(config), "--db", db]) == 2
    assert "signature rule 'grep=regex:(': the pattern does not compile" in capsys.readouterr().err
