"""The manager state file, ``<trial>/.checkpoint_manager.json``: its fields, read and write.

Owns :class:`ManagerState` (what a manager writes before it deletes anything,
so a new process can take over), its JSON form, the checks a file must pass
to be trusted (anything else is rebuilt from the checkpoints' internal
metadata by the manager), and the atomic write. Files of every earlier
release read back; a file of a newer format is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import FORMAT_VERSION
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.storage import StorageContext

__all__ = ["ManagerState", "StoredCheckpoint", "load_state", "save_state"]

logger = logging.getLogger(__name__)

_STATE_KIND = "checkpoint_manager_state"


@dataclass(frozen=True)
class StoredCheckpoint:
    """One kept checkpoint as the state file records it."""

    index: int
    dir_name: str
    score: float | None
    metrics: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "dir_name": self.dir_name, "score": self.score,
                "metrics": dict(self.metrics)}


@dataclass(frozen=True)
class ManagerState:
    """What one trial's manager has decided, as stored.

    Attributes:
        run_id: the run whose checkpoints this manager may delete.
        config: the retention config as stored (:meth:`CheckpointConfig.to_json`).
        latest_index: the highest index registered, kept or not (None before any).
        next_index: the next checkpoint index to use (None: not recorded).
        checkpoints: the kept checkpoints, by directory name.
        pending_deletes: evicted directory names whose delete is still due.
    """

    run_id: str
    config: Mapping[str, Any] | None = None
    latest_index: int | None = None
    next_index: int | None = None
    checkpoints: Mapping[str, StoredCheckpoint] = field(default_factory=dict)
    pending_deletes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": _STATE_KIND,
            "format_version": FORMAT_VERSION,
            "run_id": self.run_id,
            "config": dict(self.config or {}),
            "latest_index": self.latest_index,
            "next_index": self.next_index,
            "checkpoints": [c.to_json() for c in self.checkpoints.values()],
            "pending_deletes": list(self.pending_deletes),
            "updated_at": time.time(),
        }

    @classmethod
    def from_json(cls, state: Mapping[str, Any]) -> ManagerState | None:
        """The state of a parsed file, or None when its fields are not what a
        manager writes (the caller rebuilds from the checkpoints then)."""
        if not _well_formed(state):
            return None
        latest, following = state.get("latest_index"), state.get("next_index")
        config = state.get("config")
        return cls(
            run_id=state["run_id"],
            config=config if isinstance(config, Mapping) else None,
            latest_index=latest if isinstance(latest, int) else None,
            next_index=following if isinstance(following, int) else None,
            checkpoints={
                c["dir_name"]: StoredCheckpoint(c["index"], c["dir_name"], c.get("score"),
                                                _metrics_of(c))
                for c in state["checkpoints"]
            },
            pending_deletes=tuple(state.get("pending_deletes", [])),
        )


def _metrics_of(stored: Mapping[str, Any]) -> Mapping[str, Any]:
    metrics = stored.get("metrics")
    return metrics if isinstance(metrics, Mapping) else {}


def _well_formed(state: Mapping[str, Any]) -> bool:
    def is_entry(c: Any) -> bool:
        return (isinstance(c, dict) and isinstance(c.get("dir_name"), str)
                and isinstance(c.get("index"), int) and not isinstance(c.get("index"), bool))

    return bool(
        state.get("format_version") == FORMAT_VERSION
        and isinstance(state.get("run_id"), str) and state["run_id"]
        and isinstance(state.get("checkpoints"), list)
        and all(is_entry(c) for c in state["checkpoints"])
        and all(isinstance(n, str) for n in state.get("pending_deletes", []))
    )


def load_state(storage: StorageContext, path: str) -> tuple[ManagerState | None, str]:
    """``(state, problem)``: the state at ``path``, or None with why (``"missing"``,
    ``"unreadable (...)"``, ``"corrupt (...)"``; problem is ``""`` with a state).

    Raises:
        InvalidConfigError: the file has a newer format than this release reads.
    """
    fs = storage.filesystem
    try:
        raw = _fsutil.read_bytes(fs, path)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        if not _fsutil.exists(fs, path):
            return None, "missing"
        return None, f"unreadable ({exc})"
    try:
        obj = _json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "corrupt (not JSON)"
    if not isinstance(obj, dict):
        return None, "corrupt (not a JSON object)"
    version = obj.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise InvalidConfigError(
            f"{storage.uri(path)} has format version {version}, newer "
            f"than this checkpoint-store reads ({FORMAT_VERSION}); upgrade checkpoint-store"
        )
    state = ManagerState.from_json(obj)
    if state is None:
        return None, "corrupt (unexpected fields)"
    return state, ""


def save_state(storage: StorageContext, path: str, state: ManagerState) -> bool:
    """Write ``state`` to ``path`` atomically; False (logged) when storage refused
    it, in which case nothing may be deleted yet."""
    try:
        storage.ensure_trial_dir()
        _fsutil.write_bytes(
            storage.filesystem, path, _json.dumps(state.to_json()),
            storage.backend.capabilities, fsync=storage.fsync,
        )
        return True
    except Exception as exc:
        logger.warning(
            "could not write retention state %s (deletes postponed, retried at the next "
            "report): %s", storage.uri(path), exc,
        )
        return False
