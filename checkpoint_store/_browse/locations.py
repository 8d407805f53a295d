"""What a location argument points at, and the walks from it to trials and checkpoints.

A command's URI is resolved once (:func:`resolve_location`) and classified
(:func:`classify`) as one :data:`LocationKind`: a storage root (it holds
experiments), an experiment (it holds trials), a trial (it holds
``checkpoint_NNNNNN/``), a checkpoint, or one of the things a command refuses
with a reason (a corrupt or uncommitted checkpoint, an empty directory, a
file). The web page (:mod:`checkpoint_store.ui`) classifies with the same
functions, so both agree on what a location is.

Committed means what the library says: a valid commit marker whose manifest
matches the files (:func:`checkpoint_store._util.inspect.inspect_checkpoint`), read
in the recorded index order (:meth:`StorageContext.committed_checkpoints`).
"""

from __future__ import annotations

import dataclasses
import posixpath
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    MANAGER_STATE,
    POINTER_FILE,
    RESULT_SEGMENTS_DIR,
    TIER_STATE_FILE,
    TRIAL_FILES,
    checkpoint_dir_name,
    is_internal_name,
    is_local_tier_pointer_name,
    parse_checkpoint_dir_name,
    parse_staging_dir_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)

if TYPE_CHECKING:
    from checkpoint_store._util.inspect import Inspection
    from checkpoint_store.storage import StorageContext

__all__ = [
    "TRIAL_FILES",
    "Location",
    "LocationKind",
    "classify",
    "committed_checkpoints",
    "describe_kind",
    "follow",
    "inspect_location",
    "list_entries",
    "looks_like_trial",
    "manifest_size",
    "not_committed",
    "read_internal",
    "Recorded",
    "recorded_checkpoints",
    "require_checkpoint",
    "require_trial",
    "resolve_location",
    "storage_context",
    "foreign_of",
    "link_fault",
    "not_walked_message",
    "trials_under",
]

#: What a location is, as :func:`classify` answers.
LocationKind = Literal[
    "root", "experiment", "trial", "checkpoint", "corrupt", "uncommitted", "empty", "file"
]


_KIND_LABELS: dict[LocationKind, str] = {
    "checkpoint": "a checkpoint", "corrupt": "a corrupt checkpoint",
    "uncommitted": "an uncommitted checkpoint directory", "trial": "a trial",
    "experiment": "an experiment", "root": "a storage root (it holds experiments)",
    "empty": "an empty directory", "file": "a file",
}


@dataclasses.dataclass(frozen=True)
class Location:
    """A path on one backend, as a command argument names it."""

    backend: Backend
    path: str
    #: The path the user names when ``path`` is the sibling a re-saved path's
    #: pointer names (:func:`follow`): ``uri`` and ``name`` show it, reads use ``path``.
    shown_as: str | None = None

    @property
    def fs(self) -> Any:
        """The backend's ``pyarrow.fs`` filesystem."""
        return self.backend.filesystem

    @property
    def uri(self) -> str:
        """The location as a URI a user can pass back to a command."""
        return self.backend.uri_for(self.shown_as or self.path)

    @property
    def name(self) -> str:
        """The last path component (of the path the user names)."""
        return posixpath.basename((self.shown_as or self.path).rstrip("/"))

    @property
    def parent(self) -> Location:
        """The directory holding this one, on the same backend."""
        return Location(self.backend, posixpath.dirname(self.path.rstrip("/")))

    def child(self, *names: str) -> Location:
        """``names`` joined under this location."""
        return Location(self.backend, posixpath.join(self.path, *names))


def _is_local(text: str) -> bool:
    from checkpoint_store.registry import split_scheme

    return split_scheme(text) in (None, "file", "local")


def resolve_location(
    text: str, options: Mapping[str, Any], *, options_if_remote: bool = False
) -> Location:
    """Resolve a path or URI with the backend ``options``.

    With ``options_if_remote`` the options are dropped for local paths (``cp``
    shares one ``-o`` set between its two sides).

    Raises:
        UnknownSchemeError, BackendUnavailableError, InvalidConfigError: as
            :func:`checkpoint_store.registry.resolve`.
    """
    from checkpoint_store.registry import resolve

    opts = dict(options)
    if options_if_remote and _is_local(text):
        opts = {}
    backend, path = resolve(text, storage_options=opts or None)
    return follow(Location(backend, path))


def follow(loc: Location) -> Location:
    """``loc``, or, when it holds a pointer (``.cs_current``: a path saved
    again and again, Lightning's ``last.ckpt``), the sibling holding its
    checkpoint, shown under ``loc``'s name (:mod:`checkpoint_store._commit.pointer`).

    Raises:
        CheckpointCorruptError: a pointer naming no replacement of ``loc``.
    """
    from checkpoint_store._commit.pointer import pointed_path

    target = pointed_path(loc.fs, loc.path)
    return loc if target is None else Location(loc.backend, target, shown_as=loc.path)


def list_entries(loc: Location) -> list[tuple[str, bool]]:
    """``(name, is_dir)`` of the direct children, sorted by name; ``[]`` when absent."""
    out = []
    prefix = loc.path.rstrip("/") + "/"
    for fi in _fsutil.list_dir(loc.fs, loc.path):
        path = fi.path.rstrip("/")
        rel = path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)
        # Some fsspec stores answer a non-recursive listing with deeper entries too.
        if rel and "/" not in rel:
            out.append((rel, fi.type == _fsutil.pafs.FileType.Directory))
    return sorted(out)


def looks_like_trial(entries: Iterable[tuple[str, bool]], loc: Location | None = None) -> bool:
    """Whether a directory with these :func:`list_entries` is a trial: it holds a
    trial file, ``result.json`` segments, a checkpoint being written or a
    ``checkpoint_NNNNNN`` directory;
    a local tier's pointer (:func:`is_local_tier_pointer_name`) or state file
    (a local tier's own trial directory);
    given its ``loc``, also one holding a directory with a commit marker under
    any other name (Ray Train names the checkpoints ``CommitCallback`` commits)."""
    entries = list(entries)
    for name, is_dir in entries:
        if name in TRIAL_FILES or parse_staging_dir_name(name) is not None:
            return True
        if is_dir and name == RESULT_SEGMENTS_DIR:  # a run that died before result.json
            return True
        if not is_dir and is_local_tier_pointer_name(name):
            return True  # a run with a local tier, its first durable copy pending
        if not is_dir and name == TIER_STATE_FILE:
            return True  # a local tier's own trial directory, none committed yet
        if is_dir and parse_checkpoint_dir_name(name) is not None:
            return True
    return loc is not None and any(True for _ in _otherwise_named(loc, entries))


def _otherwise_named(loc: Location, entries: Iterable[tuple[str, bool]]) -> Iterable[str]:
    """Names of the child directories of ``loc`` holding a commit marker although
    not named ``checkpoint_NNNNNN``: the marker, not the name, makes a checkpoint.
    A directory holding a pointer (:func:`follow`) counts too."""
    for name, is_dir in entries:
        if is_dir and not is_internal_name(name) \
                and parse_checkpoint_dir_name(name) is None \
                and any(_fsutil.exists(loc.fs, posixpath.join(loc.path, name, f))
                        for f in (INTERNAL_METADATA, POINTER_FILE)):
            yield name


def copy_of(name: str, meta: Mapping[str, Any], names: Iterable[str]) -> str | None:
    """Why the committed directory ``name`` of a trial, named otherwise than
    ``checkpoint_NNNNNN``, is a copy (``cp -r checkpoint_000001 backup``): its
    marker records the index of a ``checkpoint_NNNNNN`` entry among the
    trial's entry ``names``; None when it is not. A checkpoint's identity is
    its directory name (docs/format.md), so the copy is invalid for every
    reader: never ranked beside the original, nor deleted in its place."""
    index = meta.get("index")
    if parse_checkpoint_dir_name(name) is not None or isinstance(index, bool) \
            or not isinstance(index, int) or index < 0:
        return None
    original = checkpoint_dir_name(index)
    if original not in set(names):
        return None
    return f"a copy of {original}: its marker records index {index}, which is {original}'s"


def read_internal(loc: Location) -> dict[str, Any] | None:
    """The checkpoint's internal metadata when its commit marker is valid, else None."""
    from checkpoint_store._util.inspect import read_internal_metadata

    return read_internal_metadata(loc.fs, loc.path)


def inspect_location(loc: Location) -> Inspection:
    """What the would-be checkpoint directory ``loc`` is (committed, invalid,
    absent, missing): :func:`checkpoint_store._util.inspect.inspect_checkpoint`."""
    from checkpoint_store._util.inspect import inspect_checkpoint

    return inspect_checkpoint(loc.fs, loc.path)


def _might_be_checkpoint(loc: Location) -> bool:
    # Cheap test first: inspecting lists the whole tree under loc.
    return parse_checkpoint_dir_name(loc.name) is not None or _fsutil.exists(
        loc.fs, posixpath.join(loc.path, INTERNAL_METADATA))


def _checkpoint_kind(loc: Location) -> LocationKind | None:
    """The kind of a location that carries a checkpoint's name or marker; None
    when it is a plain directory after all."""
    state = inspect_location(loc).state
    if state == "committed":
        return "checkpoint"
    if state == "invalid":
        return "corrupt"
    if state == "missing":
        raise CheckpointNotFoundError(_missing(loc))
    if parse_checkpoint_dir_name(loc.name) is not None:
        return "uncommitted"
    return None


def _missing(loc: Location) -> str:
    """Why nothing is at ``loc``: a pointer followed to a sibling that is gone
    (a removal cut short after the sibling went) is named as such."""
    if loc.shown_as is None:
        bucket = _fsutil.missing_bucket(loc.fs, loc.path, loc.backend.scheme)
        if bucket is not None:
            return _fsutil.missing_bucket_message(loc.backend.scheme, bucket, loc.uri)
        return f"nothing exists at {loc.uri}"
    return (f"{loc.uri} holds a pointer to {posixpath.basename(loc.path)}, which is gone "
            "(a removal of this checkpoint cut short): it holds no checkpoint; "
            "delete the directory")


def classify(loc: Location) -> LocationKind:
    """What ``loc`` is: checkpoint, corrupt (a checkpoint failing its manifest),
    uncommitted, trial, experiment, root, empty or file.

    Raises:
        CheckpointNotFoundError: nothing exists at ``loc``.
    """
    if _might_be_checkpoint(loc):
        kind = _checkpoint_kind(loc)
        if kind is not None:
            return kind
    if _fsutil.is_file(loc.fs, posixpath.join(loc.path, MANAGER_STATE)):
        # Only a trial holds a retention state: one stat instead of listing a
        # trial of any size.
        return "trial"
    try:
        entries = list_entries(loc)
    except OSError:
        # Listing a file fails as a storage error on some backends (local
        # disks: "Not a directory", with a hint at credentials).
        if _fsutil.kind(loc.fs, loc.path) == _fsutil.pafs.FileType.File:
            return "file"
        raise
    if not entries:
        found = _fsutil.kind(loc.fs, loc.path)
        if found == _fsutil.pafs.FileType.NotFound:
            raise CheckpointNotFoundError(_missing(loc))
        if found == _fsutil.pafs.FileType.File:
            return "file"
        return "empty"
    if looks_like_trial(entries, loc):
        return "trial"
    for name, is_dir in entries:
        if is_dir and looks_like_trial(list_entries(loc.child(name)), loc.child(name)):
            return "experiment"
    return "root"


def describe_kind(kind: LocationKind) -> str:
    """``kind`` as a phrase for messages (``"a trial"``, ``"an empty directory"``)."""
    return _KIND_LABELS.get(kind, kind)


def not_committed(
    trial: Location, committed: Iterable[str],
    entries: list[tuple[str, bool]] | None = None,
) -> tuple[list[tuple[str, Inspection]], list[str]]:
    """Checkpoint directories of ``trial`` that are not committed:
    ``([(name, inspection) of corrupt ones], [names of uncommitted ones])``;
    ``entries`` is a listing of the trial already made (:func:`list_entries`
    form; committed checkpoint directories may be left out of it)."""
    from checkpoint_store._util.inspect import Inspection

    done = set(committed)
    corrupt: list[tuple[str, Inspection]] = []
    uncommitted: list[str] = []
    entries = list_entries(trial) if entries is None else entries
    names = done | {n for n, _ in entries}
    for name, is_dir in entries:
        if not is_dir and name not in done and parse_checkpoint_dir_name(name) is not None:
            # A file in a checkpoint's place: nothing there can be read, and
            # numbering continues past it (docs/format.md).
            corrupt.append((name, Inspection("invalid", None,
                                             "is a file, not a checkpoint directory")))
            continue
        if not is_dir or name in done:
            continue
        if parse_checkpoint_dir_name(name) is not None:
            found = inspect_location(trial.child(name))
            if found.state == "invalid":
                corrupt.append((name, found))
            elif found.state != "committed":
                uncommitted.append(name)
        elif (fault := _link_fault(trial.child(name))) is not None \
                and any(True for _ in _otherwise_named(trial, [(name, True)])):
            corrupt.append((name, fault))  # a checkpoint under another name, linked
        elif _marked_but_not_committed(trial.child(name)):
            # A checkpoint under another name (Lightning's ``a.ckpt``) that
            # fails its manifest: reported, never silently left out.
            corrupt.append((name, inspect_location(trial.child(name))))
        elif (copy := _copy_fault(trial, name, names)) is not None:
            corrupt.append((name, copy))
        elif (fault := _pointer_fault(trial.child(name))) is not None:
            corrupt.append((name, fault))
        elif parse_staging_dir_name(name) is not None:
            uncommitted.append(name)
    return corrupt, uncommitted


def _copy_fault(trial: Location, name: str, names: set[str]) -> Inspection | None:
    """An ``"invalid"`` inspection of the committed directory ``name`` of
    ``trial`` when it is a copy of a ``checkpoint_NNNNNN`` entry
    (:func:`copy_of`); None otherwise. Its marker is read only when such an
    entry is there at all (a Lightning directory holds none)."""
    from checkpoint_store._util.inspect import Inspection

    if parse_checkpoint_dir_name(name) is not None or not any(
            parse_checkpoint_dir_name(n) is not None for n in names):
        return None
    meta = read_internal(trial.child(name))
    why = copy_of(name, meta, names) if meta is not None else None
    return None if why is None else Inspection("invalid", meta, reason=why)


def _link_fault(loc: Location) -> Inspection | None:
    """An ``"invalid"`` inspection of ``loc`` when it is a symbolic link (local
    disks): a trial's entry is its own directory, never another one's. (A
    ``checkpoint_NNNNNN`` link is found by the inspection itself.)"""
    from checkpoint_store._util.inspect import Inspection

    why = link_fault(loc.fs, loc.path)
    return None if why is None else Inspection("invalid", None, reason=why)


def link_fault(fs: Any, path: str) -> str | None:
    """Why the trial entry at ``path`` is no checkpoint of its own when it is a
    symbolic link (local disks), else None: what it points at may lie outside
    the store, and is another entry's or nobody's."""
    target = _fsutil.link_target(fs, path)
    if target is None:
        return None
    return f"is a symbolic link (to {target!r}), not a checkpoint directory of its own"


def _pointer_fault(loc: Location) -> Inspection | None:
    """An ``"invalid"`` inspection of ``loc`` when its pointer (``.cs_current``)
    names no replacement of it: another tool or a hand edit wrote it."""
    from checkpoint_store._util.inspect import Inspection

    if not _fsutil.exists(loc.fs, posixpath.join(loc.path, POINTER_FILE)):
        return None
    try:
        follow(loc)
    except CheckpointCorruptError as exc:
        return Inspection("invalid", None, reason=str(exc), file=POINTER_FILE)
    return None


def _marked_but_not_committed(loc: Location) -> bool:
    """``loc`` carries the commit marker but does not pass its manifest."""
    if is_internal_name(loc.name) or not _fsutil.exists(
            loc.fs, posixpath.join(loc.path, INTERNAL_METADATA)):
        return False
    return inspect_location(loc).state == "invalid"


def trials_under(loc: Location, kind: LocationKind,
                 skipped: list[Location] | None = None) -> list[Location]:
    """Trial directories at or under ``loc`` (a trial, experiment or storage root
    of the given ``kind``); ``[]`` for any other kind.

    Args:
        skipped: when given, receives the directories the walk does not
            reach although they hold trials: in an experiment, a directory
            of trials beside the trials (a storage root holding one stray
            trial, or an experiment holding a stray ``params.json``, is read
            as an experiment by :func:`classify`). Finding them lists each
            directory of an experiment that is not a trial once more.

    Raises:
        InvalidConfigError: ``loc`` is a file.
    """
    if kind == "file":
        raise InvalidConfigError(f"{loc.uri} is a file, not a directory of checkpoints")
    if kind == "trial":
        return [loc]
    if kind == "experiment":
        return _trials_of(loc, list_entries(loc), skipped)
    if kind in ("root", "empty"):
        out: list[Location] = []
        for name, is_dir in list_entries(loc):
            # Dot-named experiments are walked too: session.start accepts them,
            # and a backup that skipped them would lose them silently.
            if is_dir and not is_internal_name(name):
                exp = loc.child(name)
                out.extend(_trials_of(exp, list_entries(exp), skipped))
        return out
    return []


def _trials_of(exp: Location, entries: list[tuple[str, bool]],
               skipped: list[Location] | None) -> list[Location]:
    """The trials among the ``entries`` of experiment ``exp``; see :func:`trials_under`."""
    out = []
    for name, is_dir in entries:
        if not is_dir:
            continue
        child = exp.child(name)
        below = list_entries(child)
        if looks_like_trial(below, child):
            out.append(child)
        elif skipped is not None and not is_internal_name(name) and any(
                d and not is_internal_name(n) and looks_like_trial(list_entries(child.child(n)))
                for n, d in below):
            skipped.append(child)
    return out


def foreign_of(trial: Location, checkpoints: Iterable[tuple[Location, Mapping[str, Any]]],
               recorded: Recorded | None = None) -> set[str]:
    """Names among the trial's ``checkpoints`` written by another run or trial:
    what the restore of ``recorded`` found, else
    :func:`~checkpoint_store.retention.recorded.foreign_names` over their
    metadata (a state that cannot be read names no run)."""
    from checkpoint_store.retention.recorded import (
        UnreadableStateError,
        foreign_names,
        recorded_run_id,
    )

    if recorded is not None:
        return set(recorded.foreign)
    try:
        run_id = recorded_run_id(trial)
    except UnreadableStateError:
        run_id = None
    return foreign_names([(c.name, m) for c, m in checkpoints], trial.name, run_id)


def not_walked_message(skipped: Iterable[Location], loc: Location, kind: LocationKind) -> str:
    """One line naming the directories a walk of ``loc`` did not reach (see
    :func:`trials_under`) and what to do."""
    names = ", ".join(s.uri for s in skipped)
    return (f"{loc.uri} was read as {describe_kind(kind)}, so these directories holding "
            f"trials at another depth were not walked: {names}; pass each as its own "
            "location, or move the stray trial (or trial file such as params.json) out")


@overload
def storage_context(trial: Location, *, strict: Literal[True] = True) -> StorageContext: ...


@overload
def storage_context(trial: Location, *, strict: bool) -> StorageContext | None: ...


def storage_context(trial: Location, *, strict: bool = True) -> StorageContext | None:
    """A :class:`StorageContext` for a trial path ``<storage>/<experiment>/<trial>``.

    Raises:
        InvalidConfigError: the path has no room for a storage root and an
            experiment above the trial; with ``strict=False`` None instead.
    """
    from checkpoint_store.storage import StorageContext

    parent, trial_name = posixpath.split(trial.path.rstrip("/"))
    root, experiment = posixpath.split(parent)
    try:
        return StorageContext.from_backend(trial.backend, root, experiment, trial_name)
    except InvalidConfigError:
        if not strict:
            return None
        raise InvalidConfigError(
            f"{trial.uri} is not a trial directory: a trial lives at "
            "<storage>/<experiment>/<trial>"
        ) from None


def committed_checkpoints(trial: Location) -> list[tuple[Location, dict[str, Any]]]:
    """Committed checkpoints of a trial with their internal metadata, oldest first.

    Same rule as ``StorageContext.committed_checkpoints``: a directory counts
    only with a valid ``.internal_metadata.json``; order is the recorded index
    (then the commit time). Directories named otherwise count too when their
    marker and manifest are valid (Ray Train's ``checkpoint_<time>`` ones).
    """
    entries = list_entries(trial)
    ctx = storage_context(trial, strict=False)
    out: list[tuple[Location, dict[str, Any]]] = []
    if ctx is not None:
        out = [(Location(trial.backend, c.path), meta) for c, meta in ctx.committed_checkpoints()]
    else:
        for name, is_dir in entries:
            if is_dir and parse_checkpoint_dir_name(name) is not None:
                meta = read_internal(trial.child(name))
                if meta is not None:
                    out.append((trial.child(name), meta))
    out += _committed_otherwise_named(trial, entries, (loc.name for loc, _ in out))
    return sorted(out, key=lambda lm: (lm[1]["index"], lm[1].get("created_at", 0.0)))


def _committed_otherwise_named(trial: Location, entries: Iterable[tuple[str, bool]],
                               claimed: Iterable[str] = ()
                               ) -> list[tuple[Location, dict[str, Any]]]:
    """The committed checkpoints among :func:`_otherwise_named`, a pointer
    followed. A pointer naming no replacement is left out here and named by
    :func:`not_committed`: one bad entry never fails the listing, ``verify``
    or ``cp`` of everything else; so is a copy of a ``checkpoint_NNNNNN``
    entry (:func:`copy_of`; ``claimed``: committed names the listing may
    leave out)."""
    entries = list(entries)
    names = {n for n, _ in entries} | set(claimed)
    out = []
    for name in _otherwise_named(trial, entries):
        if _link_fault(trial.child(name)) is not None:
            continue  # named by not_committed
        try:
            ckpt = follow(trial.child(name))
        except CheckpointCorruptError:
            continue
        found = inspect_location(ckpt)
        if found.state == "committed" and found.meta is not None \
                and copy_of(name, found.meta, names) is None:
            out.append((ckpt, found.meta))
    return out


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A trial as its retention state records it (:func:`recorded_checkpoints`)."""

    #: ``(checkpoint, meta)``, oldest first; meta has ``index``, ``metrics``,
    #: ``created_at`` (no manifest).
    checkpoints: list[tuple[Location, dict[str, Any]]]
    #: The trial's listing (:func:`list_entries` form) without the committed
    #: checkpoint directories the state vouches for.
    entries: list[tuple[str, bool]]
    #: ``dir_name -> why`` of the checkpoints the state records as damaged
    #: (left out of ``checkpoints``).
    invalid: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Names among ``checkpoints`` written by another run or trial (copied in):
    #: never ranked nor deleted (:attr:`CheckpointManager.foreign_dir_names`).
    foreign: frozenset[str] = frozenset()


def recorded_checkpoints(trial: Location, problems: list[str] | None = None
                         ) -> Recorded | None:
    """The trial's committed checkpoints as its retention state records them,
    or None when it has no usable state (then :func:`committed_checkpoints`
    reads every checkpoint's metadata); why a state that is there cannot be
    used is appended to ``problems``.

    A read-only :class:`~checkpoint_store.retention.CheckpointManager` under
    the recorded config restores it as a new session would: the state, one
    listing, and an inspection of each directory the state does not name,
    whatever the trial's history (docs/format.md, "Retention state"). That
    listing is the only one: it also finds the checkpoints committed under
    other names and serves :func:`not_committed`.
    """
    from checkpoint_store.errors import CheckpointStoreError
    from checkpoint_store.retention import CheckpointConfig, CheckpointManager
    from checkpoint_store.retention.recorded import recorded_config

    ctx = storage_context(trial, strict=False)
    if ctx is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the full path names every fault
            manager = CheckpointManager(recorded_config(trial) or CheckpointConfig(), ctx,
                                        read_only=True)
    except CheckpointStoreError as exc:
        if problems is not None:
            problems.append(str(exc))
        return None
    if not manager.restored_from_state:
        if manager.state_problem is not None and problems is not None:
            problems.append(manager.state_problem)
        return None
    # Pairs, not Checkpoint objects: a ranking of 100,000 builds one Location each.
    out = [(trial.child(name), meta) for name, meta in manager.resume_candidates().named()]
    listed = manager.restore_listing  # a read-only restore deletes nothing: always there
    entries = (list_entries(trial) if listed is None else sorted(
        (posixpath.basename(fi.path.rstrip("/")), fi.type == _fsutil.pafs.FileType.Directory)
        for fi in listed))
    out += _committed_otherwise_named(trial, entries, (loc.name for loc, _ in out))
    out += _still_there(trial, manager.pending_deletes, entries)
    out.sort(key=lambda lm: (lm[1]["index"], lm[1].get("created_at") or 0.0))
    return Recorded(out, entries, manager.invalid, frozenset(manager.foreign_dir_names))


def _still_there(trial: Location, pending: Iterable[str], entries: list[tuple[str, bool]]
                 ) -> list[tuple[Location, dict[str, Any]]]:
    """The committed ones among ``pending``: checkpoints the read-only restore
    evicts (one committed after the state's last record: an upload, a crash
    before registration) or whose delete is still due. They stay on storage
    until a writer deletes them, so a listing shows them and a ranking may
    name them (one read each, usually none). Each joins ``entries`` too, where
    :func:`not_committed` counts a half-deleted one."""
    out = []
    listed = {name for name, _ in entries}
    for name in pending:
        if name not in listed:
            entries.append((name, True))
        meta = read_internal(trial.child(name))
        if meta is not None:
            out.append((trial.child(name), meta))
    entries.sort()
    return out


def manifest_size(meta: Mapping[str, Any]) -> int:
    """Total bytes of the files a checkpoint's internal metadata lists."""
    return sum(int(e.get("size", 0)) for e in meta.get("manifest", []))


def require_trial(loc: Location) -> None:
    """Raises unless ``loc`` is a trial.

    Raises:
        CheckpointNotFoundError: ``loc`` is empty or absent.
        InvalidConfigError: ``loc`` is something else (named in the message).
    """
    kind = classify(loc)
    if kind == "trial":
        return
    if kind == "empty":
        raise CheckpointNotFoundError(f"{loc.uri} is empty: no checkpoints there")
    raise InvalidConfigError(
        f"{loc.uri} is {describe_kind(kind)}, not a trial directory (one holding "
        "checkpoint_NNNNNN/)"
    )


def require_checkpoint(loc: Location) -> dict[str, Any]:
    """The internal metadata of the committed checkpoint at ``loc``.

    Raises:
        CheckpointCorruptError: a commit marker is there but the files do not match it.
        CheckpointNotFoundError: nothing there, an empty directory, or an
            uncommitted ``checkpoint_NNNNNN`` directory.
        InvalidConfigError: a location of another kind (a trial, a file ...),
            named in the message.
    """
    if _fsutil.kind(loc.fs, loc.path) == _fsutil.pafs.FileType.File:
        # A listing of a file fails as a storage error on some backends.
        raise InvalidConfigError(f"{loc.uri} is a file, not a checkpoint; pass a "
                                 "checkpoint_NNNNNN directory")
    found = inspect_location(loc)
    if found.state == "committed" and found.meta is not None:
        return found.meta
    if found.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {loc.uri} is corrupt: {found.reason}",
                                     path=loc.path, file=found.file)
    if found.state == "missing":
        raise CheckpointNotFoundError(_missing(loc))
    if parse_checkpoint_dir_name(loc.name) is not None:
        raise CheckpointNotFoundError(
            f"{loc.uri} is not a committed checkpoint (no {INTERNAL_METADATA}): an "
            "interrupted write, which `checkpoint-store gc` removes, or a directory made by "
            "hand, which gc reports and leaves alone"
        )
    kind = classify(loc)
    if kind == "empty":
        raise CheckpointNotFoundError(f"{loc.uri} is empty: no checkpoint there")
    # A location of another kind is a wrong argument (exit 2), as in require_trial.
    raise InvalidConfigError(
        f"{loc.uri} is {describe_kind(kind)}, not a checkpoint; pass a "
        "checkpoint_NNNNNN directory"
    )
