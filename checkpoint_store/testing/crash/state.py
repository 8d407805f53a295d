"""Every crash point of the retention state (see :func:`sweep_state_crashes`)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StateCrashReport", "sweep_state_crashes"]


@dataclass
class StateCrashReport:
    """What :func:`sweep_state_crashes` found.

    Attributes:
        points: crash points tried (one run per point).
        violations: ``"point N: what is wrong"``, empty when every point was clean.
    """

    points: int = 0
    violations: list[str] = field(default_factory=list)


def sweep_state_crashes(root: str, *, reports: int = 8, num_to_keep: int | None = 2,
                        compact_every: int = 3, chunk_entries: int = 2,
                        fanout: int = 2) -> StateCrashReport:
    """Crash a reporting process at every mutating storage call, one run each,
    and check what the next manager makes of the trial.

    Each run registers ``reports`` checkpoints on local disk (scores out of
    order, so retention evicts and deletes) through a filesystem that dies
    (:class:`~checkpoint_store.testing.faults.SimulatedCrash`) at its k-th
    mutating call: a checkpoint's upload or commit, a log record, a snapshot's
    chunk or root, a delete of a folded record or replaced chunk, an evicted
    checkpoint's delete. Small state thresholds (``compact_every``,
    ``chunk_entries``, ``fanout``) put every step of a compaction within a few
    reports. After the crash a new manager opens the trial (the dead
    process's lease removed, as its expiry would) and must find: a state
    that reads without a "corrupt" warning, exactly the kept set retention
    gives for the committed checkpoints (docs/retention.md), every
    checkpoint it did not evict still committed, nothing else left once its
    deletes ran, and no state part beyond the root, its chunks and the records
    after it. The sweep ends at the first run that finishes without crashing.
    """
    from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager, StorageContext
    from checkpoint_store._format.layout import LEASE_FILE
    from checkpoint_store.retention import statelog
    from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend

    config = (CheckpointConfig(num_to_keep, "score", "max") if num_to_keep is not None
              else CheckpointConfig(checkpoint_score_attribute="score"))
    src = os.path.join(root, "src")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"w" * 64)
    scores = [float((i * 7) % 11) for i in range(reports)]
    saved = (statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT)
    statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT = (
        compact_every, chunk_entries, fanout)
    report = StateCrashReport()
    try:
        for point in range(100_000):
            real = StorageContext(os.path.join(root, f"point{point}"), "exp", "t", fsync=False)
            dying = StorageContext.from_backend(
                faulty_backend(real.backend, crash_after_writes=point), real.storage_path,
                "exp", "t", fsync=False)
            crashed = False
            manager = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                acked = 0
                try:
                    manager = CheckpointManager(config, dying)
                    for i, score in enumerate(scores):
                        ckpt = dying.persist_checkpoint(
                            Checkpoint(src), i, {"metrics": {"score": score},
                                                 "run_id": manager.run_id})
                        manager.register(ckpt, {"score": score})
                        acked += 1
                    manager.close()
                except SimulatedCrash:
                    crashed = True
                    if manager is not None and manager._lease is not None:
                        manager._lease.stop_renewing()  # a dead process releases nothing
                        manager._lease._released = True
            report.points += 1
            report.violations += [f"point {point}: {v}" for v in
                                  _check_stored_state(real, config, scores, acked)]
            report.violations += [f"point {point}: {v}" for v in
                                  _check_after_crash(real, config, scores, LEASE_FILE)]
            if not crashed:
                return report
        return report
    finally:
        statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT = saved


def _check_stored_state(storage: Any, config: Any, scores: list[float], acked: int
                        ) -> list[str]:
    """The state as stored, before any manager repairs it: every registration
    that returned is in it, with what it evicted; the one cut short may be."""
    from checkpoint_store._format.layout import checkpoint_dir_name
    from checkpoint_store.retention.statelog import load_state
    from checkpoint_store.testing.stateful import RetentionModel

    def kept_after(n: int) -> set[str]:
        model = RetentionModel(config)
        for i in range(n):
            model.add(i, scores[i])
        return {checkpoint_dir_name(i) for i in model.kept()}

    state, problem = load_state(storage)
    if state is None:
        return [] if acked == 0 and problem == "missing" else [f"state lost: {problem}"]
    got = set(state.checkpoints)
    allowed = [kept_after(acked), kept_after(min(acked + 1, len(scores)))]
    if got not in allowed:
        return [f"stored kept set {sorted(got)}, after {acked} registrations it is "
                f"{sorted(allowed[0])} (or {sorted(allowed[1])})"]
    evicted = (({checkpoint_dir_name(i) for i in range(acked)} - allowed[0])
               | ({checkpoint_dir_name(i) for i in range(acked + 1)} - allowed[1]))
    if not set(state.pending_deletes) <= evicted:
        return [f"pending deletes {state.pending_deletes} name a checkpoint never evicted"]
    return []


def _check_after_crash(storage: Any, config: Any, scores: list[float],
                       lease_file: str) -> list[str]:
    from checkpoint_store import CheckpointManager
    from checkpoint_store._format.layout import (
        MANAGER_STATE,
        checkpoint_dir_name,
        parse_state_chunk_name,
        parse_state_log_name,
    )
    from checkpoint_store._util import fs as _fsutil
    from checkpoint_store.retention.statelog import load_state
    from checkpoint_store.testing.stateful import RetentionModel

    fs, trial = storage.filesystem, storage.trial_path
    _fsutil.delete_file(fs, os.path.join(trial, lease_file))
    committed = [name for _, name in storage.checkpoint_dirs()
                 if storage.checkpoint(name).internal_metadata.get("index") is not None]
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = CheckpointManager(config, storage)
    for w in caught:
        if "corrupt" in str(w.message) or "unreadable" in str(w.message):
            problems.append(f"the state did not survive: {w.message}")
    # The kept set retention gives for the committed checkpoints, whatever was
    # evicted (and deleted) before the crash: those are gone or pending.
    model = RetentionModel(config)
    survivors = {name for name in committed}
    for i, score in enumerate(scores):
        if checkpoint_dir_name(i) in survivors:
            model.add(i, score)
    want = [checkpoint_dir_name(i) for i in model.kept()]
    got = manager.kept_dir_names
    if not set(want) <= set(got) | (set(committed) - survivors):
        problems.append(f"kept {got}, retention keeps {want}")
    if not set(got) <= set(committed):
        problems.append(f"kept but not committed: {sorted(set(got) - set(committed))}")
    manager.retry_deletes()
    left = [name for _, name in storage.checkpoint_dirs()
            if storage.checkpoint(name).internal_metadata.get("index") is not None]
    if sorted(left) != sorted(manager.kept_dir_names):
        problems.append(f"committed {left} after the deletes, kept {manager.kept_dir_names}")
    manager.close()
    state, problem = load_state(storage)
    if state is None and committed:
        problems.append(f"no state after a restart: {problem}")
    if state is not None:
        root = json.loads(_fsutil.read_bytes(fs, os.path.join(trial, MANAGER_STATE)))
        named = {c["name"] for c in root["chunks"]}
        for fi in _fsutil.list_dir(fs, trial):
            name = os.path.basename(fi.path)
            seq = parse_state_log_name(name)
            if (seq is not None and seq <= root["seq"]) or (
                    parse_state_chunk_name(name) is not None and name not in named):
                problems.append(f"state part left behind: {name}")
    return problems
