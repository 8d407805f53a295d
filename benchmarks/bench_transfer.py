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
        shutil.rmtree(path, ignore_errors=True)


def local_rows(src: str, shape: Shape, work: str, reps: int, log) -> dict[str, dict[str, Cell]]:
    import fsspec

    from checkpoint_store import Checkpoint, StorageContext

    ray_storage = _ray_storage()
    scratch = _Scratch(work)
    ffs = fsspec.filesystem("file")
    os.sync()  # no writeback left from the data's generation or the last shape

    def ours(fsync: bool) -> Callable[[int], float]:
        def run(rep: int) -> float:
            root = scratch.new()
            st = StorageContext(root, "exp", "t", fsync=fsync)
            st.ensure_trial_dir()
            dt = _timed(lambda: st.persist_checkpoint(Checkpoint.from_directory(src), 0,
                                                      {"metrics": {}}))
            scratch.drop(root)
            return dt
        return run

    def cp(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: subprocess.run(["cp", "-r", src, dst], check=True))
        scratch.drop(dst)
        return dt

    def cp_sync(rep: int) -> float:
        # The durable yardstick for the fsync column: cp, then sync(1) (all
        # dirty data of the machine, as a user would make a copy durable).
        dst = scratch.new()
        dt = _timed(lambda: subprocess.run(["sh", "-c", 'cp -r "$0" "$1" && sync', src, dst],
                                           check=True))
        scratch.drop(dst)
        return dt

    def pa_copy(rep: int) -> float:
        dst = scratch.new()
        def go() -> None:
            os.makedirs(dst)  # copy_files needs it when the source has no subdirectory
            pafs.copy_files(src, dst, chunk_size=64 * MiB, use_threads=True)
        dt = _timed(go)
        scratch.drop(dst)
        return dt

    def fsspec_put(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ffs.put(src, dst, recursive=True))
        scratch.drop(dst)
        return dt

    def ray_up(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ray_storage._upload_to_fs_path(src, LOCAL, dst))
        scratch.drop(dst)
        return dt

    for fn in (cp, cp_sync):
        fn.subprocess = True  # type: ignore[attr-defined]  # its RSS is not ours
    up: dict[str, Callable[[int], float]] = {
        "checkpoint-store (fsync)": ours(True),
        "checkpoint-store (no fsync)": ours(False),
        "cp -r": cp,
        "cp -r + sync": cp_sync,
        "pyarrow copy_files 64 MiB": pa_copy,
        "fsspec put": fsspec_put,
    }
    if ray_storage is not None:
        up["Ray upload path"] = ray_up
    rows = {"upload": alternate(up, reps, log=log, label=f"local {shape.name} upload")}

    # Download: from a committed checkpoint on the local disk.
    store_root = scratch.new()
    st = StorageContext(store_root, "exp", "t", fsync=False)
    st.ensure_trial_dir()
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    # A download reads a checkpoint written earlier: its bytes on disk, not
    # dirty pages of a copy made a moment ago, whose writeback would slow
    # whichever candidate runs first (ours: rep 0 took 3.9 s against 0.47 s).
    os.sync()

    def ours_down(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ckpt.to_directory(dst))
        scratch.drop(dst)
        return dt

    def cp_down(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: subprocess.run(["cp", "-r", ckpt.path, dst], check=True))
        scratch.drop(dst)
        return dt

    def pa_down(rep: int) -> float:
        dst = scratch.new()
        def go() -> None:
            os.makedirs(dst)
            pafs.copy_files(ckpt.path, dst, chunk_size=64 * MiB, use_threads=True)
        dt = _timed(go)
        scratch.drop(dst)
        return dt

    def fsspec_get(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ffs.get(ckpt.path, dst, recursive=True))
        scratch.drop(dst)
        return dt

    def ray_down(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ray_storage._download_from_fs_path(LOCAL, ckpt.path, dst))
        scratch.drop(dst)
        return dt

    cp_down.subprocess = True  # type: ignore[attr-defined]
    down: dict[str, Callable[[int], float]] = {
        "checkpoint-store (verify)": ours_down,
        "cp -r": cp_down,
        "pyarrow copy_files 64 MiB": pa_down,
        "fsspec get": fsspec_get,
    }
    if ray_storage is not None:
        down["Ray download path"] = ray_down
    rows["download"] = alternate(down, reps, log=log, label=f"local {shape.name} download")
    scratch.drop(store_root)
    return rows


def remote_rows(
    kind: str, src: str, shape: Shape, work: str, reps: int, log, *,
    uri_root: str, options: dict[str, Any], raw_pyarrow: pafs.FileSystem, raw_fsspec: Any,
    fsspec_label: str, bucket: str, budget_s: float | None = None,
) -> dict[str, dict[str, Cell]]:
    """Rows for an object store. ``uri_root`` is ``s3://bucket`` or ``az://container``;
    ``raw_pyarrow`` / ``raw_fsspec`` are the clients a user would build themselves."""
    from checkpoint_store import StorageContext
    from checkpoint_store.checkpoint import Checkpoint

    ray_storage = _ray_storage()
    scratch = _Scratch(work)
    def prefix() -> str:
        # Unique across calls: shapes share a bucket, and a failed commit may
        # leave files behind that a reused prefix would trip over.
        return f"b{next(_PREFIXES)}-{os.getpid()}"

    def drop_remote(path: str) -> None:
        try:
            raw_pyarrow.delete_dir(path)
        except Exception:
            try:
                raw_fsspec.rm(path, recursive=True)
            except Exception:
                pass

    def ours_up(rep: int) -> float:
        p = prefix()
        st = StorageContext(f"{uri_root}/{p}", "exp", "t", storage_options=options)
        dt = _timed(lambda: st.persist_checkpoint(Checkpoint.from_directory(src), 0,
                                                  {"metrics": {}}))
        drop_remote(f"{bucket}/{p}")
        return dt

    def ours_up_with(fs: Any) -> Callable[[int], float]:
        # The user passes a filesystem object (as with Ray's storage_filesystem):
        # the plan's concurrency must not depend on which client it is.
        def run(rep: int) -> float:
            p = f"{bucket}/{prefix()}"
            st = StorageContext(p, "exp", "t", storage_filesystem=fs)
            dt = _timed(lambda: st.persist_checkpoint(Checkpoint.from_directory(src), 0,
                                                      {"metrics": {}}))
            drop_remote(p)
            return dt
        return run

    def pa_up(rep: int) -> float:
        p = f"{bucket}/{prefix()}"
        dt = _timed(lambda: pafs.copy_files(src, p, source_filesystem=LOCAL,
                                            destination_filesystem=raw_pyarrow,
                                            chunk_size=64 * MiB, use_threads=True))
        drop_remote(p)
        return dt

    def fsspec_put(rep: int) -> float:
        p = f"{bucket}/{prefix()}"
        dt = _timed(lambda: raw_fsspec.put(src, p, recursive=True))
        drop_remote(p)
        return dt

    def ray_up(rep: int) -> float:
        p = f"{bucket}/{prefix()}"
        dt = _timed(lambda: ray_storage._upload_to_fs_path(src, raw_pyarrow, p))
        drop_remote(p)
        return dt

    up: dict[str, Callable[[int], float]] = {
        "checkpoint-store": ours_up,
        "checkpoint-store (pyarrow fs passed)": ours_up_with(raw_pyarrow),
        f"checkpoint-store ({fsspec_label} fs passed)": ours_up_with(raw_fsspec),
        "pyarrow copy_files 64 MiB": pa_up,
        f"{fsspec_label} put": fsspec_put,
    }
    if ray_storage is not None:
        up["Ray upload path"] = ray_up
    rows = {"upload": alternate(up, reps, log=log, label=f"{kind} {shape.name} upload",
                                budget_s=budget_s)}

    # Download: one committed checkpoint, read by everyone.
    p = prefix()
    st = StorageContext(f"{uri_root}/{p}", "exp", "t", storage_options=options)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    remote_path = ckpt.path

    def ours_down(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ckpt.to_directory(dst))
        scratch.drop(dst)
        return dt

    def pa_down(rep: int) -> float:
        dst = scratch.new()
        def go() -> None:
            os.makedirs(dst)
            pafs.copy_files(remote_path, dst, source_filesystem=raw_pyarrow,
                            destination_filesystem=LOCAL, chunk_size=64 * MiB, use_threads=True)
        dt = _timed(go)
        scratch.drop(dst)
        return dt

    def fsspec_get(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: raw_fsspec.get(remote_path + "/", dst + "/", recursive=True))
        scratch.drop(dst)
        return dt

    def ray_down(rep: int) -> float:
        dst = scratch.new()
        dt = _timed(lambda: ray_storage._download_from_fs_path(raw_pyarrow, remote_path, dst,
                                                               filelock=False))
        scratch.drop(dst)
        return dt

    down: dict[str, Callable[[int], float]] = {
        "checkpoint-store (verify)": ours_down,
        "pyarrow copy_files 64 MiB": pa_down,
        f"{fsspec_label} get": fsspec_get,
    }
    if ray_storage is not None:
        down["Ray download path"] = ray_down
    rows["download"] = alternate(down, reps, log=log, label=f"{kind} {shape.name} download",
                                 budget_s=budget_s)
    drop_remote(f"{bucket}/{p}")
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
