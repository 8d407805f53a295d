"""A preemption signal during a real Hugging Face Trainer run (a tiny BERT on
CPU): the step under way ends with a save, committed as a preemption
checkpoint; Preempted ends trainer.train(); restore_latest resumes from it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

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

from checkpoint_store import PreemptionConfig, StorageContext  # noqa: E402
from checkpoint_store.errors import Preempted  # noqa: E402
from checkpoint_store.integrations.hf import CheckpointStoreCallback, restore_latest  # noqa: E402
from tests.integrations._shutdown import aborted_in_shutdown  # noqa: E402

pytestmark = [pytest.mark.slow,  # each Trainer run takes a few seconds on a shared CPU
              pytest.mark.usefixtures("fresh_signal_handlers")]


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, 8), generator=g)
    labels = (ids[:, 0] > 32).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


class _Scheduler(TrainerCallback):
    """Records the steps taken; sends SIGTERM to this process inside step ``at``
    (after its forward pass has begun), as a scheduler would."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.steps: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _train(output_dir, callback, *, max_steps: int, preempt_at: int | None = None,
           resume: bool = False) -> list[int]:
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8,
        save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, logging_steps=100, learning_rate=5e-3)
    sched = _Scheduler(preempt_at)
    trainer = Trainer(model=model, args=args, train_dataset=_data(64, 1),
                      callbacks=[callback, sched])
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    finally:
        callback.steps_taken = sched.steps  # type: ignore[attr-defined]
    return sched.steps


def test_sigterm_mid_step_saves_that_step_stops_and_resumes(tmp_path):
    kw = {"storage_path": str(tmp_path / "store"), "experiment_name": "bert",
          "trial_name": "run0"}
    out = tmp_path / "out"
    callback = CheckpointStoreCallback(
        preemption=PreemptionConfig(grace_period_s=60, exit_code=75), **kw)
    with pytest.raises(Preempted) as info, callback:
        _train(out, callback, max_steps=8, preempt_at=3)
    assert info.value.code == 75 and info.value.signal == "SIGTERM"
    # Step 3 ended (should_training_stop): no step 4 was taken.
    assert callback.steps_taken == [1, 2, 3]  # type: ignore[attr-defined]
    assert callback.session is None

    storage = StorageContext(kw["storage_path"], "bert", "run0")
    metas = {m["metrics"]["global_step"]: m for _, m in storage.committed_checkpoints()}
    assert sorted(metas) == [2, 3]
    assert metas[3]["preemption"]["signal"] == "SIGTERM"
    assert metas[3]["preemption"]["grace_period_s"] == 60.0
    assert "preemption" not in metas[2]
    names = {e["path"] for e in metas[3]["manifest"]}
    assert {"trainer_state.json", "model.safetensors", "optimizer.pt"} <= names
    assert storage.read_stop()["status"] == "preempted"
    assert storage.read_error() is None

    # A restart on a new machine: the preemption checkpoint is the resume point.
    fresh = tmp_path / "fresh"
    assert restore_latest(fresh, **kw) == str(fresh / "checkpoint-3")
    callback2 = CheckpointStoreCallback(preemption=True, **kw)
    with callback2:
        steps = _train(fresh, callback2, max_steps=6, resume=True)
    assert steps == [4, 5, 6]
    rows = storage.read_results()
    assert [r["global_step"] for r in rows] == [2, 3, 4, 6]


RANK_WORKER = textwrap.dedent("""
    import os, signal, sys
    rank, port, store, out = sys.argv[1:5]
    os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch
    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainerCallback, TrainingArguments)
    from checkpoint_store import PreemptionConfig, Preempted
    from checkpoint_store.integrations.hf import CheckpointStoreCallback

    class SignalRankOne(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if rank == "1" and state.global_step + 1 == 3:
                os.kill(os.getpid(), signal.SIGTERM)   # only rank 1 is told

        def on_step_end(self, args, state, control, **kwargs):
            print("STEP", state.global_step, flush=True)

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (64, 8), generator=g)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": (ids[i, 0] > 32).long()} for i in range(64)]
    args = TrainingArguments(
        output_dir=os.path.join(out, "shared"), max_steps=6, per_device_train_batch_size=4,
        save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, ddp_backend="gloo",
        seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_steps=100)
    callback = CheckpointStoreCallback(store, "e", "t", sync_timeout_s=120,
                                       preemption=PreemptionConfig(grace_period_s=60))
    try:
        with callback:
            Trainer(model=model, args=args, train_dataset=data,
                    callbacks=[SignalRankOne(), callback]).train()
    except Preempted as exc:
        # Every rank stops at the same step: no collective is in flight, and
        # the process group goes before the interpreter does (docs/hf.md).
        torch.distributed.destroy_process_group()
        print("PREEMPTED", exc.code, flush=True)
        raise
    print("TRAIN RETURNED", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_signal_to_one_rank_both_save_the_same_step(tmp_path):
    store = tmp_path / "store"
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", RANK_WORKER, str(r),
                               port, str(store), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
        outs.append((p.returncode, out, err))
    for rank, (code, out, err) in enumerate(outs):
        # Both ranks stopped after step 3: Preempted with the preemption's
        # exit status, which the process exits with.
        assert "PREEMPTED 143" in out, err[-4000:]
        if not aborted_in_shutdown(rank, code, out, err, done="PREEMPTED 143"):
            assert code == 143, err[-4000:]
        assert "TRAIN RETURNED" not in out
        assert [line for line in out.splitlines() if line.startswith("STEP")] == [
            "STEP 1", "STEP 2", "STEP 3"]
    storage = StorageContext(store, "e", "t")
    metas = {m["metrics"]["global_step"]: m for _, m in storage.committed_checkpoints()}
    assert sorted(metas) == [2, 3]
    assert metas[3]["world_size"] == 2
    assert metas[3]["preemption"]["signal"] == "SIGTERM"
    paths = {e["path"] for e in metas[3]["manifest"]}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= paths
    assert storage.read_stop()["status"] == "preempted"
