"""The Hugging Face Trainer callback and restore_latest, with a real Trainer
(a randomly initialised tiny BERT on CPU, a synthetic dataset, no download)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from checkpoint_store import CheckpointConfig, StorageContext  # noqa: E402
from checkpoint_store.integrations.hf import CheckpointStoreCallback, restore_latest  # noqa: E402
from checkpoint_store.registry import resolve  # noqa: E402
from checkpoint_store.testing.faults import SimulatedCrash, faulty_filesystem  # noqa: E402

pytestmark = pytest.mark.slow  # each Trainer run takes a few seconds on a shared CPU

CONFIG = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="eval_loss",
                          checkpoint_score_order="min")


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, 8), generator=g)
    labels = (ids[:, 0] > 32).long()  # learnable: the label is in the first token
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


class _Steps(TrainerCallback):
    """Records the global step of every optimizer step taken."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _tiny_model() -> BertForSequenceClassification:
    """The same small BERT, seeded, for every Trainer of this file."""
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))


def _train(output_dir, callback, *, max_steps: int, resume: bool = False) -> tuple[Trainer, list]:
    model = _tiny_model()
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8,
        per_device_eval_batch_size=16, learning_rate=5e-3, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, save_total_limit=2, logging_steps=2,
        metric_for_best_model="eval_loss", greater_is_better=False, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    steps = _Steps()
    trainer = Trainer(model=model, args=args, train_dataset=_data(64, 1),
                      eval_dataset=_data(32, 2), callbacks=[callback, steps])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer, steps.steps


def _committed_steps(storage: StorageContext) -> dict[int, dict]:
    return {meta["metrics"]["global_step"]: meta for _, meta in storage.committed_checkpoints()}


def test_trainer_on_s3_best_two_resume_and_incomplete_local_dir(tmp_path, s3_location):
    kw = {"storage_path": s3_location.uri, "storage_options": s3_location.storage_options,
          "experiment_name": "bert", "trial_name": "run0"}
    out = tmp_path / "out"
    trainer, steps = _train(out, CheckpointStoreCallback(checkpoint_config=CONFIG, **kw),
                            max_steps=8)
    assert steps == list(range(1, 9))

    storage = StorageContext(s3_location.uri, "bert", "run0",
                             storage_options=s3_location.storage_options)
    rows = storage.read_results()
    assert [r["global_step"] for r in rows] == [2, 4, 6, 8]
    assert [r["training_iteration"] for r in rows] == [1, 2, 3, 4]
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(evals) == [2, 4, 6, 8]
    assert {r["global_step"]: r["eval_loss"] for r in rows} == evals
    best_two = set(sorted(evals, key=lambda s: (evals[s], -s))[:2])
    committed = _committed_steps(storage)
    # Our top 2 by eval_loss, plus the newest (kept for resume) if it is not one of them.
    assert set(committed) == best_two | {8}
    assert trainer.state.best_global_step in committed
    for ckpt, meta in storage.committed_checkpoints():
        names = {e["path"] for e in meta["manifest"]}
        assert {"trainer_state.json", "model.safetensors", "optimizer.pt"} <= names
        ckpt.verify()

    # A new machine: restore into a fresh output_dir, HF resumes at step 8.
    fresh = tmp_path / "fresh"
    assert restore_latest(fresh, **kw) == str(fresh / "checkpoint-8")
    callback = CheckpointStoreCallback(checkpoint_config=CONFIG, **kw)
    trainer2, steps2 = _train(fresh, callback, max_steps=10, resume=True)
    assert steps2 == [9, 10]
    rows = storage.read_results()
    assert [(r["global_step"], r["training_iteration"]) for r in rows][-1] == (10, 5)
    assert 10 in _committed_steps(storage)

    # The newest local directory lost trainer_state.json, and a save cut short
    # left checkpoint-12 (HF's resume_from_checkpoint=True would pick it).
    os.remove(out / "checkpoint-8" / "trainer_state.json")
    (out / "checkpoint-12").mkdir()
    (out / "checkpoint-12" / "model.safetensors").write_bytes(b"half")
    got = restore_latest(out, **kw)
    assert got == str(out / "checkpoint-10")
    [(ckpt, meta)] = [(c, m) for c, m in storage.committed_checkpoints()
                      if m["metrics"]["global_step"] == 10]
    for e in meta["manifest"]:
        assert os.path.getsize(os.path.join(got, e["path"])) == e["size"]
    assert not (out / "checkpoint-12").exists()
    assert [p.name for p in out.glob("uncommitted-checkpoint-12-*")]
    # Again: the local copy matches the manifest and is used as it is.
    assert restore_latest(out, **kw) == got
    assert not list(out.glob("incomplete-*"))
    # Restoring step 8 where the local directory lost a file: it is set
    # aside (not deleted) and the committed checkpoint downloaded in its place.
    shutil.rmtree(out / "checkpoint-10")
    storage.delete_checkpoint(ckpt.path.rsplit("/", 1)[-1])
    assert restore_latest(out, **kw) == str(out / "checkpoint-8")
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    [aside] = out.glob("incomplete-checkpoint-8-*")
    assert not (aside / "trainer_state.json").exists()


def test_crash_mid_upload_commits_nothing_of_that_save(tmp_path, s3_location):
    backend, root = resolve(s3_location.uri, storage_options=s3_location.storage_options)
    # The process "dies" while uploading the weights of the third save.
    fs = faulty_filesystem(backend.filesystem,
                           crash_on_path="checkpoint_000002/model.safetensors")
    callback = CheckpointStoreCallback(root, "bert", "run0", CONFIG, storage_filesystem=fs)
    with pytest.raises(SimulatedCrash):
        _train(tmp_path / "out", callback, max_steps=8)
    with pytest.raises(SimulatedCrash):  # a dead process releases nothing, its lease included
        callback.session.manager.close()
    kw = {"storage_path": root, "experiment_name": "bert", "trial_name": "run0",
          "storage_filesystem": backend.filesystem}
    storage = StorageContext(root, "bert", "run0", storage_filesystem=backend.filesystem)
    assert sorted(_committed_steps(storage)) == [2, 4]
    assert "checkpoint_000002" in storage.scan().uncommitted
    assert restore_latest(tmp_path / "again", **kw) == str(tmp_path / "again" / "checkpoint-4")


class _FailingTrainer(Trainer):
    """A Trainer whose fifth training step raises (a bad batch, an OOM)."""

    def training_step(self, *args, **kwargs):
        if self.state.global_step == 4:
            raise RuntimeError("step 5 failed")
        return super().training_step(*args, **kwargs)


def _failing_train(output_dir, callback) -> None:
    model = _tiny_model()
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=8,
        eval_strategy="no", save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    _FailingTrainer(model=model, args=args, train_dataset=_data(64, 1),
                    callbacks=[callback]).train()


def _error_text(storage: StorageContext) -> str | None:
    from checkpoint_store._format.layout import ERROR_FILE
    from checkpoint_store._util import fs as _fsutil

    path = os.path.join(storage.trial_path, ERROR_FILE)
    if not _fsutil.exists(storage.filesystem, path):
        return None
    return _fsutil.read_bytes(storage.filesystem, path).decode()


def test_a_raising_train_inside_with_records_the_error_and_releases_the_trial(
        tmp_path, s3_location):
    from checkpoint_store import session

    kw = {"storage_path": s3_location.uri, "storage_options": s3_location.storage_options,
          "experiment_name": "bert", "trial_name": "run0"}
    callback = CheckpointStoreCallback(**kw)
    with pytest.raises(RuntimeError, match="step 5 failed"), callback:
        _failing_train(tmp_path / "out", callback)
    assert callback.session is None
    storage = StorageContext(s3_location.uri, "bert", "run0",
                             storage_options=s3_location.storage_options)
    assert sorted(_committed_steps(storage)) == [2, 4]
    text = _error_text(storage)
    assert text is not None and "RuntimeError: step 5 failed" in text
    # The lease is released now, not when this process exits: a restart starts.
    with session.start(**kw) as sess:
        assert sess.get_checkpoint().internal_metadata["metrics"]["global_step"] == 4


_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
import test_hf
from checkpoint_store.integrations.hf import CheckpointStoreCallback

callback = CheckpointStoreCallback({root!r}, experiment_name="bert", trial_name="run0")
test_hf._failing_train({out!r}, callback)   # raises; no with block, no on_train_end
"""


def test_a_raising_train_without_with_is_recorded_at_exit(tmp_path):
    import subprocess
    import sys

    root, out = str(tmp_path / "store"), str(tmp_path / "out")
    here = os.path.dirname(os.path.abspath(__file__))
    script = _SCRIPT.format(paths=[here, *sys.path], root=root, out=out)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1 and "step 5 failed" in proc.stderr, proc.stderr[-2000:]
    storage = StorageContext(root, "bert", "run0")
    assert sorted(_committed_steps(storage)) == [2, 4]
    text = _error_text(storage)
    assert text is not None and "RuntimeError: step 5 failed" in text
    # The lease is released (its lock file, which serialises taking it, stays).
    from checkpoint_store._format.layout import LEASE_FILE

    assert LEASE_FILE not in os.listdir(storage.trial_path)


# An eval score scripted per step (lower is better): the best is step 8, and
# no later step beats it.
_SCORES = {2: 0.5, 4: 0.4, 6: 0.3, 8: 0.1, 10: 0.3, 12: 0.4, 14: 0.35, 16: 0.45}
_BEST_CONFIG = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="eval_score",
                                checkpoint_score_order="min")


def _train_best(output_dir, callback, *, max_steps: int, resume: bool = False) -> Trainer:
    """A Trainer with ``load_best_model_at_end`` on the scripted eval score."""
    model = _tiny_model()
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8,
        per_device_eval_batch_size=32, learning_rate=5e-3, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, save_total_limit=2, logging_steps=2,
        load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_data(64, 1),
                      eval_dataset=_data(32, 2), callbacks=[callback],
                      compute_metrics=lambda _: {"score": _SCORES[trainer.state.global_step]})
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def _assert_weights_of_step(trainer: Trainer, storage: StorageContext, step: int, tmp) -> None:
    from safetensors.torch import load_file

    [ckpt] = [c for c, m in storage.committed_checkpoints()
              if m["metrics"]["global_step"] == step]
    saved = load_file(os.path.join(ckpt.to_directory(tmp / f"saved-{step}"), "model.safetensors"))
    live = trainer.model.state_dict()
    assert saved and all(torch.equal(live[k].cpu(), v) for k, v in saved.items())
    last = [c for c, m in storage.committed_checkpoints() if m["metrics"]["global_step"] == 16]
    other = load_file(os.path.join(last[0].to_directory(tmp / "saved-16"), "model.safetensors"))
    assert not all(torch.equal(live[k].cpu(), v) for k, v in other.items())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_best_model_at_end_after_a_new_machine(tmp_path, request, where):
    if where == "s3":
        loc = request.getfixturevalue("s3_location")
        kw = {"storage_path": loc.uri, "storage_options": loc.storage_options}
    else:
        kw = {"storage_path": str(tmp_path / "store")}
    kw.update(experiment_name="bert", trial_name="best")
    out = tmp_path / "out"
    first = _train_best(out, CheckpointStoreCallback(checkpoint_config=_BEST_CONFIG, **kw),
                        max_steps=12)
    assert first.state.best_global_step == 8
    shutil.rmtree(out)  # a new machine

    assert restore_latest(out, **kw) == str(out / "checkpoint-12")
    # The best checkpoint is where trainer_state.json says it is.
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert os.path.isdir(state["best_model_checkpoint"])
    assert os.path.samefile(state["best_model_checkpoint"], out / "checkpoint-8")
    assert sorted(os.listdir(out)) == ["checkpoint-12", "checkpoint-8"]

    trainer = _train_best(out, CheckpointStoreCallback(checkpoint_config=_BEST_CONFIG, **kw),
                          max_steps=16, resume=True)
    assert trainer.state.global_step == 16
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-8")
    final = json.loads((out / "checkpoint-16" / "trainer_state.json").read_text())
    assert os.path.isdir(final["best_model_checkpoint"])
    storage = StorageContext(kw["storage_path"], "bert", "best",
                             storage_options=kw.get("storage_options"))
    _assert_weights_of_step(trainer, storage, 8, tmp_path)


def test_best_model_is_fetched_when_the_output_dir_moved(tmp_path):
    kw = {"storage_path": str(tmp_path / "store"), "experiment_name": "bert",
          "trial_name": "best"}
    _train_best(tmp_path / "out", CheckpointStoreCallback(checkpoint_config=_BEST_CONFIG, **kw),
                max_steps=12)
    shutil.rmtree(tmp_path / "out")
    # Another machine, another output_dir; the latest checkpoint alone is there
    # (restored by hand): the recorded best path exists nowhere.
    elsewhere = tmp_path / "elsewhere"
    restore_latest(elsewhere, **kw)
    shutil.rmtree(elsewhere / "checkpoint-8")
    trainer = _train_best(elsewhere,
                          CheckpointStoreCallback(checkpoint_config=_BEST_CONFIG, **kw),
                          max_steps=16, resume=True)
    assert trainer.state.best_model_checkpoint == str(elsewhere / "checkpoint-8")
    assert sorted(os.listdir(elsewhere)) == ["checkpoint-16", "checkpoint-8"]
    _assert_weights_of_step(trainer, StorageContext(**kw), 8, tmp_path)


def _mark_pending(tier_trial_dir, indexes) -> None:
    """The state a run killed before the durable copies of ``indexes`` leaves:
    committed on the local tier, their durable copies pending."""
    from checkpoint_store.tiers import TIER_STATE_FILE

    path = os.path.join(tier_trial_dir, TIER_STATE_FILE)
    with open(path) as f:
        body = json.load(f)
    for e in body["checkpoints"]:
        if e["index"] in indexes:
            e["durable"] = "pending"
    with open(path, "w") as f:
        json.dump(body, f)


@pytest.mark.parametrize("find", ["given", "pointer"])
def test_restart_with_a_local_tier_resumes_its_newest_copy(tmp_path, s3_location, find):
    """Issue 37 item 1: steps 4..10 committed on the local tier, their durable
    copies pending, restart on the same machine: restore_latest restores the
    tier's step 10 (not S3's step 2), renames nothing aside, and the trial's
    history has each step once, on S3 too."""
    from checkpoint_store import LocalTier

    kw = {"storage_path": s3_location.uri, "storage_options": s3_location.storage_options,
          "experiment_name": "bert", "trial_name": "run0"}
    tier = LocalTier(tmp_path / "fast", num_to_keep=5, persist=lambda index, row: index < 1)
    out = tmp_path / "out"
    with CheckpointStoreCallback(checkpoint_config=CONFIG, local_tier=tier, **kw) as cb:
        _train(out, cb, max_steps=10)
    _mark_pending(tmp_path / "fast" / "bert" / "run0", {1, 2, 3, 4})
    storage = StorageContext(s3_location.uri, "bert", "run0",
                             storage_options=s3_location.storage_options)
    assert set(_committed_steps(storage)) == {2}

    got = restore_latest(out, **kw, local_tier=tier if find == "given" else None)
    assert got == str(out / "checkpoint-10")
    assert not list(out.glob("uncommitted-*")) and (out / "checkpoint-8").is_dir()
    tier = LocalTier(tmp_path / "fast", num_to_keep=5)  # now every copy goes to S3
    with CheckpointStoreCallback(checkpoint_config=CONFIG, local_tier=tier, **kw) as cb:
        _, steps = _train(out, cb, max_steps=16, resume=True)
    assert steps == list(range(11, 17))
    rows = storage.read_results()
    assert [r["global_step"] for r in rows] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [r["training_iteration"] for r in rows] == list(range(1, 9))
    committed = [meta["metrics"]["global_step"] for _, meta in storage.committed_checkpoints()]
    assert len(committed) == len(set(committed))  # no step stored twice
    loss = {r["global_step"]: r["eval_loss"] for r in rows}
    best_two = set(sorted(loss, key=lambda s: (loss[s], -s))[:2])
    assert set(committed) == best_two | {16}
