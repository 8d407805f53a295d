"""The local tier's state file and its records: where each committed
checkpoint of the local tier stands with the persistent tier.

The file is ``.cs_tier_state.json`` in the tier's trial directory
(docs/format.md, "Local tier"); :class:`~checkpoint_store.tiers.local.FastTier`
writes it on every change and reads it when it opens. A missing or damaged
file is not an error: the state is rebuilt from the committed directories.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from checkpoint_store._format.layout import (
    TEMP_FILE_PREFIX,
    TIER_STATE_FILE,
    checkpoint_dir_name,
    local_tier_rank_dir_name,
)

__all__ = ["TIER_STATE_VERSION", "DurableStatus", "TierEntry", "local_trial_dir",
           "read_tier_state"]

TIER_STATE_VERSION = 1

#: Where a checkpoint of the local tier stands with the persistent tier:
#: ``"pending"`` (selected, its copy not committed yet), ``"durable"``
#: (committed there), ``"local_only"`` (``persist`` did not select it).
DurableStatus = Literal["pending", "durable", "local_only"]
_STATUSES = ("pending", "durable", "local_only")


@dataclass
class TierEntry:
    """One committed checkpoint of the local tier, as the state file records it.

    Attributes:
        index: its index (the same checkpoint on every tier).
        bytes: the sum of its files' sizes (its manifest).
        durable: ``"pending"``, ``"durable"`` or ``"local_only"`` (:data:`DurableStatus`).
    """

    index: int
    bytes: int
    durable: DurableStatus

    @property
    def dir_name(self) -> str:
        return checkpoint_dir_name(self.index)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "dir_name": self.dir_name, "bytes": self.bytes,
                "durable": self.durable}


def local_trial_dir(path: str, experiment_name: str, trial_name: str, *, world_rank: int = 0,
                    world_size: int = 1) -> str:
    """Where a local tier at ``path`` keeps a trial's copies (a local path):
    ``<path>/<experiment>/<trial>``, with several ranks ``.../rank_<rank>``."""
    trial = os.path.join(path, experiment_name, trial_name)
    return os.path.join(trial, local_tier_rank_dir_name(world_rank)) if world_size > 1 else trial


def read_tier_state(trial_dir: str) -> dict[int, TierEntry] | None:
    """The entries of the local tier state file in ``trial_dir`` (a local
    directory), or None when there is none or it cannot be read (then the
    state is rebuilt from the committed directories)."""
    try:
        with open(os.path.join(trial_dir, TIER_STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("version") != TIER_STATE_VERSION:
        return None
    out: dict[int, TierEntry] = {}
    for e in body.get("checkpoints") or []:
        try:
            index, size, status = int(e["index"]), int(e["bytes"]), e["durable"]
        except (KeyError, TypeError, ValueError):
            continue
        if status in _STATUSES and index >= 0:
            out[index] = TierEntry(index, size, status)
    return out


def _read_evicting(trial_dir: str) -> set[int]:
    """The indexes the state file in ``trial_dir`` lists as evicted but maybe not
    deleted yet (empty when none, or when it cannot be read)."""
    try:
        with open(os.path.join(trial_dir, TIER_STATE_FILE), "rb") as f:
            body = json.loads(f.read())
        return {int(i) for i in body.get("evicting") or [] if int(i) >= 0}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


def _write_atomic(path: str, data: bytes, fsync: bool) -> None:
    fd, tmp = tempfile.mkstemp(prefix=TEMP_FILE_PREFIX, dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)



def _manifest_bytes(meta: Mapping[str, Any]) -> int:
    return sum(int(e.get("size", 0)) for e in meta.get("manifest") or [])
