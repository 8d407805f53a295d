"""The retention rules: :class:`CheckpointConfig` (which checkpoints of a trial to keep).

Owns the config's fields, their validation and their JSON form (stored in the
manager state, read back by the CLI and the UI). Upload settings are not
retention: they live in :class:`~checkpoint_store.retention.upload_config.UploadConfig`; the
old ``CheckpointConfig(upload_mode=..., max_pending_uploads=..., staging=...)``
keywords still work, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.scoring import MissingScore as MissingScore
from checkpoint_store.retention.scoring import ScoreOrder as ScoreOrder
from checkpoint_store.retention.scoring import check_retention_fields
from checkpoint_store.retention.upload_config import StagingMode, UploadConfig, UploadMode

if TYPE_CHECKING:
    from checkpoint_store.retention.policies import RetentionPolicy

__all__ = ["CheckpointConfig", "MissingScore", "ScoreOrder"]

# The retention fields: what to_json writes and from_json reads.
_RETENTION_FIELDS = (
    "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order",
    "keep_latest", "missing_score",
)
_UPLOAD_FIELDS = ("upload_mode", "max_pending_uploads", "staging")


@dataclass(frozen=True)
class CheckpointConfig:
    """Which checkpoints to keep. Same semantics as Ray Train's ``CheckpointConfig``.

    ``CheckpointConfig(num_to_keep=K, checkpoint_score_attribute=A,
    checkpoint_score_order=O, missing_score=M)`` is shorthand for
    ``policy=AnyOf(BestN(K, A, O, M), LatestN(1))`` (``LatestN(1)`` comes
    from ``keep_latest``). ``CheckpointConfig(policy=...)`` takes any policy
    of :mod:`checkpoint_store.retention.policies` (or a callable); see
    :meth:`effective_policy` and docs/retention.md.

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
        policy: a retention policy (or a callable ``checkpoints -> indexes``);
            with ``keep_latest`` the latest is preserved too. Excludes
            ``num_to_keep``. Score fields left unset are taken from the
            policy's first :class:`BestN` (they decide ``best_checkpoint``).
        upload_mode, max_pending_uploads, staging: deprecated; pass
            ``upload_config=UploadConfig(...)`` to ``session.start`` or
            :class:`~checkpoint_store.TrialRunner` instead. Still honoured
            (with a :class:`DeprecationWarning`) when no ``upload_config`` is
            given; ``None`` (the default) means unset.

    Raises:
        InvalidConfigError: at construction, for any invalid value (say
            ``num_to_keep=0``, ``2.5`` or ``True``; an empty attribute; an
            order other than ``"max"``/``"min"``; a bad upload setting; a
            ``policy`` that is not a policy, or given with ``num_to_keep``).
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: ScoreOrder = "max"
    keep_latest: bool = True
    missing_score: MissingScore = "worst"
    upload_mode: UploadMode | None = field(default=None, repr=False)
    max_pending_uploads: int | None = field(default=None, repr=False)
    staging: StagingMode | None = field(default=None, repr=False)
    policy: RetentionPolicy | None = None

    def __post_init__(self) -> None:
        self._check_retention()
        if self.policy is not None:
            self._take_policy()
        if self.legacy_upload_config() is not None:
            warnings.warn(
                "CheckpointConfig(upload_mode=..., max_pending_uploads=..., staging=...) is "
                "deprecated: pass upload_config=UploadConfig(...) to session.start or "
                "TrialRunner (from checkpoint_store import UploadConfig)",
                DeprecationWarning,
                stacklevel=3,
            )

    def _check_retention(self) -> None:
        check_retention_fields(self.num_to_keep, self.checkpoint_score_attribute,
                               self.checkpoint_score_order, self.keep_latest,
                               self.missing_score)

    def _take_policy(self) -> None:
        from checkpoint_store.retention.policies import as_policy, best_policies

        if self.num_to_keep is not None:
            raise InvalidConfigError(
                "pass either num_to_keep (top-K shorthand) or policy=..., not both; "
                "num_to_keep=K is AnyOf(BestN(K, ...), LatestN(1))"
            )
        policy = as_policy(self.policy)
        object.__setattr__(self, "policy", policy)
        best = best_policies(policy)
        if best and self.checkpoint_score_attribute is None:
            # The first BestN ranks for best_checkpoint, the CLI's best and Optuna.
            object.__setattr__(self, "checkpoint_score_attribute", best[0].attribute)
            object.__setattr__(self, "checkpoint_score_order", best[0].order)
            object.__setattr__(self, "missing_score", best[0].missing_score)

    def effective_policy(self) -> RetentionPolicy:
        """The rules as one policy: ``policy`` (plus ``LatestN(1)`` under
        ``keep_latest``), or the shorthand ``AnyOf(BestN(num_to_keep,
        checkpoint_score_attribute, checkpoint_score_order, missing_score),
        LatestN(1))`` (``LatestN(1)`` only under ``keep_latest``; ``KeepAll()``
        when ``num_to_keep`` is None)."""
        from checkpoint_store.retention.policies import AnyOf, BestN, KeepAll, LatestN

        if self.policy is not None:
            main: RetentionPolicy = self.policy
        elif self.num_to_keep is None:
            return KeepAll()
        else:
            main = BestN(self.num_to_keep, self.checkpoint_score_attribute,
                         self.checkpoint_score_order, self.missing_score)
        return AnyOf(main, LatestN(1)) if self.keep_latest else main

    def legacy_upload_config(self) -> UploadConfig | None:
        """The upload settings given through the deprecated keywords (unset ones
        take :class:`UploadConfig`'s defaults), or None when none was given.

        Raises:
            InvalidConfigError: a given upload setting is invalid.
        """
        given = {k: getattr(self, k) for k in _UPLOAD_FIELDS if getattr(self, k) is not None}
        return UploadConfig(**given) if given else None

    def to_json(self) -> dict[str, Any]:
        """The retention fields as a JSON object (stored in the manager state);
        a policy adds ``"policy"``, its own JSON form."""
        obj = {k: getattr(self, k) for k in _RETENTION_FIELDS}
        if self.policy is not None:
            obj["policy"] = self.policy.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckpointConfig:
        """Inverse of :meth:`to_json`; unknown keys (upload settings included) are ignored.

        Raises:
            InvalidConfigError: a value is invalid.
        """
        fields = {k: obj[k] for k in _RETENTION_FIELDS if k in obj}
        if obj.get("policy") is not None:
            from checkpoint_store.retention.policies import policy_from_json

            fields["policy"] = policy_from_json(obj["policy"])
        return cls(**fields)
