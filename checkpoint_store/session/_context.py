"""What the code inside a session may ask about where it runs, and where a
resumed trial's counters continue from."""

from __future__ import annotations

import math
import posixpath
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import PARAMS_FILE
from checkpoint_store._results.writer import valid_iteration
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.storage import StorageContext

__all__ = ["RESUME_FROM_KEY", "SessionContext", "checkpoint_counters", "recorded_resume_from",
           "resume_counters"]


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

    # The accessors of Ray Train's TrainContext, so code written for it runs as is.
    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str:
        return self.trial_name

    def get_trial_id(self) -> str:
        return self.trial_id

    def get_trial_dir(self) -> str:
        return self.trial_dir


#: The ``params.json`` key recording the checkpoint a trial started from
#: (``session.start(resume_from=...)``): its URI, index, run id, experiment and trial.
RESUME_FROM_KEY = "_resume_from"


def recorded_resume_from(storage: StorageContext, uri: str) -> dict[str, Any]:
    """The ``"_resume_from"`` record of the trial's ``params.json`` when it names
    ``uri`` (what the trial's first start read of its source), else ``{"uri": uri}``.

    A restart of a trial with checkpoints of its own keeps this record rather
    than read the source again (it may be gone by then)."""
    try:
        params = _json.loads(_fsutil.read_bytes(
            storage.filesystem, posixpath.join(storage.trial_path, PARAMS_FILE),
            retry=storage.retry))
    except (OSError, ValueError):
        params = None
    record = params.get(RESUME_FROM_KEY) if isinstance(params, dict) else None
    if isinstance(record, dict) and record.get("uri") == uri:
        return record
    return {"uri": uri}


def checkpoint_counters(meta: Mapping[str, Any]) -> tuple[int, float]:
    """The iteration and total time recorded with a committed checkpoint: its
    internal metadata's ``metrics`` hold the row it was reported with, so
    they bound the counters from below when ``result.json``'s last rows are
    damaged or lost (a hand edit, a torn write, a copy without the file).
    ``(0, 0.0)`` where a value is missing or not a count/finite number.

    Args:
        meta: ``{"metrics": {...}, ...}`` as the retention state or the
            checkpoint's ``.internal_metadata.json`` hold it.
    """
    metrics = meta.get("metrics")
    if not isinstance(metrics, Mapping):
        return 0, 0.0
    iteration = valid_iteration(metrics.get("training_iteration")) or 0
    t = metrics.get("time_total_s")
    total = float(t) if (not isinstance(t, bool) and isinstance(t, (int, float))
                         and math.isfinite(t) and t >= 0) else 0.0
    return iteration, total


def resume_counters(rows: list[dict[str, Any]], where: str) -> tuple[int, float]:
    """The iteration and total time to continue from, given the trial's last
    rows (:func:`~checkpoint_store._results.writer.last_result_rows`: back to the last
    row holding a valid ``training_iteration``).

    A row another tool (or a hand edit) left with a value that is not a count
    (``"abc"``, ``[1]``) must not make the trial impossible to resume: such
    values are skipped with one warning, and counting continues after the
    highest valid ``training_iteration``.
    """
    iteration, total, bad = 0, 0.0, 0
    for row in rows:
        it = valid_iteration(row.get("training_iteration"))
        if it is None and row.get("training_iteration") is not None:
            bad += 1
        iteration = max(iteration, it or 0)
        t = row.get("time_total_s")
        if not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t):
            total = max(total, float(t))
    if bad:
        warnings.warn(
            f"{where}: {bad} row(s) hold a training_iteration that is not a count; "
            f"ignored them, continuing after iteration {iteration}",
            RuntimeWarning, stacklevel=4,
        )
    return iteration, total
