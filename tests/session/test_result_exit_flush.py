"""Rows buffered for an object store survive an interpreter exit without the
session's end (issue 19, item 3): a script that ends, calls ``sys.exit`` or
dies of an uncaught exception flushes its open writers at exit, within a bound
and without raising when the store does not answer. Run in real child
processes against the moto S3 server of the fixtures.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref
from typing import Any

import pytest

from checkpoint_store import StorageContext
from checkpoint_store._format.layout import LEASE_FILE, RESULT_FILE
from checkpoint_store._results.writer import (
    _BUFFERING,
    FLUSH_INTERVAL_ENV,
    ResultLog,
    _flush_at_exit,
    list_segments,
)

_CHILD = textwrap.dedent("""
    import os, sys, time
    from checkpoint_store import Checkpoint, session
    from checkpoint_store._results import writer as _results
    uri, opts, ckpt, how = sys.argv[1], eval(sys.argv[2]), sys.argv[3], sys.argv[4]
    session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                  trial_name="t")  # never ended: no `with`, no end()
    for i in range(25):
        session.report({"i": i}, checkpoint=Checkpoint.from_directory(ckpt) if i == 9 else None)
    if how in ("hang", "fail"):
        _results._EXIT_FLUSH_TIMEOUT_S = 1.0
        def put(*args, **kwargs):
            if how == "fail":
                raise OSError("the store refused the PUT")
            time.sleep(3600)  # a store that never answers
        _results._fsutil.write_bytes = put
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("loss diverged")
    # "end", "hang", "fail": the script just ends, its session never ended
""")


def _run(s3_location: Any, tmp_path: Any, how: str) -> subprocess.CompletedProcess[str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "w.bin").write_bytes(b"w")
    env = dict(os.environ, **s3_location.env, **{FLUSH_INTERVAL_ENV: "3600"})
    return subprocess.run(
        [sys.executable, "-c", _CHILD, s3_location.uri, repr(dict(s3_location.storage_options)),
         str(ckpt), how], capture_output=True, text=True, env=env, timeout=120)


def _ctx(s3_location: Any) -> StorageContext:
    return StorageContext(s3_location.uri, "exp", "t",
                          storage_options=dict(s3_location.storage_options))


@pytest.mark.slow
@pytest.mark.parametrize(("how", "code"), [("end", 0), ("exit", 3), ("raise", 1)])
def test_rows_of_a_session_never_ended_are_written_at_exit(s3_location, tmp_path, how, code):
    """25 rows, the last 15 only in memory when the process exits: all readable
    afterwards, from segments (nothing assembled result.json: no session end)."""
    _assert_written_at_exit(s3_location, tmp_path, how, code)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3fs", "azure", "gcs"])
def test_rows_are_written_at_exit_on_every_object_store(request, tmp_path, kind):
    """The async clients (s3fs, Azure, GCS) run on event loops whose executors
    refuse work once the interpreter shuts down: the exit flush must still
    get its segment through."""
    _assert_written_at_exit(request.getfixturevalue(f"{kind}_location"), tmp_path, "end", 0)


def _assert_written_at_exit(s3_location: Any, tmp_path: Any, how: str, code: int) -> None:
    proc = _run(s3_location, tmp_path, how)
    assert proc.returncode == code, proc.stderr
    if how == "raise":
        assert "RuntimeError: loss diverged" in proc.stderr
    ctx = _ctx(s3_location)
    assert [r["i"] for r in ctx.read_results()] == list(range(25)), proc.stderr
    assert [r["training_iteration"] for r in ctx.read_results()] == list(range(1, 26))
    assert not ctx.filesystem.get_file_info(f"{ctx.trial_path}/{RESULT_FILE}").is_file
    assert len(list_segments(ctx.filesystem, ctx.trial_path)) == 2  # checkpoint report + exit
    # The lease is released after the rows, while the client still works:
    # the trial is free at once, and no warning about it.
    assert "could not release the lease" not in proc.stderr, proc.stderr
    assert not ctx.filesystem.get_file_info(f"{ctx.trial_path}/{LEASE_FILE}").is_file


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hang", "fail"])
def test_an_unreachable_store_neither_hangs_nor_fails_the_exit(s3_location, tmp_path, how):
    """The exit flush waits at most its bound for a store that does not answer,
    and logs (never raises) a failed PUT; the exit status stays the script's."""
    started = time.monotonic()
    proc = _run(s3_location, tmp_path, how)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 60  # the child would sleep an hour otherwise
    expected = "gave up writing the last buffered" if how == "hang" else \
        "could not write the last rows"
    assert expected in proc.stderr and "result.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    # What the checkpoint report flushed is there; the rest is lost, as logged.
    assert [r["i"] for r in _ctx(s3_location).read_results()] == list(range(10))


def test_the_exit_flush_holds_writers_weakly_and_only_its_own(s3_location):
    ctx = _ctx(s3_location)
    log = ResultLog(ctx, flush_interval=3600)
    log.append({"training_iteration": 1})
    assert log in _BUFFERING
    log._pid = -1  # as in a forked child: its parent's rows are not its to write
    _flush_at_exit(timeout=30)
    assert log.buffered == 1 and list_segments(ctx.filesystem, ctx.trial_path) == []
    log._pid = os.getpid()
    _flush_at_exit(timeout=30)
    assert log.buffered == 0 and [r["training_iteration"] for r in ctx.read_results()] == [1]

    log.append({"training_iteration": 2})
    log.close()  # ended: nothing left for the exit
    assert log not in _BUFFERING
    assert [r["training_iteration"] for r in ctx.read_results()] == [1, 2]

    log = ResultLog(ctx, flush_interval=3600)
    log.append({"training_iteration": 3})
    log.flush()  # no timer left holding it
    ref = weakref.ref(log)
    del log
    gc.collect()
    assert ref() is None  # the exit hook kept nothing alive
