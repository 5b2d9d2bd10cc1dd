"""vllm-router's ``vllm_xargs.agentic_context``: translated into the flat keys the hook reads,
bounded, and refused with the key named when malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controlplane.kvhints import HintError
from enginehook.hints.agentic import FIELD, MAX_KEYS, AgenticContext, parse, translate


def _body(context: Any, **xargs: Any) -> dict[str, Any]:
    return {"messages": [], "vllm_xargs": {"agentic_context": context, **xargs}}


def test_program_parent_and_ttl_become_the_hooks_keys_and_the_context_goes() -> None:
    body = _body(
        {
            "session_id": "s-1",
            "program_id": "s-1/sub-2",
            "parent_program_id": "s-1",
            "kv_retention_ttl_seconds": 7.5,
            "step_id": 4,
            "priority": 1,
            "blocks_parent": True,
            "expected_resume": None,
        }
    )
    assert translate(body) == AgenticContext("s-1/sub-2", "s-1", 7.5)
    assert body["vllm_xargs"] == {
        "session_id": "s-1/sub-2",
        "parent_session_id": "s-1",
        "pin_ttl_s": 7.5,
    }


def test_the_session_id_names_the_program_when_no_program_id_is_given() -> None:
    body = _body({"session_id": "s-9"})
    assert translate(body) == AgenticContext("s-9", None, None)
    assert body["vllm_xargs"] == {"session_id": "s-9"}


def test_what_the_request_says_itself_wins() -> None:
    body = _body({"program_id": "p", "kv_retention_ttl_seconds": 9}, pin_ttl_s=2.0)
    body["session_id"] = "own"
    translate(body)
    assert body["vllm_xargs"] == {"pin_ttl_s": 2.0}  # no session_id added, the TTL kept
    body = _body({"program_id": "p"}, session_id="xargs-own")
    translate(body)
    assert body["vllm_xargs"] == {"session_id": "xargs-own"}


def test_json_text_is_parsed_like_the_object() -> None:
    body = _body(json.dumps({"program_id": "p", "kv_retention_ttl_seconds": 3}))
    assert translate(body) == AgenticContext("p", None, 3.0)


def test_a_body_without_a_context_is_left_alone() -> None:
    body: dict[str, Any] = {"vllm_xargs": {"tool": "bash"}}
    assert translate(body) is None
    assert body == {"vllm_xargs": {"tool": "bash"}}
    assert translate({"vllm_xargs": "not an object"}) is None


@pytest.mark.parametrize(
    ("context", "field"),
    [
        ([], FIELD),
        ("[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]", FIELD),
        ({f"k{i}": 1 for i in range(MAX_KEYS + 1)}, FIELD),
        ({"program_id": ""}, f"{FIELD}.program_id"),
        ({"program_id": 7}, f"{FIELD}.program_id"),
        ({"program_id": "p" * 257}, f"{FIELD}.program_id"),
        ({"session_id": "a\nb"}, f"{FIELD}.session_id"),
        ({"parent_program_id": {"nested": 1}}, f"{FIELD}.parent_program_id"),
        ({"kv_retention_ttl_seconds": -1}, f"{FIELD}.kv_retention_ttl_seconds"),
        ({"kv_retention_ttl_seconds": True}, f"{FIELD}.kv_retention_ttl_seconds"),
        ({"kv_retention_ttl_seconds": "7"}, f"{FIELD}.kv_retention_ttl_seconds"),
        ({"kv_retention_ttl_seconds": 10**400}, f"{FIELD}.kv_retention_ttl_seconds"),
        ({"step_id": float("inf")}, f"{FIELD}.step_id"),
        ({"task_id": ["x"]}, f"{FIELD}.task_id"),
    ],
)
def test_a_malformed_context_names_the_key(context: Any, field: str) -> None:
    with pytest.raises(HintError) as refused:
        parse(context)
    assert refused.value.field == field
    assert len(str(refused.value)) < 200  # never echoes a large value whole
