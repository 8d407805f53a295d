"""Refusing to write over what a commit must not replace, and cleaning up quietly.

The checks every commit protocol makes before it touches a destination: a
directory another writer holds or committed (:func:`_conflict`,
:func:`_refuse_marked`), a torch DCP checkpoint still being written
(:func:`_refuse_unfinished_dcp`), a store that holds a written file at
another size (:func:`_refuse_changed_sizes`), and the warning when files are
replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from checkpoint_store._format.manifest import first_unlisted
from checkpoint_store._util.inspect import (
    Inspection,
    is_checkpoint_data,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    PermanentBackendError,
)

__all__: list[str] = []

# Logged under the protocols' name, as before these lines moved out of it.
logger = logging.getLogger("checkpoint_store._commit.protocols")


#: torch.distributed.checkpoint's own commit marker: its coordinator writes it
#: after every rank's data files (``*.distcp``) are written.
DCP_METADATA = ".metadata"


def _warn_replacing(dest: Backend, dest_dir: str, files: Iterable[str]) -> None:
    names = sorted(files)
    if any(is_checkpoint_data(rel) for rel in names):
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        logger.warning("%s held an uncommitted leftover (%s); replacing it with this commit",
                       dest.uri_for(dest_dir), shown)


def _conflict(dest: Backend, dest_dir: str, by_other: bool) -> CheckpointConflictError:
    who = "by another writer" if by_other else "already"
    return CheckpointConflictError(
        f"{dest.uri_for(dest_dir)} was committed {who} (it holds a commit marker); its "
        "contents were left untouched. Report the checkpoint under the next index, or delete "
        "that one first."
    )


def _refuse_marked(dest: Backend, path: str, insp: Inspection, by_other: bool) -> None:
    """Raise when ``path`` (as ``insp`` found it) holds a commit marker."""
    if insp.state == "committed":
        raise _conflict(dest, path, by_other)
    if insp.state == "invalid":
        raise CheckpointConflictError(
            f"{dest.uri_for(path)} holds a commit marker this version cannot use "
            f"({insp.reason}); commit under another index"
        )


def _refuse_unfinished_dcp(dest: Backend, dest_dir: str, data: Mapping[str, int]) -> None:
    if DCP_METADATA not in data and any(rel.endswith(".distcp") for rel in data):
        raise CheckpointCorruptError(
            f"{dest.uri_for(dest_dir)} holds torch.distributed.checkpoint data files but no "
            f"{DCP_METADATA}: that dcp.save did not finish, so it is not committed. Save "
            "again into the same directory, or resume from the previous checkpoint",
            path=dest_dir, file=DCP_METADATA,
        )


def _refuse_changed_sizes(dest: Backend, dest_dir: str, listed: Mapping[str, int],
                          manifest: Sequence[Mapping[str, Any]]) -> None:
    """Raise when a file of ``manifest`` is missing from ``listed`` (a listing
    of ``dest_dir`` after the data files were written) or listed at another
    size: the store, its client or a proxy between them changed the bytes on
    the way, and a marker over them would commit a checkpoint its restore
    refuses. (gcsfs frames a simple upload with a bare ``\\n``, and a server
    that reads ``\\r\\n`` before the closing boundary as the line end keeps
    an object ending in ``\\r`` one byte short.)

    Raises:
        PermanentBackendError: naming the first such file, its two sizes and
            what to do; the caller removes what it wrote (nothing committed).
    """
    unlisted = first_unlisted(manifest, listed)
    if unlisted is not None:
        entry, stored = unlisted
        held = "does not hold" if stored is None else f"holds {stored} bytes of"
        raise PermanentBackendError(
            f"{dest.uri_for(dest_dir)} {held} {entry['path']!r} after {entry['size']} bytes "
            "of it were written: the store or its client changed the file on the way. Nothing was "
            "committed. Report the checkpoint again; if it fails the same way, the store "
            "or its client corrupts uploads: write through another client (a pyarrow or "
            "fsspec filesystem passed as storage_filesystem) until it is fixed"
        )


def _cleanup_quietly(fn: Callable[[], None]) -> None:
    # Cleanup after a failure must not hide the failure; what it cannot
    # remove, StorageContext.remove_uncommitted() removes later.
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not clean up after a failed commit: %s", exc)
