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


def _train(output_dir, callback, *, max_steps: int, resume: bool = False) -> tuple[Trainer, list]:
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))
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
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=8,
        eval_strategy="no", save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    _FailingTrainer(model=model, args=args, train_dataset=_data(64, 1),
                    callbacks=[callback]).train()


def _error_text(storage: StorageContext) -> str | None:
    from checkpoint_store import _fsutil
    from checkpoint_store._layout import ERROR_FILE

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
    lease = [n for n in os.listdir(storage.trial_path) if "lease" in n]
    assert lease == [], lease
