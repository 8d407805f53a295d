"""The remote side of a transfer: which client really moves the bytes.

A backend's filesystem may be a thin Python handler in front of a C++
filesystem (the object-store plugins' marker-free handler keeps it as
``handler.native``) or in front of an fsspec client
(``PyFileSystem(LiteralFSSpecHandler(fs))``). The transfer plan
(:mod:`checkpoint_store._plan`) and its tasks (:mod:`checkpoint_store._tasks`)
look through the handler: bytes then move without a Python call per read or
write, a batch of small files is one concurrent fsspec call, and a copy inside
one store (:func:`server_copy`) sends no byte through this process.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pyarrow.fs as pafs

__all__ = ["S3Multipart", "_fsspec_of", "_is_async", "_native_of", "part_upload_client",
           "server_copy", "writer_of"]


def _native_of(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The C++ filesystem behind a thin Python handler that keeps it as
    ``handler.native`` (the S3 plugin's marker-free handler), else ``fs``:
    data then moves without a Python call per read or write."""
    if isinstance(fs, pafs.PyFileSystem):
        native = getattr(fs.handler, "native", None)
        if isinstance(native, pafs.FileSystem):
            return native
    return fs


#: ``id(user's S3FileSystem) -> (weak reference to it, its twin)``, see :func:`writer_of`.
_TWINS: dict[int, tuple[weakref.ref[Any], pafs.FileSystem]] = {}
_TWINS_LOCK = threading.Lock()


def writer_of(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The filesystem a transfer writes files through: ``fs`` itself, except
    for a pyarrow ``S3FileSystem`` made without ``allow_delayed_open``.

    Such a filesystem starts a multipart upload when an output stream opens,
    so every small file costs three requests (CreateMultipartUpload,
    UploadPart, CompleteMultipartUpload) instead of one PutObject; a Ray
    user's ``storage_filesystem`` usually is one. The transfer then writes
    through a twin made from the same options (credentials, endpoint,
    timeouts, metadata ...: pyarrow's own pickling state, which is also what
    a Ray worker receives of a pickled filesystem) with only
    ``allow_delayed_open=True``, kept as long as ``fs`` lives. That state
    leaves out a custom ``retry_strategy``: the twin has pyarrow's default
    (3 attempts), and every transfer task is retried by our own policy on
    top (:mod:`checkpoint_store._retry`). A write still fails as it would,
    only at its first part or its close rather than at its open. 2000 x 64
    KiB to moto, 3 alternating runs: 21.5 s -> 7.8 s.
    """
    if type(fs) is not pafs.S3FileSystem:
        return fs
    key = id(fs)
    with _TWINS_LOCK:
        held = _TWINS.get(key)
        if held is not None and held[0]() is fs:
            return held[1]
    try:
        options = dict(fs.__reduce__()[1][0])
    except (AttributeError, IndexError, KeyError, TypeError):  # another pyarrow's state
        return fs
    if options.get("allow_delayed_open", True):
        return fs
    options["allow_delayed_open"] = True
    try:
        twin = pafs.S3FileSystem(**options)
    except (TypeError, ValueError):
        return fs
    with _TWINS_LOCK:
        _TWINS[key] = (weakref.ref(fs, lambda _ref: _forget_twin(key, _ref)), twin)
    return twin


def _forget_twin(key: int, ref: weakref.ref[Any]) -> None:
    with _TWINS_LOCK:
        held = _TWINS.get(key)
        if held is not None and held[0] is ref:
            del _TWINS[key]


def _fsspec_of(fs: pafs.FileSystem) -> Any | None:
    """The fsspec filesystem behind ``PyFileSystem(FSSpecHandler(...))`` (or the
    s3fs client a plugin's handler keeps as ``deleter``), else None."""
    if isinstance(fs, pafs.PyFileSystem):
        handler = fs.handler
        for attr in ("fs", "deleter"):
            inner = getattr(handler, attr, None)
            if inner is not None and hasattr(inner, "cat_file") and hasattr(inner, "pipe"):
                return inner
    return None


def _is_async(fsspec_fs: Any) -> bool:
    """Whether an fsspec client runs its calls on an event loop (s3fs, adlfs,
    gcsfs): a batch of files is then one call that fsspec runs concurrently."""
    return bool(getattr(fsspec_fs, "async_impl", False))


#: S3's CopyObject copies at most 5 GiB; larger objects need UploadPartCopy.
_COPY_OBJECT_MAX = 5 * 1024**3


def server_copy(fs: pafs.FileSystem, src: str, dst: str, size: int) -> None:
    """Copy one object of ``size`` bytes inside its store: no byte passes
    through this process.

    A native pyarrow filesystem copies with one request (S3 CopyObject, Azure
    Copy Blob; local and memory copies); objects over 5 GiB, and filesystems
    pyarrow only wraps, go through the fsspec client's ``cp_file`` (s3fs uses
    UploadPartCopy for large objects, adlfs Copy Blob, gcsfs rewrite).
    """
    native = _native_of(fs)
    fss = _fsspec_of(fs)
    if fss is None or (not isinstance(native, pafs.PyFileSystem) and size <= _COPY_OBJECT_MAX):
        native.copy_file(src, dst)
    else:
        fss.cp_file(src, dst)


class RangeStream:
    """Bytes ``[start, end)`` of one object, fetched with ONE request and read
    piece by piece (:meth:`read`), so a large range costs one GET and holds
    only a piece in memory. Built by :func:`open_range`; close it when done."""

    def __init__(self, fss: Any, body: Any):
        self._fss = fss
        self._body = body

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the range)."""
        from fsspec.asyn import sync

        return sync(self._fss.loop, _read_exactly, self._body, n)

    def close(self) -> None:
        try:
            self._body.close()
        except Exception:  # a body already read to its end or broken: nothing to free
            pass


async def _read_exactly(body: Any, n: int) -> bytes:
    pieces = []
    got = 0
    while got < n:
        piece = await body.read(n - got)
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def part_upload_client(fs: pafs.FileSystem) -> Any | None:
    """The s3fs client that uploads a large file to ``fs`` in parallel parts
    (:class:`S3Multipart`), or None.

    The s3fs engine, an s3fs filesystem passed in, and the pyarrow engine
    (through the s3fs client that deletes for it): one stream per file sent
    one part at a time through s3fs, and through pyarrow's stream as many
    parts as the budget lets it buffer before a flush (4 x 256 MiB from
    moto, one run: pyarrow stream 16.8 s, parallel parts 12.4 s). None for
    a pyarrow S3 filesystem passed in (no s3fs client to use)."""
    fss = _fsspec_of(fs)
    return fss if can_stream_ranges(fss) else None


class S3Multipart:
    """One S3 multipart upload through an s3fs client ``fss``: parts sent from
    any thread, in any order, then completed in part-number order.

    Raises (every method): OSError as s3fs translates the store's errors.
    """

    def __init__(self, fss: Any, path: str):
        self._fss = fss
        self._bucket, self._key, _ = fss.split_path(path)
        self.upload_id: str | None = None
        self._etags: dict[int, str] = {}

    def _s3(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self._fss.loop, self._fss._call_s3, method, Bucket=self._bucket,
                    Key=self._key, **kwargs)

    def start(self) -> None:
        self.upload_id = self._s3("create_multipart_upload")["UploadId"]

    def put_part(self, number: int, data: Any) -> None:
        """Upload part ``number`` (1-based); sent again, it replaces the part."""
        resp = self._s3("upload_part", UploadId=self.upload_id, PartNumber=number, Body=data)
        self._etags[number] = resp["ETag"]

    def complete(self, parts: int) -> None:
        """Assemble the object from parts 1..``parts``, each sent exactly once
        more recently than any failure.

        Raises:
            OSError: a part is missing (a bug: nothing is assembled).
        """
        missing = [n for n in range(1, parts + 1) if n not in self._etags]
        if missing:
            raise OSError(f"s3://{self._bucket}/{self._key}: parts {missing} were not "
                          "uploaded; the upload is not completed")
        self._s3("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={
            "Parts": [{"PartNumber": n, "ETag": self._etags[n]} for n in range(1, parts + 1)]})
        self.upload_id = None

    def abort(self) -> None:
        """Drop the parts of an upload not completed.

        Raises:
            OSError: the store refused or could not be reached; the upload
                (``upload_id``) stays open. S3 keeps its parts, billed and
                not listed as objects, until an AbortMultipartUpload or a
                bucket lifecycle rule for incomplete uploads removes them.
        """
        if self.upload_id is not None:
            self._s3("abort_multipart_upload", UploadId=self.upload_id)
            self.upload_id = None

    def describe(self) -> str:
        """``s3://bucket/key (upload id ...)``, for a message (no credential)."""
        return f"s3://{self._bucket}/{self._key} (upload id {self.upload_id})"


def can_stream_ranges(fss: Any | None) -> bool:
    """Whether :func:`open_range` streams from this fsspec client (s3fs: one
    ``GetObject`` with a ``Range`` header, its body read piece by piece)."""
    return fss is not None and _is_async(fss) and hasattr(fss, "_call_s3")


def open_range(fss: Any, path: str, start: int, end: int) -> RangeStream:
    """Open bytes ``[start, end)`` of ``path`` as one streamed ranged GET
    (``fss`` must pass :func:`can_stream_ranges`).

    Raises:
        FileNotFoundError: no such object (s3fs translates the error).
        OSError: any other request error.
    """
    from fsspec.asyn import sync

    bucket, key, version = fss.split_path(path)
    kw = {"VersionId": version} if version else {}

    async def get() -> Any:
        resp = await fss._call_s3("get_object", Bucket=bucket, Key=key,
                                  Range=f"bytes={start}-{end - 1}", **kw)
        return resp["Body"]

    return RangeStream(fss, sync(fss.loop, get))
