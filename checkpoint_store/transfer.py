"""Moving checkpoint directories between filesystems, and the commit protocol.

Owns three things:

* copying a tree file by file through a bounded thread pool, computing each
  file's CRC32C on the bytes as they pass (no second read);
* the commit: which protocol is used is chosen from the destination's
  :class:`~checkpoint_store.backends.Capabilities` (docs/format.md):

  - ``atomic_rename`` (local disks): write everything, the internal metadata
    included, into a staging sibling ``.cs_staging-<name>-<writer>``, fsync
    files and directories, then rename it to ``checkpoint_NNNNNN``.
  - otherwise (object stores, memory): write the data files into
    ``checkpoint_NNNNNN/``, then ``.internal_metadata.json`` last.

* the commit in place of a directory a writer already filled at its final
  location (torch.distributed.checkpoint): no byte is copied, the manifest
  is built from the files there and the marker written last;
* downloads that verify sizes and checksums against the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import filelock
import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store import _clock, _fsutil, _json, _retry
from checkpoint_store._layout import (
    FORMAT_VERSION,
    INTERNAL_METADATA,
    INTERNAL_PREFIX,
    NAME_MAX,
    USER_METADATA,
    bounded_name,
    is_internal_file,
    is_written_record,
)
from checkpoint_store._retry import RetryPolicy
from checkpoint_store.backends.base import Backend, Capabilities
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    UnsafePathError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a checkpoint: relative posix path, size in bytes, CRC32C (8 hex digits)."""

    path: str
    size: int
    crc32c: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c}


#: ``write(filesystem, directory) -> entries``: writes a checkpoint's data files
#: into ``directory`` itself (see :func:`commit_checkpoint`).
WriteContents = Callable[[pafs.FileSystem, str], "list[ManifestEntry]"]


def _crc_hex(value: int) -> str:
    return f"{value:08x}"


def copy_tree(
    src_fs: pafs.FileSystem,
    src_root: str,
    dst_fs: pafs.FileSystem,
    dst_root: str,
    dst_caps: Capabilities,
    *,
    include: Callable[[str], bool] = lambda rel: True,
    files: list[tuple[str, int]] | None = None,
    confine_links: bool = False,
    fsync: bool = True,
    chunk_size: int | None = None,
    concurrency: int | None = None,
    retry: RetryPolicy | None = None,
    memory_limit: int | None = None,
    previous: Any = None,
) -> list[ManifestEntry]:
    """Copy every file under ``src_root`` for which ``include(relpath)`` holds.

    The source is listed and every name checked (:func:`source_files`) before
    the first write, unless the caller already did and passes ``files``
    (``(relpath, size)`` pairs). ``chunk_size`` (bytes per request; default
    the destination's ``Capabilities.chunk_size``), ``concurrency`` (threads;
    default its ``Capabilities.concurrency``) and ``memory_limit`` (bytes
    buffered at once; default its ``Capabilities.memory_budget``, else
    :data:`checkpoint_store._plan.DEFAULT_MEMORY_LIMIT`) tune the transfer
    plan of :mod:`checkpoint_store._plan`. CRC32Cs are computed on the bytes
    in flight (local copies: read again from the page cache). ``previous`` (a
    :class:`checkpoint_store._plan.Previous`): files equal to that committed
    checkpoint's are copied inside the store instead of uploaded.

    Returns:
        One :class:`ManifestEntry` per file copied, sorted by path.

    Raises:
        CheckpointNotFoundError: ``src_root`` is not a directory.
        UnsafePathError: a source entry could land outside ``dst_root`` or
            cannot be stored (see :func:`source_files`); nothing was written.
        OSError: any I/O error of either filesystem (the partial copy is left
            for the caller's commit protocol to discard).
    """
    if files is None:
        files = source_files(src_fs, src_root, include=include, confine_links=confine_links,
                             retry=retry)
    do_fsync = fsync and dst_caps.needs_fsync
    chunk = chunk_size or dst_caps.chunk_size
    _fsutil.ensure_dir(dst_fs, dst_root, dst_caps, retry=retry)
    if dst_caps.directories:
        for d in sorted({posixpath.dirname(rel) for rel, _ in files} - {""}):
            _fsutil.ensure_dir(dst_fs, posixpath.join(dst_root, d), dst_caps, retry=retry)

    # The fastest path for this pair of filesystems and these file sizes
    # (checkpoint_store/_plan.py); each task (a file, a part of a large file,
    # or a batch of small ones) is the unit of retry.
    from checkpoint_store import _plan

    results = _plan.run(
        src_fs, src_root, dst_fs, dst_root, files,
        chunk_size=chunk, concurrency=concurrency or dst_caps.concurrency, fsync=do_fsync,
        memory_limit=memory_limit if memory_limit is not None else dst_caps.memory_budget,
        call=lambda fn, what: _retry.call(fn, policy=retry, what=what), previous=previous,
    )
    entries = [ManifestEntry(r.path, r.size, _crc_hex(r.crc32c)) for r in results]
    if do_fsync:
        root_os = _fsutil.local_path(dst_fs, dst_root)
        if root_os is not None:
            for d in sorted({posixpath.dirname(e.path) for e in entries} | {""}):
                _fsutil.fsync_dir(os.path.join(root_os, d))
    return entries


def source_files(
    src_fs: pafs.FileSystem,
    src_root: str,
    *,
    include: Callable[[str], bool] = lambda rel: True,
    confine_links: bool = False,
    retry: RetryPolicy | None = None,
) -> list[tuple[str, int]]:
    """``(relative posix path, size in bytes)`` of every file under ``src_root``
    that ``include`` keeps, sorted, each name checked so the copy stays in its place.

    One listing, no write. On a local disk symlinks are followed (a linked
    file's bytes are copied, as ``cp -L`` does) unless ``confine_links``,
    which refuses a link leading out of ``src_root``: set it when the source
    is an existing checkpoint, whose files must all be its own.

    Raises:
        CheckpointNotFoundError: ``src_root`` is not a directory.
        UnsafePathError: naming the entry: a name with an empty, ``.`` or
            ``..`` component, absolute, with a backslash or NUL (these do not
            mean the same on every store: ``sub/../../x`` is a literal key on
            S3 and a way out on disk), not UTF-8, or longer than
            :data:`~checkpoint_store._layout.NAME_MAX` bytes; a symlink cycle;
            a broken symlink; with ``confine_links``, a link leading out.
    """
    if not _fsutil.is_dir(src_fs, src_root, retry=retry):
        raise CheckpointNotFoundError(f"source directory {src_root!r} does not exist")
    root_os = _fsutil.local_path(src_fs, src_root)
    if root_os is not None:
        listed = _local_files(root_os, src_root, confine_links)
    else:
        listed = list(_fsutil.walk_files(src_fs, src_root, retry=retry))
    out = []
    for rel, size in listed:
        why = check_relpath(rel) or _name_problem(rel)
        if why is not None:
            raise UnsafePathError(
                f"{rel!r} under {src_root!r} {why}; nothing was written. Rename it (or move "
                "it out of the directory) and try again", path=src_root, file=rel,
            )
        if include(rel):
            out.append((rel, size))
    return sorted(out)


def _name_problem(rel: str) -> str | None:
    """Why a relative path that :func:`check_relpath` accepts still cannot be
    stored the same way everywhere, or None."""
    for part in rel.split("/"):
        try:
            size = len(part.encode("utf-8"))
        except UnicodeEncodeError:
            return "has a name that is not valid UTF-8 (stores keep names as UTF-8 text)"
        if size > NAME_MAX:
            return f"has a name of {size} bytes; file names hold at most {NAME_MAX}"
    return None


def _local_files(root: str, src_root: str, confine_links: bool) -> list[tuple[str, int]]:
    """Walk a local tree following symlinks, refusing cycles (and, with
    ``confine_links``, links out of ``root``)."""
    real_root = os.path.realpath(root)
    out: list[tuple[str, int]] = []

    def refuse(rel: str, why: str) -> UnsafePathError:
        return UnsafePathError(
            f"{rel!r} under {src_root!r} {why}; nothing was written. Remove or replace the "
            "link and try again", path=src_root, file=rel,
        )

    def walk(path: str, rel_dir: str, ancestors: tuple[str, ...]) -> None:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = f"{rel_dir}{entry.name}"
            if entry.is_symlink():
                real = os.path.realpath(entry.path)
                if not os.path.exists(real):
                    raise refuse(rel, f"is a broken symlink (to {os.readlink(entry.path)!r})")
                if confine_links and not _inside(real, real_root):
                    raise refuse(rel, f"is a symlink leading out of the checkpoint (to {real!r})")
                if os.path.isdir(real) and any(_inside(a, real) for a in ancestors):
                    raise refuse(rel, f"is a symlink cycle (it leads back to {real!r})")
            if entry.is_dir():  # follows links
                walk(entry.path, f"{rel}/", (*ancestors, os.path.realpath(entry.path)))
            elif entry.is_file():
                out.append((rel, entry.stat().st_size))

    walk(root, "", (real_root,))
    return out


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def _is_checkpoint_data(rel: str) -> bool:
    return not is_internal_file(rel)


# -- validity -------------------------------------------------------------------

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_CLAIM_PREFIX = f"{INTERNAL_PREFIX}claim-"
DELETE_TOMBSTONE = f"{INTERNAL_PREFIX}deleting"


def check_relpath(rel: str) -> str | None:
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


@dataclass(frozen=True)
class Inspection:
    """What one listing (plus one read of the marker) says about a directory.

    Attributes:
        state: ``"committed"`` (valid marker matching the listing),
            ``"absent"`` (no ``.internal_metadata.json``), ``"invalid"``
            (a marker that does not parse, has another format version, or
            whose manifest does not match the files listed), ``"missing"``
            (nothing at all under the path).
        meta: the parsed internal metadata when committed (else None; for
            ``"invalid"`` the parsed JSON when it parsed).
        reason: for ``"invalid"``, what is wrong (names the file).
        file: for ``"invalid"``, the relative path at fault, if one.
        files: ``{relative path: size}`` of every file listed, ours included.
    """

    state: str
    meta: dict[str, Any] | None
    reason: str | None = None
    file: str | None = None
    files: dict[str, int] | None = None


def _validate_manifest(meta: Any) -> tuple[str, str | None] | None:
    """``(reason, file)`` when ``meta`` is not internal metadata we can trust."""
    if not isinstance(meta, dict):
        return "is not a JSON object", None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        return (
            f"has format_version {version!r}; this checkpoint-store reads version "
            f"{FORMAT_VERSION} (upgrade checkpoint-store for newer checkpoints)",
            None,
        )
    if not isinstance(meta.get("index"), int) or isinstance(meta.get("index"), bool):
        return "has no integer 'index'", None
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
    return None


def inspect_checkpoint(
    fs: pafs.FileSystem, checkpoint_path: str, *, retry: RetryPolicy | None = None
) -> Inspection:
    """Classify ``checkpoint_path`` with one recursive listing and, when a
    marker is listed, one read of it.

    A committed checkpoint's manifest must match the listing exactly: every
    manifest file present with its size, and no user file that the manifest
    does not list (``.user_metadata.json`` and our ``.cs_*`` files aside).
    Checksums are not read here (see :func:`verify_files`): that would read
    every byte on each listing.
    """
    entries = _fsutil.list_tree(fs, checkpoint_path, retry=retry)
    files: dict[str, int] = {}
    for fi in entries:
        if fi.type == pafs.FileType.File:
            files[_fsutil.relative(checkpoint_path, fi.path)] = fi.size
    if not entries and not _fsutil.is_dir(fs, checkpoint_path, retry=retry):
        return Inspection("missing", None, files=files)
    if INTERNAL_METADATA not in files:
        return Inspection("absent", None, files=files)
    try:
        raw = _fsutil.read_bytes(fs, posixpath.join(checkpoint_path, INTERNAL_METADATA),
                                 retry=retry)
    except FileNotFoundError:  # deleted between the listing and the read
        return Inspection("absent", None, files=files)
    try:
        meta = _json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return Inspection("invalid", None, f"{INTERNAL_METADATA} is not valid JSON ({exc})",
                          INTERNAL_METADATA, files)
    bad = _validate_manifest(meta)
    if bad is not None:
        return Inspection("invalid", meta if isinstance(meta, dict) else None,
                          f"{INTERNAL_METADATA} {bad[0]}", bad[1] or INTERNAL_METADATA, files)
    listed = {rel: size for rel, size in files.items()
              if _is_checkpoint_data(rel) and rel != USER_METADATA}
    for e in meta["manifest"]:
        rel = e["path"]
        if rel not in listed:
            return Inspection("invalid", meta, f"file {rel!r} listed in the manifest is missing",
                              rel, files)
        if listed[rel] != e["size"]:
            return Inspection(
                "invalid", meta,
                f"file {rel!r} has {listed[rel]} bytes, the manifest says {e['size']}", rel, files,
            )
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
        path = posixpath.join(checkpoint_path, e["path"])

        def _read() -> tuple[int, str]:
            crc, size = 0, 0
            with fs.open_input_stream(path) as f:
                while True:
                    buf = f.read(chunk_size)
                    if not buf:
                        break
                    crc = google_crc32c.extend(crc, buf)
                    size += len(buf)
            return size, _crc_hex(crc)

        try:
            return _retry.call(_read, policy=retry, what=f"read {path}")
        except FileNotFoundError:
            return None

    workers = max(1, min(concurrency, len(entries)))
    if workers == 1:
        results = [one(e) for e in entries]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="cs-verify") as pool:
            results = list(pool.map(one, entries))
    for e, got in zip(entries, results, strict=True):
        rel = e["path"]
        if got is None:
            raise CheckpointCorruptError(
                f"checkpoint {checkpoint_path!r} is missing file {rel!r} listed in its manifest",
                path=checkpoint_path, file=rel,
            )
        if got != (e["size"], e["crc32c"]):
            raise CheckpointCorruptError(
                f"file {rel!r} of checkpoint {checkpoint_path!r} does not match its manifest "
                f"(size {got[0]} vs {e['size']}, crc32c {got[1]} vs {e['crc32c']}); the "
                "checkpoint is corrupt: resume from an earlier one",
                path=checkpoint_path, file=rel,
            )


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
        path = posixpath.join(root, rel)

        def _read() -> dict[str, Any]:
            crc, size = 0, 0
            with fs.open_input_stream(path) as f:
                while True:
                    buf = f.read(caps.chunk_size)
                    if not buf:
                        break
                    crc = google_crc32c.extend(crc, buf)
                    size += len(buf)
            return {"path": rel, "size": size, "crc32c": _crc_hex(crc)}

        return _retry.call(_read, policy=retry, what=f"read {path}")

    workers = max(1, min(caps.concurrency, len(rels)))
    if workers == 1:
        return [one(r) for r in rels]
    with ThreadPoolExecutor(workers, thread_name_prefix="cs-manifest") as pool:
        return list(pool.map(one, rels))


# -- writers and runs -----------------------------------------------------------

_RUN_SAFE = re.compile(r"[^A-Za-z0-9_]")
RUN_ID_ENV = ("CHECKPOINT_STORE_RUN_ID", "TORCHELASTIC_RUN_ID")
_PROCESS_RUN_ID = f"p{uuid.uuid4().hex[:12]}"


def sanitize_run_id(run_id: str) -> str:
    """``run_id`` with anything but letters, digits and ``_`` replaced by ``_``
    (so names built from it split unambiguously on ``-`` and ``.``)."""
    return _RUN_SAFE.sub("_", str(run_id))[:64] or "_"


def default_run_id() -> tuple[str, bool]:
    """``(run id, shared)``: the launcher's run id (``CHECKPOINT_STORE_RUN_ID``,
    then torchrun's ``TORCHELASTIC_RUN_ID`` + restart count) with shared=True,
    else one id for this process with shared=False."""
    value = os.environ.get("CHECKPOINT_STORE_RUN_ID")
    if value:
        return sanitize_run_id(value), True
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    if value and value.lower() != "none":
        # Same rendezvous id on every restart of an elastic job; the restart
        # count tells attempts apart, so a new attempt cleans the old one's leftovers.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return sanitize_run_id(f"{value}_r{restart}"), True
    return _PROCESS_RUN_ID, False


def new_writer_id(run_id: str | None = None) -> str:
    """A unique id for one writer: ``<run>.<pid>.<random>``. The run part lets
    cleanup leave alone whatever another rank of the same run may be writing."""
    run = sanitize_run_id(run_id) if run_id else default_run_id()[0]
    return f"{run}.{os.getpid()}.{uuid.uuid4().hex[:10]}"


def run_of_writer(writer: str) -> str:
    """The run id part of a writer id (the whole string for ids without dots)."""
    return writer.split(".", 1)[0]


# -- commit -----------------------------------------------------------------------

_thread_locks: dict[tuple[int, str], threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def _commit_lock(fs: pafs.FileSystem, parent: str) -> Iterator[None]:
    """Serialise the check-then-rename of commits into ``parent``: across
    threads always, across processes with a file lock when ``parent`` is on
    the local disk."""
    key = (id(fs), parent)
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(key, threading.Lock())
    with tlock:
        parent_os = _fsutil.local_path(fs, parent)
        if parent_os is None:
            yield
            return
        with filelock.FileLock(os.path.join(parent_os, f"{INTERNAL_PREFIX}commit.lock")):
            yield


def _is_ours(insp: Inspection) -> bool:
    """An uncommitted directory this tool's writers left: empty, or holding one
    of our ``.cs_*`` files (claims, rank markers, delete tombstones)."""
    if insp.state not in ("absent", "missing"):
        return False
    files = insp.files or {}
    return not files or any(rel.split("/")[-1].startswith(INTERNAL_PREFIX) for rel in files)


def _conflict(dest: Backend, dest_dir: str, by_other: bool) -> CheckpointConflictError:
    who = "by another writer" if by_other else "already"
    return CheckpointConflictError(
        f"{dest.uri_for(dest_dir)} was committed {who} (it holds a commit marker); its "
        "contents were left untouched. Report the checkpoint under the next index, or delete "
        "that one first."
    )


def commit_checkpoint(
    src_fs: pafs.FileSystem | None,
    src_dir: str | None,
    dest: Backend,
    dest_dir: str,
    internal: dict[str, Any],
    *,
    fsync: bool = True,
    writer_id: str | None = None,
    retry: RetryPolicy | None = None,
    claim_timeout: float = 120.0,
    confine_links: bool = False,
    write: WriteContents | None = None,
    previous: Any = None,
) -> dict[str, Any]:
    """Upload ``src_dir`` as the committed checkpoint ``dest_dir``.

    The protocol follows ``dest.capabilities.atomic_rename`` (docs/format.md,
    "Commit protocol"): stage and rename where directories rename
    atomically, else data first and ``.internal_metadata.json`` last behind a
    claim that makes concurrent writers of the same directory take turns.

    Args:
        src_fs, src_dir: where the user's files are. Our internal files found
            there (say, from a downloaded checkpoint reported again) are skipped.
            None with ``write``.
        dest, dest_dir: the destination backend and the final directory path.
        internal: fields of ``.internal_metadata.json`` (index, metrics, ...);
            ``format_version``, ``created_at`` and ``manifest`` are filled in.
        fsync: on local disks, fsync data and directories before the commit.
        writer_id: this writer's id (default :func:`new_writer_id`).
        retry: retry policy for every storage call (default from environment).
        claim_timeout: seconds to wait for another writer of the same
            directory (marker-last stores) before giving up.
        confine_links: refuse a symlink in a local ``src_dir`` that leads out
            of it (set when the source is itself a checkpoint); by default
            a linked file's bytes are uploaded.
        write: instead of copying ``src_dir`` (then None), a function
            ``write(filesystem, directory)`` that writes the data files into
            ``directory`` and returns their :class:`ManifestEntry` list; the
            protocol around it is the same. It may be called again when a
            retry rebuilds the filesystem. Used to stream a state straight to
            storage without a local copy.
        previous: a :class:`checkpoint_store._plan.Previous` (the last
            committed checkpoint of the trial): files equal to its files are
            copied inside the store (marker-last stores, local source only).

    Returns:
        The internal metadata as written.

    Raises:
        CheckpointConflictError: ``dest_dir`` is already committed (by an
            earlier or a concurrent writer), or is a directory that is not ours
            (copied in by hand: adopt or remove it); nothing of it was changed.
        CheckpointNotFoundError: ``src_dir`` does not exist.
        UnsafePathError: a source file's name or link cannot be committed as
            it is (see :func:`source_files`); checked before the first write,
            so nothing was written.
        TransientBackendError, PermanentBackendError: storage failed; nothing
            was committed and earlier checkpoints are untouched.
    """
    writer_id = writer_id or new_writer_id()
    files: list[tuple[str, int]] = []
    if write is None:
        assert src_fs is not None and src_dir is not None
        files = source_files(src_fs, src_dir, include=_is_checkpoint_data,
                             confine_links=confine_links, retry=retry)
    if dest.capabilities.atomic_rename:
        if inspect_checkpoint(dest.filesystem, dest_dir, retry=retry).state == "committed":
            raise _conflict(dest, dest_dir, by_other=False)
        return _commit_by_rename(src_fs, src_dir, files, dest, dest_dir, internal, fsync,
                                 writer_id, retry, write)
    return _commit_marker_last(src_fs, src_dir, files, dest, dest_dir, internal, fsync,
                               writer_id, retry, claim_timeout, write, previous)


def _commit_by_rename(
    src_fs: pafs.FileSystem,
    src_dir: str,
    files: list[tuple[str, int]],
    dest: Backend,
    dest_dir: str,
    internal: dict[str, Any],
    fsync: bool,
    writer_id: str,
    retry: RetryPolicy | None,
    write: WriteContents | None = None,
) -> dict[str, Any]:
    fs, caps = dest.filesystem, dest.capabilities
    parent, name = posixpath.split(dest_dir)
    staging = posixpath.join(parent, bounded_name(f"{INTERNAL_PREFIX}staging-", name,
                                                  f"-{writer_id}"))
    try:
        meta = _write_contents(src_fs, src_dir, files, dest, staging, internal, fsync,
                               retry=retry, write=write)
        with _commit_lock(fs, parent):
            now = inspect_checkpoint(fs, dest_dir, retry=retry)
            if now.state == "committed":
                raise _conflict(dest, dest_dir, by_other=True)
            if now.state != "missing":
                if not _is_ours(now):
                    raise CheckpointConflictError(
                        f"{dest.uri_for(dest_dir)} exists and is not a checkpoint of this "
                        f"tool ({now.reason or 'no internal metadata'}); adopt it, move it "
                        "away, or commit under another index"
                    )
                # Our own uncommitted leftover: rename it away (atomic), then drop it.
                trash = posixpath.join(parent, bounded_name(f"{INTERNAL_PREFIX}deleting-", name,
                                                            f"-{writer_id}"))
                _fsutil.move(fs, dest_dir, trash, retry=retry)
                _fsutil.delete_dir(fs, trash, retry=retry)
            _fsutil.move(fs, staging, dest_dir, retry=retry)
            if fsync and caps.needs_fsync:
                parent_os = _fsutil.local_path(fs, parent)
                if parent_os is not None:
                    _fsutil.fsync_dir(parent_os)
        return meta
    except Exception:
        _cleanup_quietly(lambda: _fsutil.delete_dir(fs, staging, retry=retry))
        raise


def _cleanup_quietly(fn: Callable[[], None]) -> None:
    # Cleanup after a failure must not hide the failure; what it cannot
    # remove, StorageContext.remove_uncommitted() removes later.
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not clean up after a failed commit: %s", exc)


def _claims(fs: pafs.FileSystem, dest_dir: str, retry: RetryPolicy | None) -> list[str]:
    names = [posixpath.basename(fi.path) for fi in _fsutil.list_dir(fs, dest_dir, retry=retry)]
    return sorted(n for n in names if n.startswith(_CLAIM_PREFIX))


#: A claim older than this (seconds) is a dead writer's: ignored by other writers.
CLAIM_STALE_S = 3600.0


def _claim_time(name: str) -> float:
    try:
        return int(name[len(_CLAIM_PREFIX):].split("-", 1)[0]) / 1e9
    except ValueError:
        return 0.0


def _claim_age(listed: Mapping[str, pafs.FileInfo], claim: str, mine: str) -> float:
    """Seconds since ``claim`` was written, on the storage's clock: our own claim,
    written a moment ago, stamps the store's "now". Only a store without
    modification times falls back to the time in the claim's name against
    the local clock (:mod:`checkpoint_store._clock`)."""
    theirs = _clock.mtime_of(listed[claim])
    now = _clock.mtime_of(listed[mine]) if mine in listed else None
    if theirs is not None and now is not None:
        return now - theirs
    return _clock.local_time() - _claim_time(claim)


def _commit_marker_last(
    src_fs: pafs.FileSystem,
    src_dir: str,
    files: list[tuple[str, int]],
    dest: Backend,
    dest_dir: str,
    internal: dict[str, Any],
    fsync: bool,
    writer_id: str,
    retry: RetryPolicy | None,
    claim_timeout: float,
    write: WriteContents | None = None,
    previous: Any = None,
) -> dict[str, Any]:
    """Marker-last commit behind a claim (mutual exclusion without conditional writes).

    Each writer PUTs its own claim object, then lists the directory, and
    writes only if its claim is the only live one. With read-after-write
    consistent listings (S3, GCS, Azure, memory) two writers can never both
    see themselves alone: whoever lists second sees the other's claim. A
    writer that is not alone withdraws its claim, backs off with jitter and
    tries again, until the marker appears (conflict) or ``claim_timeout``.
    Claims older than :data:`CLAIM_STALE_S` belong to dead writers and are
    ignored. A commit costs: one PUT and one listing for the claim, one PUT
    per file, one PUT for the marker, one DELETE for the claim.
    """
    fs, caps = dest.filesystem, dest.capabilities
    deadline = time.monotonic() + claim_timeout
    rng = random.Random()
    delay = 0.01
    while True:
        mine = f"{_CLAIM_PREFIX}{time.time_ns():020d}-{writer_id}"
        claim_path = posixpath.join(dest_dir, mine)
        # The claim goes first: a crash from here on leaves a directory that
        # cleanup recognises as ours. Never empty: some S3-compatible stores
        # reject zero-byte objects.
        _fsutil.write_bytes(fs, claim_path, writer_id.encode(), caps, fsync=False, retry=retry)
        listed = {_fsutil.relative(dest_dir, fi.path): fi
                  for fi in _fsutil.list_tree(fs, dest_dir, retry=retry)
                  if fi.type == pafs.FileType.File}
        traces = [rel for rel in listed
                  if rel != mine and rel.split("/")[-1].startswith(INTERNAL_PREFIX)]
        foreign = not traces and any(_is_checkpoint_data(rel) for rel in listed)
        if INTERNAL_METADATA in listed or foreign:
            _cleanup_quietly(lambda p=claim_path: _fsutil.delete_file(fs, p, retry=retry))
            if INTERNAL_METADATA in listed:
                raise _conflict(dest, dest_dir, by_other=False)
            raise CheckpointConflictError(
                f"{dest.uri_for(dest_dir)} exists and is not a checkpoint of this tool (files "
                "without internal metadata); adopt it, move it away, or commit under another "
                "index"
            )
        claims = [rel for rel in listed if rel.startswith(_CLAIM_PREFIX) and "/" not in rel]
        # Our own claims from an attempt cut short (same writer id) do not count.
        others = [c for c in claims if not c.endswith(f"-{writer_id}")
                  and _claim_age(listed, c, mine) < CLAIM_STALE_S]
        if not others:
            break
        _fsutil.delete_file(fs, claim_path, retry=retry)
        if time.monotonic() > deadline:
            raise CheckpointConflictError(
                f"another writer ({others[0]}) has been committing {dest.uri_for(dest_dir)} "
                f"for more than {claim_timeout:.0f}s; retry later or commit another index"
            )
        time.sleep(delay * (0.5 + rng.random()))
        delay = min(delay * 2, 0.5)

    try:
        # Alone, and the listing after our claim showed no marker: nobody can
        # commit this directory before we do. Data a dead writer (or an earlier
        # attempt of ours) left would not match our manifest.
        for rel in sorted(listed):
            if rel != mine and not rel.split("/")[-1].startswith(_CLAIM_PREFIX):
                _fsutil.delete_file(fs, posixpath.join(dest_dir, rel), retry=retry)
        meta = _write_contents(src_fs, src_dir, files, dest, dest_dir, internal, fsync,
                               retry=retry, write=write, previous=previous)
    except Exception:
        def _undo() -> None:
            # Data first, claim last: until the claim goes, the leftovers stay
            # recognisable as ours.
            for rel in sorted(inspect_checkpoint(fs, dest_dir, retry=retry).files or {}):
                if not rel.split("/")[-1].startswith(_CLAIM_PREFIX):
                    _fsutil.delete_file(fs, posixpath.join(dest_dir, rel), retry=retry)
            _fsutil.delete_file(fs, claim_path, retry=retry)
        _cleanup_quietly(_undo)
        raise

    def _release() -> None:
        for c in [claim_path] + [posixpath.join(dest_dir, c) for c in claims if c != mine
                                 and c.endswith(f"-{writer_id}")]:
            _fsutil.delete_file(fs, c, retry=retry)

    _cleanup_quietly(_release)
    return meta


def _write_contents(
    src_fs: pafs.FileSystem,
    src_dir: str,
    files: list[tuple[str, int]],
    dest: Backend,
    target: str,
    internal: dict[str, Any],
    fsync: bool,
    *,
    retry: RetryPolicy | None = None,
    before_marker: Callable[[], None] | None = None,
    write: WriteContents | None = None,
    previous: Any = None,
) -> dict[str, Any]:
    """Copy (or ``write``) the data files into ``target``, then write the marker last."""
    if write is not None:
        _fsutil.ensure_dir(dest.filesystem, target, dest.capabilities, retry=retry)
        entries = sorted(write(dest.filesystem, target), key=lambda e: e.path)
    else:
        entries = copy_tree(
            src_fs, src_dir, dest.filesystem, target, dest.capabilities,
            files=files, fsync=fsync, retry=retry, previous=previous,
        )
    meta = dict(internal)
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("created_at", time.time())
    meta["manifest"] = [e.to_json() for e in entries if e.path != USER_METADATA]
    if before_marker is not None:
        before_marker()
    _fsutil.write_bytes(
        dest.filesystem,
        posixpath.join(target, INTERNAL_METADATA),
        _json.dumps(meta),
        dest.capabilities,
        fsync=fsync,
        retry=retry,
    )
    return meta


# -- in place -----------------------------------------------------------------------

#: torch.distributed.checkpoint's own commit marker: its coordinator writes it
#: after every rank's data files (``*.distcp``) are written.
DCP_METADATA = ".metadata"


def claim_in_place(
    dest: Backend, dest_dir: str, writer_id: str, *, retry: RetryPolicy | None = None
) -> None:
    """Create ``dest_dir`` for a writer that fills it in place, with a claim
    ``.cs_claim-<ns>-<writer_id>`` in it.

    The claim tells cleanup the directory is ours and, while its run is
    current, still being written (:meth:`StorageContext.scan`); a crash before
    :func:`commit_in_place` leaves a directory that a later run removes.
    """
    fs, caps = dest.filesystem, dest.capabilities
    _fsutil.ensure_dir(fs, dest_dir, caps, retry=retry)
    name = f"{_CLAIM_PREFIX}{time.time_ns():020d}-{writer_id}"
    _fsutil.write_bytes(fs, posixpath.join(dest_dir, name), writer_id.encode(), caps,
                        fsync=False, retry=retry)


def commit_in_place(
    dest: Backend,
    dest_dir: str,
    internal: dict[str, Any],
    *,
    fsync: bool = True,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """Commit the files already written into ``dest_dir``; no byte is copied.

    The manifest lists every user file found there (one recursive listing).
    A file's CRC32C comes from a ``.cs_written-*.json`` record when our
    writer computed it while writing and the listed size matches; any other
    file is read once. On local disks files and directories are fsynced, then
    ``.internal_metadata.json`` goes last (the marker-last protocol, also
    where directories rename atomically: the directory already has its final
    name). Claims and written records are removed afterwards.

    A torch.distributed.checkpoint save that did not finish (``*.distcp``
    files without DCP's ``.metadata``) is refused: DCP writes ``.metadata``
    last, so without it the save failed on some rank.

    Returns:
        The internal metadata as written.

    Raises:
        CheckpointNotFoundError: ``dest_dir`` is missing or holds no user file.
        CheckpointCorruptError: an unfinished DCP save; nothing is written.
        CheckpointConflictError: ``dest_dir`` is already committed, or holds a
            marker this version cannot read; nothing is changed.
    """
    fs, caps = dest.filesystem, dest.capabilities
    insp = inspect_checkpoint(fs, dest_dir, retry=retry)
    if insp.state == "committed":
        raise _conflict(dest, dest_dir, by_other=False)
    if insp.state == "invalid":
        raise CheckpointConflictError(
            f"{dest.uri_for(dest_dir)} holds a commit marker this version cannot use "
            f"({insp.reason}); commit under another index"
        )
    listed = insp.files or {}
    data = {rel: size for rel, size in listed.items() if _is_checkpoint_data(rel)}
    if not data:
        raise CheckpointNotFoundError(
            f"{dest.uri_for(dest_dir)} holds no files to commit; write the checkpoint there "
            "(e.g. dcp.save(state, checkpoint_id=session.next_checkpoint_dir())) first"
        )
    if DCP_METADATA not in data and any(rel.endswith(".distcp") for rel in data):
        raise CheckpointCorruptError(
            f"{dest.uri_for(dest_dir)} holds torch.distributed.checkpoint data files but no "
            f"{DCP_METADATA}: that dcp.save did not finish, so it is not committed. Save "
            "again into the same directory, or resume from the previous checkpoint",
            path=dest_dir, file=DCP_METADATA,
        )
    known = _written_records(fs, dest_dir, listed, retry)
    entries = [{"path": rel, "size": size, "crc32c": known[rel][1]}
               for rel, size in data.items() if rel in known and known[rel][0] == size]
    trusted = {e["path"] for e in entries}
    entries += compute_manifest(fs, dest_dir, [r for r in data if r not in trusted], caps,
                                retry=retry)
    if fsync and caps.needs_fsync:
        _fsync_tree(fs, dest_dir, data)
    meta = dict(internal)
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("created_at", time.time())
    meta["manifest"] = sorted((e for e in entries if e["path"] != USER_METADATA),
                              key=lambda e: e["path"])
    _fsutil.write_bytes(fs, posixpath.join(dest_dir, INTERNAL_METADATA), _json.dumps(meta), caps,
                        fsync=fsync, retry=retry)

    def _release() -> None:
        for rel in listed:
            name = rel.rsplit("/", 1)[-1]
            if name.startswith(_CLAIM_PREFIX) or is_written_record(name):
                _fsutil.delete_file(fs, posixpath.join(dest_dir, rel), retry=retry)

    _cleanup_quietly(_release)
    return meta


def _written_records(
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


def _fsync_tree(fs: pafs.FileSystem, root: str, files: Iterable[str]) -> None:
    """fsync each file and each directory under ``root`` (local disks only):
    a writer in place may not have, and the marker must not outlive its data."""
    root_os = _fsutil.local_path(fs, root)
    if root_os is None:
        return
    dirs = {""}
    for rel in files:
        fd = os.open(os.path.join(root_os, rel), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(posixpath.dirname(rel))
    for d in sorted(dirs):
        _fsutil.fsync_dir(os.path.join(root_os, d))


# -- delete -----------------------------------------------------------------------


def delete_checkpoint_dir(
    dest: Backend, path: str, *, writer_id: str | None = None, retry: RetryPolicy | None = None
) -> None:
    """Delete a checkpoint directory: the commit in reverse. Absent is fine.

    Where directories rename atomically, the directory is first renamed to
    ``.cs_deleting-<name>-<writer>`` (it stops being listed in one step),
    then removed. Elsewhere a ``.cs_deleting`` tombstone is written, the
    marker removed, then the rest (one batched delete on object stores): a
    delete cut short leaves a directory that is not a checkpoint and that
    cleanup knows is ours.
    """
    fs = dest.filesystem
    parent, name = posixpath.split(path.rstrip("/"))
    if dest.capabilities.atomic_rename:
        trash = posixpath.join(parent, bounded_name(
            f"{INTERNAL_PREFIX}deleting-", name, f"-{writer_id or new_writer_id()}"))
        try:
            _fsutil.move(fs, path, trash, retry=retry)
        except FileNotFoundError:
            return
        except OSError:
            if not _fsutil.exists(fs, path, retry=retry):
                return
            raise
        _fsutil.delete_dir(fs, trash, retry=retry)
        return
    files = {_fsutil.relative(path, fi.path) for fi in _fsutil.list_tree(fs, path, retry=retry)
             if fi.type == pafs.FileType.File}
    if files:
        if INTERNAL_METADATA in files:
            _fsutil.write_bytes(fs, posixpath.join(path, DELETE_TOMBSTONE), b"deleting\n",
                                dest.capabilities, fsync=False, retry=retry)
            _fsutil.delete_file(fs, posixpath.join(path, INTERNAL_METADATA), retry=retry)
        elif DELETE_TOMBSTONE not in files and not any(
            rel.split("/")[-1].startswith(INTERNAL_PREFIX) for rel in files
        ):
            # Not committed and no trace of ours: somebody else's files. Callers
            # only delete checkpoints; refuse rather than guess.
            raise CheckpointConflictError(
                f"{dest.uri_for(path)} is not a checkpoint of this tool; not deleting it"
            )
    _fsutil.delete_dir(fs, path, retry=retry)


# -- download ---------------------------------------------------------------------


def download_tree(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    caps: Capabilities,
    local_dir: str,
    *,
    manifest: Iterable[dict[str, Any]] | None,
    verify: bool = True,
    retry: RetryPolicy | None = None,
) -> list[str]:
    """Copy a checkpoint's user files (and ``.user_metadata.json``) into ``local_dir``.

    Files are only ever written under ``local_dir``: a source entry or a
    manifest entry with ``..``, an absolute path, or a symlink leading out of
    the checkpoint (local sources) or out of ``local_dir`` is refused before
    any byte is copied.

    Returns:
        The relative paths written, sorted.

    Raises:
        UnsafePathError: an unsafe entry (names it); nothing was written.
        CheckpointCorruptError: ``verify`` and a file's size or CRC32C differs
            from ``manifest``, or a manifest file is missing. Files already
            written are left for the caller to remove.
    """
    manifest = list(manifest) if manifest is not None else None
    for e in manifest or ():
        why = check_relpath(e.get("path"))
        if why is not None:
            raise UnsafePathError(
                f"checkpoint {checkpoint_path!r} lists {e.get('path')!r}, which {why}; refusing "
                "to download it", path=checkpoint_path, file=str(e.get("path")),
            )
    local = pafs.LocalFileSystem()
    local_caps = Capabilities(directories=True, chunk_size=caps.chunk_size,
                              concurrency=caps.concurrency, memory_budget=caps.memory_budget)
    root = os.path.abspath(local_dir)
    # Listed (and every name checked) before the target is touched.
    files = source_files(fs, checkpoint_path, include=_is_checkpoint_data, confine_links=True,
                         retry=retry)
    os.makedirs(root, exist_ok=True)
    real_root = os.path.realpath(root)
    for rel, _ in files:
        if not _inside(os.path.realpath(os.path.dirname(os.path.join(root, rel))), real_root):
            raise UnsafePathError(
                f"writing {rel!r} would leave the target directory {root!r} through a symlink "
                "there; refusing", path=checkpoint_path, file=rel,
            )
    got = copy_tree(fs, checkpoint_path, local, root, local_caps, files=files, fsync=False,
                    retry=retry)
    written = sorted(e.path for e in got)
    if not verify or manifest is None:
        return written
    have = {e.path: e for e in got}
    for want in manifest:
        rel = want["path"]
        e = have.get(rel)
        if e is None:
            raise CheckpointCorruptError(
                f"checkpoint {checkpoint_path!r} is missing file {rel!r} listed in its manifest",
                path=checkpoint_path, file=rel,
            )
        if e.size != want["size"] or e.crc32c != want["crc32c"]:
            raise CheckpointCorruptError(
                f"file {rel!r} of checkpoint {checkpoint_path!r} does not match its manifest "
                f"(size {e.size} vs {want['size']}, crc32c {e.crc32c} vs {want['crc32c']}); the "
                "checkpoint is corrupt: resume from an earlier one",
                path=checkpoint_path, file=rel,
            )
    return written
