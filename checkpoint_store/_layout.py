"""Names on storage: the on-disk format (docs/format.md), in one place."""

from __future__ import annotations

import hashlib
import re

FORMAT_VERSION = 1

USER_METADATA = ".user_metadata.json"
INTERNAL_METADATA = ".internal_metadata.json"
MANAGER_STATE = ".checkpoint_manager.json"
RESULT_FILE = "result.json"
PARAMS_FILE = "params.json"
#: Why the trial's last run ended with an exception (Ray Tune's name and layout:
#: ``Failure # N (occurred at ...)`` blocks). Absent: no run of it raised, or
#: a later one ended cleanly.
ERROR_FILE = "error.txt"
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


def is_internal_file(relpath: str) -> bool:
    """True for files that are ours, not the user's: never downloaded or listed as data.

    ``relpath`` is relative to the checkpoint. Only the root's
    ``.internal_metadata.json`` is ours (a ``sub/.internal_metadata.json`` is
    the user's), and any ``.cs_*`` name.
    """
    return relpath == INTERNAL_METADATA or relpath.rsplit("/", 1)[-1].startswith(INTERNAL_PREFIX)


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
    (see :mod:`checkpoint_store._clock`); deleted at once, harmless if left."""
    return f"{CLOCK_PROBE_PREFIX}{token}"


def refuse_reserved(value: str, what: str) -> str:
    """Refuse an experiment or trial name that starts with ``.cs_``.

    That prefix marks our own files and directories (staging, claims,
    leases); a trial so named would make its experiment look like a trial to
    every walk. Every other name, dot-names included, is seen by every walk
    of a storage root (docs/format.md).

    Raises:
        InvalidConfigError: the name starts with ``.cs_``.
    """
    from checkpoint_store.errors import InvalidConfigError

    if value.startswith(INTERNAL_PREFIX):
        raise InvalidConfigError(
            f"{what} {value!r} starts with {INTERNAL_PREFIX!r}, which checkpoint-store "
            "reserves for its own files; choose another name"
        )
    return value
