"""Top-K retention: keep the best ``num_to_keep`` checkpoints, delete the rest.

:class:`CheckpointConfig` has the same fields and meaning as Ray Train's
``CheckpointConfig``; :class:`CheckpointManager` applies it to the committed
checkpoints of one trial. The semantics (docs/retention.md):

* score: ``metrics[attr]`` if that literal key exists, else a nested lookup
  along ``/`` (``"eval/loss"`` -> ``metrics["eval"]["loss"]``). Without a
  score attribute, the most recent checkpoints are kept.
* NaN and missing scores rank worst in both orders (never best) and tie with
  each other; a warning is given once per attribute.
* ties go to the newer checkpoint (higher index).
* the latest checkpoint is kept besides the best K (resume needs it), unless
  ``keep_latest=False``.
* order is the index recorded in each checkpoint's internal metadata.

State goes to ``<trial>/.checkpoint_manager.json`` (atomically) before any
evicted directory is deleted, so a new process restores it; if the file is
missing or corrupt it is rebuilt from the committed checkpoints.
"""

from __future__ import annotations

import logging
import math
import posixpath
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import FORMAT_VERSION, MANAGER_STATE
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.storage import StorageContext

logger = logging.getLogger(__name__)

_MISSING_POLICIES = ("worst", "keep", "raise")


@dataclass(frozen=True)
class CheckpointConfig:
    """Which checkpoints to keep. Same semantics as Ray Train's CheckpointConfig.

    Args:
        num_to_keep: how many best checkpoints to keep (int >= 1), or None to
            keep every checkpoint.
        checkpoint_score_attribute: metric to rank by; a literal key first,
            else a ``/``-separated nested path. None keeps the most recent.
        checkpoint_score_order: ``"max"`` (higher is better) or ``"min"``.
        keep_latest: also keep the newest checkpoint, so a resume always
            starts from the last one (default True; False keeps exactly K).
        missing_score: what a NaN or missing score does: ``"worst"`` ranks it
            last with a warning, ``"keep"`` keeps it and never evicts it,
            ``"raise"`` refuses the report.

    Raises:
        InvalidConfigError: at construction, for any invalid value.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    keep_latest: bool = True
    missing_score: Literal["worst", "keep", "raise"] = "worst"

    def __post_init__(self) -> None:
        k = self.num_to_keep
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidConfigError(
                f"num_to_keep must be an int >= 1 or None (keep all), got {k!r}"
            )
        attr = self.checkpoint_score_attribute
        if attr is not None and (not isinstance(attr, str) or not attr):
            raise InvalidConfigError(
                f"checkpoint_score_attribute must be a non-empty metric name or None, got {attr!r}"
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise InvalidConfigError(
                f"checkpoint_score_order must be 'max' or 'min', got {self.checkpoint_score_order!r}"
            )
        if not isinstance(self.keep_latest, bool):
            raise InvalidConfigError(f"keep_latest must be a bool, got {self.keep_latest!r}")
        if self.missing_score not in _MISSING_POLICIES:
            raise InvalidConfigError(
                f"missing_score must be one of {_MISSING_POLICIES}, got {self.missing_score!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_to_keep": self.num_to_keep,
            "checkpoint_score_attribute": self.checkpoint_score_attribute,
            "checkpoint_score_order": self.checkpoint_score_order,
            "keep_latest": self.keep_latest,
            "missing_score": self.missing_score,
        }


_NOT_FOUND = object()


def lookup_metric(metrics: Mapping[str, Any], attribute: str) -> Any:
    """``metrics[attribute]`` if that literal key exists, else the nested value
    along ``/``; a sentinel (``_NOT_FOUND``) when absent."""
    if attribute in metrics:
        return metrics[attribute]
    node: Any = metrics
    for part in attribute.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return _NOT_FOUND
        node = node[part]
    return node


def score_of(metrics: Mapping[str, Any], attribute: str) -> float | None:
    """The numeric score, or None when missing or NaN.

    Raises:
        InvalidConfigError: the value exists but is not a number (str, list,
            bool, dict ...); the message names the attribute.
    """
    value = lookup_metric(metrics, attribute)
    if value is _NOT_FOUND or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfigError(
            f"checkpoint_score_attribute {attribute!r} has value {value!r} of type "
            f"{type(value).__name__}; scores must be numbers"
        )
    value = float(value)
    return None if math.isnan(value) else value


@dataclass
class _Record:
    index: int
    dir_name: str
    score: float | None
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "dir_name": self.dir_name,
            "score": self.score,
            "metrics": self.metrics,
        }


class CheckpointManager:
    """Keeps the best K committed checkpoints of one trial and deletes the rest.

    Args:
        config: the retention rules.
        storage: the trial's :class:`StorageContext`; all I/O goes through
            its filesystem.

    A new manager on a trial that already has checkpoints restores its state
    from ``.checkpoint_manager.json`` or rebuilds it from the committed
    checkpoints (with a warning). Memory is O(num_to_keep).
    """

    def __init__(self, config: CheckpointConfig, storage: StorageContext):
        if not isinstance(config, CheckpointConfig):
            raise InvalidConfigError(
                f"config must be a CheckpointConfig, got {type(config).__name__}"
            )
        self.config = config
        self._storage = storage
        self._kept: list[_Record] = []
        self._latest: _Record | None = None
        self._pending_deletes: list[str] = []
        self._warned_missing = False
        self._restore()

    # -- scoring ----------------------------------------------------------------

    def _score(self, metrics: Mapping[str, Any], index: int) -> float | None:
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return float(index)
        score = score_of(metrics, attr)
        if score is None:
            if self.config.missing_score == "raise":
                raise InvalidConfigError(
                    f"metric {attr!r} is missing or NaN in the reported metrics "
                    "(missing_score='raise'); report a number or change the policy"
                )
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(
                    f"checkpoint_score_attribute {attr!r} is missing or NaN for checkpoint "
                    f"index {index}; such checkpoints rank worst",
                    stacklevel=4,
                )
        return score

    def _rank_key(self, r: _Record) -> tuple[int, float, int]:
        """Bigger is better: valid scores above missing ones, then the score in
        the configured direction, then the newer index (ties go to the newer)."""
        if r.score is None:
            return (0, 0.0, r.index)
        s = r.score if self.config.checkpoint_score_order == "max" else -r.score
        return (1, s, r.index)

    def _select(self, records: list[_Record], latest: _Record | None) -> list[_Record]:
        k = self.config.num_to_keep
        if k is None:
            return sorted(records, key=lambda r: r.index)
        keep_missing = self.config.missing_score == "keep" and self.config.checkpoint_score_attribute
        ranked = sorted(records, key=self._rank_key, reverse=True)
        kept = {id(r) for r in ranked[:k]}
        if keep_missing:
            kept |= {id(r) for r in records if r.score is None}
        if self.config.keep_latest and latest is not None:
            kept.add(id(latest))
        return sorted((r for r in records if id(r) in kept), key=lambda r: r.index)

    # -- public -------------------------------------------------------------------

    def register(self, checkpoint: Checkpoint, metrics: Mapping[str, Any]) -> list[str]:
        """Track a newly committed checkpoint and apply retention.

        Args:
            checkpoint: a committed checkpoint inside this manager's trial.
            metrics: the metrics reported with it.

        Returns:
            Directory names deleted (or scheduled for deletion) by this call.

        Raises:
            InvalidConfigError: the score is not numeric, or missing with
                ``missing_score="raise"``. Nothing is deleted then.
        """
        meta = checkpoint.internal_metadata
        dir_name = posixpath.basename(checkpoint.path.rstrip("/"))
        index = int(meta["index"]) if "index" in meta else self._next_index_hint(dir_name)
        record = _Record(index, dir_name, self._score(metrics, index), dict(metrics))
        candidates = [r for r in self._kept if r.dir_name != dir_name] + [record]
        latest = record if self._latest is None or index >= self._latest.index else self._latest
        kept = self._select(candidates, latest)
        kept_names = {r.dir_name for r in kept}
        evicted = [r.dir_name for r in candidates if r.dir_name not in kept_names]
        self._kept, self._latest = kept, latest
        self._pending_deletes.extend(evicted)
        self._save_state()
        self._delete_pending()
        return evicted

    def _next_index_hint(self, dir_name: str) -> int:
        from checkpoint_store._layout import parse_checkpoint_dir_name

        parsed = parse_checkpoint_dir_name(dir_name)
        if parsed is not None:
            return parsed
        return (self._latest.index + 1) if self._latest else 0

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest registered checkpoint (highest index), or None."""
        return self._storage.checkpoint(self._latest.dir_name) if self._latest else None

    @property
    def latest_index(self) -> int | None:
        return self._latest.index if self._latest else None

    @property
    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Kept checkpoints with their metrics, best first (ties: newer first).

        Without a score attribute, most recent first.
        """
        ranked = sorted(self._kept, key=self._rank_key, reverse=True)
        return [(self._storage.checkpoint(r.dir_name), dict(r.metrics)) for r in ranked]

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        """The best kept checkpoint, or None before the first registration."""
        best = self.best_checkpoints
        return best[0][0] if best else None

    @property
    def kept_dir_names(self) -> list[str]:
        """Directory names of the kept checkpoints, oldest first."""
        return [r.dir_name for r in self._kept]

    # -- state ------------------------------------------------------------------------

    @property
    def _state_path(self) -> str:
        return posixpath.join(self._storage.trial_path, MANAGER_STATE)

    def _save_state(self) -> None:
        state = {
            "format_version": FORMAT_VERSION,
            "config": self.config.to_json(),
            "latest_index": self._latest.index if self._latest else None,
            "latest_dir_name": self._latest.dir_name if self._latest else None,
            "checkpoints": [r.to_json() for r in self._kept],
            "pending_deletes": self._pending_deletes,
        }
        self._storage.ensure_trial_dir()
        _fsutil.write_bytes(
            self._storage.filesystem, self._state_path, _json.dumps(state),
            self._storage.backend.capabilities, fsync=self._storage.fsync,
        )

    def _delete_pending(self) -> None:
        remaining = []
        for name in self._pending_deletes:
            try:
                self._storage.delete_checkpoint(name)
            except OSError as exc:
                logger.warning("could not delete %s (will retry later): %s", name, exc)
                remaining.append(name)
        if remaining != self._pending_deletes:
            self._pending_deletes = remaining
            self._save_state()

    def _load_state(self) -> dict[str, Any] | None:
        try:
            raw = _fsutil.read_bytes(self._storage.filesystem, self._state_path)
        except (FileNotFoundError, OSError):
            return None
        try:
            state = _json.loads(raw)
        except ValueError:
            return None
        if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
            return None
        return state

    def _restore(self) -> None:
        committed = {
            posixpath.basename(c.path): meta for c, meta in self._storage.committed_checkpoints()
        }
        state = self._load_state()
        records: list[_Record] = []
        latest: _Record | None = None
        pending: list[str] = []
        if state is not None:
            try:
                for item in state["checkpoints"]:
                    if item["dir_name"] in committed:  # never hand out a deleted checkpoint
                        records.append(
                            _Record(int(item["index"]), item["dir_name"], item["score"],
                                    dict(item.get("metrics") or {}))
                        )
                pending = [n for n in state.get("pending_deletes", []) if isinstance(n, str)]
                known = {r.dir_name for r in records} | set(pending)
                last_index = state.get("latest_index")
            except (KeyError, TypeError, ValueError):
                state = None
        if state is None:
            if committed:
                warnings.warn(
                    f"retention state {self._storage.uri(self._state_path)} is missing or "
                    "corrupt; rebuilding it from the committed checkpoints",
                    stacklevel=3,
                )
            known, last_index, records, pending = set(), None, [], []
        # Checkpoints committed after the state was last written (a crash in
        # between) join as new registrations; older unknown ones were evicted.
        for name, meta in sorted(committed.items(), key=lambda kv: kv[1]["index"]):
            if name in known:
                continue
            if last_index is not None and meta["index"] <= last_index:
                pending.append(name)
                continue
            metrics = meta.get("metrics") or {}
            try:
                score = self._score(metrics, meta["index"])
            except InvalidConfigError:
                score = None
            records.append(_Record(meta["index"], name, score, dict(metrics)))
        for r in records:
            if latest is None or r.index > latest.index:
                latest = r
        if state is not None and state.get("latest_dir_name") in committed:
            prev = next((r for r in records if r.dir_name == state["latest_dir_name"]), None)
            if prev is not None and (latest is None or prev.index >= latest.index):
                latest = prev
        self._latest = latest
        kept = self._select(records, latest)
        kept_names = {r.dir_name for r in kept}
        self._kept = kept
        self._pending_deletes = [n for n in pending if n not in kept_names] + [
            r.dir_name for r in records if r.dir_name not in kept_names
        ]
