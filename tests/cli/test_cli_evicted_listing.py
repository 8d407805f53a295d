"""`ls` and `best` list every committed checkpoint still on storage, also one
the retention state does not keep yet.

`ls` (without `--long`) and `best` read the trial through a read-only restore
of its retention state. A checkpoint committed after the state's last record
(`checkpoint-store upload`, a crash between commit and registration) that the
recorded policy would evict was left out: `ls` listed two checkpoints of
three, `verify` checked three, and `best --metric epoch` named a checkpoint
that was not the best one on storage.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from cli_helpers import Store, invoke

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store._util import fs as _fsutil


def _trial(store: Store, tmp_path: Any) -> str:
    """Losses 0.8, 0.3, 0.5, 0.4 under best 2 by min: checkpoints 1 and 3 kept."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    config = CheckpointConfig(2, "loss", "min")
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=config, storage_options=dict(store.options) or None):
        for epoch, loss in enumerate([0.8, 0.3, 0.5, 0.4]):
            session.report({"loss": loss, "epoch": epoch}, checkpoint=Checkpoint(str(src)))
    return store.join("exp", "t1")


def _names(args: list[str]) -> list[str]:
    res = invoke([*args, "--json"])
    assert res.exit_code == 0, res.output
    return [c["name"] for c in json.loads(res.stdout)["checkpoints"]]


def _assert_all_listed(store: Store, trial: str, expected: list[str]) -> None:
    opts = store.opt_args()
    assert _names(["ls", trial, *opts]) == expected
    assert _names(["ls", trial, "--long", *opts]) == expected
    res = invoke(["ls", store.join("exp"), "--json", *opts])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["trials"][0]["checkpoints"] == len(expected)


def test_an_uploaded_checkpoint_hides_none(every_store, tmp_path):
    trial = _trial(every_store, tmp_path)
    up = tmp_path / "up"
    up.mkdir()
    (up / "w.txt").write_bytes(b"w")
    opts = every_store.opt_args()
    res = invoke(["upload", str(up), trial, "--metrics", '{"loss": 0.01}', *opts])
    assert res.exit_code == 0, res.output
    # The recorded policy would now keep 1 and 4: 3 is still committed on storage.
    _assert_all_listed(every_store, trial,
                       ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"])
    res = invoke(["best", trial, "--metric", "epoch", "--mode", "max", *opts])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000003")


def test_a_checkpoint_committed_after_the_last_record_is_listed(every_store, tmp_path):
    """A crash between commit and registration: the next session evicts it, and
    until then it is a committed checkpoint like any other."""
    trial = _trial(every_store, tmp_path)
    ctx = every_store.ctx()
    run_id = json.loads(_fsutil.read_bytes(ctx.filesystem, posixpath.join(
        ctx.trial_path, MANAGER_STATE)))["run_id"]
    ctx.persist_checkpoint(Checkpoint(str(tmp_path / "src")), 4,
                           {"metrics": {"loss": 0.9, "epoch": 9}, "run_id": run_id})
    ctx.persist_checkpoint(Checkpoint(str(tmp_path / "src")), 5,
                           {"metrics": {"loss": 0.7, "epoch": 5}, "run_id": run_id})
    _assert_all_listed(every_store, trial, ["checkpoint_000001", "checkpoint_000003",
                                            "checkpoint_000004", "checkpoint_000005"])
    res = invoke(["best", trial, "--metric", "epoch", "--mode", "max", *every_store.opt_args()])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000004")
