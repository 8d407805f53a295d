"""result.json without rewrites (issue 19, item 3).

Local disks append; object stores (and memory) write buffered rows as small
immutable segments and assemble ``result.json`` once, at the session's end.
Readers see every row exactly once whatever step a crash stopped at, and
``session.start`` reads only the tail it needs. Run on local disk, memory and
S3 (both engines).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pyarrow as pa
import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store._format.layout import RESULT_FILE, RESULT_SEGMENTS_DIR
from checkpoint_store._results.writer import (
    FLUSH_INTERVAL_ENV,
    ResultLog,
    assemble_results,
    last_result_rows,
    list_segments,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.registry import resolve
from checkpoint_store.testing import session_internals
from checkpoint_store.testing.faults import (
    FaultInjectingHandler,
    SimulatedCrash,
    faulty_backend,
)

OBJECT_STORES = ["memory", "s3", "s3fs"]


@pytest.fixture(params=["local", *OBJECT_STORES])
def root(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any] | None]:
    """A fresh storage root: ``(storage_path, storage_options)``."""
    return _root(request, tmp_path, request.param)


@pytest.fixture(params=OBJECT_STORES)
def object_root(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any] | None]:
    return _root(request, tmp_path, request.param)


def _root(request: pytest.FixtureRequest, tmp_path, kind: str) -> tuple[str, dict[str, Any] | None]:
    if kind == "local":
        return str(tmp_path / "store"), None
    if kind == "memory":
        return f"memory://results-{uuid.uuid4().hex[:10]}/store", None
    loc = request.getfixturevalue(f"{kind}_location")
    return loc.uri, dict(loc.storage_options)


def _ctx(root, trial: str = "t", **kwargs: Any) -> StorageContext:
    return StorageContext(root[0], "exp", trial, storage_options=root[1], **kwargs)


def _start(root, **kwargs: Any) -> Any:
    return session.start(storage_path=root[0], storage_options=root[1],
                         experiment_name="exp", trial_name="t", **kwargs)


def _segments(root, trial: str = "t") -> list[str]:
    ctx = _ctx(root, trial)
    return [s.name for s in list_segments(ctx.filesystem, ctx.trial_path)]


def _result_bytes(root) -> bytes | None:
    ctx = _ctx(root)
    try:
        with ctx.filesystem.open_input_stream(posixpath.join(ctx.trial_path, RESULT_FILE)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _src(tmp_path, name: str) -> Checkpoint:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "w.bin").write_bytes(name.encode())
    return Checkpoint.from_directory(str(d))


def _iters(rows: list[dict[str, Any]]) -> list[int]:
    return [r["training_iteration"] for r in rows]


# -- writing ------------------------------------------------------------------------------


def test_rows_survive_sessions_in_order_on_every_backend(root, tmp_path, monkeypatch):
    monkeypatch.setenv(FLUSH_INTERVAL_ENV, "3600")
    with _start(root) as s:
        for i in range(5):
            s.report({"i": i}, checkpoint=_src(tmp_path, f"c{i}") if i == 2 else None)
    with _start(root) as s:
        row = s.report({"i": 5})
    assert row["training_iteration"] == 6
    rows = _ctx(root).read_results()
    assert [r["i"] for r in rows] == list(range(6))
    assert _iters(rows) == list(range(1, 7))
    # Assembled at the end: no segment left, result.json holds every row once.
    assert _segments(root) == []
    assert len(_result_bytes(root).splitlines()) == 6


def test_object_store_report_writes_a_segment_not_result_json(object_root, tmp_path, monkeypatch):
    monkeypatch.setenv(FLUSH_INTERVAL_ENV, "3600")
    with _start(object_root) as s:
        for i in range(3):
            s.report({"i": i})
        assert _result_bytes(object_root) is None  # nothing rewritten per report
        assert session_internals(s).results is not None
        assert session_internals(s).results.buffered == 3
        s.report({"i": 3}, checkpoint=_src(tmp_path, "c"))  # a checkpoint report flushes
        [name] = _segments(object_root)
        assert name.startswith(f"{1:012d}-{4:012d}-{session_internals(s).results._token}")
        assert [r["i"] for r in _ctx(object_root).read_results()] == [0, 1, 2, 3]
        s.report({"i": 4})
    assert _segments(object_root) == []
    assert [r["i"] for r in _ctx(object_root).read_results()] == [0, 1, 2, 3, 4]


def test_timer_flushes_buffered_rows(object_root, monkeypatch):
    monkeypatch.setenv(FLUSH_INTERVAL_ENV, "0.2")
    with _start(object_root) as s:
        s.report({"i": 0})
        s.report({"i": 1})
        deadline = time.monotonic() + 10
        while not _segments(object_root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_segments(object_root)) == 1
        assert session_internals(s).results is not None
        assert session_internals(s).results.buffered == 0
        assert [r["i"] for r in _ctx(object_root).read_results()] == [0, 1]


def test_local_disk_appends_in_place(tmp_path):
    root = (str(tmp_path / "store"), None)
    with _start(root) as s:
        s.report({"i": 0})
        path = tmp_path / "store" / "exp" / "t" / RESULT_FILE
        assert len(path.read_bytes().splitlines()) == 1  # written at once, no buffering
        s.report({"i": 1})
    assert not (tmp_path / "store" / "exp" / "t" / RESULT_SEGMENTS_DIR).exists()


class _CountingHandler(FaultInjectingHandler):
    """Counts calls (``calls``) and the bytes PUT (``put_bytes``)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.put_bytes = 0

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        out = super().open_output_stream(path, metadata)
        handler = self

        class _Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                handler.put_bytes += len(b)
                out.write(b)
                return len(b)

            def close(self) -> None:
                if not self.closed:
                    out.close()
                super().close()

        return pa.PythonFile(_Writer(), mode="w")


def _counted(root) -> tuple[_CountingHandler, StorageContext]:
    """The trial of ``root`` behind a :class:`_CountingHandler`."""
    backend, path = resolve(root[0], storage_options=root[1])
    handler = _CountingHandler(backend.filesystem)
    counted = Backend(pa.fs.PyFileSystem(handler), scheme=backend.scheme,
                      capabilities=backend.capabilities, name="counted")
    return handler, StorageContext.from_backend(counted, path, "exp", "t")


def test_metrics_only_reports_put_a_few_hundred_bytes_each_on_s3(s3_location, monkeypatch):
    """Issue 19's target: a metrics-only report PUTs <= 4 KB amortised, at any
    row count (it was the whole result.json per report: 1.2 MB at 5,000 rows)."""
    monkeypatch.setenv(FLUSH_INTERVAL_ENV, "3600")
    handler, storage = _counted((s3_location.uri, s3_location.storage_options))
    s = session.Session(storage)
    s.report({"loss": 0.0})
    before = handler.put_bytes
    n = 2000
    for i in range(n):
        s.report({"loss": float(i), "step": i})
        if i % 500 == 499:
            session_internals(s).results.flush()  # as the timer would
    s.close()
    per_report = (handler.put_bytes - before) / n
    assert per_report <= 4096, per_report
    assert handler.calls["open_output_stream"] < 20  # segments + lease + result.json once
    assert len(_ctx((s3_location.uri, s3_location.storage_options)).read_results()) == n + 1


# -- reading the tail ------------------------------------------------------------------


def test_start_reads_only_the_tail_of_result_json(root, monkeypatch):
    """session.start continues from the last row without reading the whole file."""
    ctx = _ctx(root)
    line = b'{"training_iteration": %d, "time_total_s": %d.5, "pad": "' + b"x" * 200 + b'"}\n'
    data = b"".join(line % (i, i) for i in range(1, 3001))  # ~650 KB
    _write(ctx, RESULT_FILE, data)
    handler, counted = _counted(root)
    rows = last_result_rows(counted)
    assert rows and rows[-1]["training_iteration"] == 3000
    assert len(rows) < 100
    assert handler.calls["open_input_stream"] == 0  # no whole-file read
    with _start(root) as s:
        row = s.report({"x": 1})
    assert row["training_iteration"] == 3001
    assert row["time_total_s"] >= 3000.5


def _write(ctx: StorageContext, name: str, data: bytes) -> None:
    from checkpoint_store._util import fs as _fsutil

    _fsutil.write_bytes(ctx.filesystem, posixpath.join(ctx.trial_path, name), data,
                        ctx.backend.capabilities)


@pytest.mark.parametrize("kind", ["long", "torn", "odd"])
def test_tail_grows_past_long_torn_and_odd_last_lines(root, kind):
    """A last row longer than the first tail read (8 KiB), a torn last line, or
    rows without a valid iteration: the read grows until it finds one."""
    ctx = _ctx(root)
    head = b"".join(b'{"training_iteration": %d, "time_total_s": 1.0}\n' % i for i in range(1, 8))
    tail = {
        "long": b'{"training_iteration": 8, "blob": "' + b"y" * 50_000 + b'"}\n',
        "torn": b'{"training_iteration": 8}\n{"training_itera',
        "odd": b'{"training_iteration": 8}\n'
               + b"".join(b'{"training_iteration": "abc", "pad": "%s"}\n' % (b"z" * 900)
                          for _ in range(40)),
    }[kind]
    _write(ctx, RESULT_FILE, head + tail)
    ctx2 = _ctx(root)
    its = [r.get("training_iteration") for r in last_result_rows(ctx2)]
    assert 8 in its
    with _start(root) as s:
        assert s.report({"x": 1})["training_iteration"] == 9


def test_old_trial_with_plain_result_json_restarts_unchanged(root):
    """A trial written before segments existed: result.json only, kept byte for
    byte, and the next row continues its numbering."""
    ctx = _ctx(root)
    old = b"".join(json.dumps({"training_iteration": i, "time_total_s": float(i),
                               "acc": i / 10}).encode() + b"\n" for i in range(1, 11))
    _write(ctx, RESULT_FILE, old)
    with _start(root) as s:
        s.report({"acc": 2.0})
    data = _result_bytes(root)
    assert data is not None and data.startswith(old)
    rows = _ctx(root).read_results()
    assert _iters(rows) == list(range(1, 12))
    assert rows[-1]["time_total_s"] >= 10.0


# -- crashes -------------------------------------------------------------------------------


def _write_segments(root, rows_per_segment: list[int], start: int = 1,
                    trial: str = "t") -> list[dict[str, Any]]:
    """Rows written through a ResultLog and flushed, one segment per entry."""
    ctx = _ctx(root, trial=trial)
    log = ResultLog(ctx, flush_interval=3600)
    written, it = [], start
    for n in rows_per_segment:
        for _ in range(n):
            row = {"training_iteration": it, "time_total_s": float(it)}
            log.append(row)
            written.append(row)
            it += 1
        log.flush()
    return written


@pytest.mark.parametrize(
    "object_root", ["memory", "s3", pytest.param("s3fs", marks=pytest.mark.slow)], indirect=True)
def test_crash_at_every_step_of_the_assembly_loses_and_doubles_nothing(object_root):
    """Kill (SimulatedCrash) before each storage write of an assembly, each time
    from the same state: readers see every row exactly once, and the next
    assembly completes it."""
    backend, path = resolve(object_root[0], storage_options=object_root[1])
    want = list(range(1, 10))
    step = 0
    while True:
        trial = f"t{step}"
        _write(_ctx(object_root, trial=trial), RESULT_FILE,
               b"".join(b'{"training_iteration": %d}\n' % i for i in range(1, 4)))
        _write_segments(object_root, [2, 3, 1], start=4, trial=trial)
        faulty = faulty_backend(backend, crash_after_writes=step)
        try:
            assemble_results(StorageContext.from_backend(faulty, path, "exp", trial))
        except SimulatedCrash:
            assert _iters(_ctx(object_root, trial=trial).read_results()) == want, step
            assert assemble_results(_ctx(object_root, trial=trial)) > 0
            assert _iters(_ctx(object_root, trial=trial).read_results()) == want, step
            assert _segments(object_root, trial) == []
            step += 1
            continue
        break
    assert step >= 4  # before result.json's write, then before each of three deletes
    assert _segments(object_root, f"t{step}") == []
    assert _iters(_ctx(object_root, trial=f"t{step}").read_results()) == want


def test_folded_segments_left_by_a_crash_are_not_read_twice(object_root):
    rows = _write_segments(object_root, [2, 2])
    # What a crash after the result.json write and before the deletes leaves:
    _write(_ctx(object_root), RESULT_FILE, b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    assert len(_segments(object_root)) == 2
    assert _iters(_ctx(object_root).read_results()) == [1, 2, 3, 4]
    with _start(object_root) as s:
        assert s.report({})["training_iteration"] == 5
    assert _iters(_ctx(object_root).read_results()) == [1, 2, 3, 4, 5]
    assert _segments(object_root) == []


_CHILD = textwrap.dedent("""
    import sys, time
    from checkpoint_store import Checkpoint, StorageContext, session
    uri, opts, ckpt = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
    with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                       trial_name="t") as s:
        for i in range(40):
            s.report({"i": i}, checkpoint=Checkpoint.from_directory(ckpt) if i == 19 else None)
        # The timer writes rows 20..39 (a fixed sleep raced its PUT under load).
        ctx = StorageContext(uri, "exp", "t", storage_options=opts)
        deadline = time.monotonic() + 60
        while len(ctx.read_results()) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("reported", flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_killed_runs_rows_are_all_readable(request, tmp_path, kind):
    """SIGKILL a reporting process after its last flush (before any assembly):
    every row is readable, a new run continues after them, and its end
    assembles one result.json with every row once."""
    root = _root(request, tmp_path, kind)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"w")
    env = dict(os.environ, **{FLUSH_INTERVAL_ENV: "0.2"})
    if kind == "s3":
        env.update(request.getfixturevalue("s3_location").env)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, root[0], repr(root[1]), str(ckpt)],
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reported"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    rows = _ctx(root).read_results()
    assert [r["i"] for r in rows] == list(range(40))
    if kind == "s3":
        assert _result_bytes(root) is None and _segments(root)  # never assembled
    with _start(root) as s:
        assert s.report({"i": 40})["training_iteration"] == 41
    assert [r["i"] for r in _ctx(root).read_results()] == list(range(41))
    assert _segments(root) == []


def test_a_read_racing_the_assembly_sees_every_row_once(object_root, monkeypatch):
    """The writer's end assembles between a reader's read of result.json and its
    read of the segments: the reader reads again instead of losing those rows."""
    from checkpoint_store._results import writer as _results

    _write(_ctx(object_root), RESULT_FILE, b'{"training_iteration": 1}\n')
    _write_segments(object_root, [2, 2], start=2)
    real = _results._fsutil.read_bytes
    raced = []

    def read_then_assemble(fs, path, **kwargs):
        data = real(fs, path, **kwargs)
        if path.endswith("/" + RESULT_FILE) and not raced:
            raced.append(path)
            assemble_results(_ctx(object_root))  # the writer's end, right now
        return data

    monkeypatch.setattr(_results._fsutil, "read_bytes", read_then_assemble)
    assert _iters(_ctx(object_root).read_results()) == [1, 2, 3, 4, 5]
    assert raced and _segments(object_root) == []


@pytest.mark.parametrize("deletes", ["work", "fail"])
def test_a_writer_merges_its_small_segments(object_root, monkeypatch, deletes):
    """Every _MERGE_COUNT flushes become one segment; when the deletes of the
    small ones fail (or a crash stops them), readers still see each row once."""
    from checkpoint_store._results import writer as _results

    monkeypatch.setattr(_results, "_MERGE_COUNT", 4)
    backend, path = resolve(object_root[0], storage_options=object_root[1])
    if deletes == "fail":
        backend = faulty_backend(backend, permanent={"delete": "access_denied"})
    log = ResultLog(StorageContext.from_backend(backend, path, "exp", "t"), flush_interval=3600)
    for it in range(1, 11):
        log.append({"training_iteration": it})
        log.flush()
    names = _segments(object_root)
    spans = sorted((int(n[:12]), int(n[13:25])) for n in names)
    if deletes == "work":
        assert spans == [(1, 4), (5, 8), (9, 9), (10, 10)]
    else:
        assert (1, 4) in spans and (5, 8) in spans and len(spans) == 12
    assert _iters(_ctx(object_root).read_results()) == list(range(1, 11))
    assert assemble_results(_ctx(object_root)) == len(names)
    assert _iters(_ctx(object_root).read_results()) == list(range(1, 11))
