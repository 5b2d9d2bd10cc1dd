"""Errors quote at most a short prefix of what they were given: a 20 MB value never
comes back whole in a status message, a CLI line or a log line."""

from __future__ import annotations

import grpc
import pytest

from controlplane.errors import (
    MAX_MESSAGE_CHARS,
    InvalidInputError,
    StorageError,
    TenantNotFoundError,
)
from controlplane.rpc.servicer import _code
from controlplane.storage import Store

HUGE = "x" * 20_000_000
SHORT = MAX_MESSAGE_CHARS + 100


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_store_errors_quote_a_prefix_of_a_huge_name(store: Store) -> None:
    with pytest.raises(TenantNotFoundError) as error:
        store.revoke_tenant(HUGE, 0.0)
    message = str(error.value)
    assert message.startswith("no tenant named 'xxxx")
    assert "(20000000 characters)" in message
    assert len(message) < 200


def test_every_status_message_is_clipped() -> None:
    for error, code in (
        (InvalidInputError("tool_args", f"cannot hold {HUGE}"), grpc.StatusCode.INVALID_ARGUMENT),
        (StorageError(f"database error: {HUGE}"), grpc.StatusCode.UNAVAILABLE),
    ):
        got, message = _code(error)
        assert got is code
        assert len(message) < SHORT
        assert message.endswith(" characters)")
