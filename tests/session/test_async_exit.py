"""Background uploads (``upload_mode="async"``) of a process that exits without
ending its session: the script ends, calls ``sys.exit`` or dies of an uncaught
exception while uploads are pending. Every reported checkpoint must be
committed before the process is gone (the interpreter's exit hook waits for
them, before ``concurrent.futures`` stops taking work), then the rows flushed;
an upload that fails there is logged, naming the lost checkpoint. Real child
processes, on a local disk and on the moto S3 server of the fixtures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from checkpoint_store import StorageContext, session

_CHILD = textwrap.dedent("""
    import os, sys, tempfile, time
    from checkpoint_store import Checkpoint, UploadConfig, session
    from checkpoint_store.storage import StorageContext
    uri, opts, how = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
    persist = StorageContext.persist_checkpoint
    def slow_persist(self, source, index, internal, **kwargs):
        time.sleep(0.5)  # the uploads are surely still pending when the script ends
        if how == "fail" and index == 2:
            raise OSError("the store refused checkpoint 2")
        return persist(self, source, index, internal, **kwargs)
    StorageContext.persist_checkpoint = slow_persist
    session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                  trial_name="t",  # never ended: no `with`, no end()
                  upload_config=UploadConfig(upload_mode="async", max_pending_uploads=2))
    tmp = tempfile.mkdtemp()
    for i in range(3):
        with open(os.path.join(tmp, "m.bin"), "wb") as f:
            f.write(os.urandom(4 << 20) + bytes([i]))
        session.report({"i": i}, checkpoint=Checkpoint.from_directory(tmp))
    session.report({"final": 1})
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("loss diverged")
""")


def _run(uri: str, options: dict[str, Any], env: dict[str, str],
         how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, uri, repr(options), how],
                          capture_output=True, text=True, env=dict(os.environ, **env),
                          timeout=300)


def _assert_all_committed(uri: str, options: dict[str, Any], env: dict[str, str],
                          how: str, code: int) -> None:
    proc = _run(uri, options, env, how)
    assert proc.returncode == code, proc.stderr
    assert "finishing its" in proc.stderr and "pending checkpoint upload(s)" in proc.stderr
    ctx = StorageContext(uri, "exp", "t", storage_options=options)
    committed = ctx.committed_checkpoints()
    assert [c.path.rsplit("/", 1)[-1] for c, _ in committed] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"], proc.stderr
    for ckpt, _ in committed:
        ckpt.verify()
    rows = ctx.read_results()
    assert [r["checkpoint_dir_name"] for r in rows] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002", None]
    with session.start(storage_path=uri, storage_options=options, experiment_name="exp",
                       trial_name="t") as s:
        latest = s.get_checkpoint()
        assert latest is not None and latest.path.endswith("checkpoint_000002")
        with latest.as_directory() as d, open(os.path.join(d, "m.bin"), "rb") as f:
            assert f.read()[-1:] == bytes([2])


@pytest.mark.parametrize(("how", "code"), [("end", 0), ("exit", 0), ("raise", 1)])
def test_pending_uploads_are_committed_at_exit_local(tmp_path, how, code):
    _assert_all_committed(str(tmp_path / "results"), {}, {}, how, code)


@pytest.mark.slow
@pytest.mark.parametrize(("how", "code"), [("end", 0), ("exit", 0), ("raise", 1)])
def test_pending_uploads_are_committed_at_exit_s3(s3_location, how, code):
    _assert_all_committed(s3_location.uri, dict(s3_location.storage_options),
                          s3_location.env, how, code)


@pytest.mark.slow
def test_pending_uploads_are_committed_at_exit_s3fs(s3fs_location):
    """s3fs runs its I/O on an event loop fed by executors that refuse work
    once the interpreter shuts down: the uploads must finish before that."""
    _assert_all_committed(s3fs_location.uri, dict(s3fs_location.storage_options),
                          s3fs_location.env, "end", 0)


def test_an_upload_failing_at_exit_is_logged_as_lost(tmp_path):
    """The exit status stays the script's; the error names the checkpoint that
    was not committed; the earlier ones are committed and the next session
    resumes from the newest of them."""
    uri = str(tmp_path / "results")
    proc = _run(uri, {}, {}, "fail")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint_000002 failed: not committed (lost)" in proc.stderr
    assert "the store refused checkpoint 2" in proc.stderr
    ctx = StorageContext(uri, "exp", "t")
    assert [c.path.rsplit("/", 1)[-1] for c, _ in ctx.committed_checkpoints()] == [
        "checkpoint_000000", "checkpoint_000001"]
    with session.start(storage_path=uri, experiment_name="exp", trial_name="t") as s:
        latest = s.get_checkpoint()
        assert latest is not None and latest.path.endswith("checkpoint_000001")
