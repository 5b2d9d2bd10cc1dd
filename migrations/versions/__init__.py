"""Frozen schema revisions, oldest first."""
