"""One rank of the sharded state tests with local tiers, as a process
(tests/tiers/test_sharded_tiers.py); not a test module. Ranks meet through
storage (no process group).

Usage: _sharded_tier_worker.py STORE FAST_ROOT OUT_DIR RANK PHASE ATTEMPT PLAN_JSON

``save``: report ``rank_state(step, rank)`` for ``plan["steps"]`` steps on 2
ranks, then ``wait()``. ``plan["hold"]`` (``"durable"`` or ``"local"``):
this rank stops for good before the durable copy (or the local commit) of
checkpoint 2, after touching ``OUT_DIR/held-<rank>``, for the test to kill
it (with ``"hold"`` in the plan, on any rank, checkpoint 1 is reported with
``upload_mode="sync"``). ``plan["signal"]``: the step before whose report this rank gets a
SIGTERM (``preemption=`` on, exit code 42). ``plan["never_persist"]``: the
tier's ``persist`` selects nothing. ``OUT_DIR/reported-<rank>`` is touched
once the last report returned.

``resume``: start, load the newest checkpoint (``get_checkpoint()``), check
it against the state of its step, write ``OUT_DIR/resume-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HELD_INDEX = 2


def full_state(step: int) -> dict[str, Any]:
    """The logical state of ``step``: two tensors large enough to be split by
    rows between the ranks (uneven rows on 2, 3 and 4 ranks), a small one
    written whole by one rank, a JSON value."""
    g = np.random.default_rng(step)
    return {
        "model": {
            "w": g.standard_normal((1037, 300), dtype=np.float32),
            "emb": g.standard_normal((2048, 160), dtype=np.float32),
            "bias": g.standard_normal(300, dtype=np.float32),
        },
        "step": step,
    }


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """``full_state(step)`` plus a RankLocal entry of ``rank``'s own."""
    from checkpoint_store.state import RankLocal

    return {**full_state(step), "rng": RankLocal(np.full(4, rank * 10 + step, dtype=np.int64))}


def _hold(where: str, out: Path, rank: int) -> None:
    """Stop this rank for good at checkpoint ``HELD_INDEX``'s durable copy
    (``durable``) or local commit (``local``)."""
    from checkpoint_store.session._targets import TieredTarget
    from checkpoint_store.tiers import FastTier

    def stop() -> None:
        (out / f"held-{rank}").touch()
        time.sleep(600)

    if where == "durable":
        persist = FastTier.persist

        def held_persist(self: Any, index: int, *args: Any, **kwargs: Any) -> None:
            if index == HELD_INDEX:
                stop()
            persist(self, index, *args, **kwargs)

        FastTier.persist = held_persist  # type: ignore[method-assign]
    else:
        commit_part = TieredTarget._commit_part

        def held_commit(self: Any, source: Any, job: Any) -> Any:
            if job.index == HELD_INDEX:
                stop()
            return commit_part(self, source, job)

        TieredTarget._commit_part = held_commit  # type: ignore[method-assign]


def main() -> None:
    store, fast_root, out_dir, rank_s, phase, attempt, plan_s = sys.argv[1:8]
    rank, plan, out = int(rank_s), json.loads(plan_s), Path(out_dir)
    from checkpoint_store import LocalTier, PreemptionConfig, session

    persist = (lambda index, metrics: False) if plan.get("never_persist") else None
    kw: dict[str, Any] = {"local_tier": LocalTier(os.path.join(fast_root, f"node{rank}"),
                                                  persist=persist)}
    if plan.get("signal") is not None:
        kw["preemption"] = PreemptionConfig(grace_period_s=20, exit_code=42)
    if plan.get("hold"):
        _hold(plan["hold"], out, rank)
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       world_rank=rank, world_size=2, attempt_id=attempt, sync_timeout_s=60,
                       **kw) as s:
        if phase == "save":
            for step in range(plan["steps"]):
                if plan.get("signal") == step:
                    os.kill(os.getpid(), signal.SIGTERM)
                # The report before the held one waits for its durable copy:
                # a kill at the hold finds every earlier checkpoint committed.
                mode = "sync" if step == HELD_INDEX - 1 and "hold" in plan else None
                s.report({"step": step}, state=rank_state(step, rank), upload_mode=mode)
            (out / f"reported-{rank}").touch()
            s.wait()
            return
        got = s.get_checkpoint()
        step = got.load_state(keys="step")["step"]
        whole = got.load_state()
        full = full_state(step)["model"]
        ok = (all(whole["model"][k].tobytes() == full[k].tobytes() for k in full)
              and int(whole["rng"][str(rank)][0]) == rank * 10 + step)
        s.wait()
    with open(out / f"resume-{rank}.json", "w") as f:
        json.dump({"rank": rank, "resumed": step, "ok": ok, "path": got.path}, f)


if __name__ == "__main__":
    main()
