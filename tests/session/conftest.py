"""Fixtures of the session tests: a storage root on each backend (``store``).

``ranks`` (N ranks as threads of this process) comes from tests/conftest.py.
"""

from __future__ import annotations

from tests.stores import store  # noqa: F401  (fixtures: a storage root on each backend)
