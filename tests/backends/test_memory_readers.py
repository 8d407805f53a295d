"""Concurrent readers of the built-in memory backend each get their own view
(issue 12, kind 5). fsspec's memory filesystem hands every reader of a path
the same file object, so four threads moved each other's position: "not valid
JSON", a CRC mismatch, or ``{}`` for a committed checkpoint. The conformance
suite (``BackendTests``) runs the same shape on every backend."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.testing.conformance import make_tree, read_tree


@pytest.fixture
def committed(tmp_path) -> Checkpoint:
    src = tmp_path / "src"
    make_tree(src, {"model.pt": 200_000, "optimizer.pt": 50_000, "cfg/a.json": 40})
    ctx = StorageContext(f"memory://readers-{uuid.uuid4().hex[:8]}/r", "e", "t")
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"loss": 0.5}})
    return Checkpoint(ckpt.uri)  # as a reader would: from the URI alone


def test_four_threads_download_into_one_directory(committed, tmp_path):
    expected = read_tree(tmp_path / "src")
    target = str(tmp_path / "same_dir")
    barrier = threading.Barrier(4)

    def download(_: int) -> dict[str, bytes]:
        barrier.wait()
        return read_tree(committed.to_directory(target))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(download, range(4)))
    assert results == [expected] * 4


def test_four_threads_read_the_internal_metadata(committed):
    barrier = threading.Barrier(4)

    def meta(_: int) -> list[dict]:
        barrier.wait()
        return [Checkpoint(committed.uri).internal_metadata for _ in range(50)]

    with ThreadPoolExecutor(4) as pool:
        seen = [m for batch in pool.map(meta, range(4)) for m in batch]
    assert len(seen) == 200
    assert all(m["index"] == 0 and m["metrics"] == {"loss": 0.5} for m in seen)
    assert all(m == seen[0] for m in seen)


# -- a file being written is not read (whole writes) ----------------------------------------
# fsspec's memory filesystem stores a file as its writer opens it, so a reader
# saw it empty or half written: a rank reading another rank's marker while it
# was written got a JSONDecodeError (tests/session/test_multirank.py under
# load). Here a file appears, or replaces the old one, when its writer closes
# it, as one object store PUT does.


def _memory_forms() -> list:
    from fsspec.implementations.memory import MemoryFileSystem

    from checkpoint_store.backends.handlers import wrap_filesystem

    uri = StorageContext(f"memory://whole-{uuid.uuid4().hex[:8]}/r", "e", "t")
    return [pytest.param(lambda: (uri.filesystem, uri.trial_path), id="uri"),
            pytest.param(lambda: (wrap_filesystem(MemoryFileSystem()),
                                  f"/whole-{uuid.uuid4().hex[:8]}/t"), id="fsspec-object")]


@pytest.mark.parametrize("form", _memory_forms())
def test_a_file_being_written_is_not_there_until_its_writer_closes_it(form):
    fs, root = form()
    path = f"{root}/.rank_1.json"
    out = fs.open_output_stream(path)
    out.write(b'{"rank": 1, "files": [')
    with pytest.raises(FileNotFoundError):
        fs.open_input_stream(path).read()
    out.write(b'"a.bin"]}')
    out.close()
    with fs.open_input_stream(path) as f:
        assert f.read() == b'{"rank": 1, "files": ["a.bin"]}'


@pytest.mark.parametrize("form", _memory_forms())
def test_a_file_being_rewritten_reads_as_its_old_bytes_until_closed(form):
    fs, root = form()
    path = f"{root}/state.json"
    with fs.open_output_stream(path) as out:
        out.write(b'{"v": 1}')
    out = fs.open_output_stream(path)
    out.write(b'{"v": ')
    with fs.open_input_stream(path) as f:
        assert f.read() == b'{"v": 1}'
    out.write(b"2}")
    out.close()
    with fs.open_input_stream(path) as f:
        assert f.read() == b'{"v": 2}'
    assert [i.path for i in fs.get_file_info(pafs.FileSelector(root))] == [path]


def test_a_reader_beside_a_writer_sees_whole_json_only():
    """``write_bytes`` (markers, rank files, leases, retention state) against
    a reader in a loop: every read parses, and is one of the versions."""
    import json

    from checkpoint_store._util.fs import write_bytes
    from checkpoint_store.backends.base import MEMORY_CAPABILITIES

    ctx = StorageContext(f"memory://whole-{uuid.uuid4().hex[:8]}/r", "e", "t")
    fs, path = ctx.filesystem, f"{ctx.trial_path}/.marker.json"
    versions = [json.dumps({"v": i, "pad": "x" * 65536}).encode() for i in range(300)]
    write_bytes(fs, path, versions[0], MEMORY_CAPABILITIES)
    done = threading.Event()
    bad: list[bytes] = []

    def read() -> None:
        while not done.is_set():
            with fs.open_input_stream(path) as f:
                data = f.read()
            if data not in versions:
                bad.append(data[:40])

    t = threading.Thread(target=read)
    t.start()
    try:
        for v in versions[1:]:
            write_bytes(fs, path, v, MEMORY_CAPABILITIES)
    finally:
        done.set()
        t.join()
    assert not bad, f"{len(bad)} reads were not a whole version: {bad[:3]}"


def test_a_rewrite_cut_before_its_bytes_keeps_the_old_ones():
    """A signal's exception between ``write_bytes`` opening its writer and
    writing (a lease renewal, a marker, the retention state): the ``with``
    block closed the writer on its way out, and the store then held an empty
    file where the old bytes were; readers got a JSONDecodeError. As an
    object store's PUT cut before its body: the old bytes stay."""
    import sys

    from checkpoint_store._util import fs as _fs
    from checkpoint_store.backends.base import MEMORY_CAPABILITIES

    ctx = StorageContext(f"memory://whole-{uuid.uuid4().hex[:8]}/r", "e", "t")
    fs, path = ctx.filesystem, f"{ctx.trial_path}/lease.json"
    _fs.write_bytes(fs, path, b'{"v": 1}', MEMORY_CAPABILITIES)

    def local(frame, event, arg):
        # The line that writes the bytes, as the interpreter runs a signal
        # handler's exception there: before the write.
        if event == "line" and "out.write(data)" in _source_line(frame):
            raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        code = frame.f_code
        return local if code.co_filename == _fs.__file__ and code.co_name == "_put" else None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            _fs.write_bytes(fs, path, b'{"v": 2}', MEMORY_CAPABILITIES, retry=None)
    finally:
        sys.settrace(None)
    with fs.open_input_stream(path) as f:
        assert f.read() == b'{"v": 1}'


def _source_line(frame) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_a_writer_never_closed_publishes_nothing():
    import gc

    ctx = StorageContext(f"memory://whole-{uuid.uuid4().hex[:8]}/r", "e", "t")
    fs, path = ctx.filesystem, f"{ctx.trial_path}/dropped.bin"
    out = fs.open_output_stream(path)
    out.write(b"half")
    del out
    gc.collect()
    assert fs.get_file_info(path).type == pafs.FileType.NotFound
