"""FSDP2 with Adam on gloo ranks, killed mid-save and mid-training, resumed on
other rank counts: the resumed loss curve is the uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(__file__), "_fsdp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(n: int, storage, steps: int, out, kill: str | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(n), WORKER, str(storage), str(steps), str(out), *([kill] if kill else [])],
        env=env, capture_output=True, text=True, timeout=600, cwd=str(out.parent))
    if kill is None:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.returncode


def _losses(out) -> tuple[int, dict[int, float]]:
    body = json.loads(out.read_text())
    return body["start"], {int(k): v for k, v in body["losses"].items()}


@pytest.mark.slow  # four torchrun launches, 2, 4, 8 and 2 ranks: about two minutes
def test_fsdp2_killed_and_resumed_on_other_rank_counts(tmp_path) -> None:
    # The reference: 2 ranks, never interrupted.
    _launch(2, tmp_path / "ref", 7, tmp_path / "ref.json")
    _, expected = _losses(tmp_path / "ref.json")
    assert sorted(expected) == list(range(7))
    store = tmp_path / "store"
    # 4 ranks; rank 2 dies right after its step-2 report (its pieces staged,
    # the commit in flight): torchrun tears the job down.
    assert _launch(4, store, 7, tmp_path / "a.json", kill="2:2:after-report") != 0
    # 8 ranks resume; rank 5 dies mid-step 4 (after backward, before step).
    assert _launch(8, store, 7, tmp_path / "b.json", kill="5:4:mid-step") != 0
    # 2 ranks resume and finish.
    _launch(2, store, 7, tmp_path / "c.json")
    a_start, a = _losses(tmp_path / "a.json")
    b_start, b = _losses(tmp_path / "b.json")
    c_start, c = _losses(tmp_path / "c.json")
    assert a_start == 0 and sorted(a) == [0, 1, 2]
    # Each restart resumes a committed checkpoint of the run before it (the
    # commit of the killed step may or may not have landed), never past it.
    # (Rank 0 may finish step 4 before torchrun ends the job rank 5 left.)
    assert 1 <= b_start <= 3 and sorted(b) == list(range(b_start, max(b) + 1)), (b_start, b)
    assert max(b) in (3, 4), b
    assert b_start <= c_start <= 4 and sorted(c) == list(range(c_start, 7)), (c_start, c)
    for run in (a, b, c):
        for step, loss in run.items():
            assert loss == pytest.approx(expected[step], rel=1e-5), (step, loss, expected[step])
