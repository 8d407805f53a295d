"""Names on storage: the on-disk format (docs/format.md), in one place.

Every name checkpoint-store writes beside or inside a user's data is built
here and, where a reader must recognise it again, parsed here: each helper
name comes as a ``*_name`` builder and a ``parse_*``/``is_*`` reader, so the
writer and the reader of a name cannot drift apart. :func:`is_internal_name`
is the one predicate for "this name is ours". Pure functions, no I/O: any
rank or thread may call them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

__all__ = [
    "CHUNK_DIR",
    "CHUNK_ROOT",
    "CHECKPOINT_PREFIX",
    "CLOCK_PROBE_PREFIX",
    "COMMIT_LOCK",
    "DELETE_TOMBSTONE",
    "EMPTY_PART_PREFIX",
    "ERROR_FILE",
    "STOPPED_FILE",
    "FORMAT_VERSION",
    "FORMAT_VERSION_CHUNKS",
    "FORMAT_VERSION_TENSORS",
    "MARKER_FORMAT_VERSIONS",
    "INTERNAL_METADATA",
    "INTERNAL_PREFIX",
    "LEASE_FILE",
    "LEASE_LOCK",
    "LIGHTNING_STAGING_PREFIX",
    "DOWNLOAD_PREFIX",
    "LOCAL_TIER_POINTER_PREFIX",
    "MANAGER_STATE",
    "STATE_FORMAT_VERSION",
    "STATE_KIND",
    "newer_format_version",
    "NAME_MAX",
    "PARAMS_FILE",
    "POINTER_FILE",
    "RESULT_FILE",
    "RESULT_SEGMENTS_DIR",
    "SHARED_STAGING_NAME",
    "SHARED_STAGING_PREFIX",
    "KEPT_STAGED_PREFIX",
    "STAGED_COPY_PREFIX",
    "STAGING_ROOT_NAME",
    "STATE_STAGING_PREFIX",
    "TEMP_FILE_PREFIX",
    "TIER_EXCHANGE_PREFIX",
    "TIER_HOLDER_FILE",
    "TIER_LOCK_FILE",
    "TIER_STATE_FILE",
    "USER_METADATA",
    "WRITTEN_STATE_RECORD",
    "DownloadHelperKind",
    "abort_file_name",
    "attempt_file_name",
    "bounded_name",
    "check_name_length",
    "checkpoint_dir_name",
    "claim_name",
    "clock_probe_name",
    "deleting_dir_name",
    "download_helper_name",
    "download_lock_name",
    "download_marker_name",
    "is_abort_file_name",
    "is_attempt_file_name",
    "is_deleting_dir_name",
    "is_internal_file",
    "is_internal_name",
    "is_legacy_temp_file_name",
    "is_local_tier_pointer_name",
    "is_temp_file_name",
    "is_written_record",
    "name_disagreement",
    "parse_checkpoint_dir_name",
    "parse_state_chunk_name",
    "parse_state_log_name",
    "parse_claim_name",
    "parse_download_helper_name",
    "parse_rank_marker_name",
    "parse_result_segment_name",
    "parse_scratch_dir_owner",
    "parse_staging_dir_name",
    "parse_temp_file_name",
    "parse_tier_exchange_name",
    "local_tier_pointer_name",
    "local_tier_rank_dir_name",
    "rank_marker_name",
    "refuse_reserved",
    "replace_dir_name",
    "result_segment_name",
    "scratch_dir_prefix",
    "share_dir_prefix",
    "staging_dir_name",
    "state_chunk_name",
    "state_log_name",
    "temp_file_name",
    "tier_exchange_name",
    "validate_component",
    "written_record_name",
]

FORMAT_VERSION = 1
#: The marker's version when it carries a tensor index (``"tensors"``, a
#: checkpoint saved from a state: docs/state.md); a marker without one stays 1.
FORMAT_VERSION_TENSORS = 2
#: The marker's version when any manifest entry's bytes live as chunks
#: (``"chunks"``, with ``"chunk_root"`` in the marker: docs/format.md, "Chunks");
#: it may carry a tensor index too. Readers of versions 1 and 2 refuse it.
FORMAT_VERSION_CHUNKS = 3
#: The marker versions this checkpoint-store reads.
MARKER_FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_TENSORS, FORMAT_VERSION_CHUNKS)


def newer_format_version(obj: object, newest: int) -> int | None:
    """The ``format_version`` of ``obj`` (a parsed JSON object: a commit
    marker, a retention state root, record or chunk) when it is above
    ``newest``, the newest this release reads (:data:`MARKER_FORMAT_VERSIONS`'
    highest, :data:`STATE_FORMAT_VERSION`): a newer release wrote it. None
    when it is not newer, absent, or not an int (a bool is not a version)."""
    version = obj.get("format_version") if isinstance(obj, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        return version
    return None


#: The chunk store's directory in an experiment directory.
CHUNK_DIR = ".cs_chunks"
#: A chunk store's directory, relative to a checkpoint directory
#: (``<experiment>/<trial>/checkpoint_NNNNNN`` -> ``<experiment>/.cs_chunks``).
CHUNK_ROOT = "../../" + CHUNK_DIR

USER_METADATA = ".user_metadata.json"
INTERNAL_METADATA = ".internal_metadata.json"
MANAGER_STATE = ".checkpoint_manager.json"
RESULT_FILE = "result.json"
PARAMS_FILE = "params.json"
#: Why the trial's last run ended with an exception (Ray Tune's name and layout:
#: ``Failure # N (occurred at ...)`` blocks). Absent: no run of it raised, or
#: a later one ended cleanly.
ERROR_FILE = "error.txt"
#: Why the trial's last run was ended early (a pruner, a scheduler, a
#: preemption signal): ``{"status": "pruned" | "stopped" | "preempted",
#: "reason": ..., "time": ...}``.
#: Absent: the last run was not stopped with a reason.
STOPPED_FILE = "stopped.json"
# Every other file or directory we create starts with this prefix: staging
# directories, per-rank markers, download markers. Users' files never do.
INTERNAL_PREFIX = ".cs_"

#: Longest file name, in UTF-8 bytes, that every filesystem we support stores
#: (ext4, XFS, APFS, NTFS; object stores allow longer keys, but a checkpoint
#: must stay copyable to a local disk).
NAME_MAX = 255

CHECKPOINT_PREFIX = "checkpoint_"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{6,})$")


def checkpoint_dir_name(index: int) -> str:
    """``checkpoint_000042`` for index 42 (at least six digits, never truncated)."""
    return f"{CHECKPOINT_PREFIX}{index:06d}"


def parse_checkpoint_dir_name(name: str) -> int | None:
    """The index in a ``checkpoint_NNNNNN`` name, or None for any other name."""
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def name_disagreement(name: str, index: object) -> str | None:
    """Why the directory ``name`` cannot be the checkpoint whose commit marker
    records ``index``, or None when it can.

    A checkpoint's identity on storage is its directory name: ``checkpoint_<index>``
    as :func:`checkpoint_dir_name` writes it. A ``checkpoint_NNNNNN`` directory
    whose marker names another index (a marker copied or edited by hand) or
    whose name spells its index otherwise (``checkpoint_0000002``, other
    digits) would be a second claimant to an index: every reader takes it
    for damaged instead. Other names (Ray Train's, Lightning's) carry no index.
    """
    named = parse_checkpoint_dir_name(name)
    if named is None:
        return None
    if index != named or isinstance(index, bool):
        return (f"records index {index!r} but its directory is {name!r} (a commit marker "
                "copied or edited by hand?)")
    if name != checkpoint_dir_name(named):
        return (f"directory {name!r} is not how index {named} is named "
                f"({checkpoint_dir_name(named)!r})")
    return None


# Sizes and CRC32Cs of files a writer of ours computed while writing them in
# place (integrations.torch.StorageWriter); the in-place commit trusts an entry
# whose size matches the listing instead of reading the file back.
_WRITTEN_RE = re.compile(r"^\.cs_written-([A-Za-z0-9_.]+)\.json$")


def written_record_name(part: str) -> str:
    """``.cs_written-<part>.json``: one writer's record of the files it wrote."""
    return f"{INTERNAL_PREFIX}written-{part}.json"


def is_written_record(name: str) -> bool:
    """True for a name built by :func:`written_record_name`."""
    return _WRITTEN_RE.match(name) is not None


#: ``.cs_written-state.json``: the record a state's writer leaves beside the
#: files it wrote (checkpoint_store/state/_staging.py).
WRITTEN_STATE_RECORD = written_record_name("state")


def is_internal_name(name: str) -> bool:
    """True for a file or directory name that is ours (``.cs_*``): staging,
    tombstones, claims, markers, leases, temporary files. Users' names never
    start so (:func:`refuse_reserved`)."""
    return name.startswith(INTERNAL_PREFIX)


def is_internal_file(relpath: str) -> bool:
    """True for files that are ours, not the user's: never downloaded or listed as data.

    ``relpath`` is relative to the checkpoint. Only the root's
    ``.internal_metadata.json`` is ours (a ``sub/.internal_metadata.json`` is
    the user's), and any ``.cs_*`` name.
    """
    return relpath == INTERNAL_METADATA or is_internal_name(relpath.rsplit("/", 1)[-1])


def validate_component(value: str, what: str) -> str:
    """Refuse anything but one non-empty path component.

    Raises:
        InvalidConfigError: empty, ``.``/``..``, or containing ``/`` or ``\\``.
    """
    from checkpoint_store.errors import InvalidConfigError

    if not isinstance(value, str) or not value:
        raise InvalidConfigError(f"{what} must be a non-empty string, got {value!r}")
    if value in (".", "..") or "/" in value or "\\" in value or "\x00" in value:
        raise InvalidConfigError(
            f"{what} {value!r} must be a single path component: no '/', '\\', '.' or '..'"
        )
    check_name_length(value, what)
    return value


def check_name_length(value: str, what: str) -> str:
    """Refuse a file name longer than :data:`NAME_MAX` UTF-8 bytes (or not
    encodable as UTF-8: a lone surrogate).

    Raises:
        InvalidConfigError: naming ``what`` and the length.
    """
    from checkpoint_store.errors import InvalidConfigError

    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidConfigError(
            f"{what} {value!r} is not valid UTF-8 text; rename it"
        ) from None
    if size > NAME_MAX:
        raise InvalidConfigError(
            f"{what} {value[:40]!r}... is {size} bytes long; file names hold at most "
            f"{NAME_MAX} bytes (UTF-8) on the disks checkpoints are copied to: choose a "
            "shorter name"
        )
    return value


def bounded_name(prefix: str, name: str, suffix: str = "") -> str:
    """``prefix + name + suffix``, with ``name`` shortened when the whole would
    exceed :data:`NAME_MAX` bytes.

    Helper names (download lock and marker, staging directories, temporary
    files) are built from a user's name plus our own parts; a user's name that
    fits must never make its helper's name too long. When shortened, ``name``
    keeps its longest UTF-8-safe head and gains ``~`` plus 16 hex digits of
    its SHA-256, so distinct names keep distinct helpers. The result holds no
    ``-`` that ``name`` did not, so parsers splitting on ``-`` from the right
    still work.
    """
    full = f"{prefix}{name}{suffix}"
    if len(full.encode("utf-8", "surrogateescape")) <= NAME_MAX:
        return full
    raw = name.encode("utf-8", "surrogateescape")
    tag = "~" + hashlib.sha256(raw).hexdigest()[:16]
    room = NAME_MAX - len(f"{prefix}{tag}{suffix}".encode("utf-8", "surrogateescape"))
    head = raw[: max(room, 0)].decode("utf-8", "ignore")
    return f"{prefix}{head}{tag}{suffix}"


CLOCK_PROBE_PREFIX = f"{INTERNAL_PREFIX}clock-"


def clock_probe_name(token: str) -> str:
    """``.cs_clock-<token>``: a probe object written to read the store's clock
    (see :mod:`checkpoint_store._util.clock`); deleted at once, harmless if left."""
    return f"{CLOCK_PROBE_PREFIX}{token}"


# -- result.json segments (object stores: no append) -------------------------------

#: ``<trial>/.cs_results/``: rows of ``result.json`` not yet assembled into it,
#: one immutable object per flush (docs/format.md, "result.json segments").
RESULT_SEGMENTS_DIR = f"{INTERNAL_PREFIX}results"
_SEGMENT_RE = re.compile(r"^(\d{12,})-(\d{12,})-([0-9a-f]{8,})\.jsonl$")


def result_segment_name(first: int, last: int, token: str) -> str:
    """``<first>-<last>-<token>.jsonl``: a segment holding the rows whose
    ``training_iteration`` runs from ``first`` to ``last`` (12 or more digits
    each, so names sort by ``first``); ``token`` (hex) is the writer's."""
    return f"{first:012d}-{last:012d}-{token}.jsonl"


def parse_result_segment_name(name: str) -> tuple[int, int] | None:
    """``(first, last)`` of a :func:`result_segment_name`, or None for any other name."""
    m = _SEGMENT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: The files a trial directory holds besides its checkpoints.
TRIAL_FILES = frozenset({RESULT_FILE, PARAMS_FILE, MANAGER_STATE, ERROR_FILE, STOPPED_FILE})


def is_reserved_name(name: str) -> bool:
    """True for a name our layout uses inside a trial, which no experiment or
    trial may take: ``checkpoint_NNNNNN``, a trial file (``result.json``,
    ``params.json``, ``error.txt``, the manager state), a checkpoint's
    metadata file, or anything of ours (``.cs_*``, :func:`is_internal_name`).

    A trial so named would make its experiment look like a trial to every
    walk of a storage root (``ls``, ``verify``, ``cp``), which reads a
    directory holding such a name as a trial (docs/format.md).
    """
    return (is_internal_name(name)
            or name in TRIAL_FILES
            or name in (USER_METADATA, INTERNAL_METADATA)
            or parse_checkpoint_dir_name(name) is not None)


def refuse_reserved(value: str, what: str) -> str:
    """Refuse an experiment or trial name that :func:`is_reserved_name` holds.

    Every other name, dot-names included, is seen by every walk of a storage
    root (docs/format.md).

    Returns:
        ``value`` unchanged.

    Raises:
        InvalidConfigError: naming ``what``, the name and why.
    """
    from checkpoint_store.errors import InvalidConfigError

    if is_reserved_name(value):
        why = (f"starts with {INTERNAL_PREFIX!r}, which checkpoint-store reserves for its own "
               "files" if is_internal_name(value) else
               "is a name checkpoint-store uses inside a trial")
        raise InvalidConfigError(
            f"{what} {value!r} {why}: a trial or experiment so named would make its "
            "experiment look like a trial to ls, verify and cp; choose another name"
        )
    return value


def check_run_name(value: str, what: str) -> str:
    """An experiment or trial name: one path component (:func:`validate_component`)
    that is not reserved (:func:`refuse_reserved`).

    Control characters (U+0000 to U+001F, U+007F) are refused too: a run name
    is printed one per line by the CLI and stored in object keys, and S3's
    XML listings cannot carry most of them.

    Raises:
        InvalidConfigError: see both, or a control character.
    """
    from checkpoint_store.errors import InvalidConfigError

    value = validate_component(value, what)
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise InvalidConfigError(
            f"{what} {value!r} holds a control character (newline, tab, ...): "
            "choose a name of printable characters"
        )
    return refuse_reserved(value, what)


# -- helper names of a commit ---------------------------------------------------
# ``<name>`` below is a checkpoint directory name (no ``-``), ``<writer>`` a
# writer id or multi-rank attempt id; parsers split on the first ``-`` after
# the name, so a writer id may hold ``-``.

_STAGING = f"{INTERNAL_PREFIX}staging-"
_DELETING = f"{INTERNAL_PREFIX}deleting-"
_REPLACE = f"{INTERNAL_PREFIX}replace-"
_CLAIM = f"{INTERNAL_PREFIX}claim-"
_TMP = f"{INTERNAL_PREFIX}tmp-"
_ATTEMPT = f"{INTERNAL_PREFIX}attempt-"
_ABORT = f"{INTERNAL_PREFIX}abort-"
_RANK_MARKER_RE = re.compile(rf"^{re.escape(INTERNAL_PREFIX)}rank-(\d+)\.json$")

#: A file in a directory being deleted on a store without atomic rename: the
#: directory is ours and going away, whatever else it holds.
DELETE_TOMBSTONE = f"{INTERNAL_PREFIX}deleting"
#: Lock file (local disks) serialising commits into one trial directory.
COMMIT_LOCK = f"{INTERNAL_PREFIX}commit.lock"
#: The retention manager's lease (``<trial>/.cs_manager_lease.json``).
LEASE_FILE = f"{INTERNAL_PREFIX}manager_lease.json"
#: Lock file (local disks) serialising the take-over of :data:`LEASE_FILE`
#: (check, write, read back) between processes.
LEASE_LOCK = f"{INTERNAL_PREFIX}manager_lease.lock"
#: Inside a re-saved path (Lightning's ``last.ckpt``): the name of the
#: ``.cs_replace-*`` sibling that holds its checkpoint (docs/format.md).
POINTER_FILE = f"{INTERNAL_PREFIX}current"


# -- retention state: log records and snapshot chunks ---------------------------
# Beside ``.checkpoint_manager.json`` (the snapshot root) in the trial directory,
# so the one listing a restart makes of the trial finds them too
# (docs/format.md, "Retention state").

#: Version of the retention state (root, log records, chunks); 1 was a single file.
STATE_FORMAT_VERSION = 2
#: ``kind`` of the retention state's snapshot root (every version wrote it).
STATE_KIND = "checkpoint_manager_state"


_STATE_LOG_RE = re.compile(rf"^{re.escape(INTERNAL_PREFIX)}state-log-(\d{{12,}})\.json$")
_STATE_CHUNK_RE = re.compile(rf"^{re.escape(INTERNAL_PREFIX)}state-chunk-(\d{{12,}})-(\d+)\.json$")


def state_log_name(seq: int) -> str:
    """``.cs_state-log-<seq, 12 digits>.json``: one retention log record."""
    return f"{INTERNAL_PREFIX}state-log-{seq:012d}.json"


def parse_state_log_name(name: str) -> int | None:
    """The sequence number of a :func:`state_log_name`, or None for any other name."""
    m = _STATE_LOG_RE.match(name)
    return int(m.group(1)) if m else None


def state_chunk_name(seq: int, part: int) -> str:
    """``.cs_state-chunk-<seq>-<part>.json``: an immutable chunk of kept entries
    written by the compaction that made snapshot ``seq``."""
    return f"{INTERNAL_PREFIX}state-chunk-{seq:012d}-{part}.json"


def parse_state_chunk_name(name: str) -> tuple[int, int] | None:
    """``(seq, part)`` of a :func:`state_chunk_name`, or None for any other name."""
    m = _STATE_CHUNK_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def staging_dir_name(name: str, writer: str) -> str:
    """``.cs_staging-<name>-<writer>``: a rename-commit's (or a multi-rank
    attempt's) staging sibling of ``<name>``."""
    return bounded_name(_STAGING, name, f"-{writer}")


def parse_staging_dir_name(name: str) -> str | None:
    """The writer of a :func:`staging_dir_name`, or None for any other name."""
    if not name.startswith(_STAGING):
        return None
    return name[len(_STAGING):].split("-", 1)[-1]


def deleting_dir_name(name: str, writer: str) -> str:
    """``.cs_deleting-<name>-<writer>``: a directory renamed away to be deleted."""
    return bounded_name(_DELETING, name, f"-{writer}")


def is_deleting_dir_name(name: str) -> bool:
    """True for a :func:`deleting_dir_name`."""
    return name.startswith(_DELETING)


def replace_dir_name(name: str, writer: str) -> str:
    """``.cs_replace-<name>-<writer>``: a committed directory moved aside while
    a new one replaces it (Lightning's ``save_checkpoint`` over a path)."""
    return bounded_name(_REPLACE, name, f"-{writer}")


def claim_name(time_ns: int, writer: str) -> str:
    """``.cs_claim-<ns>-<writer>``: a marker-last writer's claim on a directory,
    stamped with the writer's clock (nanoseconds, 20 digits)."""
    return f"{_CLAIM}{time_ns:020d}-{writer}"


def parse_claim_name(name: str) -> tuple[float, str] | None:
    """``(seconds, writer)`` of a :func:`claim_name`; seconds is 0.0 when the
    stamp is not a number. None for any other name."""
    if not name.startswith(_CLAIM):
        return None
    stamp, _, writer = name[len(_CLAIM):].partition("-")
    try:
        seconds = int(stamp) / 1e9
    except ValueError:
        seconds = 0.0
    return seconds, writer


def rank_marker_name(rank: int) -> str:
    """``.cs_rank-<rank>.json``: one rank's part of a multi-rank checkpoint is written."""
    return f"{INTERNAL_PREFIX}rank-{rank:06d}.json"


def parse_rank_marker_name(name: str) -> int | None:
    """The rank of a :func:`rank_marker_name`, or None for any other name."""
    m = _RANK_MARKER_RE.match(name)
    return int(m.group(1)) if m else None


def attempt_file_name(attempt_id: str) -> str:
    """``<trial>/.cs_attempt-<attempt_id>.json``: rank 0's start record of a launch attempt."""
    return f"{_ATTEMPT}{attempt_id}.json"


def is_attempt_file_name(name: str) -> bool:
    """True for an :func:`attempt_file_name`."""
    return name.startswith(_ATTEMPT)


def abort_file_name(dir_name: str, attempt_id: str) -> str:
    """``<trial>/.cs_abort-<dir_name>-<attempt_id>.json``: rank 0's verdict on
    a multi-rank checkpoint that was not committed."""
    return bounded_name(_ABORT, dir_name, f"-{attempt_id}.json")


def is_abort_file_name(name: str) -> bool:
    """True for an :func:`abort_file_name`."""
    return name.startswith(_ABORT)


#: The start of every temporary file of ours on a local disk: a
#: :func:`temp_file_name`, or a ``tempfile.mkstemp`` name beside the local
#: tier's state file (``.cs_tmp-<random>``).
TEMP_FILE_PREFIX = _TMP


def is_temp_file_name(name: str) -> bool:
    """True for a name under :data:`TEMP_FILE_PREFIX` (either kind of temporary file)."""
    return name.startswith(TEMP_FILE_PREFIX)


def temp_file_name(base: str, writer_tag: str, token: str) -> str:
    """``.cs_tmp-<base>-<writer tag>-<token>``: an atomic write's temporary
    sibling of ``base`` (local disks)."""
    return bounded_name(_TMP, base, f"-{writer_tag}-{token}")


def is_legacy_temp_file_name(name: str) -> bool:
    """True for ``<file>.<pid>.<id>.cs_tmp``, the temporary files of early
    versions: ours, though they do not start with ``.cs_``."""
    return name.endswith(".cs_tmp")


def parse_temp_file_name(name: str) -> str | None:
    """The writer tag of a :func:`temp_file_name`, or None for any other name
    (also for a ``.cs_tmp-`` name without the tag)."""
    if not name.startswith(_TMP):
        return None
    parts = name.rsplit("-", 2)
    return parts[1] if len(parts) == 3 else None


def temp_file_base(name: str) -> str | None:
    """The ``base`` a :func:`temp_file_name` is the temporary sibling of (cut
    to its bounded length, as written), or None for any other name."""
    if parse_temp_file_name(name) is None:
        return None
    return name[len(_TMP):].rsplit("-", 2)[0]


# -- helper names of a download (local disk, beside the target) ------------------

#: ``download``: a staging directory being filled; ``download_old``: the
#: previous target moved aside. They differ before the first ``-`` so that no
#: staging name of one target can read as a moved-aside name of another.
DownloadHelperKind = Literal["download", "download_old"]
_DOWNLOAD_HELPER_RE = re.compile(
    rf"^{re.escape(INTERNAL_PREFIX)}(download|download_old)-.*-(\d+(?:_\d+)?)-([0-9a-f]{{8}})$"
)


def download_lock_name(base: str) -> str:
    """``.<base>.cs_lock``: the lock letting one download into ``<base>`` run."""
    return bounded_name(".", base, ".cs_lock")


def download_marker_name(base: str) -> str:
    """``.<base>.cs_download.json``: what the last download into ``<base>`` wrote."""
    return bounded_name(".", base, ".cs_download.json")


def download_helper_name(kind: DownloadHelperKind, base: str, writer_tag: str, token: str) -> str:
    """``.cs_<kind>-<base>-<writer tag>-<token>``: a helper directory of a
    download into ``<base>`` (``token``: 8 hex digits)."""
    return bounded_name(f"{INTERNAL_PREFIX}{kind}-", base, f"-{writer_tag}-{token}")


def parse_download_helper_name(name: str, base: str) -> tuple[DownloadHelperKind, str] | None:
    """``(kind, writer tag)`` when ``name`` is exactly a
    :func:`download_helper_name` for ``base``; None otherwise (also for the
    helpers of another target, ``run`` vs ``run-5``)."""
    m = _DOWNLOAD_HELPER_RE.match(name)
    if m is None:
        return None
    kind: DownloadHelperKind = "download" if m.group(1) == "download" else "download_old"
    tag, token = m.group(2), m.group(3)
    if download_helper_name(kind, base, tag, token) != name:
        return None
    return kind, tag


# -- the local tier (docs/format.md, "Local tier") --------------------------------

#: The local tier's state file, in its trial directory (``<path>/<experiment>/
#: <trial>/``, or ``.../rank_<rank>/`` with several ranks).
TIER_STATE_FILE = f"{INTERNAL_PREFIX}tier_state.json"
#: The local tier's trial directory lock, held (an OS file lock) by the one
#: session that owns the directory for its whole life; the kernel drops it
#: when that process dies (tiers/lock.py).
TIER_LOCK_FILE = f"{INTERNAL_PREFIX}tier.lock"
#: Beside :data:`TIER_LOCK_FILE`: who holds it (JSON: pid, host, durable URI,
#: since), for the error a second job gets.
TIER_HOLDER_FILE = f"{INTERNAL_PREFIX}tier_holder.json"
#: ``<trial>/.cs_local_tier-<host>-<rank>.json`` in the persistent tier's trial
#: directory: where that host and rank keep their local tier.
LOCAL_TIER_POINTER_PREFIX = f"{INTERNAL_PREFIX}local_tier-"
#: ``<trial>/.cs_tier-<attempt>-<rank>.json`` in the persistent tier's trial
#: directory: one rank's local copies, told to the others at start (several
#: ranks without a process group).
TIER_EXCHANGE_PREFIX = f"{INTERNAL_PREFIX}tier-"
_TIER_EXCHANGE_RE = re.compile(rf"^{re.escape(TIER_EXCHANGE_PREFIX)}(.+)-(\d+)\.json$")


def local_tier_rank_dir_name(rank: int) -> str:
    """``rank_<rank>``: one rank's part of a local tier's trial directory (several ranks)."""
    return f"rank_{rank}"


def local_tier_pointer_name(host: str, rank: int) -> str:
    """``.cs_local_tier-<host>-<rank>.json`` (``host``: 64 characters of ``[A-Za-z0-9_.-]``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:64] or "host"
    return f"{LOCAL_TIER_POINTER_PREFIX}{safe}-{rank}.json"


def is_local_tier_pointer_name(name: str) -> bool:
    """True for a :func:`local_tier_pointer_name` (any host and rank)."""
    return name.startswith(LOCAL_TIER_POINTER_PREFIX) and name.endswith(".json")


def tier_exchange_name(attempt_id: str, rank: int) -> str:
    """``.cs_tier-<attempt>-<rank>.json``: one rank's local-tier report in one attempt."""
    return f"{TIER_EXCHANGE_PREFIX}{attempt_id}-{rank}.json"


def parse_tier_exchange_name(name: str) -> tuple[str, int] | None:
    """``(attempt id, rank)`` of a :func:`tier_exchange_name`, or None for any other name."""
    m = _TIER_EXCHANGE_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


# -- scratch names on this machine, never on storage --------------------------------
# Directories and files a process makes for itself: under the staging root
# (``CHECKPOINT_STORE_STAGING_DIR``, else ``<tmp>/checkpoint_store_staging``),
# in the system temporary directory, or in shared memory. ``tempfile`` adds a
# random tail to each prefix; nothing reads them back by name.

#: The staging root's name in the system temporary directory.
STAGING_ROOT_NAME = "checkpoint_store_staging"
#: A checkpoint's private copy for a background upload, in the staging root.
STAGED_COPY_PREFIX = "stage-"
#: The local directory a state is written to before its upload, in the staging root.
STATE_STAGING_PREFIX = "state-"
#: A Lightning checkpoint's tensors staged for an async save, in the staging root.
LIGHTNING_STAGING_PREFIX = "lightning-"
#: A checkpoint downloaded into a new temporary directory, in the staging root.
DOWNLOAD_PREFIX = "download-"
#: A staged copy (``staging="move"``) whose files could not all go back into
#: the reported directory, renamed so: no sweep of the staging root removes it.
KEPT_STAGED_PREFIX = "kept-"
_SCRATCH_KINDS = (STAGED_COPY_PREFIX, STATE_STAGING_PREFIX, LIGHTNING_STAGING_PREFIX,
                  DOWNLOAD_PREFIX)


def scratch_dir_prefix(kind: str, owner: str) -> str:
    """``<kind><owner>-``: the prefix of a scratch directory in the staging root
    (``tempfile`` adds a random tail). ``kind`` is one of the prefixes above
    (``stage-``, ``state-``, ``lightning-``, ``download-``), ``owner`` the
    making process's :func:`~checkpoint_store._util.liveness.writer_tag`
    (``<pid>_<start ticks>``): a later process removes the directory once that
    process is dead (a save or download a kill cut short)."""
    if kind not in _SCRATCH_KINDS or "-" in owner:
        raise ValueError(f"not a scratch kind and owner tag: {kind!r}, {owner!r}")
    return f"{kind}{owner}-"


def parse_scratch_dir_owner(name: str) -> str | None:
    """The owner tag of a :func:`scratch_dir_prefix` name, or None (another
    name, or a scratch directory made before names carried their owner)."""
    for kind in _SCRATCH_KINDS:
        if name.startswith(kind):
            owner, sep, _tail = name[len(kind):].partition("-")
            return owner if sep and owner else None
    return None
#: The empty directory a rank with no files of its own reports as its part
#: (system temporary directory).
EMPTY_PART_PREFIX = "cs-empty-part-"
#: The shared memory of a state's staging buffers: the ``memfd_create`` name.
SHARED_STAGING_NAME = "checkpoint-store-staging"
#: The same, as an unlinked file's prefix on ``/dev/shm`` where there is no ``memfd_create``.
SHARED_STAGING_PREFIX = f"{SHARED_STAGING_NAME}-"


def share_dir_prefix(name: str) -> str:
    """``.cs-share-<name>-``: the prefix of a directory of hard links to some
    files of the local directory ``<name>``, made beside it (Hugging Face)."""
    return f".cs-share-{name}-"
