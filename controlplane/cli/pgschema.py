"""A fresh PostgreSQL schema per benchmark run (``cachettl bench controlplane``)."""

from __future__ import annotations

import os
import uuid
from typing import Any

__all__ = ["drop_schema", "pg_schema_url"]


def pg_schema_url(base: str) -> tuple[str, Any]:
    """``base`` with a fresh schema on its search path, and the handle to drop it."""
    from sqlalchemy import create_engine, text

    from controlplane.storage.sql import normalize_url

    schema = f"bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    engine = create_engine(normalize_url(base), isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}", (engine, schema)


def drop_schema(handle: Any) -> None:
    """Drops the schema of a ``pg_schema_url`` handle, and its engine."""
    from sqlalchemy import text

    engine, schema = handle
    with engine.connect() as c:
        c.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
    engine.dispose()
