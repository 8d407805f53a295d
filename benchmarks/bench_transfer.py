"""Upload and download of checkpoint directories: checkpoint-store against the
tools a user would pick instead, on the local disk, S3 (moto) and Azure (Azurite).

"ours" always includes what the library does for a real checkpoint: CRC32C
of every file, the manifest, and the commit (rename on local disks, marker
last on object stores); downloads verify every checksum. The others copy
bytes only.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from benchmarks._common import Cell, Shape, alternate, make_tree

_PREFIXES = itertools.count(1)

MiB = 1024 * 1024
LOCAL = pafs.LocalFileSystem()


def _ray_storage() -> Any | None:
    try:
        from ray.train.v2._internal.execution import storage as ray_storage
    except Exception:
        try:
            from ray.train._internal import storage as ray_storage  # older Ray
        except Exception:
            return None
    return ray_storage


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Scratch:
    """Fresh destination directories on the local disk, removed after timing."""

    def __init__(self, root: str):
        self.root = root
        self.n = 0

    def new(self) -> str:
        self.n += 1
        return os.path.join(self.root, f"d{self.n}")

    def drop(self, path: str) -> None:
        """Remove ``path``, then let the filesystem finish (untimed) what the
        removal started: the next candidate then starts as quiet as this one
        did, not behind the journal commits of 2000 freed inodes (2000 x
        64 KiB: whichever candidate ran right after another's clean-up took
        2-6x its time in the first round)."""
        shutil.rmtree(path, ignore_errors=True)
        os.sync()


# -- the candidates -----------------------------------------------------------------------
#
# One registry serves the timed rows (alternating in this process) and the peak
# RSS of each candidate in a fresh interpreter (bench_misc.fresh_rss), so both
# describe the same calls. A candidate is ``prepare(source, destination)``: it
# sets up what the transfer needs (a StorageContext, a directory) and returns
# the transfer itself, which is what gets timed or measured.

Transfer = Callable[[], Any]
Prepare = Callable[[str, str], Transfer]

UPLOAD, DOWNLOAD = "upload", "download"
#: Run as a child process: the RSS of this process says nothing of them.
SUBPROCESS = "subprocess"


def _as_subprocess(prepare: Prepare) -> Prepare:
    setattr(prepare, SUBPROCESS, True)
    return prepare


@dataclass
class Remote:
    """An object store as the candidates reach it: ``uri_root`` (``s3://bucket``,
    ``az://container``) and ``options`` for checkpoint-store, the raw clients a
    user would build themselves, and ``bucket`` (bucket or container name)."""

    uri_root: str
    bucket: str
    options: dict[str, Any]
    raw_pyarrow: pafs.FileSystem
    raw_fsspec: Any
    fsspec_label: str

    def path(self, name: str) -> str:
        """``name`` inside the bucket, as a path of the raw clients."""
        return f"{self.bucket}/{name}"

    def drop(self, path: str) -> None:
        try:
            self.raw_pyarrow.delete_dir(path)
        except Exception:
            try:
                self.raw_fsspec.rm(path, recursive=True)
            except Exception:
                pass


def connect(spec: dict[str, str]) -> Remote:
    """The clients of ``spec``: ``kind`` (``s3`` or ``azure``), ``bucket``, and the
    checkpoint-store storage options of that store (``s3``: endpoint_url,
    access_key_id, secret_access_key, region; ``azure``: connection_string). A
    plain dict, so that a fresh interpreter builds the very same clients."""
    options = {k: v for k, v in spec.items() if k not in ("kind", "bucket")}
    if spec["kind"] == "s3":
        import s3fs

        scheme, host = spec["endpoint_url"].split("://", 1)
        raw_pa = pafs.S3FileSystem(endpoint_override=host, scheme=scheme,
                                   access_key=spec["access_key_id"],
                                   secret_key=spec["secret_access_key"], region=spec["region"])
        raw_fs = s3fs.S3FileSystem(endpoint_url=spec["endpoint_url"], key=spec["access_key_id"],
                                   secret=spec["secret_access_key"])
        return Remote(f"s3://{spec['bucket']}", spec["bucket"], options, raw_pa, raw_fs, "s3fs")
    import adlfs

    from checkpoint_store.registry import resolve

    conn = spec["connection_string"]
    raw_pa = resolve(f"az://{spec['bucket']}", storage_options={
        "engine": "pyarrow", "connection_string": conn})[0].filesystem
    raw_fs = adlfs.AzureBlobFileSystem(connection_string=conn)
    return Remote(f"az://{spec['bucket']}", spec["bucket"], options, raw_pa, raw_fs, "adlfs")


def _ours_upload(root_of: Callable[[str], str], **storage: Any) -> Prepare:
    """checkpoint-store: the source directory as checkpoint 0 of trial ``exp/t``
    under ``root_of(destination)``; ``storage``: StorageContext options."""
    from checkpoint_store import Checkpoint, StorageContext

    def prepare(src: str, dst: str) -> Transfer:
        st = StorageContext(root_of(dst), "exp", "t", **storage)
        st.ensure_trial_dir()
        return lambda: st.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    return prepare


def _ours_download(ckpt: Any) -> Prepare:
    """checkpoint-store: ``ckpt`` into the destination, every checksum verified
    (the source argument is ``ckpt.path``, for the raw clients)."""
    return lambda src, dst: lambda: ckpt.to_directory(dst)


def local_candidates(direction: str, ckpt: Any = None) -> dict[str, Prepare]:
    """Every candidate of a local row, ours first. Upload: source is the data,
    destination a new directory (ours: a new storage root). Download: source is
    ``ckpt.path``, a committed checkpoint, destination a new directory."""
    import fsspec

    ray_storage = _ray_storage()
    ffs = fsspec.filesystem("file")
    up = direction == UPLOAD

    def cp(src: str, dst: str) -> Transfer:
        return lambda: subprocess.run(["cp", "-r", src, dst], check=True)

    def cp_sync(src: str, dst: str) -> Transfer:
        # The durable yardstick for the fsync column: cp, then sync(1) (all
        # dirty data of the machine, as a user would make a copy durable).
        return lambda: subprocess.run(["sh", "-c", 'cp -r "$0" "$1" && sync', src, dst],
                                      check=True)

    def pa_copy(src: str, dst: str) -> Transfer:
        def go() -> None:
            os.makedirs(dst)  # copy_files needs it when the source has no subdirectory
            pafs.copy_files(src, dst, chunk_size=64 * MiB, use_threads=True)
        return go

    def fsspec_copy(src: str, dst: str) -> Transfer:
        return lambda: (ffs.put if up else ffs.get)(src, dst, recursive=True)

    def ray(src: str, dst: str) -> Transfer:
        assert ray_storage is not None  # only listed when Ray is there
        if up:
            return lambda: ray_storage._upload_to_fs_path(src, LOCAL, dst)
        return lambda: ray_storage._download_from_fs_path(LOCAL, src, dst)

    out: dict[str, Prepare] = (
        {"checkpoint-store (fsync)": _ours_upload(str, fsync=True),
         "checkpoint-store (no fsync)": _ours_upload(str, fsync=False)}
        if up else {"checkpoint-store (verify)": _ours_download(ckpt)})
    out["cp -r"] = _as_subprocess(cp)
    if up:
        out["cp -r + sync"] = _as_subprocess(cp_sync)
    out["pyarrow copy_files 64 MiB"] = pa_copy
    out["fsspec put" if up else "fsspec get"] = fsspec_copy
    if ray_storage is not None:
        out["Ray upload path" if up else "Ray download path"] = ray
    return out


def remote_candidates(remote: Remote, direction: str, ckpt: Any = None) -> dict[str, Prepare]:
    """Every candidate of an object-store row, ours first. Upload: source is the
    data, destination a new name inside the bucket. Download: source is
    ``ckpt.path``, a committed checkpoint, destination a new local directory."""
    ray_storage = _ray_storage()
    pa_fs, raw_fs = remote.raw_pyarrow, remote.raw_fsspec
    out: dict[str, Prepare] = {}
    if direction == UPLOAD:
        out["checkpoint-store"] = _ours_upload(lambda name: f"{remote.uri_root}/{name}",
                                               storage_options=remote.options)
        # The user passes a filesystem object (as with Ray's storage_filesystem):
        # the plan's concurrency must not depend on which client it is.
        for label, fs in (("pyarrow", pa_fs), (remote.fsspec_label, raw_fs)):
            out[f"checkpoint-store ({label} fs passed)"] = _ours_upload(
                remote.path, storage_filesystem=fs)

        def pa_up(src: str, name: str) -> Transfer:
            return lambda: pafs.copy_files(src, remote.path(name), source_filesystem=LOCAL,
                                           destination_filesystem=pa_fs, chunk_size=64 * MiB,
                                           use_threads=True)

        out["pyarrow copy_files 64 MiB"] = pa_up
        out[f"{remote.fsspec_label} put"] = (
            lambda src, name: lambda: raw_fs.put(src, remote.path(name), recursive=True))
        if ray_storage is not None:
            out["Ray upload path"] = (lambda src, name: lambda: ray_storage._upload_to_fs_path(
                src, pa_fs, remote.path(name)))
        return out

    def pa_down(src: str, dst: str) -> Transfer:
        def go() -> None:
            os.makedirs(dst)
            pafs.copy_files(src, dst, source_filesystem=pa_fs, destination_filesystem=LOCAL,
                            chunk_size=64 * MiB, use_threads=True)
        return go

    out["checkpoint-store (verify)"] = _ours_download(ckpt)
    out["pyarrow copy_files 64 MiB"] = pa_down
    out[f"{remote.fsspec_label} get"] = (
        lambda src, dst: lambda: raw_fs.get(src + "/", dst + "/", recursive=True))
    if ray_storage is not None:
        out["Ray download path"] = lambda src, dst: lambda: ray_storage._download_from_fs_path(
            pa_fs, src, dst, filelock=False)
    return out


def _runner(prepare: Prepare, src: str, new_dest: Callable[[], str],
            drop: Callable[[str], None]) -> Callable[[int], float]:
    """``prepare`` as a candidate of :func:`alternate`: a new destination each
    run, the transfer alone timed, the destination removed afterwards."""
    def run(rep: int) -> float:
        dst = new_dest()
        try:
            return _timed(prepare(src, dst))
        finally:
            drop(dst)
    setattr(run, SUBPROCESS, getattr(prepare, SUBPROCESS, False))
    return run


def new_name() -> str:
    """A prefix inside a bucket, unique across calls: shapes share a bucket, and
    a failed commit may leave files behind that a reused prefix would trip over."""
    return f"b{next(_PREFIXES)}-{os.getpid()}"


def committed_checkpoint(src: str, root: str, **storage: Any) -> Any:
    """``src`` committed as checkpoint 0 of trial ``exp/t`` under ``root``: the
    source every download reads."""
    from checkpoint_store import Checkpoint, StorageContext

    st = StorageContext(root, "exp", "t", **storage)
    st.ensure_trial_dir()
    return st.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})


def local_rows(src: str, shape: Shape, work: str, reps: int, log) -> dict[str, dict[str, Cell]]:
    scratch = _Scratch(work)
    os.sync()  # no writeback left from the data's generation or the last shape
    up = {name: _runner(prep, src, scratch.new, scratch.drop)
          for name, prep in local_candidates(UPLOAD).items()}
    rows = {"upload": alternate(up, reps, log=log, label=f"local {shape.name} upload")}

    # Download: from a committed checkpoint on the local disk.
    store_root = scratch.new()
    ckpt = committed_checkpoint(src, store_root, fsync=False)
    # A download reads a checkpoint written earlier: its bytes on disk, not
    # dirty pages of a copy made a moment ago, whose writeback would slow
    # whichever candidate runs first (ours: rep 0 took 3.9 s against 0.47 s).
    os.sync()
    down = {name: _runner(prep, ckpt.path, scratch.new, scratch.drop)
            for name, prep in local_candidates(DOWNLOAD, ckpt).items()}
    rows["download"] = alternate(down, reps, log=log, label=f"local {shape.name} download")
    scratch.drop(store_root)
    return rows


def remote_rows(
    kind: str, src: str, shape: Shape, work: str, reps: int, log, *, remote: Remote,
    budget_s: float | None = None,
) -> dict[str, dict[str, Cell]]:
    """Rows for an object store reached through ``remote``."""
    scratch = _Scratch(work)

    def drop_name(name: str) -> None:
        remote.drop(remote.path(name))

    up = {name: _runner(prep, src, new_name, drop_name)
          for name, prep in remote_candidates(remote, UPLOAD).items()}
    rows = {"upload": alternate(up, reps, log=log, label=f"{kind} {shape.name} upload",
                                budget_s=budget_s)}

    # Download: one committed checkpoint, read by everyone.
    name = new_name()
    ckpt = committed_checkpoint(src, f"{remote.uri_root}/{name}", storage_options=remote.options)
    down = {n: _runner(prep, ckpt.path, scratch.new, scratch.drop)
            for n, prep in remote_candidates(remote, DOWNLOAD, ckpt).items()}
    rows["download"] = alternate(down, reps, log=log, label=f"{kind} {shape.name} download",
                                 budget_s=budget_s)
    drop_name(name)
    return rows


def incremental_rows(
    kind: str, src: str, shape: Shape, work: str, reps: int, log, *,
    uri_root: str, options: dict[str, Any], changed_size: int,
) -> dict[str, dict[str, Cell]]:
    """A second report of ``src`` where one file of ``changed_size`` bytes
    changed: incremental (unchanged files copied inside the store) against a
    full upload (``incremental=False``), alternating. Each run starts from a
    committed first checkpoint."""
    from checkpoint_store import StorageContext
    from checkpoint_store.checkpoint import Checkpoint

    copy = os.path.join(work, f"incremental-{os.getpid()}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(src, copy)
    victim = max((os.path.join(d, n) for d, _, ns in os.walk(copy) for n in ns),
                 key=os.path.getsize)
    counter = [0]

    def second_report(incremental: bool) -> Callable[[int], float]:
        def run(rep: int) -> float:
            counter[0] += 1
            st = StorageContext(f"{uri_root}/inc{counter[0]}-{os.getpid()}", "exp", "t",
                                storage_options=options, incremental=incremental)
            st.persist_checkpoint(Checkpoint.from_directory(copy), 0, {"metrics": {}})
            with open(victim, "r+b") as f:  # one file changes (its size does not)
                f.write(os.urandom(min(changed_size, os.path.getsize(victim))))
            dt = _timed(lambda: st.persist_checkpoint(Checkpoint.from_directory(copy), 1,
                                                      {"metrics": {}}))
            for d in ("checkpoint_000000", "checkpoint_000001"):
                st.delete_checkpoint(d)
            return dt
        return run

    cands: dict[str, Callable[[int], float]] = {
        "checkpoint-store (incremental)": second_report(True),
        "checkpoint-store (full upload)": second_report(False),
    }
    rows = {"upload": alternate(cands, reps, log=log, label=f"{kind} {shape.name} incremental")}
    shutil.rmtree(copy, ignore_errors=True)
    return rows


def datasets(shapes: list[Shape], root: str) -> dict[str, str]:
    return {s.name: make_tree(os.path.join(root, s.name.replace(" ", "")), s) for s in shapes}


def scratch_dir(base: str | None = None) -> str:
    return tempfile.mkdtemp(prefix="cs-bench-", dir=base)
