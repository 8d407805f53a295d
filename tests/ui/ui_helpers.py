"""Helpers for the ui tests: trials written by real sessions, and the library's answers."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    StorageContext,
    session,
)

NUM_TO_KEEP = 2
CONFIG = CheckpointConfig(num_to_keep=NUM_TO_KEEP, checkpoint_score_attribute="val/accuracy",
                          checkpoint_score_order="max")
XSS = "<img src=x onerror=alert(1)>"

# experiment -> trial -> (scores, which reports carry a checkpoint, params)
LAYOUT: dict[str, dict[str, tuple[list[float], list[bool], dict[str, Any]]]] = {
    "sweep": {
        "lr-0.1": ([0.50, 0.62, 0.71, 0.69, 0.74, 0.60], [True] * 6, {"lr": 0.1, "hidden": 32}),
        "lr-0.01": ([0.40, 0.55, 0.58, 0.66], [True, False, True, True],
                    {"lr": 0.01, "hidden": 64}),
        "lr-1.0": ([0.30, 0.20, 0.25], [True, True, True], {"lr": 1.0, "hidden": 32}),
    },
    XSS: {
        "t0": ([0.1, 0.3, 0.2], [True, True, True], {"note": XSS}),
        "t1": ([0.5, 0.4], [True, False], {"note": "plain"}),
        XSS: ([0.9], [True], {"note": "x"}),
    },
}


@dataclass
class Store:
    """A storage root and the options (credentials) it needs."""

    uri: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def ctx(self, experiment: str, trial: str) -> StorageContext:
        return StorageContext(self.uri, experiment, trial,
                              storage_options=dict(self.options) or None)


def report_trial(store: Store, experiment: str, trial: str, scores: Sequence[float],
                 with_checkpoint: Sequence[bool], params: Mapping[str, Any]) -> None:
    """One session on the trial reporting ``scores`` (nested as ``val/accuracy``), with a
    checkpoint (``model.bin`` of a size distinct per report) where asked."""
    with session.start(storage_path=store.uri, experiment_name=experiment, trial_name=trial,
                       checkpoint_config=CONFIG, config=dict(params),
                       storage_options=dict(store.options) or None):
        for i, (score, ckpt) in enumerate(zip(scores, with_checkpoint, strict=True)):
            metrics = {"val": {"accuracy": score}, "loss": 1.0 - score}
            if not ckpt:
                session.report(metrics)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "model.bin"), "wb") as f:
                    f.write(bytes(range(256)) * (4 + i))
                Checkpoint.from_directory(tmp).set_metadata({"epoch": i, "note": trial})
                session.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def write_store(store: Store) -> None:
    for experiment, trials in LAYOUT.items():
        for trial, (scores, ckpts, params) in trials.items():
            report_trial(store, experiment, trial, scores, ckpts, params)


def library_answer(store: Store, experiment: str, trial: str) -> dict[str, Any]:
    """What the library itself says about a trial (the page must agree)."""
    ctx = store.ctx(experiment, trial)
    committed = ctx.committed_checkpoints()
    with CheckpointManager(CONFIG, ctx, read_only=True) as manager:
        best = manager.best_checkpoint
        kept = manager.kept_dir_names
    return {
        "reports": len(ctx.read_results()),
        "committed": [c.path.rsplit("/", 1)[-1] for c, _ in committed],
        "size": sum(int(e["size"]) for _, m in committed for e in m["manifest"]),
        "best": best.path.rsplit("/", 1)[-1] if best else None,
        "best_score": next(m["metrics"]["val"]["accuracy"] for c, m in committed
                           if best is not None and c.path == best.path) if best else None,
        "kept": kept,
    }


# The "page" experiment (issue 42, item 6): a state checkpoint of 24 tensors, and a
# trial with an early loss spike, a user "step" key and a resume after report 6.
STATE_TENSORS = {f"layer{i:02d}.{part}": (i + 1, 8 if part == "weight" else 1)
                 for i in range(12) for part in ("weight", "bias")}
SPIKY_LOSS = [50.0, 1.0, 0.9, 0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.42, 0.4]
SPIKY_CONFIG = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                                checkpoint_score_order="min")


def write_page_store(store: Store) -> None:
    """``page/state`` (one report with ``state=``: 24 float32 tensors) and
    ``page/spiky`` (:data:`SPIKY_LOSS` with ``step`` = 10 x report, a checkpoint at
    every report, run as two sessions: the second, a resume, from report 7 on)."""
    import numpy as np

    with session.start(storage_path=store.uri, experiment_name="page", trial_name="state",
                       config={"lr": 0.003, "model": {"depth": 12}}):
        state = {k: np.full(shape, 0.5, dtype=np.float32) for k, shape in STATE_TENSORS.items()}
        session.report({"loss": 0.5}, state={"model": state, "step": 1})
    for part in (SPIKY_LOSS[:6], SPIKY_LOSS[6:]):
        with session.start(storage_path=store.uri, experiment_name="page", trial_name="spiky",
                           checkpoint_config=SPIKY_CONFIG, config={"lr": 0.1, "opt": "adam"}):
            for loss in part:
                step = 10 * (SPIKY_LOSS.index(loss) + 1)
                with tempfile.TemporaryDirectory() as tmp:
                    with open(os.path.join(tmp, "model.bin"), "wb") as f:
                        f.write(b"x" * step)
                    session.report({"loss": loss, "step": step},
                                   checkpoint=Checkpoint.from_directory(tmp))


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the page may be mid-render
            last_exc = exc
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}"
                         + (f" (last error: {last_exc})" if last_exc else ""))
