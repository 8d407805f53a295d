"""The checkpoint directories of one trial, as :class:`~checkpoint_store.storage.StorageContext`
reads them: the ``checkpoint_NNNNNN`` listing, the committed ones with their
internal metadata, the previous committed checkpoint a commit reuses files
from (and whether it reuses any), the checks before a foreign directory is
adopted, and the transfer settings a StorageContext commits with.

Paths only: the storage layer wraps them in :class:`~checkpoint_store.checkpoint.Checkpoint`.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    MARKER_FORMAT_VERSIONS,
    checkpoint_dir_name,
    is_internal_file,
    newer_format_version,
    parse_checkpoint_dir_name,
    validate_component,
)
from checkpoint_store._format.manifest import is_chunked
from checkpoint_store._transfer.plan import Previous
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint, read_internal_metadata
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointNotFoundError,
    InvalidConfigError,
)

__all__ = ["adoptable", "checkpoint_dirs", "committed_paths", "previous_checkpoint",
           "reuses_previous", "transfer_backend"]


def checkpoint_dirs(filesystem: Any, trial_path: str, *,
                    retry: RetryPolicy | None, files: bool = False) -> list[tuple[int, str]]:
    """``(index, dir name)`` of every ``checkpoint_NNNNNN`` directory of
    ``trial_path``, committed or not, sorted by index (one listing); with
    ``files``, also the files that take such a name (an index nothing can be
    committed under)."""
    found = []
    for fi in _fsutil.list_dir(filesystem, trial_path, retry=retry):
        name = posixpath.basename(fi.path.rstrip("/"))
        index = parse_checkpoint_dir_name(name)
        if index is not None and (files or fi.type != _fsutil.pafs.FileType.File):
            found.append((index, name))
    return sorted(found)


def committed_paths(filesystem: Any, trial_path: str, dirs: list[tuple[int, str]], *,
                    retry: RetryPolicy | None) -> list[tuple[str, dict[str, Any]]]:
    """``(path, internal metadata)`` of each directory of ``dirs`` that holds
    valid internal metadata, sorted by the index recorded there."""
    out = []
    for _, name in dirs:
        path = posixpath.join(trial_path, name)
        meta = read_internal_metadata(filesystem, path, retry=retry)
        if meta is not None:
            out.append((path, meta))
    out.sort(key=lambda pm: pm[1]["index"])
    return out


def previous_checkpoint(filesystem: Any, trial_path: str, index: int,
                        dirs: Callable[[], list[tuple[int, str]]], *,
                        retry: RetryPolicy | None) -> Previous | None:
    """The latest committed checkpoint below ``index`` (see
    :meth:`~checkpoint_store.storage.StorageContext.previous_checkpoint`);
    ``dirs`` lists the trial's checkpoint directories, called only when
    ``checkpoint_<index - 1>`` is not the answer."""
    if index > 0:
        found = _previous_at(filesystem, trial_path, checkpoint_dir_name(index - 1), retry)
        if found is not None:
            return found
    below = [name for i, name in dirs() if i < index - 1]
    for name in reversed(below[-3:]):
        found = _previous_at(filesystem, trial_path, name, retry)
        if found is not None:
            return found
    return None


def _previous_at(filesystem: Any, trial_path: str, name: str,
                 retry: RetryPolicy | None) -> Previous | None:
    path = posixpath.join(trial_path, name)
    meta = read_internal_metadata(filesystem, path, retry=retry)
    if meta is None:
        return None
    # A chunked file of the previous checkpoint is not in its directory: no
    # server-side copy can take it from there.
    return Previous(path, {e["path"]: (e["size"], int(e["crc32c"], 16))
                           for e in meta["manifest"] if not is_chunked(e)})


def adoptable(filesystem: Any, trial_path: str, dir_name: str,
              metrics: Mapping[str, Any] | None, *, uri: Callable[[str], str],
              next_index: Callable[[], int],
              retry: RetryPolicy | None) -> tuple[str, int, dict[str, Any], list[str]]:
    """The checks of :meth:`~checkpoint_store.storage.StorageContext.adopt`,
    made before anything is written.

    Returns:
        ``(path, index, metrics as a JSON object, data files sorted)``.

    Raises:
        InvalidConfigError, CheckpointNotFoundError, CheckpointConflictError:
            as :meth:`~checkpoint_store.storage.StorageContext.adopt`.
    """
    validate_component(dir_name, "dir_name")
    index = parse_checkpoint_dir_name(dir_name)
    if index is None:
        raise InvalidConfigError(
            f"{dir_name!r} is not named checkpoint_NNNNNN; rename it (e.g. to "
            f"{checkpoint_dir_name(next_index())}) and adopt it again"
        )
    if dir_name != checkpoint_dir_name(index):  # the name is the checkpoint's identity
        raise InvalidConfigError(
            f"{dir_name!r} is not how index {index} is named; rename it to "
            f"{checkpoint_dir_name(index)} and adopt it again"
        )
    clean_metrics = _json.to_json_object(metrics or {}, "metrics")
    path = posixpath.join(trial_path, dir_name)
    insp = inspect_checkpoint(filesystem, path, retry=retry)
    if insp.state == "committed":
        raise CheckpointConflictError(f"{uri(path)} is already a committed checkpoint")
    if insp.state == "invalid" and isinstance(insp.meta, dict):
        version = newer_format_version(insp.meta, max(MARKER_FORMAT_VERSIONS))
        if version is not None:
            raise CheckpointConflictError(
                f"{uri(path)} was written by a newer checkpoint-store (format "
                f"{version}); upgrade instead of adopting it"
            )
    data = {rel: size for rel, size in (insp.files or {}).items()
            if not is_internal_file(rel)}
    if insp.state == "missing" or not data:
        raise CheckpointNotFoundError(f"{uri(path)} holds no files to adopt")
    return path, index, clean_metrics, sorted(data)


def transfer_backend(backend: Backend, max_concurrency: int | None, memory_budget: int | None,
                     incremental: bool) -> Backend:
    """``backend`` with ``max_concurrency`` (as ``Capabilities.concurrency``) and
    ``memory_budget`` (bytes) in its capabilities, where given.

    Raises:
        InvalidConfigError: ``max_concurrency`` not an int >= 1, ``memory_budget``
            not an int >= 1 MiB, or ``incremental`` not a bool.
    """
    changes: dict[str, Any] = {}
    for name, value, floor in (("max_concurrency", max_concurrency, 1),
                               ("memory_budget", memory_budget, 1024 * 1024)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            raise InvalidConfigError(
                f"{name} must be an int >= {floor}, got {value!r}"
                + (" (bytes)" if name == "memory_budget" else "")
            )
        changes["concurrency" if name == "max_concurrency" else name] = value
    if not isinstance(incremental, bool):
        raise InvalidConfigError(f"incremental must be True or False, got {incremental!r}")
    if changes:
        caps = dataclasses.replace(backend.capabilities, **changes)
        backend = dataclasses.replace(backend, capabilities=caps)
    return backend


def reuses_previous(backend: Backend, incremental: bool, source_fs: Any, source: str) -> bool:
    """Whether a commit of the local directory ``source`` into ``backend`` looks
    for files to copy server-side from the previous checkpoint."""
    # Where the store renames directories (local disks) a copy from the
    # source is already a kernel copy or a reflink: nothing to gain.
    caps = backend.capabilities
    return (incremental and caps.server_side_copy and not caps.atomic_rename
            and _fsutil.local_path(source_fs, source) is not None)
