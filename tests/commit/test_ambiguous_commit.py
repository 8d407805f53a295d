"""A commit whose outcome a failure left unknown is settled; a session never wedges."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from _commit_helpers import make_source

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.errors import AmbiguousCommitError, TransientBackendError
from checkpoint_store.registry import resolve
from checkpoint_store.testing.relay import FaultRelay

MARKER = ".internal_metadata.json"


class _Failing(ForwardingHandler):
    """Fails the calls ``fail(method, path)`` picks with a retryable error."""

    def __init__(self, inner: pafs.FileSystem, fail: Callable[[str, str], bool]):
        super().__init__(inner)
        self.fail = fail

    def _check(self, method: str, path: str) -> None:
        if self.fail(method, path):
            raise ConnectionResetError(f"injected: connection reset ({method} {path})")

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._check("list", selector.base_dir)
        return super().get_file_info_selector(selector)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._check("read", path)
        return super().open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        self._check("read", path)
        return super().open_input_file(path)

    def open_output_stream(self, path: str, metadata: object) -> pa.NativeFile:
        self._check("write", path)
        return super().open_output_stream(path, metadata)

    def delete_file(self, path: str) -> None:
        self._check("delete", path)
        super().delete_file(path)


def _session_on(fs: pafs.FileSystem, root: str, **kwargs):
    return session.start(storage_path=root, storage_filesystem=fs, experiment_name="exp",
                         trial_name="trial", checkpoint_config=CheckpointConfig(num_to_keep=10),
                         **kwargs)


def _committed(uri: str, **options) -> list[int]:
    clean = StorageContext(uri, "exp", "trial", storage_options=options or None)
    return [m["index"] for _, m in clean.committed_checkpoints()]


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_MAX_DELAY", "0.01")


def test_a_commit_whose_read_back_fails_does_not_wedge_the_session(tmp_path):
    # The commit of checkpoint_000001 lands; every read of it afterwards
    # fails (3 of 3 attempts) until the next checkpoint is committed.
    root = f"memory://cs-amb-{uuid.uuid4().hex}"
    backend, path = resolve(root)
    state = {"marker_written": False, "healed": False}

    def fail(method: str, p: str) -> bool:
        if method == "write" and p.endswith(f"checkpoint_000001/{MARKER}"):
            state["marker_written"] = True
        if method == "write" and "checkpoint_000002/" in p:
            state["healed"] = True
        return (state["marker_written"] and not state["healed"]
                and method in ("list", "read") and "checkpoint_000001" in p)

    fs = pafs.PyFileSystem(_Failing(backend.filesystem, fail))
    srcs = [make_source(tmp_path / f"s{i}", i, files=2, size=256) for i in range(5)]
    with _session_on(fs, path) as s:
        for i in range(5):
            session.report({"i": i}, checkpoint=Checkpoint.from_directory(srcs[i]))
        assert s.get_checkpoint().path.endswith("checkpoint_000004")
    assert _committed(root) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_an_orphan_claim_of_the_session_is_not_waited_for(s3_server, s3_bucket, tmp_path):
    # Report 0: its data PUTs fail, and so do the DELETEs of its claim. Its
    # index is consumed (its commit began writing under it); the next report
    # commits the next index at once, never after claim_timeout (120 s), and
    # removes what the failed commit left (the session's own claim and files).
    failing = {"on": True}

    def rule(conn: int, req: int, head: bytes):
        if not failing["on"]:
            return None
        data_put = head.startswith(b"PUT") and b"checkpoint_000000/part" in head
        delete = head.startswith(b"DELETE") or (head.startswith(b"POST") and b"?delete" in head)
        return "drop" if data_put or delete else None

    src = make_source(tmp_path / "s", 0, files=2, size=256)
    with FaultRelay(s3_server.endpoint_url, rule=rule, lifetime_s=200) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url}
        uri = f"s3://{s3_bucket}/runs"
        with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                           trial_name="trial"):
            with pytest.raises(TransientBackendError):
                session.report({"i": 0}, checkpoint=Checkpoint.from_directory(src))
            assert any(".cs_claim-" in k for k in s3_server.list_keys(s3_bucket))
            failing["on"] = False
            t0 = time.monotonic()
            row = session.report({"i": 1}, checkpoint=Checkpoint.from_directory(src))
            assert time.monotonic() - t0 < 30
            assert row["checkpoint_dir_name"] == "checkpoint_000001"
            assert not any(".cs_claim-" in k for k in s3_server.list_keys(s3_bucket))
    assert _committed(uri, **s3_server.storage_options()) == [1]
    assert not any(k.split("/trial/")[-1].startswith("checkpoint_000000/")
                   for k in s3_server.list_keys(s3_bucket))
    assert not any(".cs_claim-" in k for k in s3_server.list_keys(s3_bucket))


@pytest.mark.slow
def test_an_unknown_commit_outcome_is_typed_and_the_next_report_settles_it(
        s3_server, s3_bucket, tmp_path):
    # Every answer to the marker PUT of checkpoint_000000 is lost (the PUT
    # lands) and reading the marker back is dropped: the report says it may
    # have committed; the next report takes the next index, and the session
    # registers checkpoint_000000 as its own.
    state = {"healed": False}

    def rule(conn: int, req: int, head: bytes):
        if state["healed"] or b"checkpoint_000000/.internal_metadata.json" not in head:
            return None
        return "lose_answer" if head.startswith(b"PUT") else "drop"

    src = make_source(tmp_path / "s", 0, files=2, size=256)
    with FaultRelay(s3_server.endpoint_url, rule=rule, lifetime_s=120) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url}
        uri = f"s3://{s3_bucket}/runs"
        with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                           trial_name="trial",
                           checkpoint_config=CheckpointConfig(num_to_keep=10)) as s:
            with pytest.raises(AmbiguousCommitError, match="may have been committed"):
                session.report({"i": 0}, checkpoint=Checkpoint.from_directory(src))
            state["healed"] = True
            row = session.report({"i": 1}, checkpoint=Checkpoint.from_directory(src))
            assert row["checkpoint_dir_name"] == "checkpoint_000001"
            kept = sorted(c.path.rsplit("/", 1)[-1] for c, _ in s.manager.resume_candidates())
            assert kept == ["checkpoint_000000", "checkpoint_000001"]
    assert _committed(uri, **s3_server.storage_options()) == [0, 1]


@pytest.mark.slow
def test_a_failed_listing_after_an_s3_commit_does_not_wedge_the_session(s3_server, s3_bucket,
                                                                        tmp_path):
    # Through a relay in front of moto: after the marker PUT of
    # checkpoint_000001, every listing of that directory is dropped nine times
    # (three tries of the engine, three of ours): the report used to raise
    # TransientBackendError and the four after it CheckpointConflictError.
    state = {"marker": False, "dropped": 0}

    def rule(conn: int, req: int, head: bytes):
        if head.startswith(b"PUT") and b"checkpoint_000001/.internal_metadata.json" in head:
            state["marker"] = True
        if (state["marker"] and state["dropped"] < 9 and head.startswith(b"GET")
                and b"list-type=2" in head and b"checkpoint_000001" in head):
            state["dropped"] += 1
            return "drop"
        return None

    srcs = [make_source(tmp_path / f"s{i}", i, files=2, size=256) for i in range(5)]
    with FaultRelay(s3_server.endpoint_url, rule=rule, lifetime_s=120) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url}
        uri = f"s3://{s3_bucket}/runs"
        with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                           trial_name="trial",
                           checkpoint_config=CheckpointConfig(num_to_keep=10)) as s:
            for i in range(5):
                session.report({"i": i}, checkpoint=Checkpoint.from_directory(srcs[i]))
            assert s.get_checkpoint().path.endswith("checkpoint_000004")
    assert _committed(uri, **s3_server.storage_options()) == [0, 1, 2, 3, 4]


def test_a_commit_run_again_by_its_writer_finds_its_own_marker(trial, tmp_path):
    # The same writer committing one index twice (a retried step after a lost
    # answer) succeeds with the marker it wrote; another writer still conflicts.
    storage = trial.storage(retry=RetryPolicy(attempts=2, base_delay=0.0))
    src = Checkpoint.from_directory(make_source(tmp_path / "s", 0, files=2, size=64))
    first = storage.persist_checkpoint(src, 0, {"metrics": {}}, writer_id="run.1.a")
    again = storage.persist_checkpoint(src, 0, {"metrics": {}}, writer_id="run.1.a")
    assert again.internal_metadata["created_at"] == first.internal_metadata["created_at"]
    from checkpoint_store.errors import CheckpointConflictError
    with pytest.raises(CheckpointConflictError):
        storage.persist_checkpoint(src, 0, {"metrics": {}}, writer_id="run.1.b")
