"""How ``report()`` uploads a checkpoint: :class:`UploadConfig`, a value.

Upload settings are not retention; the value sits beside
:class:`~checkpoint_store.retention.config.CheckpointConfig` because that
config still accepts the deprecated ``upload_mode`` / ``max_pending_uploads``
/ ``staging`` keywords and builds an :class:`UploadConfig` from them. The
machinery that uploads (staging, the background thread) is
:mod:`checkpoint_store.session._uploads`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from checkpoint_store._chunks.writer import check_chunking
from checkpoint_store.errors import InvalidConfigError

__all__ = ["STAGING_MODES", "UPLOAD_MODES", "StagingMode", "UploadConfig", "UploadMode",
           "check_max_pending", "check_staging", "check_upload_mode"]


UploadMode = Literal["sync", "async"]


StagingMode = Literal["copy", "hardlink", "move"]


UPLOAD_MODES: tuple[UploadMode, ...] = ("sync", "async")


STAGING_MODES: tuple[StagingMode, ...] = ("copy", "hardlink", "move")


def check_upload_mode(mode: Any) -> str:
    """``mode`` if it is ``"sync"`` or ``"async"``.

    Raises:
        InvalidConfigError: any other value.
    """
    if mode not in UPLOAD_MODES:
        raise InvalidConfigError(f"upload_mode must be 'sync' or 'async', got {mode!r}")
    return str(mode)


def check_staging(mode: Any) -> str:
    """``mode`` if it is ``"copy"``, ``"hardlink"`` or ``"move"``.

    Raises:
        InvalidConfigError: any other value.
    """
    if mode not in STAGING_MODES:
        raise InvalidConfigError(
            f"staging must be one of {', '.join(repr(m) for m in STAGING_MODES)}, got {mode!r}"
        )
    return str(mode)


def check_max_pending(n: Any) -> int:
    """``n`` if it is an int >= 1.

    Raises:
        InvalidConfigError: any other value.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidConfigError(f"max_pending_uploads must be an int >= 1, got {n!r}")
    return n


@dataclass(frozen=True)
class UploadConfig:
    """How ``report()`` uploads a checkpoint. Given to ``session.start(upload_config=...)``
    or a :class:`~checkpoint_store.TrialRunner`; ``report(..., upload_mode=...,
    staging=...)`` overrides it for one report.

    Args:
        upload_mode: ``"sync"`` (default: ``report()`` returns once the
            checkpoint is committed) or ``"async"`` (``report()`` stages a copy
            and returns; the upload runs in the background, commits keep report
            order; see :mod:`checkpoint_store.session._uploads`). One rank only.
        max_pending_uploads: with ``"async"``, ``report()`` blocks while this
            many uploads are still pending (default 1, as Orbax's async saves).
        staging: with ``"async"``, how the checkpoint directory is staged:
            ``"copy"`` (default), ``"hardlink"`` or ``"move"`` (see :func:`stage`).
        staging_budget: bytes of shared memory ``report(state=...)`` copies
            tensors into (None: min(2 GiB, 25 % of RAM)); a larger state is
            staged in pieces while the persist process drains (see
            :mod:`checkpoint_store.state._staging`). At least 1 MiB.
        warm_staging: when the staging area and its persist process are
            made ready, so the first ``report(state=...)`` costs what the
            later ones do (as torchtitan pre-warms its staging; Meta's
            ``torch_checkpointing`` starts its writer at construction).
            None (default): at ``session.start`` when the trial resumes from
            a state checkpoint (the area's pages faulted in the background
            up to that checkpoint's tensor bytes, at most the budget), else
            on the first state report. True: at ``session.start`` always
            (the whole budget faulted in the background: memory held from
            the start). False: on the first state report. With several
            ranks each rank warms its own staging (a resumed trial: an
            even share of that checkpoint's tensor bytes per rank).
        dedup: store the large files of each checkpoint (every tensor shard
            of ``report(state=...)``) on the storage_path as content-addressed
            chunks, each stored once across the experiment's checkpoints,
            trials and forks; retention frees the chunks no checkpoint uses
            (see :class:`~checkpoint_store.StorageContext` and docs/dedup.md).
            Default False. One rank only; the local tier keeps plain files.
        compression: the codec of new chunks with ``dedup``: ``"auto"``
            (default: on for object stores, off on local disks and memory),
            ``"on"`` or ``"off"``.

    Raises:
        InvalidConfigError: at construction, for any other value.
    """

    upload_mode: UploadMode = "sync"
    max_pending_uploads: int = 1
    staging: StagingMode = "copy"
    staging_budget: int | None = None
    warm_staging: bool | None = None
    dedup: bool = False
    compression: str = "auto"

    def __post_init__(self) -> None:
        if not (self.warm_staging is None or isinstance(self.warm_staging, bool)):
            raise InvalidConfigError(
                f"warm_staging must be None, True or False, got {self.warm_staging!r}")
        check_chunking(self.dedup, self.compression)
        check_upload_mode(self.upload_mode)
        check_max_pending(self.max_pending_uploads)
        check_staging(self.staging)
        if self.staging_budget is not None and (
                isinstance(self.staging_budget, bool) or not isinstance(self.staging_budget, int)
                or self.staging_budget < 1 << 20):
            raise InvalidConfigError(
                f"staging_budget must be a number of bytes >= 1048576 (1 MiB) or None, got "
                f"{self.staging_budget!r}")
