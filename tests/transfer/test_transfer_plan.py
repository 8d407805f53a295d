"""Transfer planning (checkpoint_store/_transfer/plan.py): every route moves the exact
bytes and reports each file's size and CRC32C, on real files and real servers."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import get_args

import fsspec
import google_crc32c
import pyarrow.fs as pafs
import pytest

from checkpoint_store._transfer import budget as _budget
from checkpoint_store._transfer import durability as _durability
from checkpoint_store._transfer import plan as _plan
from checkpoint_store._transfer import remote as _remote
from checkpoint_store._transfer.trees import copy_tree
from checkpoint_store._util import retry as _retry
from checkpoint_store.backends.base import LOCAL_CAPABILITIES, Capabilities
from checkpoint_store.errors import SourceDeletedError
from checkpoint_store.registry import resolve

LOCAL = pafs.LocalFileSystem()


def _crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def test_crc32c_combine_matches_the_crc_of_the_concatenation() -> None:
    rng = random.Random(3)
    for _ in range(200):
        a = rng.randbytes(rng.choice([0, 1, 7, 100, 4096, rng.randint(0, 70000)]))
        b = rng.randbytes(rng.choice([1, 3, 64, 65536, rng.randint(1, 70000)]))
        got = _plan.crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert got == google_crc32c.value(a + b)
    # Known value: CRC32C("123456789") = e3069283, split anywhere.
    s = b"123456789"
    for i in range(len(s) + 1):
        c = _plan.crc32c_combine(google_crc32c.value(s[:i]), google_crc32c.value(s[i:]), len(s) - i)
        assert f"{c:08x}" == "e3069283"


def _make_tree(root: str, sizes: dict[str, int], seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    out = {}
    for rel, size in sizes.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        out[rel] = data
    return out


SHAPES = {
    "empty.bin": 0,
    "a/one.bin": 1,
    "a/b/c/deep.bin": 1000,
    "big.bin": 5 * 1024 * 1024 + 17,  # several parts with 1 MiB chunks
    "exact.bin": 2 * 1024 * 1024,  # a multiple of the chunk
    **{f"many/f{i:03d}": 3000 + i for i in range(150)},  # more than one batch
}


def _check(entries, fs: pafs.FileSystem, root: str, want: dict[str, bytes]) -> None:
    assert [e.path for e in entries] == sorted(want)
    for e in entries:
        with fs.open_input_stream(f"{root}/{e.path}") as f:
            data = f.read()
        assert data == want[e.path], e.path
        assert (e.size, e.crc32c) == (len(want[e.path]), _crc(want[e.path])), e.path


@pytest.mark.parametrize("fsync", [True, False])
def test_local_copy_parts_batches_and_checksums(tmp_path, monkeypatch, fsync) -> None:
    # Parts of 1 MiB so that a 5 MiB file is copied by several threads.
    monkeypatch.setattr(_plan, "LOCAL_PART", 1024 * 1024)
    src = str(tmp_path / "src")
    want = _make_tree(src, SHAPES)
    dst = str(tmp_path / "dst")
    entries = copy_tree(LOCAL, src, LOCAL, dst, LOCAL_CAPABILITIES, fsync=fsync)
    _check(entries, LOCAL, dst, want)


def test_plan_cuts_large_files_in_parts_and_batches_small_ones(tmp_path) -> None:
    files = [("big", 20 * 2**20), ("s1", 10), ("s2", 20)] + [(f"m{i}", 100) for i in range(200)]
    p = _plan.plan(LOCAL, "/x", pafs.SubTreeFileSystem("/", pafs.LocalFileSystem()), "/y", files,
                   chunk_size=2**20, concurrency=4)
    assert p.route == "local"
    assert p.large == [("big", 20 * 2**20)]
    # "/x" and "/y" do not exist (their filesystem is unknown): batches for the pool.
    assert sum(len(b) for b in p.batches) == 202 and len(p.batches) >= 4
    # Between local-device filesystems, the small files are one batch (one
    # thread copies them in turn).
    p = _plan.plan(LOCAL, str(tmp_path), LOCAL, str(tmp_path), files, chunk_size=2**20,
                   concurrency=4)
    if _durability.creates_locally(str(tmp_path)):
        assert [len(b) for b in p.batches] == [202]
    remote = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    p = _plan.plan(LOCAL, "/x", remote, "/y", files, chunk_size=2**20, concurrency=4)
    assert p.route == "upload"
    assert sum(len(b) for b in p.batches) == 202
    assert all(len(b) <= _plan.BATCH_FILES for b in p.batches)
    assert len(p.batches) >= 4


@pytest.mark.parametrize(("src_local", "dst_local", "route"), [
    (True, True, "local"), (False, True, "download"), (True, False, "upload"),
    (False, False, "stream"),
])
def test_plan_route_follows_where_each_side_lives(src_local, dst_local, route) -> None:
    remote = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    p = _plan.plan(LOCAL if src_local else remote, "/x", LOCAL if dst_local else remote, "/y",
                   [("f", 10)], chunk_size=2**20, concurrency=1)
    assert p.route == route
    assert route in get_args(_plan.Route)


def test_a_vanished_source_file_fails_the_copy(tmp_path) -> None:
    src = tmp_path / "src"
    _make_tree(str(src), {f"f{i}": 10 for i in range(5)})
    files = [(f"f{i}", 10) for i in range(5)] + [("gone", 10)]
    (tmp_path / "dst").mkdir()
    # Typed, naming the file (still a FileNotFoundError); the OS's error is its cause.
    with pytest.raises(SourceDeletedError, match="gone was deleted while") as info:
        _plan.run(LOCAL, str(src), LOCAL, str(tmp_path / "dst"), files,
                  chunk_size=2**20, concurrency=2, fsync=False)
    assert info.value.file == "gone"
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_budget_never_holds_more_than_its_limit() -> None:
    budget = _budget._Budget(100)
    held = []
    peak = [0]
    lock = threading.Lock()

    def worker(n: int) -> None:
        for _ in range(50):
            budget.acquire(n)
            with lock:
                held.append(n)
                peak[0] = max(peak[0], sum(held))
            time.sleep(0.0005)
            with lock:
                held.remove(n)
            budget.release(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (30, 40, 50, 60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] <= 100
    # One request larger than the limit still goes through, alone.
    budget.acquire(500)
    assert not budget.try_acquire(1)
    budget.release(500)


def _roundtrip(tmp_path, uri: str, options) -> None:
    backend, root = resolve(uri, storage_options=options)
    src = str(tmp_path / "src")
    want = _make_tree(src, SHAPES)
    # 1 MiB chunks: the 5 MiB file streams up in several chunks and comes
    # down in several ranged parts.
    up = copy_tree(LOCAL, src, backend.filesystem, root, backend.capabilities,
                   chunk_size=2**20, memory_limit=3 * 2**20)
    _check(up, backend.filesystem, root, want)
    dst = str(tmp_path / "dst")
    caps = Capabilities(directories=True, chunk_size=2**20, concurrency=4)
    down = copy_tree(backend.filesystem, root, LOCAL, dst, caps, fsync=False,
                     memory_limit=3 * 2**20)
    _check(down, LOCAL, dst, want)
    assert [(e.path, e.crc32c) for e in down] == [(e.path, e.crc32c) for e in up]


@pytest.mark.slow
def test_s3_pyarrow_upload_and_ranged_download(tmp_path, s3_location) -> None:
    _roundtrip(tmp_path, s3_location.uri, s3_location.storage_options)


@pytest.mark.slow
def test_s3fs_batched_upload_and_download(tmp_path, s3fs_location) -> None:
    _roundtrip(tmp_path, s3fs_location.uri, s3fs_location.storage_options)


@pytest.mark.slow
def test_azure_adlfs_batched_upload_and_download(tmp_path, azure_location) -> None:
    _roundtrip(tmp_path, azure_location.uri, azure_location.storage_options)


# -- downloads from S3: few requests, each streamed (issue 17) ---------------------

MiB = 2**20


@pytest.mark.parametrize("engine", ["s3_location", "s3fs_location"])
@pytest.mark.parametrize(("files", "part"), [
    ([(f"shard{i}", 256 * MiB) for i in range(4)], 128 * MiB),  # 2 GETs per file
    ([(f"shard{i}", 256 * MiB) for i in range(8)], 256 * MiB),  # one GET per file
    ([("model", 1024 * MiB)], 128 * MiB),  # every worker still has a GET
    ([("model", 10 * 1024 * MiB)], _plan.MAX_STREAM_PART),  # a retry refetches at most this
])
def test_s3_download_plan_streams_one_large_range_per_worker(
        request, engine, files, part) -> None:
    backend, root = resolve(request.getfixturevalue(engine).uri,
                            storage_options=request.getfixturevalue(engine).storage_options)
    p = _plan.plan(backend.filesystem, root, LOCAL, "/tmp/x", files, chunk_size=64 * MiB,
                   concurrency=8, memory_limit=256 * MiB)
    assert (p.route, p.chunk_size) == ("download", part)
    # Memory does not grow with the part: each worker holds one piece (twice).
    assert p.piece * 2 * p.concurrency <= p.memory_limit
    small = _plan.plan(backend.filesystem, root, LOCAL, "/tmp/x", files, chunk_size=64 * MiB,
                       concurrency=8, memory_limit=16 * MiB)
    assert small.chunk_size == part and small.piece == MiB


def test_azure_download_plan_keeps_parts_within_the_budget(azure_location) -> None:
    # adlfs has no streamed range here: each part is one buffer, sized by the budget.
    backend, root = resolve(azure_location.uri, storage_options=azure_location.storage_options)
    p = _plan.plan(backend.filesystem, root, LOCAL, "/tmp/x", [("m", 1024 * MiB)],
                   chunk_size=64 * MiB, concurrency=8, memory_limit=256 * MiB)
    assert p.piece == 0 and p.chunk_size * 2 * _plan.PARTS_IN_FLIGHT <= 256 * MiB
    # A larger budget or fewer workers does not make parts that pyarrow's pool
    # maps afresh for every read (32 MiB parts: every page faulted in again).
    roomy = _plan.plan(backend.filesystem, root, LOCAL, "/tmp/x", [("m", 1024 * MiB)],
                       chunk_size=64 * MiB, concurrency=4, memory_limit=1024 * MiB)
    assert roomy.chunk_size == _plan.MAX_READ_PART == 16 * MiB


def _moto_requests(s3_server, bucket: str, since: int) -> list[str]:
    time.sleep(0.2)  # moto logs a request after answering it
    with open(s3_server.log_path, "rb") as f:
        f.seek(since)
        lines = f.read().decode("utf-8", "replace").splitlines()
    return [ln.split('"')[1].split(" HTTP")[0] for ln in lines
            if f" /{bucket}/" in ln or f" /{bucket}?" in ln]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["s3_location", "s3fs_location"])
def test_s3_download_asks_each_file_once(tmp_path, request, s3_server, s3_bucket,
                                         engine) -> None:
    # The raw clients GET each file once: so do we, and a large file is one
    # ranged GET per worker, streamed, however small the budget. No HEAD per
    # file with either engine: small files are read through the engine's
    # s3fs client with a range from the listing (s3fs asks an object's size
    # before an unbounded read; pyarrow's client opens each file with one).
    loc = request.getfixturevalue(engine)
    backend, root = resolve(loc.uri, storage_options=loc.storage_options)
    sizes = {**{f"small/s{i:02d}": 1000 + i for i in range(40)}, "empty.bin": 0,
             "big0.bin": 6 * MiB + 3, "big1.bin": 6 * MiB}
    want = _make_tree(str(tmp_path / "src"), sizes)
    up = copy_tree(LOCAL, str(tmp_path / "src"), backend.filesystem, root, backend.capabilities)
    since = os.path.getsize(s3_server.log_path)
    caps = Capabilities(directories=True, chunk_size=2 * MiB, concurrency=4)
    down = copy_tree(backend.filesystem, root, LOCAL, str(tmp_path / "dst"), caps,
                     fsync=False, memory_limit=4 * MiB)
    _check(down, LOCAL, str(tmp_path / "dst"), want)
    assert [(e.path, e.crc32c) for e in down] == [(e.path, e.crc32c) for e in up]
    reqs = _moto_requests(s3_server, s3_bucket, since)
    gets = [r for r in reqs if r.startswith("GET") and "list-type" not in r]
    heads = [r for r in reqs if r.startswith("HEAD")]
    # 12 MiB over 4 workers: ranges of 4 MiB, 2 per large file; one GET per
    # small file, the empty one included.
    assert len(gets) == 41 + 2 + 2, reqs
    assert len(heads) <= 2, heads  # the listing's directory checks


@pytest.mark.slow
def test_s3_streamed_range_shorter_than_listed_fails(tmp_path, s3_location, monkeypatch) -> None:
    # A file cut short between the listing and its download must not be
    # reported (and written) as complete.
    backend, root = resolve(s3_location.uri, storage_options=s3_location.storage_options)
    _make_tree(str(tmp_path / "src"), {"big.bin": 6 * MiB})
    copy_tree(LOCAL, str(tmp_path / "src"), backend.filesystem, root, backend.capabilities)
    real = _remote.RangeStream.read

    def short(self, n: int) -> bytes:
        data = real(self, n)
        return data[: len(data) // 2] if len(data) > 1 else b""

    monkeypatch.setattr(_remote.RangeStream, "read", short)
    caps = Capabilities(directories=True, chunk_size=2 * MiB, concurrency=2)
    with pytest.raises(OSError, match="changed while it was being downloaded"):
        copy_tree(backend.filesystem, root, LOCAL, str(tmp_path / "dst"), caps, fsync=False,
                  memory_limit=4 * MiB, files=[("big.bin", 6 * MiB)],
                  retry=_retry.RetryPolicy(attempts=1))


def test_azure_adlfs_engine_moves_bytes_through_pyarrow(azure_location) -> None:
    # adlfs keeps names, listings, deletes and the marker; file bytes of a
    # transfer go through pyarrow's C++ client on the same account.
    backend, _ = resolve(azure_location.uri, storage_options=azure_location.storage_options)
    assert isinstance(_remote._native_of(backend.filesystem), pafs.AzureFileSystem)
    assert _remote._fsspec_of(backend.filesystem) is not None
    # Options only adlfs understands: pyarrow could not reach the store the same way.
    other, _ = resolve(azure_location.uri,
                       storage_options={**azure_location.storage_options, "max_concurrency": 2})
    assert _remote._native_of(other.filesystem) is other.filesystem
