"""Does a finished turn end in a tool call, and which tool?

Sources, in order of trust:

1. ``last_turn``: the client says the program ends here; never a tool call.
2. The engine's tool-call parser output (``parsed``: ``(name, arguments)`` pairs).
3. The client's ``tool`` hint (the agent knows what it is about to run).
4. A ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block in the text (the
   Hermes/Qwen format that vLLM's ``hermes`` parser reads).
5. mini-swe-agent's rule: exactly one action block is the action; its submit command
   (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) ends the program. The blocks are those
   of mini-swe-agent 2.4's configurations: a fence of ```` ```mswea_bash_command ```` (its
   default and text-based ones) or ```` ```bash ```` (earlier releases, and most custom
   configs), or a ``<mswea_bash_command>`` tag (its XML configs).

>>> detect_tool_call("Let me look.\\n```bash\\nls -la\\n```")
DetectedCall(name='bash', arguments='ls -la', source='bash-block')
>>> detect_tool_call("THOUGHT: list\\n```mswea_bash_command\\nls src\\n```").arguments
'ls src'
>>> detect_tool_call("<mswea_bash_command>grep -rn foo .</mswea_bash_command>").arguments
'grep -rn foo .'
>>> detect_tool_call("Two blocks\\n```bash\\nls\\n```\\n```bash\\npwd\\n```") is None
True
>>> detect_tool_call("x", hint="search").name
'search'
>>> detect_tool_call("```bash\\nls\\n```", last_turn=True) is None
True
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["SUBMIT_MARKER", "DetectedCall", "detect_tool_call"]

#: mini-swe-agent's submission command: the turn that runs it is the program's last.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_BASH_BLOCK = re.compile(
    r"```(?:bash|mswea_bash_command)\s*\n(.*?)\n?```"
    r"|<mswea_bash_command>(.*?)</mswea_bash_command>",
    re.DOTALL,
)
_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MAX_ARGS_CHARS = 4096


@dataclass(frozen=True, slots=True)
class DetectedCall:
    """A tool call detected in a turn's output: the tool's name, its argument string, and
    the source rule (not to be confused with ``controlplane.records.ToolCall``, the
    control plane's record of a finished call)."""

    name: str
    arguments: str | None
    source: str


def _from_tag(text: str) -> DetectedCall | None:
    match = _TOOL_TAG.search(text)
    if match is None:
        return None
    try:
        body = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(body, Mapping) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    args = body.get("arguments")
    arguments = args if isinstance(args, str) else json.dumps(args, sort_keys=True)
    return DetectedCall(body["name"], arguments[:_MAX_ARGS_CHARS], "tool-call-tag")


def _from_bash_block(text: str) -> DetectedCall | None:
    blocks = _BASH_BLOCK.findall(text)
    if len(blocks) != 1:
        return None
    fenced, tagged = blocks[0]
    command = (fenced or tagged).strip()
    if SUBMIT_MARKER in command:
        return None
    return DetectedCall("bash", command[:_MAX_ARGS_CHARS], "bash-block")


def detect_tool_call(
    text: str | None,
    *,
    parsed: Sequence[tuple[str, str | None]] = (),
    hint: str | None = None,
    last_turn: bool = False,
) -> DetectedCall | None:
    """The tool call this turn's output ends in, or ``None`` (not pinnable)."""
    if last_turn:
        return None
    for name, arguments in parsed:
        if name:
            return DetectedCall(name, arguments, "parser")
    found = (_from_tag(text) or _from_bash_block(text)) if text else None
    if hint:
        same = found is not None and found.name == hint
        return DetectedCall(hint, found.arguments if same and found else None, "hint")
    return found
