"""Names on storage: the on-disk format (docs/format.md), in one place."""

from __future__ import annotations

import re

FORMAT_VERSION = 1

USER_METADATA = ".user_metadata.json"
INTERNAL_METADATA = ".internal_metadata.json"
MANAGER_STATE = ".checkpoint_manager.json"
RESULT_FILE = "result.json"
PARAMS_FILE = "params.json"
# Every other file or directory we create starts with this prefix: staging
# directories, per-rank markers, download markers. Users' files never do.
INTERNAL_PREFIX = ".cs_"

CHECKPOINT_PREFIX = "checkpoint_"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{6,})$")


def checkpoint_dir_name(index: int) -> str:
    """``checkpoint_000042`` for index 42 (at least six digits, never truncated)."""
    return f"{CHECKPOINT_PREFIX}{index:06d}"


def parse_checkpoint_dir_name(name: str) -> int | None:
    """The index in a ``checkpoint_NNNNNN`` name, or None for any other name."""
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def is_internal_file(relpath: str) -> bool:
    """True for files that are ours, not the user's: never downloaded or listed as data."""
    name = relpath.rsplit("/", 1)[-1]
    return name == INTERNAL_METADATA or name.startswith(INTERNAL_PREFIX)


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
    return value
