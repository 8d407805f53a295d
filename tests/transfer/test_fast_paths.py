"""The fast paths of transfer planning (issue 17): local copies (two
threads, or the kernel) and their fallbacks, durability, incremental
uploads and the memory budget, each checked for correct bytes, checksums
and commits (not for speed)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading

import google_crc32c
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._transfer import durability as _durability
from checkpoint_store._transfer import localcopy as _localcopy
from checkpoint_store._transfer import plan as _plan
from checkpoint_store._transfer import tasks as _tasks
from checkpoint_store._transfer.trees import copy_tree
from checkpoint_store._util import retry as _retry
from checkpoint_store.backends.base import LOCAL_CAPABILITIES
from checkpoint_store.errors import InvalidConfigError, SourceDeletedError

LOCAL = pafs.LocalFileSystem()
SHM = "/dev/shm"

SHAPES = {
    "empty.bin": 0,
    "one.bin": 1,
    "a/b/deep.bin": 100_000,
    "big.bin": 3 * 1024 * 1024 + 5,
    **{f"many/f{i:02d}": 1000 + i for i in range(40)},
}


def _tree(root: str, sizes: dict[str, int]) -> dict[str, bytes]:
    out = {}
    for i, (rel, size) in enumerate(sizes.items()):
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = (bytes([i % 251]) + os.urandom(16)) * (size // 17) + os.urandom(size % 17)
        with open(path, "wb") as f:
            f.write(data)
        out[rel] = data
    return out


def _assert_copied(entries, src: str, dst: str, want: dict[str, bytes]) -> None:
    assert [e.path for e in entries] == sorted(want)
    for e in entries:
        path = os.path.join(dst, *e.path.split("/"))
        with open(path, "rb") as f:
            assert f.read() == want[e.path], e.path
        assert (e.size, e.crc32c) == (len(want[e.path]),
                                      f"{google_crc32c.value(want[e.path]):08x}"), e.path
        # A copy, never a hard link to the user's file.
        st, st_src = os.stat(path), os.stat(os.path.join(src, *e.path.split("/")))
        assert st.st_nlink == 1 and (st.st_dev, st.st_ino) != (st_src.st_dev, st_src.st_ino)


@pytest.fixture
def shm_dir(tmp_path):
    if not os.path.isdir(SHM) or not os.access(SHM, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="cs-test-", dir=SHM)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def network_disks(monkeypatch) -> None:
    """Copies as between network filesystems (NFS, Lustre ...): a large file
    is one kernel copy, which may run on the server, and its checksum a
    second read, instead of the two-thread copy through user space."""
    monkeypatch.setattr(_plan, "creates_locally", lambda path: False)


@pytest.mark.parametrize("fsync", [True, False])
def test_tmpfs_has_no_reflink_and_the_copy_falls_back(shm_dir, monkeypatch, fsync) -> None:
    # tmpfs refuses FICLONE: a large file takes the two-thread copy (small
    # ones the buffer), and the same tree still arrives whole.
    src, dst = os.path.join(shm_dir, "src"), os.path.join(shm_dir, "dst")
    want = _tree(src, SHAPES)
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=fsync)
    _assert_copied(entries, src, dst, want)
    dev = os.stat(src).st_dev
    assert (dev, dev) in _localcopy._NO_REFLINK


def test_files_around_the_buffer_size_copy_whole(tmp_path, monkeypatch) -> None:
    # At most one buffer: one read feeds the write and the checksum; one byte
    # more: the two-thread copy. Both edges, and an empty file.
    buf = 64 * 1024
    monkeypatch.setattr(_localcopy, "LOCAL_BUFFER", buf)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    want = _tree(src, {"empty": 0, "under": buf - 1, "exact": buf, "over": buf + 1,
                       "many/x": 3, "many/y": buf // 2})
    _assert_copied(copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=False),
                   src, dst, want)


@pytest.mark.parametrize("err", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP])
def test_without_copy_file_range_the_buffer_copies(shm_dir, tmp_path, monkeypatch,
                                                   network_disks, err) -> None:
    # Where large files take the kernel copy (network filesystems): a kernel
    # without copy_file_range (ENOSYS), or a pair of filesystems it does not
    # join (EXDEV), and the user-space loop moves the same bytes.
    tried = [0]

    def refuse(*args, **kwargs):
        tried[0] += 1
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(_localcopy.os, "copy_file_range", refuse, raising=False)
    monkeypatch.setattr(_localcopy, "_COPY_FILE_RANGE", [True])
    # Files over 64 KiB are large: big.bin and deep.bin take the kernel copy.
    monkeypatch.setattr(_localcopy, "LOCAL_BUFFER", 64 * 1024)
    src, dst = os.path.join(shm_dir, "src"), str(tmp_path / "dst")  # tmpfs -> disk
    want = _tree(src, SHAPES)
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=True)
    _assert_copied(entries, src, dst, want)
    assert tried[0] >= 1


def test_syncfs_durability_copies_the_same(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_durability, "DURABILITY", "syncfs")
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    want = _tree(src, SHAPES)
    _assert_copied(copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=True),
                   src, dst, want)


def _fail_after(monkeypatch, n_ok: int, method: str) -> None:
    """Make the runner's ``method`` fail after ``n_ok`` successful calls."""
    real = getattr(_tasks.TransferTasks, method)
    calls = [0]

    def flaky(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > n_ok:
            raise PermissionError(errno.EACCES, "injected failure half-way")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_tasks.TransferTasks, method, flaky)


def test_a_local_copy_failing_half_way_commits_nothing(tmp_path, monkeypatch) -> None:
    src = str(tmp_path / "src")
    _tree(src, SHAPES)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    _fail_after(monkeypatch, 3, "_copy_local_whole")
    with pytest.raises(OSError, match="injected"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
    scan = ctx.scan()
    assert (scan.committed, scan.uncommitted) == (["checkpoint_000000"], [])


def test_an_upload_failing_half_way_commits_nothing(tmp_path, monkeypatch, s3_location) -> None:
    src = str(tmp_path / "src")
    _tree(src, SHAPES)
    ctx = StorageContext(s3_location.uri, "exp", "trial",
                         storage_options=s3_location.storage_options)
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    full = StorageContext(s3_location.uri, "exp", "trial", incremental=False,
                          storage_options=s3_location.storage_options)
    _fail_after(monkeypatch, 1, "_upload_batch")  # the first batch lands, then a failure
    with pytest.raises(OSError, match="injected"):
        full.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
    scan = ctx.scan()
    assert (scan.committed, scan.uncommitted) == (["checkpoint_000000"], [])


class _CopySpy:
    """Counts server-side copies (they still run)."""

    def __init__(self, monkeypatch) -> None:
        self.copied: list[str] = []
        real = _plan.server_copy

        def spy(fs, src, dst, size):
            real(fs, src, dst, size)
            self.copied.append(dst.rsplit("/", 1)[-1])

        monkeypatch.setattr(_plan, "server_copy", spy)


@pytest.fixture(params=["s3_location", "s3fs_location", "memory"])
def object_store(request):
    if request.param == "memory":
        import uuid

        return f"memory://cs-inc-{uuid.uuid4().hex}", {}
    loc = request.getfixturevalue(request.param)
    return loc.uri, dict(loc.storage_options)


def test_incremental_copies_only_what_is_unchanged(tmp_path, monkeypatch, object_store) -> None:
    uri, opts = object_store
    spy = _CopySpy(monkeypatch)
    src = str(tmp_path / "src")
    _tree(src, {"same.bin": 300_000, "same2.bin": 5, "samesize.bin": 4096, "new.bin": 0})
    ctx = StorageContext(uri, "exp", "trial", storage_options=opts)
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert spy.copied == []
    with open(os.path.join(src, "samesize.bin"), "r+b") as f:
        f.write(b"\x00\x01\x02\x03")  # same size, another CRC32C
    with open(os.path.join(src, "added.bin"), "wb") as f:
        f.write(b"added")
    want = {rel: open(os.path.join(src, rel), "rb").read() for rel in os.listdir(src)}
    second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert sorted(spy.copied) == ["new.bin", "same.bin", "same2.bin"]
    ctx.delete_checkpoint("checkpoint_000000")
    second.verify()
    out = second.to_directory(str(tmp_path / "out"))
    assert {rel: open(os.path.join(out, rel), "rb").read() for rel in os.listdir(out)} == want
    # incremental=False uploads everything.
    spy.copied.clear()
    full = StorageContext(uri, "exp", "trial", storage_options=opts, incremental=False)
    full.persist_checkpoint(Checkpoint.from_directory(src), 2, {})
    assert spy.copied == []


def test_previous_deleted_mid_report_falls_back_to_a_full_upload(
    tmp_path, monkeypatch, caplog, object_store
) -> None:
    uri, opts = object_store
    src = str(tmp_path / "src")
    want = _tree(src, {"a.bin": 200_000, "b/c.bin": 1234})
    ctx = StorageContext(uri, "exp", "trial", storage_options=opts)
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    real = StorageContext.previous_checkpoint

    def then_delete(self, index):
        prev = real(self, index)
        assert prev is not None
        self.delete_checkpoint("checkpoint_000000")  # after the lookup, before the copies
        return prev

    monkeypatch.setattr(StorageContext, "previous_checkpoint", then_delete)
    spy = _CopySpy(monkeypatch)
    with caplog.at_level("INFO", logger="checkpoint_store._transfer.plan"):
        second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert spy.copied == []  # every copy failed: all uploaded
    # ... and the user is told why this report moved every byte.
    assert [r.getMessage() for r in caplog.records
            if "could not be copied from the previous checkpoint" in r.getMessage()
            and r.getMessage().startswith("2 of 2 ")], caplog.text
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [1]
    second.verify()
    out = second.to_directory(str(tmp_path / "out"))
    for rel, data in want.items():
        with open(os.path.join(out, *rel.split("/")), "rb") as f:
            assert f.read() == data


def test_unchanged_files_are_copied_while_the_changed_ones_go_up(tmp_path, monkeypatch) -> None:
    # Each copy inside the store waits (up to 20 s) for the changed file's
    # upload to start: run one after the other, every copy would time out.
    src = str(tmp_path / "src")
    _tree(src, {"a.bin": 50_000, "b.bin": 60_000, "changed.bin": 70_000})
    # Two slots: one for the copies, one for the upload (with one, they take turns).
    ctx = StorageContext("memory://overlap", "exp", "trial", max_concurrency=2)
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    with open(os.path.join(src, "changed.bin"), "r+b") as f:
        f.write(b"new bytes")
    uploading = threading.Event()
    real_batch = _tasks.TransferTasks._upload_batch
    real_copy = _plan.server_copy
    overlapped: list[bool] = []

    def batch(self, items):
        uploading.set()
        return real_batch(self, items)

    def copy(fs, src_path, dst_path, size):
        overlapped.append(uploading.wait(20))
        real_copy(fs, src_path, dst_path, size)

    monkeypatch.setattr(_tasks.TransferTasks, "_upload_batch", batch)
    monkeypatch.setattr(_plan, "server_copy", copy)
    second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert overlapped == [True, True]
    ctx.delete_checkpoint("checkpoint_000000")
    second.verify()


class _InFlight:
    """Counts the storage requests of a transfer running at once (each held
    open a moment, so that overlapping ones meet): every one goes through
    the retry policy's ``call``. Threads alive before (another test's
    background uploader, say) are not this transfer's and not counted."""

    def __init__(self, monkeypatch) -> None:
        self.now = self.most = 0
        self.lock = threading.Lock()
        others = {t.ident for t in threading.enumerate()} - {threading.get_ident()}
        real = _retry.call

        def call(fn, **kwargs):
            if threading.get_ident() in others:
                return real(fn, **kwargs)
            with self:
                return real(fn, **kwargs)

        monkeypatch.setattr(_retry, "call", call)

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        threading.Event().wait(0.1)

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.now -= 1


@pytest.mark.parametrize("limit", [1, 2])
def test_incremental_uploads_keep_max_concurrency_requests_in_flight(
    tmp_path, monkeypatch, object_store, limit
) -> None:
    # The copies of unchanged files share max_concurrency with the uploads of
    # the changed ones: together they keep at most that many requests in flight.
    uri, opts = object_store
    src = str(tmp_path / "src")
    _tree(src, {**{f"same{i}.bin": 1000 + i for i in range(6)},
                **{f"changed{i}.bin": 2000 + i for i in range(4)}})
    ctx = StorageContext(uri, "exp", "trial", storage_options=opts, max_concurrency=limit)
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    for i in range(4):
        with open(os.path.join(src, f"changed{i}.bin"), "r+b") as f:
            f.write(b"new bytes")
    spy = _InFlight(monkeypatch)
    second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    assert spy.most == limit
    ctx.delete_checkpoint("checkpoint_000000")
    second.verify()


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1GB"])
def test_transfer_settings_are_checked(tmp_path, bad) -> None:
    with pytest.raises(InvalidConfigError, match="max_concurrency"):
        StorageContext(str(tmp_path), "e", "t", max_concurrency=bad)
    with pytest.raises(InvalidConfigError, match="memory_budget"):
        StorageContext(str(tmp_path), "e", "t", memory_budget=bad)


def test_transfer_settings_reach_the_backend(tmp_path) -> None:
    ctx = StorageContext(str(tmp_path), "e", "t", max_concurrency=3, memory_budget=64 << 20)
    assert (ctx.backend.capabilities.concurrency,
            ctx.backend.capabilities.memory_budget) == (3, 64 << 20)


_RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from checkpoint_store import Checkpoint, StorageContext

    def rss():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

    src, uri, opts, budget = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    ctx = StorageContext(uri, "exp", "trial", storage_options=opts, memory_budget=budget,
                         max_concurrency=8)
    # Warm up (imports, client set-up, thread pools) on a tiny checkpoint, so
    # that the baseline holds everything but the data in flight.
    warm = os.path.join(sys.argv[5] + "-warm")
    os.makedirs(warm)
    with open(os.path.join(warm, "w.bin"), "wb") as f:
        f.write(b"w" * 6_000_000)
    ctx.persist_checkpoint(Checkpoint.from_directory(warm), 0, {}).to_directory(warm + "-out")
    base = rss()
    peak = [base]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    up = peak[0]
    ckpt.to_directory(sys.argv[5])
    done.set()
    t.join()
    print(json.dumps({"base": base, "peak": peak[0], "upload_peak": up}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("location", ["s3_location", "s3fs_location", "azure_location"])
def test_memory_budget_holds_under_8_large_files(tmp_path, request, location) -> None:
    loc = request.getfixturevalue(location)
    src = tmp_path / "src"
    src.mkdir()
    size = 24 * 1024 * 1024
    for i in range(8):
        (src / f"shard_{i}.bin").write_bytes(os.urandom(size))
    budget = 32 * 1024 * 1024
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(src), loc.uri, json.dumps(loc.storage_options),
         str(budget), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, check=True,
        # glibc gives each thread its own malloc arena and keeps freed blocks
        # there: buffers freed by 8 threads can stay in RSS (+100 MiB with
        # s3fs here). Two arenas measure the bytes held, which is what the
        # budget bounds (docs/concepts.md, "Memory").
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = got["peak"] - got["base"]
    # 192 MiB moved up and down; the process grows by the budget plus the
    # clients' own fixed costs (connection pools, thread stacks), never by
    # the data: well under the 192 MiB a client holding whole files needs.
    assert grew <= budget + 48 * 1024 * 1024, (grew / 2**20, got)
    for i in range(8):
        assert (tmp_path / "out" / f"shard_{i}.bin").read_bytes() == (
            src / f"shard_{i}.bin").read_bytes()


@pytest.mark.parametrize("route", ["_kernel_copy", "_copy_through_buffer", "_pipe_copy"])
def test_a_source_changing_during_the_copy_fails_it(tmp_path, monkeypatch, route) -> None:
    # Files larger than the thread's buffer: two threads copy through user
    # space, checksumming what they read (local disks), or the kernel copies
    # the bytes and a second read checksums them (network filesystems).
    # Smaller files: one read feeds both the write and the checksum. A file
    # rewritten meanwhile would get a manifest that does not describe it.
    src = str(tmp_path / "src")
    _tree(src, {"w.bin": 300_000})
    if route != "_copy_through_buffer":
        monkeypatch.setattr(_localcopy, "LOCAL_BUFFER", 64 * 1024)
    if route == "_kernel_copy":
        monkeypatch.setattr(_plan, "creates_locally", lambda path: False)
    real = getattr(_tasks.TransferTasks, route)

    def then_write(self, rel, *args):
        out = real(self, rel, *args)
        with open(os.path.join(src, rel), "ab") as f:
            f.write(b"late")
        return out

    monkeypatch.setattr(_tasks.TransferTasks, route, then_write)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    with pytest.raises(OSError, match="changed while it was being copied"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ctx.committed_checkpoints() == []


def _count_flushes(monkeypatch) -> dict[str, int]:
    """Count ``syncfs`` calls and per-file fsyncs of :func:`_durability.flush_files`
    (both still run)."""
    seen = {"syncfs": 0, "fsync": 0}
    real_syncfs, real_fsync = _durability._syncfs, os.fsync

    def syncfs(fd: int) -> bool:
        seen["syncfs"] += 1
        return real_syncfs(fd)

    def fsync(fd: int) -> None:
        seen["fsync"] += 1
        real_fsync(fd)

    monkeypatch.setattr(_durability, "_syncfs", syncfs)
    monkeypatch.setattr(_durability.os, "fsync", fsync)
    return seen


@pytest.mark.parametrize(
    ("n_files", "other_dirty", "kernel_ok", "want"),
    [
        (200, 0, True, "syncfs"),  # many files, nothing else to write back
        (200, 1 << 40, True, "fsync"),  # syncfs would wait for others' terabyte
        (200, 0, False, "fsync"),  # syncfs hides writeback errors before Linux 5.8
        (3, 0, True, "fsync"),  # few files: fsyncs cost no more
    ],
)
def test_auto_durability_takes_syncfs_only_where_it_pays(
    tmp_path, monkeypatch, n_files, other_dirty, kernel_ok, want
) -> None:
    root = str(tmp_path / "t")
    sizes = {f"d{i % 3}/f{i:03d}": 100 + i for i in range(n_files)}
    _tree(root, sizes)
    nbytes = sum(sizes.values())
    monkeypatch.setattr(_durability, "DURABILITY", "auto")
    monkeypatch.setattr(_durability, "_machine_dirty_bytes", lambda: nbytes + other_dirty)
    if not kernel_ok:
        monkeypatch.setattr(_durability, "_SYNCFS_KERNEL", (10_000, 0))
    seen = _count_flushes(monkeypatch)
    _durability.flush_files(root, sorted(sizes), 4, nbytes)
    if want == "syncfs":
        assert seen == {"syncfs": 1, "fsync": 0}
    else:
        assert seen == {"syncfs": 0, "fsync": n_files}


def test_machine_dirty_bytes_reads_meminfo() -> None:
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    got = _durability._machine_dirty_bytes()
    assert got is not None and got >= 0 and got % 1024 == 0


def test_a_failed_syncfs_commits_nothing(tmp_path, monkeypatch) -> None:
    # A writeback error reported by syncfs means the bytes may not be on disk:
    # the checkpoint must not be committed (and its staging is removed).
    def failing(fd: int) -> bool:
        raise OSError(errno.EIO, "injected writeback error")

    monkeypatch.setattr(_durability, "DURABILITY", "syncfs")
    monkeypatch.setattr(_durability, "_syncfs", failing)
    src = str(tmp_path / "src")
    _tree(src, {f"f{i:03d}": 1000 for i in range(100)})
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial", fsync=True)
    with pytest.raises(OSError, match="injected writeback error"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ctx.committed_checkpoints() == []
    scan = ctx.scan()
    assert (scan.committed, scan.uncommitted) == ([], [])


@pytest.mark.parametrize("durability", ["auto", "fsync", "syncfs"])
def test_data_is_flushed_before_the_commit_marker(tmp_path, monkeypatch, durability) -> None:
    # fsync=True: every file's bytes are made durable (flush_files) before the
    # marker that commits them is written, whichever way they are flushed.
    from checkpoint_store._format.layout import INTERNAL_METADATA
    from checkpoint_store._util import fs as _fsutil

    monkeypatch.setattr(_durability, "DURABILITY", durability)
    events: list[str] = []
    real_flush, real_write = _plan.flush_files, _fsutil.write_bytes

    def flush(root, rels, workers, nbytes=0):
        real_flush(root, rels, workers, nbytes)
        events.append(f"flush {len(rels)}")

    def write_bytes(fs, path, data, caps, **kwargs):
        if path.endswith("/" + INTERNAL_METADATA):
            events.append(f"marker fsync={kwargs.get('fsync')}")
        return real_write(fs, path, data, caps, **kwargs)

    monkeypatch.setattr(_plan, "flush_files", flush)
    monkeypatch.setattr(_fsutil, "write_bytes", write_bytes)
    src = str(tmp_path / "src")
    want = _tree(src, {**{f"s/f{i:03d}": 700 for i in range(80)}, "big": 5 * 1024 * 1024})
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial", fsync=True)
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert events == ["flush 81", "marker fsync=True"]
    ck.verify()
    out = ck.to_directory(str(tmp_path / "out"))
    for rel, data in want.items():
        with open(os.path.join(out, *rel.split("/")), "rb") as f:
            assert f.read() == data


def test_a_download_through_a_linked_directory_out_of_the_target_is_refused(tmp_path) -> None:
    # Many files share a directory (checked once); the refusal names one of them.
    from checkpoint_store._transfer.trees import download_tree
    from checkpoint_store.errors import UnsafePathError

    src = str(tmp_path / "src")
    _tree(src, {**{f"ok/f{i:03d}": 10 for i in range(50)}, **{f"out/g{i}": 10 for i in range(3)}})
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    target = tmp_path / "target"
    target.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, target / "out")
    with pytest.raises(UnsafePathError, match="'out/g0' would leave the target"):
        download_tree(ck.filesystem, ck.path, LOCAL_CAPABILITIES, str(target),
                      manifest=None)
    assert os.listdir(elsewhere) == [] and os.listdir(target) == ["out"]


@pytest.mark.parametrize("task", ["copy_local_file", "crc_local_range"])
@pytest.mark.parametrize("change", ["append", "replace_same_size"])
def test_a_large_file_changing_between_its_copy_and_its_checksums_fails(
    tmp_path, monkeypatch, network_disks, task, change
) -> None:
    # Between network filesystems a large file is copied whole by the kernel
    # while its parts are checksummed by other tasks: a write (or a rename of another file of the
    # same size over it) after one task read it is caught by the next.
    # Two workers planned, run on this thread so the order is fixed: the
    # copy, then the parts.
    monkeypatch.setattr(_plan, "LOCAL_PART", 1024 * 1024)
    monkeypatch.setattr(_plan, "_run_on_pool", _plan._run_in_turn)
    src = str(tmp_path / "src")
    _tree(src, {"big.bin": 3 * 1024 * 1024 + 7})
    path = os.path.join(src, "big.bin")
    real = getattr(_tasks.TransferTasks, task)
    done = [False]

    def then_change(self, rel, *args):
        out = real(self, rel, *args)
        if not done[0]:
            done[0] = True
            if change == "append":
                with open(path, "ab") as f:
                    f.write(b"late")
            else:
                with open(path + ".new", "wb") as f:
                    f.write(os.urandom(os.path.getsize(path)))
                os.replace(path + ".new", path)
        return out

    monkeypatch.setattr(_tasks.TransferTasks, task, then_change)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial", max_concurrency=2)
    with pytest.raises(OSError, match="changed while it was being copied"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ctx.committed_checkpoints() == []
    scan = ctx.scan()
    assert (scan.committed, scan.uncommitted) == ([], [])


@pytest.mark.parametrize("concurrency", [2, 4])
def test_a_large_local_file_is_copied_whole_and_checksummed_in_parts(
    tmp_path, monkeypatch, network_disks, concurrency
) -> None:
    # The route of a single large file between network filesystems: one
    # kernel copy, the CRC32C combined from its parts; also through
    # to_directory, whose verification reads the same way.
    monkeypatch.setattr(_plan, "LOCAL_PART", 1024 * 1024)
    calls: list[str] = []
    real = _tasks.TransferTasks.copy_local_file

    def spy(self, rel, stamp):
        calls.append(rel)
        return real(self, rel, stamp)

    monkeypatch.setattr(_tasks.TransferTasks, "copy_local_file", spy)
    src = str(tmp_path / "src")
    want = _tree(src, {"big.bin": 5 * 1024 * 1024 + 3, "small": 10})
    dst = str(tmp_path / "dst")
    caps = LOCAL_CAPABILITIES.__class__(**{**LOCAL_CAPABILITIES.__dict__,
                                          "concurrency": concurrency})
    entries = copy_tree(LOCAL, src, LOCAL, dst, caps, fsync=True)
    if not _localcopy._NO_REFLINK:
        pytest.skip("this filesystem clones: large files are whole-file clones")
    _assert_copied(entries, src, dst, want)
    assert calls == ["big.bin"]
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial", max_concurrency=concurrency)
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    out = ck.to_directory(str(tmp_path / "out"))
    with open(os.path.join(out, "big.bin"), "rb") as f:
        assert f.read() == want["big.bin"]


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_a_refused_clone_leaves_the_copy_a_new_file(tmp_path, shm_dir, monkeypatch,
                                                    where) -> None:
    # The clone is tried on the largest file first. Where it is refused
    # (ext4, tmpfs), the copy must still create that file itself: reopening
    # the probe's empty file with O_TRUNC makes ext4 write the whole file
    # back when it is closed (auto_da_alloc), doubling a 1 GiB copy's time.
    base = str(tmp_path) if where == "tmp" else shm_dir
    src, dst = os.path.join(base, "src"), os.path.join(base, "dst")
    want = _tree(src, {"big.bin": 40 * 1024 * 1024 + 1, "small": 10})
    existed: list[bool] = []
    real = _tasks.TransferTasks._copy_local_whole

    def spy(self, rel):
        if rel == "big.bin":
            existed.append(os.path.exists(self._dst_os(rel)))
        return real(self, rel)

    monkeypatch.setattr(_tasks.TransferTasks, "_copy_local_whole", spy)
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=False)
    _assert_copied(entries, src, dst, want)
    if (os.stat(src).st_dev, os.stat(src).st_dev) not in _localcopy._NO_REFLINK:
        pytest.skip("this filesystem clones: the probe is the copy")
    assert existed == [False]


@pytest.mark.parametrize("task", ["copy_local_file", "_pipe_copy"])
def test_a_large_local_copy_failing_half_way_commits_nothing(tmp_path, monkeypatch,
                                                             task) -> None:
    monkeypatch.setattr(_plan, "LOCAL_PART", 1024 * 1024)
    if task == "copy_local_file":  # between network filesystems
        monkeypatch.setattr(_plan, "creates_locally", lambda path: False)
    src = str(tmp_path / "src")
    _tree(src, {"big.bin": 5 * 1024 * 1024, "b.bin": 6 * 1024 * 1024 + 1})
    _fail_after(monkeypatch, 1, task)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    with pytest.raises(OSError, match="injected"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ctx.committed_checkpoints() == []
    scan = ctx.scan()
    assert (scan.committed, scan.uncommitted) == ([], [])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_small_local_files_are_copied_in_turn_by_one_thread(tmp_path, monkeypatch) -> None:
    # Disk to disk, small files go through one thread (the caller's when
    # nothing else runs): more threads measured slower (directory lock, GIL).
    threads: set[int] = set()
    real = _tasks.TransferTasks._copy_local_whole

    def spy(self, rel):
        threads.add(threading.get_ident())
        return real(self, rel)

    monkeypatch.setattr(_tasks.TransferTasks, "_copy_local_whole", spy)
    if not _durability.creates_locally(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on {_durability.fs_type(str(tmp_path))!r}")
    small = {rel: size for rel, size in SHAPES.items() if rel != "big.bin"}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    want = _tree(src, small)
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=True)
    _assert_copied(entries, src, dst, want)
    assert threads == {threading.get_ident()}
    # From or onto a filesystem of another kind (NFS, Lustre ...: each open
    # and close waits for the server) the small files keep several threads.
    for remote in ("source", "destination"):
        threads.clear()
        dst2 = str(tmp_path / f"dst-{remote}")
        side = src if remote == "source" else dst2
        monkeypatch.setattr(_plan, "creates_locally", lambda path, side=side: path != side)
        entries = copy_tree(LOCAL, src, LOCAL, dst2, LOCAL_CAPABILITIES, fsync=False)
        _assert_copied(entries, src, dst2, want)
        assert threads and threading.get_ident() not in threads  # the pool's threads


@pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="needs Linux")
def test_fs_type_reads_the_mount_table(shm_dir, tmp_path) -> None:
    assert _durability.fs_type(shm_dir) == "tmpfs"
    assert _durability.creates_locally(shm_dir)
    assert _durability.fs_type(str(tmp_path / "missing")) is None
    assert not _durability.creates_locally(str(tmp_path / "missing"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_local_copy_leaves_no_descriptor_open_and_names_a_vanished_file(tmp_path) -> None:
    # Files are opened relative to descriptors of the two roots: those are
    # closed after the copy, also a failed one, and an error names the
    # source file's whole path, not its path under the root.
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    want = _tree(src, {"a/x": 10, "y": 20})
    before = _open_fds()
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=False)
    _assert_copied(entries, src, dst, want)
    assert _open_fds() == before
    os.makedirs(tmp_path / "dst2" / "a")
    with pytest.raises(SourceDeletedError, match="was deleted while it was being copied") \
            as info:
        _plan.run(LOCAL, src, LOCAL, str(tmp_path / "dst2"), [("a/gone", 10), ("y", 20)],
                  chunk_size=2**20, concurrency=4, fsync=False)
    assert str(info.value).startswith(os.path.join(src, "a", "gone") + " ")
    assert (info.value.path, info.value.file) == (src, "a/gone")
    assert info.value.__cause__.filename == os.path.join(src, "a", "gone")
    assert _open_fds() == before


def _committed(tmp_path, sizes: dict[str, int]):
    src = str(tmp_path / "src")
    want = _tree(src, sizes)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    return ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {}), want


def test_a_download_takes_sizes_from_the_inspection_and_still_reads_real_ones(tmp_path) -> None:
    # to_directory passes the inspection's listing on, so a local checkpoint
    # is not stat'ed twice; a listed size gone stale only misplans: the copy
    # reads the real bytes and the manifest check passes.
    from checkpoint_store._transfer.trees import download_tree
    from checkpoint_store._util.inspect import inspect_checkpoint

    ck, want = _committed(tmp_path, {"a/x": 10, "y": 3 * 1024 * 1024 + 1})
    insp = inspect_checkpoint(ck.filesystem, ck.path)
    assert insp.files is not None and insp.files["y"] == 3 * 1024 * 1024 + 1
    stale = {rel: 1 for rel in insp.files}
    out = str(tmp_path / "out")
    written = download_tree(ck.filesystem, ck.path, LOCAL_CAPABILITIES, out,
                            manifest=insp.meta["manifest"], listed=stale)
    assert written == ["a/x", "y"]
    for rel, data in want.items():
        with open(os.path.join(out, *rel.split("/")), "rb") as f:
            assert f.read() == data
    assert ck.to_directory(str(tmp_path / "out2")) == str(tmp_path / "out2")
    with open(tmp_path / "out2" / "y", "rb") as f:
        assert f.read() == want["y"]


def test_a_link_out_of_a_checkpoint_is_refused_also_with_sizes_listed(tmp_path) -> None:
    from checkpoint_store._transfer.trees import download_tree
    from checkpoint_store._util.inspect import inspect_checkpoint
    from checkpoint_store.errors import UnsafePathError

    ck, _ = _committed(tmp_path, {"x": 10})
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    os.symlink(secret, os.path.join(ck.path, "leak"))
    listed = dict(inspect_checkpoint(ck.filesystem, ck.path).files or {})
    with pytest.raises(UnsafePathError, match="leading out of the checkpoint"):
        download_tree(ck.filesystem, ck.path, LOCAL_CAPABILITIES, str(tmp_path / "out"),
                      manifest=None, listed={**listed, "leak": 9})
    assert not os.path.exists(tmp_path / "out" / "leak")


# -- large files between local disks: two threads through user space ----------------------

PIECE = 64 * 1024


@pytest.fixture
def small_pipe(monkeypatch) -> None:
    """Files over 64 KiB take the two-thread copy, in 64 KiB pieces, two in
    flight, each written in 16 KiB calls."""
    monkeypatch.setattr(_localcopy, "LOCAL_BUFFER", PIECE)
    monkeypatch.setattr(_localcopy, "PIPE_PIECE", PIECE)
    monkeypatch.setattr(_localcopy, "PIPE_BUFFERS", 2)
    monkeypatch.setattr(_localcopy, "PIPE_WRITE", 16 * 1024)


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cs-copy-writer"]


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_large_local_files_are_copied_by_a_reader_and_a_writer(tmp_path, shm_dir, small_pipe,
                                                               monkeypatch, where) -> None:
    # Sizes at and around a whole number of pieces: every byte written once,
    # the CRC32C of exactly those bytes; on ext4 and on tmpfs, uploads and
    # downloads (to_directory verifies against the manifest).
    base = str(tmp_path) if where == "tmp" else shm_dir
    if not _durability.creates_locally(base):
        pytest.skip(f"{base} is on {_durability.fs_type(base)!r}")
    piped: list[str] = []
    real = _tasks.TransferTasks._pipe_copy

    def spy(self, rel, *args):
        piped.append(rel)
        return real(self, rel, *args)

    monkeypatch.setattr(_tasks.TransferTasks, "_pipe_copy", spy)
    sizes = {"exact": 4 * PIECE, "over": 4 * PIECE + 1, "under": 4 * PIECE - 1,
             "one_more": PIECE + 1, "d/big": 37 * PIECE + 123, "small": 100}
    src = os.path.join(base, "src")
    want = _tree(src, sizes)
    entries = copy_tree(LOCAL, src, LOCAL, os.path.join(base, "dst"), LOCAL_CAPABILITIES,
                        fsync=True)
    if (os.stat(src).st_dev,) * 2 not in _localcopy._NO_REFLINK:
        pytest.skip("this filesystem clones: large files are clones")
    _assert_copied(entries, src, os.path.join(base, "dst"), want)
    assert sorted(piped) == sorted(r for r in sizes if r != "small")
    piped.clear()
    ctx = StorageContext(os.path.join(base, "store"), "exp", "trial", fsync=False)
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    out = ck.to_directory(os.path.join(base, "out"))
    for rel, data in want.items():
        with open(os.path.join(out, *rel.split("/")), "rb") as f:
            assert f.read() == data, rel
    assert len(piped) == 2 * (len(sizes) - 1)
    assert _writers() == []


@pytest.mark.parametrize("side", ["write", "read"])
def test_a_failing_two_thread_copy_raises_and_leaves_no_thread(tmp_path, small_pipe,
                                                                monkeypatch, side) -> None:
    # A write failing on the writer thread (a full disk) or a read failing on
    # the reader's: the first error is raised, the other thread stops (no
    # hang waiting for a buffer), nothing is committed.
    calls = [0]  # the 7th: inside the second piece's writes, or its checksum
    target = "_pwrite_all" if side == "write" else "_crc"
    real = getattr(_localcopy, target)

    def fail_third(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 7:
            raise OSError(errno.ENOSPC, f"injected {side} failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(_localcopy, target, fail_third)
    src = str(tmp_path / "src")
    _tree(src, {"big.bin": 40 * PIECE + 5})
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial",
                         retry=_retry.RetryPolicy(attempts=1))
    with pytest.raises(OSError, match=f"injected {side} failure"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ctx.committed_checkpoints() == []
    assert _writers() == []

