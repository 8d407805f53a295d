"""The manifest and commit marker of a checkpoint, as values: no I/O.

Owns the shape of ``.internal_metadata.json`` (docs/format.md):
:func:`internal_metadata` is the one place a marker is built,
:func:`check_relpath` the one rule for a safe relative path, and
:func:`check_entry` the one comparison of a manifest entry with what was read,
:func:`first_unlisted` the one comparison of a manifest with a listing.
Reading a marker from storage and checking it against a listing lives in
:mod:`checkpoint_store._util.inspect`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from checkpoint_store._format.layout import (
    CHUNK_ROOT,
    FORMAT_VERSION,
    FORMAT_VERSION_CHUNKS,
    FORMAT_VERSION_TENSORS,
    USER_METADATA,
    is_internal_file,
)
from checkpoint_store.errors import CheckpointCorruptError

__all__ = [
    "Inspection",
    "InspectionState",
    "ManifestEntry",
    "check_chunks",
    "check_chunk_root",
    "check_entry",
    "check_relpath",
    "crc_hex",
    "first_unlisted",
    "internal_metadata",
    "is_checkpoint_data",
    "is_chunked",
]


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a checkpoint: relative posix path, size in bytes, CRC32C (8 hex digits)."""

    path: str
    size: int
    crc32c: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c}


def crc_hex(value: int) -> str:
    """A CRC32C as the manifest writes it: 8 lowercase hex digits."""
    return f"{value:08x}"


def is_checkpoint_data(rel: str) -> bool:
    """True for a user's file (anything but our internal files)."""
    return not is_internal_file(rel)


_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
#: A chunk's name: 64 hex digits of BLAKE3, with ``.<8 hex>`` when it was
#: uploaded afresh under a condemned name (docs/format.md, "Chunks").
_CHUNK_NAME_RE = re.compile(r"^[0-9a-f]{64}(\.[0-9a-f]{8})?$")


def is_chunked(entry: Mapping[str, Any]) -> bool:
    """True for a manifest entry whose bytes live as chunks (its file is not
    in the checkpoint directory)."""
    return "chunks" in entry


def check_chunks(entry: Mapping[str, Any]) -> str | None:
    """Why a chunked manifest entry's ``"chunks"`` list is malformed, or None.

    Each element is ``[name, logical_len, stored_len]``: a valid chunk name
    and two non-negative integers; the logical lengths sum to the entry's
    ``"size"``.
    """
    chunks = entry.get("chunks")
    if not isinstance(chunks, list):
        return "has 'chunks' that is not a list"
    total = 0
    for i, c in enumerate(chunks):
        if not isinstance(c, list) or len(c) != 3:
            return f"has chunk #{i} that is not [name, logical_len, stored_len]"
        name, logical, stored = c
        if not isinstance(name, str) or not _CHUNK_NAME_RE.match(name):
            return f"has chunk #{i} with an invalid name {name!r}"
        for n in (logical, stored):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                return f"has chunk #{i} ({name}) with an invalid length {n!r}"
        total += logical
    if total != entry.get("size"):
        return f"has chunks of {total} bytes in all, but a size of {entry.get('size')!r}"
    return None


def check_chunk_root(root: object) -> str | None:
    """Why a marker's ``"chunk_root"`` is unusable, or None: the only root a
    checkpoint may name is its experiment's chunk store, :data:`CHUNK_ROOT`
    (a marker naming another directory could make a reader fetch, or a gc
    count, objects outside the experiment)."""
    if root != CHUNK_ROOT:
        return f"is not {CHUNK_ROOT!r}"
    return None


def check_relpath(rel: object) -> str | None:
    """Why ``rel`` is not a safe relative path inside a checkpoint, or None when it is.

    Refused: empty, absolute (``/x``; ``C:x`` on Windows), backslashes, NUL,
    and any empty, ``.`` or ``..`` component.
    """
    if not isinstance(rel, str) or not rel:
        return "is empty"
    if rel.startswith("/") or (os.name == "nt" and len(rel) > 1 and rel[1] == ":"):
        # "C:x" is a legal POSIX file name but a drive-relative path on Windows.
        return "is absolute"
    if "\\" in rel or "\x00" in rel:
        return "contains a backslash or NUL"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' component"
    return None


#: What a directory is: ``committed`` (valid marker matching the listing),
#: ``absent`` (files but no marker, or an empty one), ``invalid`` (a marker
#: we cannot trust),
#: ``missing`` (nothing at all under the path).
InspectionState = Literal["committed", "absent", "invalid", "missing"]


@dataclass(frozen=True)
class Inspection:
    """What one listing (plus one read of the marker) says about a directory.

    Attributes:
        state: ``"committed"`` (valid marker matching the listing),
            ``"absent"`` (no ``.internal_metadata.json``, or an empty
            one: a commit killed as it wrote it), ``"invalid"``
            (a marker that does not parse, has another format version, or
            whose manifest does not match the files listed), ``"missing"``
            (nothing at all under the path).
        meta: the parsed internal metadata when committed (else None; for
            ``"invalid"`` the parsed JSON when it parsed).
        reason: for ``"invalid"``, what is wrong (names the file).
        file: for ``"invalid"``, the relative path at fault, if one.
        files: ``{relative path: size}`` of every file listed, ours included.
    """

    state: InspectionState
    meta: dict[str, Any] | None
    reason: str | None = None
    file: str | None = None
    files: dict[str, int] | None = None


def internal_metadata(
    internal: Mapping[str, Any], entries: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """The ``.internal_metadata.json`` body for a commit: ``internal`` (index,
    metrics, run id, ...; a ``"tensors"`` index makes it format version 2,
    docs/state.md; an entry with ``"chunks"`` makes it version 3, and then
    ``internal`` carries ``"chunk_root"``) plus ``format_version``, ``created_at`` (kept when
    given; seconds since the epoch) and ``manifest`` (``entries`` sorted by
    path, ``.user_metadata.json`` left out: it may change after the commit).

    The only place a marker is built: every commit protocol, the multi-rank
    finalize, ``StorageContext.adopt`` and the integrations call it.
    """
    meta = dict(internal)
    manifest = sorted(
        (dict(e) for e in entries if e["path"] != USER_METADATA), key=lambda e: e["path"]
    )
    if any(is_chunked(e) for e in manifest):
        meta["format_version"] = FORMAT_VERSION_CHUNKS
    else:
        meta["format_version"] = FORMAT_VERSION_TENSORS if "tensors" in meta else FORMAT_VERSION
    meta.setdefault("created_at", time.time())
    meta["manifest"] = manifest
    return meta


def check_entry(
    checkpoint_path: str, want: Mapping[str, Any], got: tuple[int, str] | None
) -> None:
    """Compare one manifest entry with the ``(size, crc32c)`` read (None: missing).

    Raises:
        CheckpointCorruptError: missing or different; ``.file`` names it.
    """
    rel = want["path"]
    if got is None:
        raise CheckpointCorruptError(
            f"checkpoint {checkpoint_path!r} is missing file {rel!r} listed in its manifest",
            path=checkpoint_path, file=rel,
        )
    if got != (want["size"], want["crc32c"]):
        raise CheckpointCorruptError(
            f"file {rel!r} of checkpoint {checkpoint_path!r} does not match its manifest "
            f"(size {got[0]} vs {want['size']}, crc32c {got[1]} vs {want['crc32c']}); the "
            "checkpoint is corrupt: resume from an earlier one",
            path=checkpoint_path, file=rel,
        )


def first_unlisted(manifest: Iterable[Mapping[str, Any]], listed: Mapping[str, int]
                   ) -> tuple[Mapping[str, Any], int | None] | None:
    """The first manifest entry (``{"path", "size", ...}``) that ``listed``
    (relative path -> size in bytes, from a listing) does not hold at its
    size, with the listed size (None: not listed); None when it holds every
    entry. Shared by :func:`~checkpoint_store._util.inspect.inspect_checkpoint`
    (a committed checkpoint against its marker) and the commit's check before
    its marker (:func:`~checkpoint_store._commit.refusals._refuse_changed_sizes`).
    A chunked entry (:func:`is_chunked`) is not expected in the listing."""
    for e in manifest:
        if is_chunked(e):
            continue
        size = listed.get(e["path"])
        if size != e["size"]:
            return e, size
    return None
