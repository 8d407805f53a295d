"""Refusing to write over what a commit must not replace, and cleaning up quietly.

The checks every commit protocol makes before it touches a destination: a
directory another writer holds or committed (:func:`_conflict`,
:func:`_refuse_marked`), a torch DCP checkpoint still being written
(:func:`_refuse_unfinished_dcp`), and the warning when files are replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from checkpoint_store._util.inspect import (
    Inspection,
    is_checkpoint_data,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
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


def _cleanup_quietly(fn: Callable[[], None]) -> None:
    # Cleanup after a failure must not hide the failure; what it cannot
    # remove, StorageContext.remove_uncommitted() removes later.
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not clean up after a failed commit: %s", exc)
