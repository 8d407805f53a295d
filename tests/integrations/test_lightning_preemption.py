"""A preemption signal during a real Lightning fit (a 4->1 linear model on
CPU) with ReportCheckpointCallback(preemption=...): the batch under way ends
with a save committed as a preemption checkpoint, fit() ends with Preempted
(the process with the configured status), and a restart resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from checkpoint_store import PreemptionConfig, StorageContext  # noqa: E402
from checkpoint_store.errors import InvalidConfigError, Preempted  # noqa: E402
from checkpoint_store.integrations.lightning import (  # noqa: E402
    STATE_FILE,
    ReportCheckpointCallback,
)

pytestmark = [pytest.mark.slow,  # Lightning fits: seconds each on a shared CPU
              pytest.mark.usefixtures("fresh_signal_handlers")]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", 1.0 / (self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g),
                                        torch.randn(16, 1, generator=g)), batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()


class _SigtermAt(L.Callback):
    """The scheduler: SIGTERM to this process as the batch after ``step`` begins."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class _Steps(L.Callback):
    def __init__(self) -> None:
        self.start: int | None = None
        self.ends: list[int] = []

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(trainer.global_step)


def _trainer(tmp_path, callbacks) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=4, limit_train_batches=4, limit_val_batches=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=callbacks)


def test_sigterm_mid_batch_saves_that_batch_stops_fit_and_resumes(tmp_path):
    args = dict(monitor="val_loss", mode="min", storage_path=str(tmp_path / "runs"),
                experiment_name="exp", trial_name="t0")
    cb = ReportCheckpointCallback(
        preemption=PreemptionConfig(grace_period_s=60, exit_code=75), **args)
    steps = _Steps()
    t = _trainer(tmp_path, [steps, cb, _SigtermAt(5)])
    with pytest.raises(Preempted) as info:
        t.fit(Tiny())
    assert info.value.code == 75 and info.value.signal == "SIGTERM"
    assert t.should_stop and cb.stopped_by_session
    # Epoch 0 validated at step 4; the signal came during step 6 (batch 2 of
    # epoch 1), which ended with the preemption checkpoint; no step 7.
    assert steps.ends == [1, 2, 3, 4, 5, 6]
    storage = StorageContext(args["storage_path"], "exp", "t0")
    metas = {m["metrics"]["step"]: m for _, m in storage.committed_checkpoints()}
    assert sorted(metas) == [4, 6]
    assert metas[6]["preemption"]["signal"] == "SIGTERM"
    assert metas[6]["preemption"]["grace_period_s"] == 60.0
    assert "preemption" not in metas[4]
    assert storage.read_stop()["status"] == "preempted"
    assert storage.read_error() is None

    # A restart (a new process): the preemption checkpoint is the newest; fit
    # continues from step 6, mid-epoch, to the end.
    cb2 = ReportCheckpointCallback(preemption=True, **args)
    path = cb2.resume_path()
    state = torch.load(path, weights_only=False)
    assert state["global_step"] == 6 and os.path.basename(path) == STATE_FILE
    steps2 = _Steps()
    t2 = _trainer(tmp_path, [cb2, steps2])
    t2.fit(Tiny(), ckpt_path=path)
    assert steps2.start == 6 and t2.global_step == 16
    assert steps2.ends == list(range(7, 17))
    assert 16 in {m["metrics"]["step"] for _, m in storage.committed_checkpoints()}


def test_preemption_needs_the_callbacks_own_session():
    with pytest.raises(InvalidConfigError, match="preemption"):
        ReportCheckpointCallback(preemption=True)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from checkpoint_store import PreemptionConfig
    from checkpoint_store.integrations.lightning import ReportCheckpointCallback

    store, ready = sys.argv[1:3]

    class Slow(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_step == 3:
                open(ready, "w").close()   # the test sends SIGTERM now
            time.sleep(0.3)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(400, 4, generator=g),
                                            torch.randn(400, 1, generator=g)), batch_size=4)

    cb = ReportCheckpointCallback(storage_path=store, experiment_name="e", trial_name="t",
                                  preemption=PreemptionConfig(grace_period_s=30))
    L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False,
              callbacks=[cb]).fit(Slow())
    print("FIT RETURNED", flush=True)
""")


def test_process_killed_by_sigterm_exits_143_with_its_preemption_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    store = tmp_path / "store"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(store), str(ready)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "FIT RETURNED" not in out
    assert took < 30  # within the grace period
    storage = StorageContext(str(store), "e", "t")
    metas = [m for _, m in storage.committed_checkpoints()]
    assert len(metas) == 1
    assert metas[0]["metrics"]["step"] == 4  # the batch under way (step 4) ended with it
    assert metas[0]["preemption"]["signal"] == "SIGTERM"
    assert storage.read_stop()["status"] == "preempted"


class _SigtermInValidation(Tiny):
    """The scheduler's SIGTERM arrives during the validation of epoch 1."""

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 1 and not self.trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)
        super().validation_step(batch, batch_idx)


def test_sigterm_during_validation_still_ends_with_a_preemption_checkpoint(tmp_path):
    """Lightning's own SIGTERM handler stops a validation (SIGTERMException)
    before any batch end: the callback saves in on_exception instead."""
    args = dict(storage_path=str(tmp_path / "runs"), experiment_name="exp", trial_name="t0")
    cb = ReportCheckpointCallback(preemption=True, **args)
    t = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=4, limit_train_batches=4, limit_val_batches=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[cb])
    with pytest.raises(Preempted) as info:
        t.fit(_SigtermInValidation())
    assert info.value.code == 143
    storage = StorageContext(args["storage_path"], "exp", "t0")
    metas = {m["metrics"]["step"]: m for _, m in storage.committed_checkpoints()}
    assert sorted(metas) == [4, 8]
    assert metas[8]["preemption"]["signal"] == "SIGTERM"
    assert storage.read_stop()["status"] == "preempted"
    cb2 = ReportCheckpointCallback(**args)
    t2 = _trainer(tmp_path, [cb2])
    t2.fit(Tiny(), ckpt_path=cb2.resume_path())
    assert t2.global_step == 16
