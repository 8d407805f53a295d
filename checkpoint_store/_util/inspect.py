"""Reading a checkpoint's commit marker back from storage and checking it.

:func:`inspect_checkpoint` is the one place ``.internal_metadata.json`` is
read and checked against a listing, and :func:`verify_files` /
:func:`read_checked` the one place file bytes are compared with it; also
:func:`compute_manifest` for files already in place. The marker's shape (its
entries, how it is built, the safe-path rule) is a value kept in
:mod:`checkpoint_store._format.manifest` and re-exported here.

Thread use: every function here is safe to call from any thread or rank; the
readers fan out over a bounded pool of their own.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    FORMAT_VERSION_CHUNKS,
    FORMAT_VERSION_TENSORS,
    INTERNAL_METADATA,
    MARKER_FORMAT_VERSIONS,
    USER_METADATA,
    is_written_record,
    name_disagreement,
    parse_checkpoint_dir_name,
)
from checkpoint_store._format.manifest import (
    _CRC_RE,
    check_chunk_root,
    check_chunks,
    check_entry,
    check_relpath,
    first_unlisted,
    is_chunked,
)
from checkpoint_store._format.manifest import Inspection as Inspection
from checkpoint_store._format.manifest import InspectionState as InspectionState
from checkpoint_store._format.manifest import ManifestEntry as ManifestEntry
from checkpoint_store._format.manifest import crc_hex as crc_hex
from checkpoint_store._format.manifest import internal_metadata as internal_metadata
from checkpoint_store._format.manifest import is_checkpoint_data as is_checkpoint_data
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Capabilities
from checkpoint_store.errors import CheckpointCorruptError, PermanentBackendError

__all__ = [
    "InspectionState",
    "Inspection",
    "ManifestEntry",
    "check_entry",
    "check_relpath",
    "compute_manifest",
    "crc_hex",
    "inspect_checkpoint",
    "internal_metadata",
    "is_checkpoint_data",
    "read_checked",
    "read_internal_metadata",
    "read_with_crc",
    "verify_files",
    "written_crcs",
]










# -- validity -------------------------------------------------------------------









def _validate_manifest(meta: Any) -> tuple[str, str | None] | None:
    """``(reason, file)`` when ``meta`` is not internal metadata we can trust."""
    if not isinstance(meta, dict):
        return "is not a JSON object", None
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in MARKER_FORMAT_VERSIONS:
        return (
            f"has format_version {version!r}; this checkpoint-store reads versions "
            f"{', '.join(map(str, MARKER_FORMAT_VERSIONS))} (upgrade checkpoint-store for "
            "newer checkpoints)",
            None,
        )
    if version == FORMAT_VERSION_TENSORS and not isinstance(meta.get("tensors"), dict):
        return "has format_version 2 but no 'tensors' object", None
    if "tensors" in meta and not isinstance(meta.get("tensors"), dict):
        return "has a 'tensors' index that is not an object", None
    if version == FORMAT_VERSION_CHUNKS:
        why = check_chunk_root(meta.get("chunk_root"))
        if why is not None:
            return f"has format_version 3 but its 'chunk_root' {why}", None
    if not isinstance(meta.get("index"), int) or isinstance(meta.get("index"), bool):
        return "has no integer 'index'", None
    if meta["index"] < 0:
        return f"has a negative 'index' ({meta['index']})", None
    manifest = meta.get("manifest")
    if not isinstance(manifest, list):
        return "has no 'manifest' list", None
    seen = set()
    for e in manifest:
        if not isinstance(e, dict):
            return "has a manifest entry that is not an object", None
        rel, size, crc = e.get("path"), e.get("size"), e.get("crc32c")
        why = check_relpath(rel)
        if why is not None:
            return f"lists an unsafe path {rel!r} (it {why}); refusing it", str(rel)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"lists file {rel!r} with an invalid size {size!r}", rel
        if not isinstance(crc, str) or not _CRC_RE.match(crc):
            return f"lists file {rel!r} with an invalid crc32c {crc!r}", rel
        if rel in seen:
            return f"lists file {rel!r} twice", rel
        seen.add(rel)
        if is_chunked(e):
            if version != FORMAT_VERSION_CHUNKS:
                return (f"lists file {rel!r} as chunks but has format_version {version}, "
                        "not 3"), rel
            why = check_chunks(e)
            if why is not None:
                return f"lists file {rel!r} that {why}", rel
    return None


_A_FILE = "is a file, not a checkpoint directory"


def inspect_checkpoint(
    fs: pafs.FileSystem, checkpoint_path: str, *, retry: RetryPolicy | None = None,
    identity: bool = True,
) -> Inspection:
    """Classify ``checkpoint_path`` with one recursive listing and, when a
    marker is listed, one read of it.

    A committed checkpoint's manifest must match the listing exactly: every
    manifest file present with its size, and no user file that the manifest
    does not list (``.user_metadata.json`` and our ``.cs_*`` files aside).
    A chunked entry (format version 3) is the exception: its file lives as
    chunks in the chunk store and must NOT be listed (one that is is
    ``"invalid"``); its chunks are not listed here (:func:`verify_files`
    and the readers find a missing one).
    Checksums are not read here (see :func:`verify_files`): that would read
    every byte on each listing.

    A directory named ``checkpoint_NNNNNN`` is a trial's entry, and its name
    is its identity: one that is a symbolic link (local disks), or whose
    marker records another index (:func:`~checkpoint_store._format.layout.
    name_disagreement`), is ``"invalid"`` for every reader, never another
    checkpoint. ``identity=False`` leaves that check out: a directory a user
    hands in as a source, whatever it is named.
    """
    entry = identity and parse_checkpoint_dir_name(posixpath.basename(
        checkpoint_path.rstrip("/"))) is not None
    if entry:
        target = _fsutil.link_target(fs, checkpoint_path)
        if target is not None:
            return Inspection("invalid", None, f"is a symbolic link (to {target!r}), not a "
                              "checkpoint directory of its own; nothing reads or deletes "
                              "through it")
        local = _fsutil.local_path(fs, checkpoint_path)
        if local is not None and os.path.isfile(local):  # a listing of it would fail
            return Inspection("invalid", None, _A_FILE)
    try:
        entries = _fsutil.list_tree(fs, checkpoint_path, retry=retry)
    except PermanentBackendError:
        # Some stores refuse to list a file (memory: not a directory).
        if entry and _fsutil.kind(fs, checkpoint_path, retry=retry) == pafs.FileType.File:
            return Inspection("invalid", None, _A_FILE)
        raise
    files: dict[str, int] = {}
    for fi in entries:
        if fi.type == pafs.FileType.File:
            files[_fsutil.relative(checkpoint_path, fi.path)] = fi.size
    if not entries and not _fsutil.is_dir(fs, checkpoint_path, retry=retry):
        if entry and _fsutil.kind(fs, checkpoint_path, retry=retry) == pafs.FileType.File:
            return Inspection("invalid", None, _A_FILE)
        return Inspection("missing", None, files=files)
    if INTERNAL_METADATA not in files or files[INTERNAL_METADATA] == 0:
        # An empty marker is a commit that never published one, never a
        # checkpoint: pyarrow's Azure client creates the blob empty as it
        # opens it and fills it at close, so a writer killed in between
        # leaves it so. Taken for a damaged checkpoint, it stayed for ever
        # (no gc removes a marked directory) and blocked its index.
        return Inspection("absent", None, files=files)
    try:
        # Read again while torn: a marker read while its commit writes it in
        # place (fsspec directory filesystems) is not a damaged checkpoint.
        meta = _fsutil.read_control(fs, posixpath.join(checkpoint_path, INTERNAL_METADATA),
                                    retry=retry)
    except FileNotFoundError:  # deleted between the listing and the read
        return Inspection("absent", None, files=files)
    except ValueError as exc:  # it stayed unparsable
        return Inspection("invalid", None, f"{INTERNAL_METADATA} is not valid JSON ({exc})",
                          INTERNAL_METADATA, files)
    bad = _validate_manifest(meta)
    if bad is not None:
        return Inspection("invalid", meta if isinstance(meta, dict) else None,
                          f"{INTERNAL_METADATA} {bad[0]}", bad[1] or INTERNAL_METADATA, files)
    if entry:
        why = name_disagreement(posixpath.basename(checkpoint_path.rstrip("/")), meta["index"])
        if why is not None:
            return Inspection("invalid", meta, f"{INTERNAL_METADATA} {why}", INTERNAL_METADATA,
                              files)
    listed = {rel: size for rel, size in files.items()
              if is_checkpoint_data(rel) and rel != USER_METADATA}
    unlisted = first_unlisted(meta["manifest"], listed)
    if unlisted is not None:
        e, size = unlisted
        rel = e["path"]
        if size is None:
            return Inspection("invalid", meta, f"file {rel!r} listed in the manifest is missing",
                              rel, files)
        return Inspection(
            "invalid", meta, f"file {rel!r} has {size} bytes, the manifest says {e['size']}",
            rel, files,
        )
    # A chunked entry's file is not in the directory; one that is there too
    # is refused like any file the manifest does not list as a file: a
    # reader could not tell which bytes are the checkpoint's.
    doubled = sorted(set(listed) & {e["path"] for e in meta["manifest"] if is_chunked(e)})
    if doubled:
        return Inspection("invalid", meta, f"file {doubled[0]!r} is in the directory but the "
                          "manifest says its bytes live as chunks", doubled[0], files)
    extra = sorted(set(listed) - {e["path"] for e in meta["manifest"]})
    if extra:
        return Inspection("invalid", meta, f"file {extra[0]!r} is not in the manifest",
                          extra[0], files)
    return Inspection("committed", meta, files=files)


def read_internal_metadata(
    fs: pafs.FileSystem, checkpoint_path: str, *, retry: RetryPolicy | None = None
) -> dict[str, Any] | None:
    """The parsed ``.internal_metadata.json`` if ``checkpoint_path`` is a committed
    checkpoint, else None.

    Not committed: the marker is absent or unparsable, has another format
    version, or its manifest does not match the files listed (a missing
    file, a size that differs, a user file it does not list). Costs one
    recursive listing plus one small read; checksums are checked by
    :func:`verify_files` / ``Checkpoint.verify()``.
    """
    insp = inspect_checkpoint(fs, checkpoint_path, retry=retry)
    return insp.meta if insp.state == "committed" else None


def verify_files(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    manifest: Iterable[dict[str, Any]],
    *,
    chunk_size: int = 8 * 1024 * 1024,
    concurrency: int = 4,
    retry: RetryPolicy | None = None,
) -> None:
    """Read every manifest file and compare its size and CRC32C.

    Raises:
        CheckpointCorruptError: the first file (in manifest order) that is
            missing or differs; ``.file`` names it.
    """
    entries = list(manifest)

    def one(e: dict[str, Any]) -> tuple[int, str] | None:
        try:
            size, crc, _ = read_with_crc(
                fs, posixpath.join(checkpoint_path, e["path"]), chunk_size=chunk_size, retry=retry
            )
            return size, crc
        except FileNotFoundError:
            return None

    workers = max(1, min(concurrency, len(entries)))
    if workers == 1:
        results = [one(e) for e in entries]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="cs-verify") as pool:
            results = list(pool.map(one, entries))
    for e, got in zip(entries, results, strict=True):
        check_entry(checkpoint_path, e, got)


def read_with_crc(
    fs: pafs.FileSystem,
    path: str,
    *,
    chunk_size: int = 8 * 1024 * 1024,
    keep: bool = False,
    retry: RetryPolicy | None = None,
) -> tuple[int, str, bytes]:
    """``(size, crc32c, data)`` of one file, read once in ``chunk_size`` pieces
    (retried as a whole); ``data`` is the file's bytes when ``keep``, else ``b""``.

    Raises:
        FileNotFoundError: no such file.
    """

    def _read() -> tuple[int, str, bytes]:
        crc, size, chunks = 0, 0, []
        with fs.open_input_stream(path) as f:
            while True:
                buf = f.read(chunk_size)
                if not buf:
                    break
                crc = google_crc32c.extend(crc, buf)
                size += len(buf)
                if keep:
                    chunks.append(buf)
        return size, crc_hex(crc), b"".join(chunks)

    return _retry.call(_read, policy=retry, store=fs, what=f"read {path}")


def read_checked(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    entry: Mapping[str, Any],
    *,
    keep: bool = True,
    retry: RetryPolicy | None = None,
) -> bytes:
    """One manifest file's bytes (``b""`` unless ``keep``), its size and CRC32C
    checked against ``entry`` by :func:`check_entry` on the same single read.

    Raises:
        CheckpointCorruptError: the file is missing or differs; ``.file`` names it.
    """
    got: tuple[int, str] | None = None
    data = b""
    try:
        size, crc, data = read_with_crc(
            fs, posixpath.join(checkpoint_path, entry["path"]), keep=keep, retry=retry
        )
        got = (size, crc)
    except FileNotFoundError:
        pass  # check_entry reports the file as missing
    check_entry(checkpoint_path, entry, got)
    return data


def compute_manifest(
    fs: pafs.FileSystem,
    root: str,
    relpaths: Iterable[str],
    caps: Capabilities,
    *,
    retry: RetryPolicy | None = None,
) -> list[dict[str, Any]]:
    """Manifest entries (``{path, size, crc32c}``, sorted by path) for files
    already in place under ``root``, reading each once.

    Raises:
        CheckpointCorruptError: a path is unsafe (``..``, absolute).
        FileNotFoundError: a file vanished while being read.
    """
    rels = sorted(relpaths)
    for rel in rels:
        why = check_relpath(rel)
        if why is not None:
            raise CheckpointCorruptError(f"{rel!r} under {root!r} {why}", path=root, file=rel)

    def one(rel: str) -> dict[str, Any]:
        size, crc, _ = read_with_crc(
            fs, posixpath.join(root, rel), chunk_size=caps.chunk_size, retry=retry
        )
        return {"path": rel, "size": size, "crc32c": crc}

    workers = max(1, min(caps.concurrency, len(rels)))
    if workers == 1:
        return [one(r) for r in rels]
    with ThreadPoolExecutor(workers, thread_name_prefix="cs-manifest") as pool:
        return list(pool.map(one, rels))




# -- the marker -----------------------------------------------------------------






def written_crcs(
    fs: pafs.FileSystem, root: str, listed: dict[str, int], retry: RetryPolicy | None
) -> dict[str, tuple[int, str]]:
    """``{relative path: (size, crc32c)}`` from the ``.cs_written-*.json`` records
    under ``root``; a record that does not parse is ignored (its files are read)."""
    out: dict[str, tuple[int, str]] = {}
    for rel in sorted(listed):
        if not is_written_record(rel.rsplit("/", 1)[-1]):
            continue
        try:
            body = _json.loads(_fsutil.read_bytes(fs, posixpath.join(root, rel), retry=retry))
        except (FileNotFoundError, ValueError):
            continue
        base = posixpath.dirname(rel)
        for e in body.get("files", []) if isinstance(body, dict) else []:
            if not isinstance(e, dict):
                continue
            path, size, crc = e.get("path"), e.get("size"), e.get("crc32c")
            if (isinstance(path, str) and check_relpath(path) is None
                    and isinstance(size, int) and isinstance(crc, str) and _CRC_RE.match(crc)):
                out[posixpath.join(base, path) if base else path] = (size, crc)
    return out
