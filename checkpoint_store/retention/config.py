"""The retention rules: :class:`CheckpointConfig` (which checkpoints of a trial to keep).

Owns the config's fields, their validation and their JSON form (stored in the
manager state, read back by the CLI and the UI). Upload settings are not
retention: they live in :class:`~checkpoint_store._async.UploadConfig`; the
old ``CheckpointConfig(upload_mode=..., max_pending_uploads=..., staging=...)``
keywords still work, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from checkpoint_store._async import StagingMode, UploadConfig, UploadMode
from checkpoint_store.errors import InvalidConfigError

__all__ = ["CheckpointConfig", "MissingScore", "ScoreOrder"]

#: Which way a score is better: ``"max"`` (higher) or ``"min"`` (lower).
ScoreOrder = Literal["max", "min"]
#: What a NaN or missing score does (see :class:`CheckpointConfig`).
MissingScore = Literal["worst", "keep", "raise"]

_MISSING_POLICIES: tuple[MissingScore, ...] = get_args(MissingScore)
_SCORE_ORDERS: tuple[ScoreOrder, ...] = get_args(ScoreOrder)
# The retention fields: what to_json writes and from_json reads.
_RETENTION_FIELDS = (
    "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order",
    "keep_latest", "missing_score",
)
_UPLOAD_FIELDS = ("upload_mode", "max_pending_uploads", "staging")


@dataclass(frozen=True)
class CheckpointConfig:
    """Which checkpoints to keep. Same semantics as Ray Train's ``CheckpointConfig``.

    Args:
        num_to_keep: how many best checkpoints to keep (int >= 1), or None to
            keep every checkpoint.
        checkpoint_score_attribute: metric to rank by; a literal key first,
            else a ``/``-separated nested path (``"eval/loss"``). None ranks by
            recency (the newest K are kept).
        checkpoint_score_order: ``"max"`` (higher is better) or ``"min"``.
        keep_latest: also keep the newest checkpoint, so a resume always
            starts from the last one (default True; False keeps exactly K).
        missing_score: what a NaN or missing score does: ``"worst"`` ranks it
            below every number (with a warning), ``"keep"`` keeps it and never
            evicts it (it does not count towards K), ``"raise"`` refuses the
            report with :class:`InvalidConfigError`.
        upload_mode, max_pending_uploads, staging: deprecated; pass
            ``upload_config=UploadConfig(...)`` to ``session.start`` or
            :class:`~checkpoint_store.TrialRunner` instead. Still honoured
            (with a :class:`DeprecationWarning`) when no ``upload_config`` is
            given; ``None`` (the default) means unset.

    Raises:
        InvalidConfigError: at construction, for any invalid value (say
            ``num_to_keep=0``, ``2.5`` or ``True``; an empty attribute; an
            order other than ``"max"``/``"min"``; a bad upload setting).
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: ScoreOrder = "max"
    keep_latest: bool = True
    missing_score: MissingScore = "worst"
    upload_mode: UploadMode | None = field(default=None, repr=False)
    max_pending_uploads: int | None = field(default=None, repr=False)
    staging: StagingMode | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_retention()
        if self.legacy_upload_config() is not None:
            warnings.warn(
                "CheckpointConfig(upload_mode=..., max_pending_uploads=..., staging=...) is "
                "deprecated: pass upload_config=UploadConfig(...) to session.start or "
                "TrialRunner (from checkpoint_store import UploadConfig)",
                DeprecationWarning,
                stacklevel=3,
            )

    def _check_retention(self) -> None:
        k = self.num_to_keep
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidConfigError(
                f"num_to_keep must be an int >= 1, or None to keep every checkpoint; got {k!r}"
            )
        attr = self.checkpoint_score_attribute
        if attr is not None and (not isinstance(attr, str) or not attr):
            raise InvalidConfigError(
                "checkpoint_score_attribute must be a non-empty metric name (nested: "
                f"'eval/loss') or None to keep the most recent; got {attr!r}"
            )
        if self.checkpoint_score_order not in _SCORE_ORDERS:
            raise InvalidConfigError(
                "checkpoint_score_order must be 'max' (higher is better) or 'min'; "
                f"got {self.checkpoint_score_order!r}"
            )
        if not isinstance(self.keep_latest, bool):
            raise InvalidConfigError(f"keep_latest must be True or False, got {self.keep_latest!r}")
        if self.missing_score not in _MISSING_POLICIES:
            raise InvalidConfigError(
                f"missing_score must be one of {_MISSING_POLICIES}, got {self.missing_score!r}"
            )

    def legacy_upload_config(self) -> UploadConfig | None:
        """The upload settings given through the deprecated keywords (unset ones
        take :class:`UploadConfig`'s defaults), or None when none was given.

        Raises:
            InvalidConfigError: a given upload setting is invalid.
        """
        given = {k: getattr(self, k) for k in _UPLOAD_FIELDS if getattr(self, k) is not None}
        return UploadConfig(**given) if given else None

    def to_json(self) -> dict[str, Any]:
        """The retention fields as a JSON object (stored in the manager state)."""
        return {k: getattr(self, k) for k in _RETENTION_FIELDS}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckpointConfig:
        """Inverse of :meth:`to_json`; unknown keys (upload settings included) are ignored.

        Raises:
            InvalidConfigError: a value is invalid.
        """
        return cls(**{k: obj[k] for k in _RETENTION_FIELDS if k in obj})
