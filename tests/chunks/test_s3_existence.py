"""The writer's existence check on moto S3: HEADs and prefix listings agree."""

from __future__ import annotations

import time

import pyarrow.fs as pafs
import pytest

from checkpoint_store._chunks import store as store_mod
from checkpoint_store._chunks.store import ChunkStore
from tests.chunks._helpers import blob


def _s3(srv):
    return pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                             endpoint_override=srv.endpoint_url.split("://", 1)[1],
                             scheme="http", region=srv.region)


@pytest.mark.parametrize("count", [10, 300])
def test_heads_and_listing_agree(s3_server, s3_bucket, monkeypatch, count):
    store = ChunkStore(_s3(s3_server), f"{s3_bucket}/exp/.cs_chunks")
    names = [blob(i)[0] for i in range(count)]
    for n, b in (blob(i) for i in range(0, count, 2)):
        store.write_object(n, b)
    timings = {}
    for mode, threshold in (("head", 10**9), ("list", 1)):
        monkeypatch.setattr(store_mod, "LISTING_THRESHOLD", threshold)
        t0 = time.perf_counter()
        found = store.stat_objects(names)
        timings[mode] = time.perf_counter() - t0
        assert set(found) == set(names[::2])
    print(f"{count} names: {timings}")
