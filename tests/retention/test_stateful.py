"""The retention state machines (checkpoint_store.testing.stateful) in CI:
1000 examples on local disk, fewer on memory storage."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from checkpoint_store.testing.stateful import (
    MemoryRetentionMachine,
    RetentionMachine,
    StateLogMachine,
)

_HC = [HealthCheck.too_slow, HealthCheck.data_too_large]


class TestRetentionQuick(RetentionMachine.TestCase):
    settings = settings(max_examples=40, stateful_step_count=15, deadline=None,
                        suppress_health_check=_HC)


@pytest.mark.slow
class TestRetention1000(RetentionMachine.TestCase):
    settings = settings(max_examples=1000, stateful_step_count=20, deadline=None,
                        suppress_health_check=_HC)


@pytest.mark.slow
class TestRetentionMemory(MemoryRetentionMachine.TestCase):
    settings = settings(max_examples=60, stateful_step_count=15, deadline=None,
                        suppress_health_check=_HC)


class TestStateLogQuick(StateLogMachine.TestCase):
    settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                        suppress_health_check=_HC)


@pytest.mark.slow
class TestStateLog1000(StateLogMachine.TestCase):
    settings = settings(max_examples=1000, stateful_step_count=30, deadline=None,
                        suppress_health_check=_HC)
