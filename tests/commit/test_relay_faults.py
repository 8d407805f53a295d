"""Reports through a relay that fails about 20 % of the requests to S3 (moto)."""

from __future__ import annotations

import os

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store.errors import CheckpointStoreError
from checkpoint_store.testing.relay import FaultRelay

REPORTS = 20
BIG = 70 * 1024 * 1024  # over the S3 part threshold (64 MiB chunks): sent in parts


def _source(root, i: int, big: bool) -> str:
    d = os.path.join(root, f"s{i}")
    os.makedirs(d)
    for j in range(3):
        with open(os.path.join(d, f"f{j}.bin"), "wb") as f:
            f.write(bytes([i, j]) * (2048 + i))
    if big:
        with open(os.path.join(d, "big.bin"), "wb") as f:
            f.write(os.urandom(BIG))
    return d


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_reports_commit_through_20_percent_network_faults(s3_server, s3_bucket, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_MAX_DELAY", "0.5")
    ok, failed = 0, []
    with FaultRelay(s3_server.endpoint_url, seed=1, fault_rate=0.2, stall_s=3,
                    lifetime_s=400, max_connections=5000) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url,
                "request_timeout": 2, "connect_timeout": 2}
        uri = f"s3://{s3_bucket}/runs"
        with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                           trial_name="trial",
                           checkpoint_config=CheckpointConfig(num_to_keep=100)):
            for i in range(REPORTS):
                src = _source(str(tmp_path), i, big=i == REPORTS // 2)
                try:
                    session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
                    ok += 1
                except CheckpointStoreError as exc:  # typed, never a raw error
                    failed.append(exc)
        faults = sum(relay.counts[k] for k in ("reset", "drop", "stall", "lose_answer"))
    assert faults >= 0.1 * relay.counts["requests"], relay.counts
    assert ok >= REPORTS - 1, failed
    clean = StorageContext(uri, "exp", "trial", storage_options=s3_server.storage_options())
    committed = clean.committed_checkpoints()
    assert len(committed) >= ok
    for ckpt, _ in committed:
        ckpt.verify()  # nothing half-committed
