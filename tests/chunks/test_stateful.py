"""The chunk gc state machine (checkpoint_store.testing.chunk_gc): quick runs
on local disk and memory, a long run (>= 10,000 steps), and moto S3."""

from __future__ import annotations

import uuid

import pyarrow.fs as pafs
import pytest
from hypothesis import HealthCheck, settings

from checkpoint_store.testing.chunk_gc import ChunkGcMachine, MemoryChunkGcMachine

_HC = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


class TestChunkGcLocal(ChunkGcMachine.TestCase):
    settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                        suppress_health_check=_HC)


class TestChunkGcMemory(MemoryChunkGcMachine.TestCase):
    settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                        suppress_health_check=_HC)


@pytest.mark.slow
class TestChunkGcMemoryLong(MemoryChunkGcMachine.TestCase):
    """300 runs of up to 50 steps: over 10,000 steps in all."""

    settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                        suppress_health_check=_HC)


def test_chunk_gc_machine_on_s3(s3_server, s3_bucket):
    srv = s3_server

    class S3Machine(ChunkGcMachine):
        def make_filesystem(self):
            fs = pafs.S3FileSystem(access_key=srv.access_key_id,
                                   secret_key=srv.secret_access_key,
                                   endpoint_override=srv.endpoint_url.split("://", 1)[1],
                                   scheme="http", region=srv.region)
            return fs, f"{s3_bucket}/gc-{uuid.uuid4().hex}"

    test = S3Machine.TestCase
    test.settings = settings(max_examples=5, stateful_step_count=25, deadline=None,
                             suppress_health_check=_HC)
    test().runTest()
