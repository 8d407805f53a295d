"""The one Session implementation behind ``report()``, for training and tuning."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store import _json
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError
from checkpoint_store.retention import CheckpointConfig, CheckpointManager
from checkpoint_store.storage import ResultLog, StorageContext

AUTO_FILLED = (
    "training_iteration",
    "timestamp",
    "time_total_s",
    "time_this_iter_s",
    "trial_id",
    "checkpoint_dir_name",
)


@dataclass(frozen=True)
class SessionContext:
    """What the code inside a session may ask about where it runs.

    Attributes:
        experiment_name, trial_name: the layout names.
        trial_id: ``"<experiment_name>/<trial_name>"``.
        world_rank, world_size, local_rank: this process's place in a
            multi-worker job (0, 1, 0 for a single process).
        trial_dir: URI of the trial directory.
        storage: the :class:`StorageContext` (filesystem and layout).
        config: the trial config, as given to ``start``.
    """

    experiment_name: str
    trial_name: str
    trial_id: str
    world_rank: int
    world_size: int
    local_rank: int
    trial_dir: str
    storage: StorageContext
    config: Mapping[str, Any]


def _int_from(value: int | None, env: str, default: int, what: str) -> int:
    if value is None:
        raw = os.environ.get(env)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise InvalidConfigError(f"environment variable {env}={raw!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfigError(f"{what} must be an int >= 0, got {value!r}")
    return value


class Session:
    """One training run's (or trial's) reporting state. Build it with
    :func:`checkpoint_store.session.start`.

    Thread-safety: one thread reports; ``report`` is serialised by a lock.
    """

    def __init__(
        self,
        storage: StorageContext,
        checkpoint_config: CheckpointConfig | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        world_rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
    ):
        self.storage = storage
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        self.config = _json.to_json_object(config or {}, "config")
        self.world_rank = _int_from(world_rank, "RANK", 0, "world_rank")
        self.world_size = _int_from(world_size, "WORLD_SIZE", 1, "world_size")
        self.local_rank = _int_from(local_rank, "LOCAL_RANK", 0, "local_rank")
        if self.world_size < 1 or self.world_rank >= self.world_size:
            raise InvalidConfigError(
                f"world_rank {self.world_rank} must be in [0, world_size={self.world_size})"
            )
        self._lock = threading.Lock()
        self._closed = False
        storage.ensure_trial_dir()
        if self.config:
            storage.write_params(self.config)
        rows = storage.read_results()
        last = rows[-1] if rows else {}
        self._iteration = int(last.get("training_iteration", 0) or 0)
        self._time_offset = float(last.get("time_total_s", 0.0) or 0.0)
        self._results = ResultLog(storage, rows)
        self.manager = CheckpointManager(self.checkpoint_config, storage)
        committed = storage.committed_checkpoints()
        self._latest: Checkpoint | None = committed[-1][0] if committed else None
        # Numbering continues past every index the retention state remembers.
        self._next_index = max(storage.next_checkpoint_index(), self.manager.next_index)
        self._start = time.time()
        self._last_report = self._start

    @property
    def trial_id(self) -> str:
        return f"{self.storage.experiment_name}/{self.storage.trial_name}"

    def get_context(self) -> SessionContext:
        s = self.storage
        return SessionContext(
            experiment_name=s.experiment_name,
            trial_name=s.trial_name,
            trial_id=self.trial_id,
            world_rank=self.world_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            trial_dir=s.uri(s.trial_path),
            storage=s,
            config=dict(self.config),
        )

    def get_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint of this trial (also one written by an
        earlier process), or None."""
        return self._latest

    def report(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None = None) -> dict[str, Any]:
        """Record ``metrics`` and, optionally, persist and commit ``checkpoint``.

        Returns:
            The result row as written to ``result.json`` (metrics plus the
            auto-filled keys).

        Raises:
            MetadataError: ``metrics`` is not a dict of JSON-serialisable values
                (the message names the key). Nothing is written.
            InvalidConfigError: ``checkpoint`` is not a Checkpoint, or its score
                is not numeric.
            CheckpointStoreError: the session has ended.
        """
        clean = _json.to_json_object(metrics, "metrics")
        if checkpoint is not None:
            _require_checkpoint(checkpoint)
        with self._lock:
            if self._closed:
                raise CheckpointStoreError("this session has ended; start a new one to report")
            now = time.time()
            self._iteration += 1
            row = dict(clean)
            row.update(
                training_iteration=self._iteration,
                timestamp=now,
                time_total_s=self._time_offset + (now - self._start),
                time_this_iter_s=now - self._last_report,
                trial_id=self.trial_id,
                checkpoint_dir_name=None,
            )
            self._last_report = now
            if checkpoint is not None:
                try:  # refuse a bad score before anything is uploaded
                    self.manager.validate_metrics(row)
                except CheckpointStoreError:
                    self._iteration -= 1
                    raise
                index = self._next_index
                from checkpoint_store._layout import checkpoint_dir_name

                row["checkpoint_dir_name"] = checkpoint_dir_name(index)
                persisted = self.storage.persist_checkpoint(
                    checkpoint, index,
                    {"metrics": row, "world_size": self.world_size,
                     "run_id": self.manager.run_id},
                )
                self._next_index = index + 1
                self._latest = persisted
                self.manager.register(persisted, row)
            self._results.append(row)
            return row

    def close(self) -> None:
        self._closed = True
        # Releases the trial's retention lease (also when an exception ends the session).
        self.manager.close()
