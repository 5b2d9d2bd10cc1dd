"""Alembic migrations of the control plane's database (installed as
``controlplane.migrations``). Revisions are frozen: they never import live models."""
