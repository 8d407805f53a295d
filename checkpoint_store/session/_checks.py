"""The checks of a session's arguments, made before its first storage call.

``Session`` and ``TrialRunner`` run these on what they were given, so a
refused start writes nothing (no trial directory, no ``params.json``). Each
returns the checked value or raises :class:`InvalidConfigError` saying what
to pass instead; ``check_resume_source`` reads the checkpoint ``resume_from``
names, which a session does only for a trial without checkpoints of its own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention import CheckpointConfig
from checkpoint_store.session._uploads import UploadConfig
from checkpoint_store.storage import StorageContext

__all__ = [
    "check_checkpoint_config",
    "check_resume_source",
    "check_timeout",
    "check_upload_config",
    "int_from",
    "resume_source",
]


def int_from(value: int | None, env: str, default: int, what: str) -> int:
    if value is None:
        raw = os.environ.get(env)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise InvalidConfigError(
                f"environment variable {env}={raw!r} is not an integer"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfigError(f"{what} must be an int >= 0, got {value!r}")
    return value


def check_checkpoint_config(value: Any) -> CheckpointConfig:
    if value is None:
        return CheckpointConfig()
    if not isinstance(value, CheckpointConfig):
        hint = " (build one: CheckpointConfig(**that_dict))" if isinstance(value, Mapping) else ""
        raise InvalidConfigError(
            f"checkpoint_config must be a CheckpointConfig or None, got "
            f"{type(value).__name__}{hint}"
        )
    return value


def check_upload_config(value: Any, checkpoint_config: CheckpointConfig) -> UploadConfig:
    """``value``, else the deprecated upload keywords of ``checkpoint_config``, else
    the defaults."""
    legacy = checkpoint_config.legacy_upload_config()
    if value is None:
        return legacy or UploadConfig()
    if not isinstance(value, UploadConfig):
        raise InvalidConfigError(
            f"upload_config must be an UploadConfig or None, got {type(value).__name__}"
        )
    if legacy is not None and legacy != value:
        raise InvalidConfigError(
            "upload settings given twice, in upload_config and in CheckpointConfig("
            "upload_mode=..., max_pending_uploads=..., staging=...); give only upload_config"
        )
    return value


def check_timeout(value: Any, what: str = "sync_timeout_s") -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise InvalidConfigError(f"{what} must be a number > 0, got {value!r}")
    return float(value)


def check_wait_timeout(value: Any, what: str = "wait(timeout)") -> float | None:
    """A wait's ``timeout``: None or ``math.inf`` (as long as it takes), or
    seconds >= 0 (0: only what is done already); returned as None or a float.

    Raises:
        InvalidConfigError: anything else (a string, a bool, NaN, < 0).
    """
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or math.isnan(value) or value < 0):
        raise InvalidConfigError(f"{what} must be None or a number of seconds >= 0, "
                                 f"got {value!r}")
    return float(value)


def resume_source(value: Any, storage: StorageContext) -> Checkpoint | None:
    """The checkpoint of another run this trial starts from, checked by its
    type and location only: nothing is read (:func:`check_resume_source` reads
    it, once the session knows the trial has no checkpoint of its own).

    Raises:
        InvalidConfigError: not a Checkpoint, path or URI, or a checkpoint of
            this very trial (its own checkpoints resume without it).
    """
    if value is None:
        return None
    if not isinstance(value, Checkpoint) and isinstance(value, (str, os.PathLike)):
        value = Checkpoint(value)
    if not isinstance(value, Checkpoint):
        raise InvalidConfigError(
            f"resume_from must be a Checkpoint, a path or a URI, got {type(value).__name__}"
        )
    trial = storage.uri(storage.trial_path).rstrip("/") + "/"
    if value.uri.startswith(trial):
        raise InvalidConfigError(
            f"resume_from {value.uri} is a checkpoint of this trial; get_checkpoint() resumes "
            "from this trial's own checkpoints without it (resume_from is for another run's)"
        )
    return value


def check_resume_source(source: Checkpoint, verify: bool) -> None:
    """Check that ``source`` can be started from: committed and, with
    ``verify``, every file's size and CRC32C (rank 0 reads every byte; the
    other ranks only see that it is committed).

    Raises:
        CheckpointNotFoundError: missing, or not committed.
        CheckpointCorruptError: a file fails its size or CRC32C (``verify``),
            or does not match the manifest.
    """
    if verify or not source.is_committed:
        source.verify()  # raises the typed error naming what is wrong
