"""Fixtures of the util tests."""

from __future__ import annotations

from tests.stores import store  # noqa: F401  (fixtures: a storage root on each backend)
