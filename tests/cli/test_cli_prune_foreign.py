"""`prune` never ranks or deletes a checkpoint of another run or trial, by the
retention manager's own rule (docs/retention.md, "What may retention delete?").

It ranked every committed checkpoint: two checkpoints copied in from another
run made `prune --keep 1` delete the trial's own best and its newest one (the
checkpoint a resume starts from), keeping the copies.
"""

from __future__ import annotations

import json
import os

from cli_helpers import Store, committed_names, invoke

from checkpoint_store import Checkpoint, CheckpointConfig, session


def _session_trial(store: Store, tmp_path) -> object:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=CheckpointConfig(2, "loss", "min"),
                       storage_options=dict(store.options) or None):
        for loss in [0.8, 0.3, 0.5, 0.4]:
            session.report({"loss": loss}, checkpoint=Checkpoint(str(src)))
    return store.ctx()


def test_prune_leaves_another_runs_checkpoints_alone(every_store, tmp_path):
    ctx = _session_trial(every_store, tmp_path)
    for index, loss in ((9, 0.01), (10, 0.02)):  # copied in from another run
        ctx.persist_checkpoint(Checkpoint(str(tmp_path / "src")), index,
                               {"metrics": {"loss": loss}, "run_id": "another-run"})
    trial = every_store.join("exp", "t1")
    res = invoke(["prune", trial, "--keep", "1", "--json", *every_store.opt_args()])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [os.path.basename(u) for u in out["foreign"]] == [
        "checkpoint_000009", "checkpoint_000010"]
    assert [d["name"] for d in out["kept"]] == ["checkpoint_000001", "checkpoint_000003"]
    assert "another run" in res.stderr
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003",
                                    "checkpoint_000009", "checkpoint_000010"]


def test_without_a_state_a_checkpoint_naming_another_trial_stays(near_store, tmp_path):
    ctx = near_store.ctx()
    for index, loss in ((0, 0.5), (1, 0.4), (2, 0.6)):
        ctx.persist_checkpoint(Checkpoint(str(_src(tmp_path))), index, {"metrics": {"loss": loss}})
    other = near_store.ctx(trial="t2")
    # At the index it lands under: a copy whose marker names another index is
    # invalid whatever it holds (tests/cli/test_cli_identity.py).
    other.persist_checkpoint(Checkpoint(str(_src(tmp_path))), 7, {"metrics": {"loss": 0.1}})
    src_dir = other.checkpoint_path(7)
    dst_dir = ctx.checkpoint_path(7)
    for rel in (".internal_metadata.json", "w.bin"):  # a hand copy, names and all
        ctx.filesystem.create_dir(dst_dir, recursive=True)
        with other.filesystem.open_input_stream(f"{src_dir}/{rel}") as f, \
                ctx.filesystem.open_output_stream(f"{dst_dir}/{rel}") as out:
            out.write(f.read())
    res = invoke(["prune", near_store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--no-keep-latest"])
    assert res.exit_code == 0, res.output
    assert sorted(committed_names(ctx)) == ["checkpoint_000001", "checkpoint_000007"]


def _src(tmp_path):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    return src


def test_without_a_state_another_run_of_the_same_trial_is_foreign(near_store, tmp_path):
    # As a manager rebuilding a lost state decides: the run is the newest
    # checkpoint's of this trial; another run_id, even under the same trial
    # name (a copy of an earlier run), is neither ranked nor deleted.
    ctx = near_store.ctx()
    for index, loss, run in ((0, 0.05, "old-run"), (1, 0.06, "old-run"),
                             (5, 0.5, "this-run"), (6, 0.4, "this-run"), (7, 0.6, "this-run")):
        ctx.persist_checkpoint(Checkpoint(str(_src(tmp_path))), index,
                               {"metrics": {"loss": loss}, "run_id": run, "trial_name": "t1"})
    res = invoke(["prune", near_store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--no-keep-latest", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [os.path.basename(u) for u in out["foreign"]] == [
        "checkpoint_000000", "checkpoint_000001"]
    # Ranked among this run's alone: the old run's lower losses did not evict them all.
    assert sorted(committed_names(ctx)) == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000006"]


def _every_best(store: Store) -> dict[str, str]:
    """The trial's best as `best`, `ls` of its experiment, `Experiment` and the page
    name it."""
    from checkpoint_store import Experiment
    from checkpoint_store.ui._model import StoreView

    trial, opts = store.join("exp", "t1"), store.opt_args()
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    exp = json.loads(invoke(["ls", store.join("exp"), "--json", *opts]).stdout)
    view = StoreView(store.uri, dict(store.options))
    view.experiments()
    best = Experiment(store.join("exp"), storage_options=dict(store.options) or None
                      ).best_checkpoint("loss", "min")
    return {"best": os.path.basename(res.stdout.splitlines()[0]),
            "ls": os.path.basename(exp["trials"][0]["best_checkpoint"]),
            "experiment": os.path.basename(best.path),
            "page": view.summary("exp", "t1")["best_checkpoint"]}


def test_best_and_the_page_never_name_another_runs_checkpoint(store, tmp_path):
    """`best`, `ls EXPERIMENT` and the page named checkpoint_000009, copied in
    from another run (loss 0.01): prune and the retention manager never rank it
    (the manager's best_checkpoint is checkpoint_000001)."""
    ctx = _session_trial(store, tmp_path)
    ctx.persist_checkpoint(Checkpoint(str(tmp_path / "src")), 9,
                           {"metrics": {"loss": 0.01}, "run_id": "another-run"})
    assert set(_every_best(store).values()) == {"checkpoint_000001"}


def test_without_a_state_best_never_names_another_trials_checkpoint(near_store, tmp_path):
    ctx = near_store.ctx()
    for index, loss in ((0, 0.5), (1, 0.4)):
        ctx.persist_checkpoint(Checkpoint(str(_src(tmp_path))), index, {"metrics": {"loss": loss}})
    # A checkpoint of trial t2 (its marker says so) copied in at index 2.
    ctx.persist_checkpoint(Checkpoint(str(_src(tmp_path))), 2,
                           {"metrics": {"loss": 0.1}, "trial_name": "t2"})
    named = _every_best(near_store)
    assert named.pop("page") is None  # the page ranks by a recorded metric only
    assert set(named.values()) == {"checkpoint_000001"}
