"""Which calls get a signature: only those whose arguments name a command, or a tool the
operator gave a rule. The calls are shaped as the agents of the field send them."""

from __future__ import annotations

import pickle

import pytest

from estimator import DurationHierarchy, Level
from estimator.signatures import (
    RULES_VERSION,
    SignatureRegistry,
    SignatureRule,
    parse_rules,
)

#: (tool, arguments, signature) as agents send them.
AGENT_CALLS = [
    # mini-swe-agent: the command line itself
    ("bash", "cd /testbed && python -m pytest tests/test_x.py -x", "cd+python"),
    ("bash", "pytest -x", "pytest"),
    ("bash", "git status", "git"),
    # SWE-agent and OpenHands: JSON naming the command
    ("bash", '{"command": "pytest -x -q"}', "pytest"),
    ("execute_bash", '{"command": "ls -la", "is_input": "false"}', "ls"),
    ("str_replace_editor", '{"command": "view", "path": "/testbed/x.py"}', "view"),
    # Claude Code, Gemini CLI, Cursor: their names for a shell
    ("Bash", '{"command": "npm run build", "timeout": 600000}', "npm"),
    ("run_shell_command", '{"command": "make -j4"}', "make"),
    ("run_terminal_cmd", '{"command": "cargo test", "is_background": false}', "cargo"),
    # OpenAI Codex: an argument vector, the script of a shell's -c read as a line
    ("shell", '{"command": ["bash", "-lc", "pytest -q"], "workdir": "/r"}', "pytest"),
    ("local_shell", '{"cmd": ["rg", "-n", "TODO"]}', "rg"),
    # free text: queries, patterns, code, paths
    ("web_search", "python decimal rounding", ""),
    ("web_search", '{"query": "vllm prefix caching", "max_results": 5}', ""),
    ("grep", "def count_stock", ""),
    ("grep", '{"pattern": "def count_stock", "path": "src"}', ""),
    ("execute_ipython_cell", '{"code": "import os\\nos.listdir()"}', ""),
    ("read_file", '{"path": "src/app.py"}', ""),
    ("fetch_url", '{"url": "https://example.org/x", "mode": "raw"}', ""),
    ("bash", '{"restart": true}', ""),
]


@pytest.mark.parametrize(("tool", "args", "expected"), AGENT_CALLS)
def test_only_arguments_that_name_a_command_give_a_signature(
    tool: str, args: str, expected: str
) -> None:
    assert SignatureRegistry().signature(tool, args) == expected


def test_free_text_does_not_split_a_tools_samples() -> None:
    h = DurationHierarchy(min_samples=1)
    for query in ("python decimal rounding", "how to sort a dict", "rust borrow checker"):
        h.update("web_search", query, 1.2)
    for pattern in ("def count_stock", "class Foo", "import re"):
        h.update("grep", pattern, 0.05)
    h.update("bash", "pytest -x", 9.0)
    assert h.signatures_of("web_search") == []
    assert h.signatures_of("grep") == []
    assert h.signatures_of("bash") == ["pytest"]
    assert h.lookup("web_search", "python decimal rounding").level is Level.TOOL


@pytest.mark.parametrize(
    ("rule", "tool", "args", "expected"),
    [
        ("grep=command", "grep", "rg -n x", "rg"),
        ("bash=none", "bash", "pytest -x", ""),
        ("web_search=keys", "web_search", '{"query": "x", "n": 1}', "web_search(n,query)"),
        ("runner=regex:--suite[= ]([a-z]+)", "runner", "go --suite unit -v", "unit"),
        ("runner=regex:--suite[= ]([a-z]+)", "runner", "go -v", ""),
        ("sql=regex:[A-Za-z]+", "sql", "  SELECT * FROM t", "SELECT"),
        ("sql=regex:(?i)^\\s*(select|insert)?", "sql", "drop table t", ""),
    ],
)
def test_an_operators_rule_decides_for_its_tool(
    rule: str, tool: str, args: str, expected: str
) -> None:
    registry = SignatureRegistry(rules=parse_rules([rule]))
    assert registry.signature(tool, args) == expected
    assert registry.signature("other", "ls") == ""  # other tools keep the built-in rules


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bash", "must be TOOL=KIND"),
        ("=command", "must be TOOL=KIND"),
        (" bash=command", "blanks around it"),
        ("bash=shell", "the kind must be command, keys, none or regex:PATTERN, got 'shell'"),
        ("bash=regex:", "regex: needs a pattern"),
        ("bash=regex:(", "the pattern does not compile"),
    ],
)
def test_a_bad_rule_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="signature rule") as error:
        SignatureRule.parse(text)
    assert message in str(error.value)
    assert repr(text) in str(error.value)


def test_one_rule_per_tool() -> None:
    with pytest.raises(ValueError, match="tool 'bash' already has rule 'bash=none'"):
        parse_rules(["bash=none", "bash=command"])


def test_the_key_names_the_rules_and_survives_pickling() -> None:
    registry = SignatureRegistry(rules=parse_rules(["runner=regex:-s ([a-z]+)", "bash=none"]))
    assert registry.key == (RULES_VERSION, ("runner=regex:-s ([a-z]+)", "bash=none"))
    copy = pickle.loads(pickle.dumps(registry))
    assert copy.key == registry.key
    assert copy.signature("runner", "x -s fast") == "fast"
    assert copy.signature("bash", "ls") == ""
    assert SignatureRegistry().key != registry.key


def test_a_registry_pickled_before_rules_existed_has_the_old_key() -> None:
    """A model snapshot stored by an earlier release holds a registry without rules: its
    key differs, so its models are not reused and the log is learned again."""
    old = SignatureRegistry()
    state = old.__getstate__()
    del state["rules"], state["version"]
    revived = SignatureRegistry.__new__(SignatureRegistry)
    revived.__setstate__(state)
    assert revived.key == (1, ())
    assert revived.key != SignatureRegistry().key
