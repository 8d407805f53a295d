"""``session.start(resume_from=...)``: a trial starts from another run's checkpoint, which
it never registers, moves or deletes (issue 14; Lightning #21813)."""

from __future__ import annotations

import json
import os
import posixpath
import uuid

import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
    StorageContext,
    TrialRunner,
    session,
)
from checkpoint_store.retention import LatestN


@pytest.fixture(params=["memory", "s3"])
def root(request, tmp_path):
    """``(storage_path, storage_options)`` on memory:// and on S3 (moto)."""
    if request.param == "memory":
        return f"memory://resume-{uuid.uuid4().hex}", None
    loc = request.getfixturevalue("s3_location")
    return loc.uri, dict(loc.storage_options)


def _src(tmp_path, i: int) -> Checkpoint:
    d = tmp_path / f"src{i}"
    d.mkdir(exist_ok=True)
    (d / "model.bin").write_bytes(bytes([i]) * 64)
    return Checkpoint.from_directory(d)


def _run_a(tmp_path, storage_path, options, n=6) -> StorageContext:
    with session.start(
        storage_path=storage_path, storage_options=options, experiment_name="exp", trial_name="A"
    ):
        for i in range(n):
            session.report({"loss": float(i)}, checkpoint=_src(tmp_path, i))
    return StorageContext(storage_path, "exp", "A", storage_options=options)


def _names(ctx: StorageContext) -> list[str]:
    return [posixpath.basename(c.path) for c, _ in ctx.committed_checkpoints()]


def _a5(a: StorageContext, options) -> Checkpoint:
    return Checkpoint(
        a.uri(posixpath.join(a.trial_path, "checkpoint_000005")), storage_options=options
    )


def test_resume_from_another_run_keeps_its_checkpoint(root, tmp_path):
    storage_path, options = root
    a = _run_a(tmp_path, storage_path, options)
    source = _a5(a, options)
    config = CheckpointConfig(num_to_keep=1, keep_latest=False)
    with session.start(
        storage_path=storage_path,
        storage_options=options,
        experiment_name="exp",
        trial_name="B",
        checkpoint_config=config,
        resume_from=source,
        config={"lr": 0.1},
    ):
        got = session.get_checkpoint()
        assert got.uri == source.uri
        with got.as_directory() as d:
            assert open(os.path.join(d, "model.bin"), "rb").read() == bytes([5]) * 64
        session.report({"loss": 9.0}, checkpoint=_src(tmp_path, 7))
        mine = session.get_checkpoint()
        assert mine.uri != source.uri and mine.path.endswith("B/checkpoint_000000")
        session.report({"loss": 8.0}, checkpoint=_src(tmp_path, 8))
    b = StorageContext(storage_path, "exp", "B", storage_options=options)
    assert _names(b) == ["checkpoint_000001"]  # exactly one of its own, indexes from 0
    assert _names(a) == [f"checkpoint_{i:06d}" for i in range(6)]
    source.verify()  # still whole
    params = json.loads(
        b.filesystem.open_input_stream(posixpath.join(b.trial_path, "params.json")).read()
    )
    assert params["lr"] == 0.1
    assert params["_resume_from"]["uri"] == source.uri
    assert params["_resume_from"]["index"] == 5
    assert params["_resume_from"]["trial_name"] == "A"


def test_resume_from_s3_into_a_local_trial_with_a_latest_only_policy(s3_location, tmp_path):
    options = dict(s3_location.storage_options)
    a = _run_a(tmp_path, s3_location.uri, options)
    source = _a5(a, options)
    local = str(tmp_path / "local")
    with session.start(
        storage_path=local,
        experiment_name="exp",
        trial_name="B",
        checkpoint_config=CheckpointConfig(policy=LatestN(1), keep_latest=False),
        resume_from=source,
    ):
        assert session.get_checkpoint().uri.startswith("s3://")
        for i in range(3):
            session.report({"loss": float(i)}, checkpoint=_src(tmp_path, 10 + i))
    assert _names(StorageContext(local, "exp", "B")) == ["checkpoint_000002"]
    assert _names(a) == [f"checkpoint_{i:06d}" for i in range(6)]


def test_restart_of_b_prefers_its_own_checkpoint(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=2)
    source = Checkpoint(os.path.join(a.trial_path, "checkpoint_000001"))
    kw = dict(storage_path=root, experiment_name="exp", trial_name="B", resume_from=source)
    with session.start(**kw):
        session.report({"x": 1}, checkpoint=_src(tmp_path, 3))
    with session.start(**kw):
        assert session.get_checkpoint().path.endswith("B/checkpoint_000000")


def test_trial_runner_resume_from(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=2)
    source = os.path.join(a.trial_path, "checkpoint_000001")
    seen = []

    def train(config):
        seen.append(session.get_checkpoint().path)
        session.report({"loss": 1.0}, checkpoint=_src(tmp_path, 4))
        seen.append(session.get_checkpoint().path)

    runner = TrialRunner(
        train,
        storage_path=root,
        experiment_name="exp",
        trial_name="B",
        checkpoint_config=CheckpointConfig(num_to_keep=1),
        resume_from=source,
    )
    while runner.step() is not None:
        pass
    assert seen[0] == source
    assert seen[1].endswith("B/checkpoint_000000")
    assert len(_names(a)) == 2


# -- bad input: typed errors, nothing written ----------------------------------------


def _nothing_written(root: str) -> None:
    assert not os.path.exists(os.path.join(root, "exp", "B"))


def test_uncommitted_source_is_refused(tmp_path):
    root = str(tmp_path / "runs")
    plain = _src(tmp_path, 1)  # a directory without a commit marker
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        session.start(
            storage_path=root,
            experiment_name="exp",
            trial_name="B",
            resume_from=plain,
            config={"lr": 1},
        )
    with pytest.raises(CheckpointNotFoundError):
        session.start(
            storage_path=root,
            experiment_name="exp",
            trial_name="B",
            resume_from=str(tmp_path / "nowhere"),
        )
    _nothing_written(root)


def test_corrupt_source_is_refused(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=2)
    path = os.path.join(a.trial_path, "checkpoint_000001")
    with open(os.path.join(path, "model.bin"), "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(CheckpointCorruptError):
        session.start(storage_path=root, experiment_name="exp", trial_name="B", resume_from=path)
    _nothing_written(root)


def test_own_checkpoint_or_not_a_checkpoint_is_refused(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=1)
    own = os.path.join(a.trial_path, "checkpoint_000000")
    with pytest.raises(InvalidConfigError, match="checkpoint of this trial"):
        session.start(storage_path=root, experiment_name="exp", trial_name="A", resume_from=own)
    with pytest.raises(InvalidConfigError, match="resume_from must be"):
        session.start(storage_path=root, experiment_name="exp", trial_name="B", resume_from=5)
    _nothing_written(root)


# -- a starting point, read once ------------------------------------------------------


def _start_b(storage_path, options, source, **kw):
    return session.start(storage_path=storage_path, storage_options=options,
                         experiment_name="exp", trial_name="B", resume_from=source, **kw)


def _donor_evicts(tmp_path, storage_path, options) -> Checkpoint:
    """Donor A keeps one checkpoint; returns its checkpoint_000000 (still there)."""
    kw = dict(storage_path=storage_path, storage_options=options, experiment_name="exp",
              trial_name="A", checkpoint_config=CheckpointConfig(num_to_keep=1))
    with session.start(**kw):
        session.report({"loss": 1.0}, checkpoint=_src(tmp_path, 1))
    a = StorageContext(storage_path, "exp", "A", storage_options=options)
    return Checkpoint(a.uri(posixpath.join(a.trial_path, "checkpoint_000000")),
                      storage_options=options)


def test_relaunch_after_the_donor_evicted_the_source_resumes_from_its_own(root, tmp_path):
    storage_path, options = root
    source = _donor_evicts(tmp_path, storage_path, options)
    with _start_b(storage_path, options, source):
        assert session.get_checkpoint().uri == source.uri
        session.report({"loss": 0.5}, checkpoint=_src(tmp_path, 2))
    # The donor's K=1 retention evicts (deletes) the source.
    with session.start(storage_path=storage_path, storage_options=options,
                       experiment_name="exp", trial_name="A",
                       checkpoint_config=CheckpointConfig(num_to_keep=1)):
        session.report({"loss": 0.9}, checkpoint=_src(tmp_path, 3))
    assert not source.is_committed
    with _start_b(storage_path, options, source):  # the same command again
        got = session.get_checkpoint()
        assert got.path.endswith("B/checkpoint_000000")
        with got.as_directory() as d:
            assert open(os.path.join(d, "model.bin"), "rb").read() == bytes([2]) * 64
        session.report({"loss": 0.4}, checkpoint=_src(tmp_path, 4))
    b = StorageContext(storage_path, "exp", "B", storage_options=options)
    assert _names(b) == ["checkpoint_000000", "checkpoint_000001"]
    params = json.loads(
        b.filesystem.open_input_stream(posixpath.join(b.trial_path, "params.json")).read())
    # What the first start read of the source is kept, not read again.
    assert params["_resume_from"]["uri"] == source.uri
    assert params["_resume_from"]["index"] == 0
    assert params["_resume_from"]["trial_name"] == "A"


def _counting_local_fs(prefix: str):
    """A local fsspec filesystem counting every call that touches ``prefix``."""
    from fsspec.implementations.local import LocalFileSystem

    class Counting(LocalFileSystem):
        calls: list[str] = []

        def _count(self, path) -> None:
            if str(self._strip_protocol(path)).startswith(prefix):
                Counting.calls.append(str(path))

        def info(self, path, **kw):
            self._count(path)
            return super().info(path, **kw)

        def ls(self, path, detail=False, **kw):
            self._count(path)
            return super().ls(path, detail=detail, **kw)

        def find(self, path, *args, **kw):
            self._count(path)
            return super().find(path, *args, **kw)

        def _open(self, path, mode="rb", **kw):
            self._count(path)
            return super()._open(path, mode=mode, **kw)

    return Counting(skip_instance_cache=True)


def test_the_source_is_not_opened_at_a_restart_of_a_trial_with_its_own(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=2)
    path = os.path.join(a.trial_path, "checkpoint_000001")
    fs = _counting_local_fs(path)
    source = Checkpoint(path, filesystem=fs)
    with _start_b(root, None, source):
        assert session.get_checkpoint() == source
        session.report({"loss": 1.0}, checkpoint=_src(tmp_path, 5))
    assert fs.calls  # the first start read it (verified every byte)
    fs.calls.clear()
    with _start_b(root, None, source, config={"lr": 0.1}):
        assert session.get_checkpoint().path.endswith("B/checkpoint_000000")
        session.report({"loss": 0.5}, checkpoint=_src(tmp_path, 6))
    assert fs.calls == []
    with TrialRunner(lambda c: session.report({"loss": 0.2}, checkpoint=_src(tmp_path, 7)),
                     storage_path=root, experiment_name="exp", trial_name="B",
                     resume_from=source) as runner:
        while runner.step() is not None:
            pass
    assert runner.error is None and fs.calls == []


def test_a_trial_without_its_own_checkpoint_and_a_missing_source_is_refused(root, tmp_path):
    storage_path, options = root
    source = _donor_evicts(tmp_path, storage_path, options)
    with _start_b(storage_path, options, source):
        session.report({"loss": 0.5})  # metrics only: no checkpoint of its own
    source_ctx = StorageContext(storage_path, "exp", "A", storage_options=options)
    source_ctx.delete_checkpoint("checkpoint_000000")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        _start_b(storage_path, options, source)
    b = StorageContext(storage_path, "exp", "B", storage_options=options)
    # An uncommitted leftover is not a checkpoint of its own either; the refusal
    # comes after the restore then, and releases the trial again.
    b.filesystem.create_dir(posixpath.join(b.trial_path, "checkpoint_000000"))
    with b.filesystem.open_output_stream(
            posixpath.join(b.trial_path, "checkpoint_000000", "model.bin")) as f:
        f.write(b"partial")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        _start_b(storage_path, options, source)
    with pytest.raises(CheckpointNotFoundError):
        TrialRunner(lambda c: None, storage_path=storage_path, storage_options=options,
                    experiment_name="exp", trial_name="B", resume_from=source).step()
    with session.start(storage_path=storage_path, storage_options=options,
                       experiment_name="exp", trial_name="B"):
        assert session.get_checkpoint() is None


def test_own_checkpoints_failing_verification_fall_back_to_a_checked_source(tmp_path):
    root = str(tmp_path / "runs")
    a = _run_a(tmp_path, root, None, n=2)
    path = os.path.join(a.trial_path, "checkpoint_000001")
    with _start_b(root, None, path):
        session.report({"loss": 1.0}, checkpoint=_src(tmp_path, 5))
    own = os.path.join(root, "exp", "B", "checkpoint_000000", "model.bin")
    with open(own, "r+b") as f:
        f.write(b"\xff")  # same size: only the CRC32C tells
    with _start_b(root, None, path):
        with pytest.warns(RuntimeWarning, match="does not verify"):
            assert session.get_checkpoint().path == path  # read now, and verified
    with open(os.path.join(path, "model.bin"), "r+b") as f:
        f.write(b"\xff")
    # The damaged own one is recorded invalid: no checkpoint of its own is left,
    # so the start reads the source, and refuses it.
    with pytest.warns(RuntimeWarning, match="checkpoint_000000, is corrupt"), \
            pytest.raises(CheckpointCorruptError, match="model.bin"):
        _start_b(root, None, path)


def test_every_rank_of_a_relaunch_resumes_from_its_own(root, tmp_path, ranks):
    storage_path, options = root
    source = _donor_evicts(tmp_path, storage_path, options)

    def run(attempt: str, report: bool):
        def rank_fn(rank):
            with _start_b(storage_path, options, source, world_rank=rank, world_size=2,
                          attempt_id=attempt, sync_timeout_s=30):
                got = session.get_checkpoint().uri
                if report:
                    d = tmp_path / f"rank{rank}"
                    d.mkdir()
                    (d / f"shard_{rank}.bin").write_bytes(bytes([rank]) * 16)
                    session.report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(d))
                return got
        return ranks(2, rank_fn)

    assert run("a1", True) == [source.uri, source.uri]
    _donor_evicts(tmp_path, storage_path, options)  # A's K=1 evicts the source
    assert not source.is_committed
    got = run("a2", False)
    assert all(isinstance(g, str) and g.endswith("B/checkpoint_000000") for g in got), got
