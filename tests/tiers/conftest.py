"""Fixtures of the local tier tests: the persistent tier in every location form."""

from __future__ import annotations

import pytest
from _tier_helpers import DURABLE_FORMS, Durable, make_durable


@pytest.fixture(params=DURABLE_FORMS)
def durable(request, tmp_path) -> Durable:
    return make_durable(request.param, request, tmp_path)


@pytest.fixture(params=["local", "memory", "s3-uri"])
def durable_uri(request, tmp_path) -> Durable:
    """The persistent tier as a path or URI only (for the slower tests)."""
    return make_durable(request.param, request, tmp_path)
