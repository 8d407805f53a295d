"""Small files of ours (markers, rank files, leases, retention state) are
read whole or not at all, on every store. On a store where a reader can see
a file being written (``Capabilities.whole_writes`` False: sftp, smb, hdfs,
webdav, an fsspec filesystem over a local disk), ``write_bytes`` writes a
temporary sibling and moves it into place; before, it wrote in place, and a
reader (another rank, ``ls``, the page, a second job) could read a marker
empty or half written. Here the store is fsspec's ``DirFileSystem`` over a
real local directory, passed in as a user would, with a recorder that looks
at the destination whenever one of our JSON files is being written."""

from __future__ import annotations

import os
import threading

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store._format.layout import is_temp_file_name
from checkpoint_store._util.fs import write_bytes


class _Watched(LocalFileSystem):
    """A local filesystem that, whenever a ``.json`` file (or its temporary
    sibling) is opened for writing and after each write to it, reads what a
    reader would find at the file's final name and records it."""

    def __init__(self, seen: list[tuple[str, bytes | None]], **kw):
        super().__init__(**kw)
        self.seen = seen

    def _open(self, path, mode="rb", *args, **kwargs):
        f = super()._open(path, mode, *args, **kwargs)
        name = os.path.basename(str(path))
        if "w" not in mode or not _final_name(name).endswith(".json"):
            return f
        final = os.path.join(os.path.dirname(str(path)), _final_name(name))
        seen, write = self.seen, f.write

        def look() -> None:
            try:
                with open(final, "rb") as g:
                    seen.append((final, g.read()))
            except FileNotFoundError:
                seen.append((final, None))

        def watched_write(data):
            n = write(data)
            look()
            return n

        look()  # opened for writing, nothing written yet
        f.write = watched_write
        return f


def _final_name(name: str) -> str:
    """The destination of a temporary sibling ``.cs_tmp-<name>-<tag>-<token>``."""
    if is_temp_file_name(name):
        return name[len(".cs_tmp-"):].rsplit("-", 2)[0]
    return name


def _fs(root, seen) -> DirFileSystem:
    os.makedirs(root, exist_ok=True)
    return DirFileSystem(str(root), fs=_Watched(seen, skip_instance_cache=True))


def test_a_marker_rewritten_is_never_seen_half_written(tmp_path):
    seen: list[tuple[str, bytes | None]] = []
    ctx = StorageContext("/runs", "e", "t", storage_filesystem=_fs(tmp_path / "store", seen))
    assert ctx.backend.capabilities.whole_writes is False
    path = f"{ctx.trial_path}/.probe.json"
    versions = [b'{"v": %d, "pad": "%s"}' % (i, b"x" * 4096) for i in range(5)]
    for v in versions:
        write_bytes(ctx.filesystem, path, v, ctx.backend.capabilities)
    assert seen, "the recorder saw no write"
    bad = [(p, d[:20]) for p, d in seen if d is not None and d not in versions]
    assert not bad, f"a reader saw the file half written: {bad[:3]}"
    with ctx.filesystem.open_input_stream(path) as f:
        assert f.read() == versions[-1]
    left = [n for n in os.listdir(tmp_path / "store" / "runs" / "e" / "t")
            if is_temp_file_name(n)]
    assert left == []


def test_a_session_on_such_a_store_writes_every_marker_whole(tmp_path):
    """Markers, claims, the retention state and the lease, through
    ``report()``: never read empty or half written, no temporary sibling
    left, and the newest checkpoint restores."""
    seen: list[tuple[str, bytes | None]] = []
    fs = _fs(tmp_path / "store", seen)
    src = tmp_path / "src"
    src.mkdir()
    with session.start(storage_path="/runs", experiment_name="e", trial_name="t",
                       storage_filesystem=fs,
                       checkpoint_config=CheckpointConfig(num_to_keep=2)):
        for i in range(3):
            (src / "model.bin").write_bytes(bytes([i]) * 1000)
            session.report({"step": i}, checkpoint=Checkpoint.from_directory(str(src)))
    partial = [(p, d[:20]) for p, d in seen if d is not None and not _whole_json(d)]
    assert not partial, f"a reader saw one of our files half written: {partial[:3]}"
    names = {os.path.basename(p) for p, _ in seen}
    assert {".internal_metadata.json", ".cs_manager_lease.json"} <= names, names
    tree = [n for _, _, names in os.walk(tmp_path / "store") for n in names]
    assert not [n for n in tree if is_temp_file_name(n)], tree
    ctx = StorageContext("/runs", "e", "t", storage_filesystem=fs)
    committed = ctx.committed_checkpoints()
    assert [m["metrics"]["step"] for _, m in committed] == [1, 2]
    out = committed[-1][0].to_directory(str(tmp_path / "restored"))
    assert (open(os.path.join(out, "model.bin"), "rb").read()) == bytes([2]) * 1000


def _whole_json(data: bytes) -> bool:
    import json

    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def test_two_writers_of_one_marker_leave_one_whole_version(tmp_path):
    n = 2
    seen: list[tuple[str, bytes | None]] = []
    ctx = StorageContext("/runs", "e", "t", storage_filesystem=_fs(tmp_path / "store", seen))
    path = f"{ctx.trial_path}/.rank.json"
    versions = [b'{"writer": %d, "pad": "%s"}' % (w, b"y" * 65536) for w in range(n)]
    barrier = threading.Barrier(n)

    def write(w: int) -> None:
        barrier.wait()
        for _ in range(20):
            write_bytes(ctx.filesystem, path, versions[w], ctx.backend.capabilities)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with ctx.filesystem.open_input_stream(path) as f:
        assert f.read() in versions
    assert not [d for _, d in seen if d is not None and d not in versions]
