"""The bytes of a saved state's tensors: ranged reads, coalescing, memory maps.

:class:`_Fetcher` fills byte views from a checkpoint's files: on a local
disk with ``preadv``; on an object store with ranged GETs, tensors adjacent
in one file coalesced and cut into parts of at most :data:`PART_BYTES`,
``concurrency`` at a time. :class:`_Maps` memory-maps local files
(``mmap=True``, copy-on-write); :func:`_new_tensor` and :func:`_from_buffer`
make the tensors those bytes land in or are viewed from.
"""

from __future__ import annotations

import math
import mmap as mmap_module
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.clients import _client_of, _native_of, keeps_names
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_store.state._tiles import REMOTE_ROW_BYTES
from checkpoint_store.state._tree import DTYPES

__all__ = ["PART_BYTES"]


#: Largest single ranged read from an object store (bytes); larger ranges
#: are split and fetched in parallel.
PART_BYTES = 32 << 20


def _new_tensor(e: Mapping[str, Any]) -> tuple[Any, memoryview]:
    """A new tensor for an index entry and a writable byte view of its memory."""
    size, np_name, torch_name = DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    if e["framework"] == "torch":
        import ctypes

        import torch

        t = torch.empty(shape, dtype=getattr(torch, str(torch_name)))
        n = t.numel() * size
        if n == 0:
            return t, memoryview(bytearray())
        buf = (ctypes.c_char * n).from_address(t.data_ptr())
        buf.tensor = t  # type: ignore[attr-defined]
        return t, memoryview(buf).cast("B")
    import numpy as np

    a = np.empty(shape, dtype=np_name)
    return a, a.reshape(-1).view(np.uint8).data


def _from_buffer(e: Mapping[str, Any], buf: Any, begin: int) -> Any:
    """A tensor viewing ``buf`` (a memory map) at byte ``begin``: no copy."""
    size, np_name, torch_name = DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    count = math.prod(shape)
    if e["framework"] == "torch":
        import torch

        dtype = getattr(torch, str(torch_name))
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)
    import numpy as np

    return np.frombuffer(buf, dtype=np_name, count=count, offset=begin).reshape(shape)


def _gone(root: str, rel: str) -> CheckpointNotFoundError:
    """A file of the checkpoint at ``root``, listed when its index was read,
    not there when its bytes are: the checkpoint is being deleted."""
    return CheckpointNotFoundError(
        f"file {rel!r} of checkpoint {root!r} was deleted while it was being read (a "
        "retention pass or a delete removed the checkpoint); load another checkpoint")


class _Fetcher:
    """Byte ranges of a checkpoint's files: local preadv, or ranged reads."""

    def __init__(self, fs: pafs.FileSystem, root: str, sizes: Mapping[str, int],
                 retry: RetryPolicy | None, concurrency: int,
                 on_read: Callable[[int], None] | None = None,
                 chunked: Mapping[str, Any] | None = None):
        self.fs, self.root, self.sizes, self.retry = fs, root, sizes, retry
        #: ``{relative path: ChunkedFile}``: files read through their chunks.
        self.chunked = dict(chunked or {})
        #: Called with the bytes of each finished read (from worker threads).
        self.on_read = on_read
        self.concurrency = max(1, concurrency)
        self.local = _fsutil.local_path(fs, root)
        #: Column reads of rows narrower than this read their covering span
        #: (:data:`~._tiles.REMOTE_ROW_BYTES`): a request to an object store
        #: costs more than the holes' bytes; local files and memory: 0.
        self.span_below = (0 if self.local is not None or "memory" in fs.type_name
                           or fs.type_name == "mock" else REMOTE_ROW_BYTES)
        self.native = _native_of(fs)
        # An fsspec client reads a range with one GET, no HEAD first: the one
        # behind the filesystem's handler, or the twin of a pyarrow S3 or
        # Azure filesystem passed in (what the downloads use too).
        fss = _client_of(fs)
        self.fss = fss if fss is not None and keeps_names(fss, [root]) else None

    def _read_remote(self, rel: str, begin: int, end: int) -> Any:
        path = posixpath.join(self.root, rel)

        def go() -> Any:
            if self.fss is not None:
                return self.fss.cat_file(path, start=begin, end=end)
            # pyarrow's Python API asks for the size (a HEAD) before it reads.
            with self.native.open_input_file(path) as f:
                return f.read_at(end - begin, begin)

        try:
            data = _retry.call(go, policy=self.retry, store=self.fs,
                               what=f"read bytes {begin}-{end} of {path}")
        except FileNotFoundError as exc:
            raise _gone(self.root, rel) from exc
        if len(data) != end - begin:
            raise CheckpointCorruptError(
                f"{path!r} ended early: asked for bytes [{begin}, {end}), got {len(data)}",
                path=self.root, file=rel)
        return data

    def fill(self, jobs: Sequence[tuple[str, int, memoryview]]) -> None:
        """Fill each ``(file, begin, view)`` with the file's bytes from ``begin``."""
        jobs = [j for j in jobs if len(j[2])]
        if self.chunked:
            self._fill_chunked([j for j in jobs if j[0] in self.chunked])
            jobs = [j for j in jobs if j[0] not in self.chunked]
        if not jobs:
            return
        if self.local is not None:
            self._fill_local(jobs)
            return
        # Coalesce tensors adjacent in one file, then cut into parts.
        runs: list[list[Any]] = []  # [file, begin, end, [(begin, view), ...]]
        for rel, begin, view in sorted(jobs, key=lambda j: (j[0], j[1])):
            end = begin + len(view)
            if runs and runs[-1][0] == rel and runs[-1][2] == begin:
                runs[-1][2] = end
                runs[-1][3].append((begin, view))
            else:
                runs.append([rel, begin, end, [(begin, view)]])
        parts = []
        for rel, start, end, dests in runs:
            first = 0  # dests are sorted and adjacent: walk them along the parts
            for b in range(start, end, PART_BYTES):
                e = min(b + PART_BYTES, end)
                while dests[first][0] + len(dests[first][1]) <= b:
                    first += 1
                last = first
                while last < len(dests) and dests[last][0] < e:
                    last += 1
                parts.append((rel, b, e, dests[first:last]))

        def one(part: tuple[str, int, int, list[tuple[int, memoryview]]]) -> None:
            rel, b, e, dests = part
            data = memoryview(self._read_remote(rel, b, e)).cast("B")
            for at, view in dests:
                lo, hi = max(at, b), min(at + len(view), e)
                if lo < hi:
                    view[lo - at:hi - at] = data[lo - b:hi - b]
            if self.on_read is not None:
                self.on_read(e - b)

        self._run(one, parts)

    def _fill_chunked(self, jobs: Sequence[tuple[str, int, memoryview]]) -> None:
        """Fill jobs on chunked files from their chunks (decoded chunks shared
        between adjacent jobs through each file's cache)."""
        def one(job: tuple[str, int, memoryview]) -> None:
            rel, begin, view = job
            data = self.chunked[rel].read_range(begin, len(view))
            if len(data) != len(view):
                raise CheckpointCorruptError(
                    f"{rel!r} of {self.root!r} ended early: asked for bytes [{begin}, "
                    f"{begin + len(view)}), got {len(data)}", path=self.root, file=rel)
            view[:] = data
            if self.on_read is not None:
                self.on_read(len(view))

        self._run(one, jobs)

    def _fill_local(self, jobs: Sequence[tuple[str, int, memoryview]]) -> None:
        assert self.local is not None
        fds: dict[str, int] = {}
        try:
            for rel, _, _ in jobs:
                if rel not in fds:
                    try:
                        fds[rel] = os.open(os.path.join(self.local, rel), os.O_RDONLY)
                    except FileNotFoundError as exc:
                        raise _gone(self.root, rel) from exc

            def one(batch: Sequence[tuple[str, int, memoryview]]) -> None:
                for rel, begin, view in batch:
                    got = 0
                    while got < len(view):
                        n = os.preadv(fds[rel], [view[got:]], begin + got)
                        if n == 0:
                            raise CheckpointCorruptError(
                                f"{rel!r} of {self.local!r} ended early at byte {begin + got}",
                                path=self.root, file=rel)
                        got += n
                    if self.on_read is not None:
                        self.on_read(len(view))

            self._run(one, _batches(jobs, self.concurrency))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run(self, fn: Any, items: Sequence[Any]) -> None:
        if self.concurrency == 1 or len(items) <= 1:
            for it in items:
                fn(it)
            return
        with ThreadPoolExecutor(min(self.concurrency, len(items)),
                                thread_name_prefix="cs-state-read") as pool:
            for _ in pool.map(fn, items):
                pass


def _batches(jobs: Sequence[tuple[str, int, memoryview]],
             n: int) -> list[Sequence[tuple[str, int, memoryview]]]:
    """``jobs`` in order, cut into runs of about 1/``n`` of their bytes each
    (a job is never cut): one task per run, so thousands of small reads (a
    column slice's row segments) cost a thread hand-off each run, not each
    read, while a few large ones still go one per thread."""
    total = sum(len(j[2]) for j in jobs)
    target = max(1, -(-total // max(1, n)))
    out: list[Sequence[tuple[str, int, memoryview]]] = []
    start, size = 0, 0
    for i, job in enumerate(jobs):
        size += len(job[2])
        if size >= target:
            out.append(jobs[start:i + 1])
            start, size = i + 1, 0
    if start < len(jobs):
        out.append(jobs[start:])
    return out


class _Maps:
    """One copy-on-write memory map per local file, opened on first use."""

    def __init__(self, local_root: str):
        self.root = local_root
        self.maps: dict[str, mmap_module.mmap] = {}

    def get(self, rel: str) -> mmap_module.mmap:
        m = self.maps.get(rel)
        if m is None:
            with open(os.path.join(self.root, rel), "rb") as f:
                # ACCESS_COPY: writable views (torch.frombuffer wants them), and
                # writes to them stay in this process: the file never changes.
                m = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY)
            self.maps[rel] = m
        return m
