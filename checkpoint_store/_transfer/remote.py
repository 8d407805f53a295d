"""The remote side of a transfer: which client really moves the bytes.

A backend's filesystem may be a thin Python handler in front of a C++
filesystem (the object-store plugins' marker-free handler keeps it as
``handler.native``) or in front of an fsspec client
(``PyFileSystem(LiteralFSSpecHandler(fs))``). The transfer plan
(:mod:`checkpoint_store._transfer.plan`) and its tasks (:mod:`checkpoint_store._transfer.tasks`)
look through the handler: bytes then move without a Python call per read or
write, a batch of small files is one concurrent fsspec call, and a copy inside
one store (:func:`server_copy`) sends no byte through this process.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import pyarrow.fs as pafs

from checkpoint_store.backends.clients import _client_of as _client_of
from checkpoint_store.backends.clients import _fsspec_of as _fsspec_of
from checkpoint_store.backends.clients import _is_adlfs
from checkpoint_store.backends.clients import _is_async as _is_async
from checkpoint_store.backends.clients import _native_of as _native_of
from checkpoint_store.backends.clients import keeps_names as keeps_names
from checkpoint_store.backends.clients import writer_of as writer_of
from checkpoint_store.backends.engine_errors import azure_os_error as _azure_os_error

__all__ = ["AzureBlocks", "PartUpload", "PartUploader", "S3Multipart", "_client_of",
           "_fsspec_of", "_is_async", "_native_of", "keeps_names", "part_upload_client",
           "server_copy", "writer_of"]
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
    fss = _client_of(fs)
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


class PartUpload(Protocol):
    """One large file going up in parts sent from any thread, in any order
    (:class:`S3Multipart`, :class:`AzureBlocks`); the object appears only at
    :meth:`complete`. Every method raises OSError for a failed request."""

    #: Most parts one upload may have, and most bytes in one part (the store's limits).
    MAX_PARTS: ClassVar[int]
    MAX_PART: ClassVar[int]

    def start(self) -> None:
        """Begin the upload (before any part)."""

    def put_part(self, number: int, data: Any) -> None:
        """Send part ``number`` (1-based, ``data`` bytes-like); sent again, it replaces the part."""

    def complete(self, parts: int) -> None:
        """Assemble the object from parts 1..``parts``, in that order."""

    def abort(self) -> None:
        """Drop what an upload not completed has sent."""

    def describe(self) -> str:
        """Where the upload goes, for a message (no credential)."""


@dataclass(frozen=True)
class PartUploader:
    """How large files go up in parallel parts to one store: the fsspec
    client ``fss`` and the :class:`PartUpload` class that drives it.
    ``literal_names``: Azure blob names as pyarrow's AzureFileSystem,
    which writes the backend's other files, spells them (see
    :class:`AzureBlocks`)."""

    fss: Any
    kind: type[S3Multipart] | type[AzureBlocks]
    literal_names: bool = False

    def open(self, path: str) -> PartUpload:
        """The upload of one file to ``path`` (not started yet)."""
        if self.kind is AzureBlocks:
            return AzureBlocks(self.fss, path, literal=self.literal_names)
        return self.kind(self.fss, path)

    @property
    def max_parts(self) -> int:
        return self.kind.MAX_PARTS

    @property
    def max_part(self) -> int:
        return self.kind.MAX_PART


def part_upload_client(fs: pafs.FileSystem) -> PartUploader | None:
    """How a large file goes up to ``fs`` in parallel parts, or None (one
    stream per file).

    S3 (:class:`S3Multipart`): the s3fs engine, an s3fs filesystem passed
    in, and the pyarrow engine (through the s3fs client that deletes for
    it). One stream per file is sent one part at a time through s3fs, and
    through pyarrow's stream as many parts as the budget lets it buffer
    before a flush (4 x 256 MiB from moto, one run: pyarrow stream 16.8 s,
    parallel parts 12.4 s). A pyarrow S3 filesystem passed in goes through
    an s3fs client made from its options where that client would write the
    same way (:func:`_s3fs_twin_of`), else None.

    Azure (:class:`AzureBlocks`): the adlfs engine, the pyarrow engine
    (through the adlfs client that deletes for it) and an adlfs filesystem
    passed in, and a pyarrow AzureFileSystem passed in (through an adlfs
    client made from its account and key, :func:`_adlfs_twin_of`). A stream
    per file sends one block at a time (pyarrow's AzureFileSystem and adlfs
    alike).
    """
    fss = _client_of(fs)
    if can_stream_ranges(fss):
        return PartUploader(fss, S3Multipart)
    if _is_adlfs(fss):
        native = not isinstance(_native_of(fs), pafs.PyFileSystem)
        return PartUploader(fss, AzureBlocks, literal_names=native)
    return None




class S3Multipart:
    """One S3 multipart upload through an s3fs client ``fss``: parts sent from
    any thread, in any order, then completed in part-number order.

    Raises (every method): OSError as s3fs translates the store's errors.
    """

    #: S3 allows 10,000 parts of at most 5 GiB (the planner has kept below 10,000).
    MAX_PARTS: ClassVar[int] = 9000
    MAX_PART: ClassVar[int] = 5 * 1024**3

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


class AzureBlocks:
    """One Azure block-blob upload through an adlfs client ``fss`` (its async
    azure-storage-blob clients, on its event loop): blocks staged from any
    thread, in any order (Put Block), then committed in part order with one
    Put Block List. The blob appears only then, whole (or replaces the
    previous blob of that name whole).

    Block ids are a random prefix of this upload followed by the part
    number, 32 characters in all (Azure wants the ids of one blob's blocks
    of one length; adlfs's own writes use 32 too): blocks staged under the
    same name by another writer, or left by a failed upload, never enter
    this blob.

    The blob is named as the client that writes the backend's other files
    names it: with ``literal=True`` (pyarrow's AzureFileSystem writes them)
    the path is cut at its first ``/`` into container and blob name, as
    is; else by adlfs's ``split_path``, which drops a ``?`` that ends a
    name (the adlfs engine refuses such names; the pyarrow engine stores
    them).

    Raises (every method): OSError for a failed request, the Azure SDK's
    errors translated: FileNotFoundError (no such container),
    PermissionError (authentication or authorization refused),
    ConnectionError (unreachable, timed out, or the service answered 408,
    429 or 5xx: worth retrying), OSError otherwise.
    """

    #: Azure allows 50,000 blocks of at most 4000 MiB per block blob.
    MAX_PARTS: ClassVar[int] = 50_000
    MAX_PART: ClassVar[int] = 4000 * 1024**2

    def __init__(self, fss: Any, path: str, *, literal: bool = False):
        self._fss = fss
        if literal:
            self._container, _, self._blob = path.strip("/").partition("/")
        else:
            self._container, self._blob, _ = fss.split_path(path)
        self._prefix = ""
        self._staged: set[int] = set()

    def _block_id(self, number: int) -> str:
        return f"{self._prefix}{number:05d}"

    def _run(self, fn: Any) -> Any:
        """``await fn(blob_client)`` on adlfs's event loop; Azure errors as OSError."""
        from azure.core.exceptions import AzureError
        from fsspec.asyn import sync

        async def go() -> Any:
            async with self._fss.service_client.get_blob_client(self._container,
                                                                self._blob) as bc:
                return await fn(bc)

        try:
            return sync(self._fss.loop, go)
        except AzureError as exc:
            raise _azure_os_error(exc, self.describe()) from exc

    def start(self) -> None:
        self._prefix = uuid.uuid4().hex[:27]
        self._staged = set()

    def put_part(self, number: int, data: Any) -> None:
        """Stage part ``number`` (1-based, at most :data:`MAX_PARTS`) as a
        block; staged again, the block is replaced."""
        block_id = self._block_id(number)
        self._run(lambda bc: bc.stage_block(block_id, data, length=len(data)))
        self._staged.add(number)

    def complete(self, parts: int) -> None:
        """Commit parts 1..``parts`` as the blob, in that order (the blocks
        staged and not listed are dropped by the service).

        Raises:
            OSError: a part is missing (a bug: nothing is committed).
        """
        from azure.storage.blob import BlobBlock

        missing = [n for n in range(1, parts + 1) if n not in self._staged]
        if missing:
            raise OSError(f"{self.describe()}: parts {missing} were not staged; the blob "
                          "is not committed")
        blocks = [BlobBlock(self._block_id(n)) for n in range(1, parts + 1)]
        self._run(lambda bc: bc.commit_block_list(blocks))
        self._staged = set()

    def abort(self) -> None:
        """Forget the staged blocks. Azure has no request that deletes
        uncommitted blocks: they stay invisible (no blob exists until a
        commit) and the service drops them after 7 days, or at once when a
        blob of that name is next committed (an upload that succeeds)."""
        self._staged = set()

    def describe(self) -> str:
        """``az://container/blob``, for a message (no credential)."""
        return f"az://{self._container}/{self._blob}"


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
