"""Fixtures of the format tests."""

from __future__ import annotations

from tests.stores import near_store, store  # noqa: F401  (fixtures: a storage root on each backend)
