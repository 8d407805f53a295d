"""PyTorch Lightning integration: real Trainer on CPU, tiny models, real storage.

Contract checked on each path: the committed checkpoints are exactly the
framework's (or our retention's) best K and each verifies, resume continues
the step count, a save cut short leaves nothing listed.
"""

from __future__ import annotations

import os
import pickle
import posixpath
import subprocess
import sys
import threading
import time
import uuid
import warnings

import google_crc32c
import pyarrow.fs as pafs
import pytest

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from checkpoint_store import (  # noqa: E402
    CheckpointNotFoundError,
    InvalidConfigError,
    StorageContext,
)
from checkpoint_store._format.layout import COMMIT_LOCK  # noqa: E402
from checkpoint_store._util.inspect import inspect_checkpoint  # noqa: E402
from checkpoint_store.integrations._lightning import verified_state  # noqa: E402
from checkpoint_store.integrations._lightning.replace import current_dir  # noqa: E402
from checkpoint_store.integrations.lightning import (  # noqa: E402
    STATE_FILE,
    CheckpointStoreIO,
    ReportCheckpointCallback,
    StoreModelCheckpoint,
    checkpoint_file,
    resume_path,
)
from checkpoint_store.registry import resolve  # noqa: E402
from checkpoint_store.testing.faults import SimulatedCrash, faulty_filesystem  # noqa: E402

# val_loss per epoch: the best two (epochs 3 and 1) are not the two newest.
VAL_LOSS = [0.5, 0.2, 0.4, 0.1, 0.15, 0.6]


class _TinyBody:
    """A 4->1 linear model logging a fixed val_loss per epoch (no LightningModule
    base, so the old ``pytorch_lightning`` name can use it too)."""

    #: val_loss by epoch (cycled).
    losses = VAL_LOSS

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.losses[self.current_epoch % len(self.losses)])

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


class Tiny(_TinyBody, L.LightningModule):
    pass


class Improving(Tiny):
    """val_loss falls every epoch: the best K are always the newest K."""

    losses = [1.0 / (epoch + 1) for epoch in range(20)]


def memory_fs(**faults):
    """A fresh directory on the in-memory backend behind the fault injector,
    and the plain backend to look at it without faults."""
    plain, _ = resolve("memory://lt")
    return faulty_filesystem(plain.filesystem, **faults), plain, f"/lt-{uuid.uuid4().hex[:8]}"


def trainer(tmp_path, **kw) -> L.Trainer:
    args = dict(
        accelerator="cpu", devices=1, max_epochs=4, limit_train_batches=2, limit_val_batches=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    args.update(kw)
    return L.Trainer(**args)


def committed(backend, dirpath: str) -> dict[str, dict]:
    """``{name: internal metadata}`` of the committed directories in ``dirpath``."""
    fs = backend.filesystem
    out = {}
    try:
        listing = fs.get_file_info(pafs.FileSelector(dirpath))
    except FileNotFoundError:
        return out
    for fi in listing:
        if fi.type == pafs.FileType.Directory and not fi.base_name.startswith("."):
            insp = inspect_checkpoint(fs, fi.path)
            if insp.state == "committed":
                out[fi.base_name] = insp.meta
    return out


def held(backend, dirpath: str) -> set[str]:
    """Names of the Lightning paths in ``dirpath`` that hold a committed
    checkpoint, a replaced one (``last.ckpt``) followed to its pointer."""
    out = set()
    for fi in backend.filesystem.get_file_info(pafs.FileSelector(dirpath)):
        if fi.type == pafs.FileType.Directory and not fi.base_name.startswith("."):
            if inspect_checkpoint(backend.filesystem,
                                  current_dir(backend, fi.path)).state == "committed":
                out.add(fi.base_name)
    return out


def basenames(paths) -> set[str]:
    return {posixpath.basename(str(p).rstrip("/")) for p in paths}


# -- CheckpointStoreIO with ModelCheckpoint -----------------------------------------------


def _fit_top2(tmp_path, dirpath: str, io: CheckpointStoreIO):
    mc = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2)
    t = trainer(tmp_path, plugins=[io], callbacks=[mc])
    t.fit(Tiny())
    return t, mc


def _check_top2(backend, root: str, mc: ModelCheckpoint, io: CheckpointStoreIO) -> None:
    found = committed(backend, root)
    assert set(found) == basenames(mc.best_k_models) == {"epoch=1-step=4.ckpt",
                                                         "epoch=3-step=8.ckpt"}
    for name, meta in found.items():
        assert meta["run_id"] == io.run_id
        assert [e["path"] for e in meta["manifest"]] == [STATE_FILE]
        verified_state(backend, posixpath.join(root, name))  # checks size + CRC32C
    # Evicted ones are gone entirely, not only uncommitted.
    names = {fi.base_name for fi in backend.filesystem.get_file_info(pafs.FileSelector(root))}
    assert names & {"epoch=0-step=2.ckpt", "epoch=2-step=6.ckpt"} == set()


def test_model_checkpoint_top2_local_and_resume(tmp_path):
    dirpath = str(tmp_path / "ckpts")
    io = CheckpointStoreIO()
    t, mc = _fit_top2(tmp_path, dirpath, io)
    backend, root = resolve(dirpath)
    _check_top2(backend, root, mc, io)
    assert io.root == backend.uri_for(root)
    assert found_metrics(backend, root)["epoch=3-step=8.ckpt"] == {
        "epoch": 3, "step": 8, "val_loss": pytest.approx(0.1)}

    best = resume_path(dirpath, monitor="val_loss", mode="min")
    newest = resume_path(dirpath)
    assert best == newest == os.path.join(dirpath, "epoch=3-step=8.ckpt")
    io2 = CheckpointStoreIO()
    mc2 = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2)
    t2 = trainer(tmp_path, max_epochs=5, plugins=[io2], callbacks=[mc2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        t2.fit(Tiny(), ckpt_path=best)
    assert t2.global_step == 10  # continued from step 8, not restarted
    # Epoch 4 (0.15) enters the top 2 and ModelCheckpoint evicts epoch 1 (0.2),
    # which the process before wrote: the resumed run is the same run.
    assert io2.run_id == io.run_id
    assert set(committed(backend, root)) == basenames(mc2.best_k_models) == {
        "epoch=3-step=8.ckpt", "epoch=4-step=10.ckpt"}


def found_metrics(backend, root):
    return {n: m["metrics"] for n, m in committed(backend, root).items()}


def test_model_checkpoint_top2_s3(tmp_path, s3_bucket, s3_storage_options, s3_env):
    pytest.importorskip("s3fs")  # Lightning's ModelCheckpoint lists its dirpath through fsspec
    dirpath = f"s3://{s3_bucket}/run/ckpts"
    io = CheckpointStoreIO(storage_options=s3_storage_options)
    _t, mc = _fit_top2(tmp_path, dirpath, io)
    backend, root = resolve(dirpath, storage_options=s3_storage_options)
    _check_top2(backend, root, mc, io)
    best = resume_path(dirpath, monitor="val_loss", storage_options=s3_storage_options)
    assert best == f"{dirpath}/epoch=3-step=8.ckpt"
    state = CheckpointStoreIO(storage_options=s3_storage_options).load_checkpoint(best)
    assert state["global_step"] == 8


# -- the store's options reach ModelCheckpoint's own listing -----------------------------


@pytest.fixture
def no_aws_env(monkeypatch, tmp_path):
    """No AWS credentials anywhere but the plugin's storage options: every
    ``AWS_*`` variable removed, the shared files pointed at nothing."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))


def _fit_top1_then_resume(tmp_path, dirpath: str, options: dict, **kw) -> tuple[str, L.Trainer]:
    """Fit 2 epochs keeping the best 1, then resume to 3 epochs with a new plugin."""
    io = CheckpointStoreIO(storage_options=options)
    mc = StoreModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1, **kw)
    trainer(tmp_path, max_epochs=2, plugins=[io], callbacks=[mc]).fit(Tiny())
    assert basenames(mc.best_k_models) == {"epoch=1-step=4.ckpt"}
    path = resume_path(dirpath, monitor="val_loss", storage_options=options)
    # last.ckpt, when saved, holds the same step and score as the best.
    assert path in {f"{dirpath}/epoch=1-step=4.ckpt", f"{dirpath}/last.ckpt"}
    mc2 = StoreModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1, **kw)
    t2 = trainer(tmp_path, max_epochs=3, plugins=[CheckpointStoreIO(storage_options=options)],
                 callbacks=[mc2])
    with pytest.warns(UserWarning, match="exists and is not empty"):  # listed with the options
        t2.fit(Tiny(), ckpt_path=path)
    return path, t2


def test_model_checkpoint_reaches_s3_with_plugin_options_only(tmp_path, s3_bucket,
                                                              s3_storage_options, no_aws_env):
    dirpath = f"s3://{s3_bucket}/run/ckpts"
    # save_last: ModelCheckpoint also looks for last.ckpt through its filesystem.
    _path, t2 = _fit_top1_then_resume(tmp_path, dirpath, s3_storage_options, save_last=True)
    assert t2.current_epoch == 3 and t2.global_step == 6  # continued from epoch 1's end
    backend, root = resolve(dirpath, storage_options=s3_storage_options)
    # Epoch 2 (0.4) does not beat epoch 1 (0.2): top-1 still holds epoch 1.
    assert held(backend, root) == {"epoch=1-step=4.ckpt", "last.ckpt"}
    assert CheckpointStoreIO(storage_options=s3_storage_options).load_checkpoint(
        f"{dirpath}/last.ckpt")["global_step"] == 6


@pytest.mark.slow
def test_model_checkpoint_reaches_azure_with_plugin_options_only(tmp_path, azure_container,
                                                                 azure_storage_options):
    pytest.importorskip("adlfs")
    dirpath = f"az://{azure_container}/run/ckpts"
    _path, t2 = _fit_top1_then_resume(tmp_path, dirpath, azure_storage_options)
    assert t2.current_epoch == 3 and t2.global_step == 6
    backend, root = resolve(dirpath, storage_options=azure_storage_options)
    assert set(committed(backend, root)) == {"epoch=1-step=4.ckpt"}


@pytest.mark.slow
def test_model_checkpoint_reaches_gcs_with_plugin_options_only(tmp_path, gcs_bucket,
                                                               gcs_storage_options, monkeypatch):
    pytest.importorskip("gcsfs")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)  # the endpoint is in the options
    dirpath = f"gs://{gcs_bucket}/run/ckpts"
    _path, t2 = _fit_top1_then_resume(tmp_path, dirpath, gcs_storage_options)
    assert t2.current_epoch == 3 and t2.global_step == 6
    backend, root = resolve(dirpath, storage_options=gcs_storage_options)
    assert set(committed(backend, root)) == {"epoch=1-step=4.ckpt"}


def test_store_model_checkpoint_needs_the_plugin(tmp_path):
    mc = StoreModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    with pytest.raises(InvalidConfigError, match="CheckpointStoreIO"):
        trainer(tmp_path, max_epochs=1, callbacks=[mc]).fit(Tiny())


# -- restarts: a resumed run is the same run ------------------------------------------------


def _top2_min(dirpath: str, **kw) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, monitor="val_loss", mode="min", save_top_k=2, **kw)


def _no_refusals():
    """Fails the test on a refused remove of a checkpoint the run resumed through."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("error", "not removing .*did not write", RuntimeWarning)
    return ctx


def _fit_3_then_6(tmp_path, dirpath: str, options) -> tuple[ModelCheckpoint, str]:
    t1 = trainer(tmp_path, max_epochs=3, plugins=[CheckpointStoreIO(storage_options=options)],
                 callbacks=[_top2_min(dirpath)])
    t1.fit(Improving())
    ckpt = resume_path(dirpath, storage_options=options)
    mc = _top2_min(dirpath)
    t2 = trainer(tmp_path, max_epochs=6, plugins=[CheckpointStoreIO(storage_options=options)],
                 callbacks=[mc])
    ctx = _no_refusals()
    try:
        t2.fit(Improving(), ckpt_path=ckpt)
    finally:
        ctx.__exit__(None, None, None)
    assert t2.global_step == 12
    return mc, ckpt


@pytest.mark.parametrize("where", ["local", "s3"])
def test_resumed_fit_keeps_model_checkpoint_top_k_on_storage(tmp_path, where, request):
    """Fit 3 epochs, then a new process (new plugin) resumes to 6 from epoch
    2: storage holds ModelCheckpoint's top 2 (epochs 4 and 5) and the
    checkpoint fit resumed from, which Lightning keeps (on local disks it
    never asks to remove it), not also epoch 1, whose remove was refused
    because the earlier process wrote it."""
    if where == "local":
        dirpath, options = str(tmp_path / "ckpts"), None
    else:
        pytest.importorskip("s3fs")
        request.getfixturevalue("s3_env")  # Lightning's own fsspec lists the dirpath
        dirpath = f"s3://{request.getfixturevalue('s3_bucket')}/run/ckpts"
        options = request.getfixturevalue("s3_storage_options")
    mc, ckpt = _fit_3_then_6(tmp_path, dirpath, options)
    assert ckpt.endswith("epoch=2-step=6.ckpt")
    backend, root = resolve(dirpath, storage_options=options)
    assert basenames(mc.best_k_models) == {"epoch=4-step=10.ckpt", "epoch=5-step=12.ckpt"}
    assert set(committed(backend, root)) == basenames(mc.best_k_models) | {
        "epoch=2-step=6.ckpt"}
    # Evicted ones are gone, not only uncommitted; one run id throughout.
    names = {posixpath.basename(fi.path) for fi in _fsutil_list(backend, root)}
    assert names & {f"epoch={e}-step={2 * e + 2}.ckpt" for e in (0, 1, 3)} == set()
    assert len({m["run_id"] for m in committed(backend, root).values()}) == 1


def _fsutil_list(backend, root):
    return backend.filesystem.get_file_info(pafs.FileSelector(root, recursive=False))


class _KillAt(L.Callback):
    """Ends fit with an error after epoch ``epoch``'s checkpoints are saved,
    as a preemption would."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise SimulatedCrash(f"killed after epoch {self.epoch}")


@pytest.mark.parametrize("async_save", [False, True])
def test_kill_resume_cycles_keep_top_k_and_last(tmp_path, async_save):
    """10 epochs in 5 processes (killed after epochs 1, 3, 5, 7): storage ends
    with ModelCheckpoint's top 2 and last.ckpt, as one uninterrupted fit
    leaves, instead of all 10 epochs."""
    dirpath = str(tmp_path / "ckpts")
    kills = [1, 3, 5, 7]
    mc = None
    for cycle in range(len(kills) + 1):
        mc = _top2_min(dirpath, save_last=True)
        cbs = [mc] + ([_KillAt(kills[cycle])] if cycle < len(kills) else [])
        t = trainer(tmp_path, max_epochs=10, callbacks=cbs,
                    plugins=[CheckpointStoreIO(async_save=async_save)])
        ctx = _no_refusals()
        try:
            if cycle < len(kills):
                with pytest.raises(SimulatedCrash):
                    t.fit(Improving(), ckpt_path=resume_path(dirpath))
            else:
                t.fit(Improving(), ckpt_path=resume_path(dirpath))
        finally:
            ctx.__exit__(None, None, None)
    assert t.global_step == 20
    backend, root = resolve(dirpath)
    assert held(backend, root) == basenames(mc.best_k_models) | {"last.ckpt"} == {
        "epoch=8-step=18.ckpt", "epoch=9-step=20.ckpt", "last.ckpt"}


def test_resume_owns_only_the_run_it_resumed_through(tmp_path):
    """A plugin that loaded run A's checkpoint (a resume) may remove A's
    checkpoints; a checkpoint of run C in the same directory, never resumed
    through, stays, as does everything for a plugin that resumed nothing."""
    ck = tmp_path / "ck"
    run_a, run_c = CheckpointStoreIO(), CheckpointStoreIO()
    run_a.save_checkpoint({"global_step": 1}, str(ck / "a1.ckpt"))
    run_a.save_checkpoint({"global_step": 2}, str(ck / "a2.ckpt"))
    run_c.save_checkpoint({"global_step": 1}, str(ck / "c1.ckpt"))
    fresh = CheckpointStoreIO()
    fresh.save_checkpoint({"global_step": 3}, str(ck / "f3.ckpt"))
    with pytest.warns(RuntimeWarning, match="did not write"):
        fresh.remove_checkpoint(str(ck / "a1.ckpt"))

    resumed = CheckpointStoreIO()
    assert resumed.load_checkpoint(str(ck / "a2.ckpt"))["global_step"] == 2
    assert resumed.run_id == run_a.run_id
    resumed.save_checkpoint({"global_step": 3}, str(ck / "a3.ckpt"))
    resumed.remove_checkpoint(str(ck / "a1.ckpt"))
    with pytest.warns(RuntimeWarning, match="did not write"):
        resumed.remove_checkpoint(str(ck / "c1.ckpt"))
    # A legacy plain file records no run: loading it continues nothing.
    legacy = ck / "legacy.ckpt"
    torch.save({"global_step": 0}, legacy)
    other = CheckpointStoreIO(root=str(ck))
    other.load_checkpoint(str(legacy))
    with pytest.warns(RuntimeWarning, match="did not write"):
        other.remove_checkpoint(str(ck / "a2.ckpt"))
    backend, root = resolve(str(ck))
    assert set(committed(backend, root)) == {"a2.ckpt", "a3.ckpt", "c1.ckpt", "f3.ckpt"}


# -- the best checkpoint, and Lightning's and torch's own loaders ------------------------------


def _where(tmp_path, where: str, request) -> tuple[str, dict | None]:
    """A ModelCheckpoint dirpath on the local disk or on moto S3, and its options."""
    if where == "local":
        return str(tmp_path / "ckpts"), None
    pytest.importorskip("s3fs")
    request.getfixturevalue("s3_env")  # Lightning's own fsspec lists the dirpath
    return (f"s3://{request.getfixturevalue('s3_bucket')}/run/ckpts",
            request.getfixturevalue("s3_storage_options"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_best_model_path_loads_with_lightning_and_torch(tmp_path, where, request):
    """best_model_path names our checkpoint directory, which
    load_from_checkpoint and torch.load cannot open (IsADirectoryError
    locally, EOFError on S3); checkpoint_file(best_model_path) is what they
    take, verified. ckpt_path="best" goes through the plugin."""
    dirpath, options = _where(tmp_path, where, request)
    io = CheckpointStoreIO(storage_options=options)
    t, mc = _fit_top2(tmp_path, dirpath, io)
    best = mc.best_model_path
    assert best.endswith("epoch=3-step=8.ckpt")
    expected = io.load_checkpoint(best)["state_dict"]

    model = Tiny.load_from_checkpoint(checkpoint_file(best, storage_options=options))
    assert torch.equal(model.layer.weight, expected["layer.weight"])
    state = torch.load(checkpoint_file(best, storage_options=options), weights_only=False)
    assert (state["epoch"], state["global_step"]) == (3, 8)
    assert torch.load(io.checkpoint_file(best), weights_only=False)["global_step"] == 8

    t.validate(Tiny(), ckpt_path="best")  # Lightning's "best", loaded by the plugin
    assert t.ckpt_path == best


def test_checkpoint_file_follows_replacements_and_takes_legacy_files(tmp_path):
    from checkpoint_store import CheckpointCorruptError

    fs, backend, root = memory_fs()
    io = CheckpointStoreIO(storage_filesystem=fs)
    io.save_checkpoint({"global_step": 1}, f"{root}/last.ckpt")
    io.save_checkpoint({"global_step": 2}, f"{root}/last.ckpt")  # replaced: a pointer
    f = checkpoint_file(f"{root}/last.ckpt", storage_filesystem=fs)
    assert torch.load(f)["global_step"] == 2
    assert torch.load(io.checkpoint_file(f"{root}/last.ckpt"))["global_step"] == 2

    legacy = tmp_path / "legacy.ckpt"
    torch.save({"global_step": 7}, legacy)
    assert checkpoint_file(str(legacy)) == str(legacy)

    local = str(tmp_path / "ck" / "a.ckpt")
    CheckpointStoreIO().save_checkpoint({"global_step": 3, "w": torch.ones(64)}, local)
    assert checkpoint_file(local) == os.path.join(local, STATE_FILE)
    with open(os.path.join(local, STATE_FILE), "r+b") as out:
        out.seek(-30, os.SEEK_END)
        byte = out.read(1)
        out.seek(-30, os.SEEK_END)
        out.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="does not match its manifest"):
        checkpoint_file(local)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint_file(str(tmp_path / "ck" / "nothing.ckpt"))


class _StartStep(L.Callback):
    """Records the global step fit starts from (after it restored ckpt_path)."""

    step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_report_callback_best_checkpoint_reachable(tmp_path, where, request):
    """The callback is no ModelCheckpoint, so Lightning refuses
    ckpt_path="best"; best_path() is the best checkpoint as a local file
    (for ckpt_path= and load_from_checkpoint), best_checkpoint() the one on
    storage, in this process and in a new one."""
    if where == "local":
        loc = dict(storage_path=str(tmp_path / "runs"))
    else:
        loc = dict(storage_path=request.getfixturevalue("s3_uri"),
                   storage_options=request.getfixturevalue("s3_storage_options"))
    cb_args = dict(monitor="val_loss", mode="min", num_to_keep=3, experiment_name="exp",
                   trial_name="t0", **loc)
    cb = ReportCheckpointCallback(**cb_args)
    t = trainer(tmp_path, max_epochs=5, enable_checkpointing=False, callbacks=[cb])
    t.fit(Tiny())  # val_loss 0.5, 0.2, 0.4, 0.1, 0.15: epoch 3 best, epoch 4 newest
    with pytest.raises(ValueError, match="best"):
        t.validate(Tiny(), ckpt_path="best")
    best = cb.best_checkpoint()
    assert best.internal_metadata["metrics"]["step"] == 8
    path = cb.best_path(tmp_path / "best")
    state = torch.load(path, weights_only=False)
    assert (state["epoch"], state["global_step"]) == (3, 8)
    model = Tiny.load_from_checkpoint(path)
    assert torch.equal(model.layer.weight, state["state_dict"]["layer.weight"])
    t.validate(Tiny(), ckpt_path=path)

    cb2 = ReportCheckpointCallback(**cb_args)  # a new process
    start = _StartStep()
    t2 = trainer(tmp_path, max_epochs=6, enable_checkpointing=False, callbacks=[cb2, start])
    t2.fit(Tiny(), ckpt_path=cb2.best_path())
    assert (start.step, t2.global_step) == (8, 12)  # from the best, not the newest (10)
    with pytest.raises(InvalidConfigError, match="monitor"):
        ReportCheckpointCallback(storage_path=loc["storage_path"],
                                 storage_options=loc.get("storage_options")).best_path()


# -- the CLI on a ModelCheckpoint dirpath ------------------------------------------------------


def _cli_json(args: list[str], options) -> dict:
    import json

    from click.testing import CliRunner

    from checkpoint_store.cli import main

    opts = [a for k, v in (options or {}).items() for a in ("-o", f"{k}={v}")]
    out = CliRunner().invoke(main, [*args, "--json", *opts])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_cli_ls_and_best_show_the_monitored_score(tmp_path, where, request):
    """A ModelCheckpoint dirpath has no retention state: ls showed every
    score as "-", and best asked for --metric. Both now take the monitor and
    mode the plugin recorded from ModelCheckpoint (val_loss, min)."""
    dirpath, options = _where(tmp_path, where, request)
    mc = _top2_min(dirpath, save_last=True)
    trainer(tmp_path, plugins=[CheckpointStoreIO(storage_options=options)],
            callbacks=[mc]).fit(Tiny())
    listed = _cli_json(["ls", dirpath], options)
    assert listed["metric"] == "val_loss"
    assert {c["name"]: c["score"] for c in listed["checkpoints"]} == {
        "epoch=1-step=4.ckpt": pytest.approx(0.2), "epoch=3-step=8.ckpt": pytest.approx(0.1),
        "last.ckpt": pytest.approx(0.1)}
    best = _cli_json(["best", dirpath], options)
    assert (best["metric"], best["mode"]) == ("val_loss", "min")  # max would pick 0.2
    assert best["uri"].endswith("/epoch=3-step=8.ckpt")


def test_cli_ls_shows_each_dirpaths_own_monitor(tmp_path):
    """Two ModelCheckpoints into two directories, monitoring two metrics: each
    checkpoint records both values, and each directory lists by its own."""
    class TwoMetrics(Tiny):
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            self.log("val_acc", 1.0 - self.losses[self.current_epoch % len(self.losses)])

    loss_dir, acc_dir = str(tmp_path / "by_loss"), str(tmp_path / "by_acc")
    callbacks = [_top2_min(loss_dir),
                 ModelCheckpoint(dirpath=acc_dir, monitor="val_acc", mode="max", save_top_k=1)]
    trainer(tmp_path, plugins=[CheckpointStoreIO(root=str(tmp_path))],
            callbacks=callbacks).fit(TwoMetrics())
    assert _cli_json(["ls", loss_dir], None)["metric"] == "val_loss"
    assert _cli_json(["ls", acc_dir], None)["metric"] == "val_acc"
    best = _cli_json(["best", acc_dir], None)
    assert (best["metric"], best["mode"], best["score"]) == ("val_acc", "max",
                                                            pytest.approx(0.9))


def test_load_verifies_and_accepts_legacy_file(tmp_path):
    io = CheckpointStoreIO()
    path = str(tmp_path / "ck" / "a.ckpt")
    io.save_checkpoint({"global_step": 3, "w": torch.arange(4.0)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(4.0))

    legacy = tmp_path / "legacy.ckpt"
    torch.save({"global_step": 1, "w": torch.ones(2)}, legacy)
    assert io.load_checkpoint(str(legacy), weights_only=True)["global_step"] == 1

    backend, fs_path = resolve(path)
    _expect_damaged_state_refused(io, path, backend, fs_path)
    with pytest.raises(FileNotFoundError):  # CheckpointNotFoundError, as Lightning expects
        io.load_checkpoint(str(tmp_path / "nothing.ckpt"))


def _expect_damaged_state_refused(io, path, backend, fs_path) -> None:
    """Flip one byte of the committed state file (same size: only the CRC32C
    can tell) and check that loading it fails with the manifest's verdict."""
    from checkpoint_store import CheckpointCorruptError

    fs = backend.filesystem
    state = posixpath.join(fs_path, STATE_FILE)
    with fs.open_input_stream(state) as f:
        data = bytearray(f.read())
    (entry,) = inspect_checkpoint(fs, fs_path).meta["manifest"]
    data[-30] ^= 0xFF
    with fs.open_output_stream(state) as f:
        f.write(bytes(data))
    damaged = f"{google_crc32c.value(bytes(data)):08x}"
    assert damaged != entry["crc32c"]
    with pytest.raises(CheckpointCorruptError, match="does not match its manifest") as err:
        io.load_checkpoint(path)
    assert (err.value.path, err.value.file) == (fs_path, STATE_FILE)
    assert f"size {len(data)} vs {entry['size']}" in str(err.value)
    assert f"crc32c {damaged} vs {entry['crc32c']}" in str(err.value)


def test_load_refuses_a_damaged_state_read_into_memory():
    # Off the local disk the state comes back as bytes, checked on the same read.
    io = CheckpointStoreIO()
    path = f"memory://lt-{uuid.uuid4().hex[:8]}/ck/a.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.arange(4.0)}, path)
    backend, fs_path = resolve(path)
    assert isinstance(verified_state(backend, fs_path), bytes)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(4.0))
    _expect_damaged_state_refused(io, path, backend, fs_path)


def test_remove_refuses_outside_root_and_other_runs(tmp_path):
    run1, run2 = CheckpointStoreIO(), CheckpointStoreIO()
    a = str(tmp_path / "ck" / "a.ckpt")
    b = str(tmp_path / "ck" / "b.ckpt")
    elsewhere = str(tmp_path / "other" / "c.ckpt")
    run1.save_checkpoint({"global_step": 1}, a)
    run1.save_checkpoint({"global_step": 1}, elsewhere)  # root stays tmp_path/ck
    run2.save_checkpoint({"global_step": 2}, b)
    with pytest.warns(RuntimeWarning, match="did not write"):
        run2.remove_checkpoint(a)  # another run's (run2 resumed nothing)
    with pytest.warns(RuntimeWarning, match="outside"):
        run1.remove_checkpoint(elsewhere)
    legacy = tmp_path / "ck" / "legacy.ckpt"
    legacy.write_bytes(b"not ours")
    with pytest.warns(RuntimeWarning, match="did not write"):
        run1.remove_checkpoint(str(legacy))
    assert os.path.isdir(a) and os.path.isdir(elsewhere) and legacy.exists()
    run2.remove_checkpoint(b)
    assert not os.path.exists(b)
    run2.remove_checkpoint(b)  # absent is fine


@pytest.mark.parametrize("where", ["local", "memory"])
def test_save_overwrites_same_path(tmp_path, where):
    """Lightning saves last.ckpt again and again: each save replaces it (the
    new one committed beside it, then pointed at), leaving nothing else."""
    if where == "local":
        io, backend, root = CheckpointStoreIO(), *resolve(str(tmp_path / "ck"))
    else:
        fs, backend, root = memory_fs()
        io = CheckpointStoreIO(storage_filesystem=fs)
    path = f"{root}/last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(2)}, path)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, path)
    state = io.load_checkpoint(path)
    assert state["global_step"] == 2 and torch.equal(state["w"], torch.ones(2))
    names = {fi.base_name for fi in backend.filesystem.get_file_info(pafs.FileSelector(root))}
    sibling = posixpath.basename(current_dir(backend, path))
    assert sibling.startswith(".cs_replace-last.ckpt-")
    assert names - {COMMIT_LOCK} == {"last.ckpt", sibling}
    assert inspect_checkpoint(backend.filesystem, f"{root}/{sibling}").meta["index"] == 2


@pytest.mark.parametrize("crash_at", [STATE_FILE, ".internal_metadata.json"])
def test_crash_mid_save_leaves_nothing_listed(crash_at):
    """A process dying inside the upload (marker-last store), before or after
    the state is written, leaves nothing listed; resume picks the previous one."""
    fs, _plain, root = memory_fs()
    ok = CheckpointStoreIO(storage_filesystem=fs)
    ok.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, f"{root}/s2.ckpt")
    dying_fs = faulty_filesystem(fs, crash_on_path=f"s4.ckpt/{crash_at}")
    dying = CheckpointStoreIO(storage_filesystem=dying_fs)
    with pytest.raises(SimulatedCrash):
        dying.save_checkpoint({"global_step": 4, "w": torch.ones(3)}, f"{root}/s4.ckpt")
    backend, _ = resolve(root, filesystem=fs)
    assert set(committed(backend, root)) == {"s2.ckpt"}
    assert resume_path(root, storage_filesystem=fs) == f"{root}/s2.ckpt"
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        ok.load_checkpoint(f"{root}/s4.ckpt")
    # The resumed run reaches the same name again: the leftover (with the dead
    # writer's claim) does not hold the save off.
    started = time.monotonic()
    CheckpointStoreIO(storage_filesystem=fs).save_checkpoint({"global_step": 4},
                                                             f"{root}/s4.ckpt")
    assert time.monotonic() - started < 10
    assert set(committed(backend, root)) == {"s2.ckpt", "s4.ckpt"}


def test_resume_path_skips_damaged_newest(tmp_path):
    io = CheckpointStoreIO()
    ck = tmp_path / "ck"
    io.save_checkpoint({"global_step": 2}, str(ck / "s2.ckpt"))
    io.save_checkpoint({"global_step": 4}, str(ck / "s4.ckpt"))
    state = ck / "s4.ckpt" / STATE_FILE
    data = bytearray(state.read_bytes())
    data[-30] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="s4.ckpt"):
        assert resume_path(str(ck)) == str(ck / "s2.ckpt")
    assert resume_path(str(tmp_path / "empty")) is None



def test_resume_path_warns_for_a_newest_checkpoint_damaged_in_the_listing(tmp_path):
    """A truncated or deleted state file shows in the listing: skipped with a
    warning too, not silently (only a flipped byte was named before)."""
    io = CheckpointStoreIO()
    ck = tmp_path / "ck"
    for step in (2, 4, 6):
        io.save_checkpoint({"global_step": step}, str(ck / f"s{step}.ckpt"))
    os.truncate(ck / "s6.ckpt" / STATE_FILE, 10)
    with pytest.warns(RuntimeWarning, match="s6.ckpt"):
        assert resume_path(str(ck)) == str(ck / "s4.ckpt")
    os.remove(ck / "s4.ckpt" / STATE_FILE)
    with pytest.warns(RuntimeWarning, match="s4.ckpt"):
        assert resume_path(str(ck)) == str(ck / "s2.ckpt")


def test_resume_path_continues_the_run_that_committed_last(tmp_path):
    """A fresh fit in a dirpath holding an earlier run's further checkpoints
    is a run of its own: its restart resumes it, not the earlier run's end."""
    ck = tmp_path / "ck"
    CheckpointStoreIO().save_checkpoint({"global_step": 100}, str(ck / "old-100.ckpt"))
    fresh = CheckpointStoreIO()
    fresh.save_checkpoint({"global_step": 2}, str(ck / "new-2.ckpt"))
    assert resume_path(str(ck)) == str(ck / "new-2.ckpt")
    resumed = CheckpointStoreIO()
    resumed.load_checkpoint(str(ck / "new-2.ckpt"))
    resumed.save_checkpoint({"global_step": 4}, str(ck / "new-4.ckpt"))
    assert resume_path(str(ck)) == str(ck / "new-4.ckpt")
    # The run's only checkpoints damaged: no fallback to the other run's.
    for name in ("new-2.ckpt", "new-4.ckpt"):
        os.truncate(ck / name / STATE_FILE, 10)
    with pytest.warns(RuntimeWarning, match="new-4.ckpt"):
        assert resume_path(str(ck)) is None


def test_resume_path_refuses_a_monitor_nothing_recorded(tmp_path):
    """Best by a metric no checkpoint recorded (a restart with another
    monitor) is a typed error, not the newest handed out as the best."""
    io = CheckpointStoreIO()
    ck = tmp_path / "ck"

    def state(step: int, loss: float | None) -> dict:
        mc = {"monitor": "val_loss", "current_score": None if loss is None else torch.tensor(loss)}
        return {"global_step": step, "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": mc}}

    io.save_checkpoint(state(2, 0.1), str(ck / "s2.ckpt"))
    io.save_checkpoint(state(4, 0.5), str(ck / "s4.ckpt"))
    io.save_checkpoint(state(6, None), str(ck / "s6.ckpt"))  # before any validation
    assert resume_path(str(ck), monitor="val_loss") == str(ck / "s2.ckpt")
    assert resume_path(str(ck), monitor="val_loss", mode="max") == str(ck / "s4.ckpt")
    with pytest.raises(InvalidConfigError, match="val_acc.*val_loss"):
        resume_path(str(ck), monitor="val_acc")

# -- async ------------------------------------------------------------------------------------


def test_async_ordered_queue_keeps_a_committed_checkpoint(tmp_path):
    """Slow storage, save_top_k=1 and a save every step: Lightning removes the
    previous checkpoint right after asking for the next save. Removes wait in
    the queue behind that save, so some committed checkpoint exists at every
    moment, and after teardown exactly K remain."""
    slow, backend, root = memory_fs(latency=0.02)
    io = CheckpointStoreIO(async_save=True, storage_filesystem=slow)
    mc = ModelCheckpoint(dirpath=root, save_top_k=1, every_n_train_steps=1,
                         monitor="step", mode="max")
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(len(committed(backend, root)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        t = trainer(tmp_path, max_epochs=2, limit_val_batches=0, plugins=[io], callbacks=[mc])
        t.fit(Tiny())
    finally:
        stop.set()
        watcher.join()
    first = next(i for i, n in enumerate(seen) if n)
    assert min(seen[first:]) >= 1, "a moment with no committed checkpoint"
    assert len(committed(backend, root)) == 1
    assert basenames(committed(backend, root)) == basenames(mc.best_k_models)


def test_async_load_waits_and_teardown_raises_first_error(tmp_path):
    slow, plain, root = memory_fs(latency=0.05)
    io = CheckpointStoreIO(async_save=True, storage_filesystem=slow)
    path = f"{root}/a.ckpt"
    w = torch.zeros(3)
    io.save_checkpoint({"global_step": 1, "w": w}, path)
    w += 1  # training goes on: the queued save holds its own copy
    assert torch.equal(io.load_checkpoint(path)["w"], torch.zeros(3))  # waited for the save

    failing, plain, root = memory_fs(latency=0.02, permanent={"write": "no_space"},
                                     path_contains="b.ckpt")
    io2 = CheckpointStoreIO(async_save=True, storage_filesystem=failing)
    io2.save_checkpoint({"global_step": 1}, f"{root}/ok.ckpt")
    io2.save_checkpoint({"global_step": 2}, f"{root}/b.ckpt")
    io2.remove_checkpoint(f"{root}/ok.ckpt")  # must not run: the save before it failed
    with pytest.raises(OSError, match="No space"):
        io2.teardown()
    assert set(committed(plain, root)) == {"ok.ckpt"}
    io2.teardown()  # each error is raised once


# Many tensors, so the queued snapshot takes a while to free: the window in
# which a daemon worker, still freeing it as the interpreter finalised, was
# killed inside torch's tensor destructor (SIGABRT, "terminate called without
# an active exception"): 6 runs in 10 before the worker was joined.
_EXIT_SCRIPT = """
import sys, threading, torch
from checkpoint_store.integrations.lightning import CheckpointStoreIO

io = CheckpointStoreIO(async_save=True)
state = {"state_dict": {f"w{i}": torch.randn(64, 64) for i in range(3000)},
         "big": torch.randn(2000, 2000)}
for step in range(3):
    state["global_step"] = step
    io.save_checkpoint(state, f"{sys.argv[1]}/s{step}.ckpt")
if sys.argv[2] == "teardown":
    io.teardown()
    assert not [t for t in threading.enumerate() if t.name == "cs-lightning-io"]
"""


def _run_exit_script(tmp_path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), how],
                          capture_output=True, text=True, timeout=300)


def test_async_teardown_ends_the_worker_and_exit_finishes_queued_saves(tmp_path):
    """teardown() returns once the worker thread has ended (nothing of ours
    runs at interpreter exit); a process that exits without teardown waits
    for its queued saves, which commit, instead of killing them."""
    io = CheckpointStoreIO(async_save=True)
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(8)}, str(tmp_path / "a.ckpt"))
    io.teardown()
    # Alive only: a start that a signal's exception cut (tests/util) leaves
    # its thread in threading's list of threads being started, for ever.
    assert not [t for t in threading.enumerate()
                if t.name == "cs-lightning-io" and t.is_alive()]

    out = _run_exit_script(tmp_path / "no-teardown", "exit")
    assert out.returncode == 0, out.stderr[-2000:]
    backend, root = resolve(str(tmp_path / "no-teardown"))
    assert set(committed(backend, root)) == {"s0.ckpt", "s1.ckpt", "s2.ckpt"}


@pytest.mark.slow
def test_async_process_exit_never_aborts(tmp_path):
    """The docs' async setup, exiting right after teardown, five times: rc 0 each time."""
    for run in range(5):
        out = _run_exit_script(tmp_path / f"run{run}", "teardown")
        assert out.returncode == 0, (run, out.returncode, out.stderr[-2000:])
        backend, root = resolve(str(tmp_path / f"run{run}"))
        assert len(committed(backend, root)) == 3


def test_plugin_pickles_for_spawned_ranks(tmp_path):
    """ddp_spawn sends the plugin to each rank: same run id and root, no thread."""
    io = CheckpointStoreIO(async_save=True)
    io.save_checkpoint({"global_step": 1}, str(tmp_path / "a.ckpt"))
    clone = pickle.loads(pickle.dumps(io))
    io.teardown()
    assert (clone.run_id, clone.root) == (io.run_id, io.root)
    clone.remove_checkpoint(str(tmp_path / "a.ckpt"))
    clone.teardown()
    assert not (tmp_path / "a.ckpt").exists()


# -- callback mode ---------------------------------------------------------------------------


def test_report_callback_keeps_best_two_and_resumes(tmp_path):
    cb_args = dict(monitor="val_loss", mode="min", num_to_keep=2,
                   storage_path=str(tmp_path / "runs"), experiment_name="exp", trial_name="t0")
    cb = ReportCheckpointCallback(**cb_args)
    t = trainer(tmp_path, enable_checkpointing=False, callbacks=[cb])  # sanity check runs
    t.fit(Tiny())
    storage = StorageContext(str(tmp_path / "runs"), "exp", "t0")
    rows = storage.read_results()
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]  # 4 reports, none for the sanity check
    assert [r["val_loss"] for r in rows] == pytest.approx(VAL_LOSS[:4])
    kept = storage.committed_checkpoints()
    assert sorted(m["metrics"]["step"] for _, m in kept) == [4, 8]
    for ckpt, _ in kept:
        ckpt.verify()

    cb2 = ReportCheckpointCallback(**cb_args)
    path = cb2.resume_path(tmp_path / "restore")
    assert path == str(tmp_path / "restore" / STATE_FILE)
    t2 = trainer(tmp_path, max_epochs=5, enable_checkpointing=False, callbacks=[cb2])
    t2.fit(Tiny(), ckpt_path=path)
    assert t2.global_step == 10
    rows = storage.read_results()
    assert [r["training_iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["step"] == 10


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_report_callback_keeps_best_two_across_resumes(tmp_path, where, request):
    """Three processes (to 2, 4 and 6 epochs), each resuming the one before:
    our retention keeps the best two of all six epochs, whichever process
    wrote them, and the iterations run on."""
    if where == "local":
        where_args = dict(storage_path=str(tmp_path / "runs"))
    else:
        where_args = dict(storage_path=request.getfixturevalue("s3_uri"),
                          storage_options=request.getfixturevalue("s3_storage_options"))
    cb_args = dict(monitor="val_loss", mode="min", num_to_keep=2, experiment_name="exp",
                   trial_name="t0", **where_args)
    for max_epochs in (2, 4, 6):
        cb = ReportCheckpointCallback(**cb_args)
        t = trainer(tmp_path, max_epochs=max_epochs, enable_checkpointing=False, callbacks=[cb])
        t.fit(Improving(), ckpt_path=cb.resume_path())
        assert t.global_step == 2 * max_epochs
    storage = StorageContext(where_args["storage_path"], "exp", "t0",
                             storage_options=where_args.get("storage_options"))
    assert [r["training_iteration"] for r in storage.read_results()] == [1, 2, 3, 4, 5, 6]
    assert sorted(m["metrics"]["step"] for _, m in storage.committed_checkpoints()) == [10, 12]


def test_report_callback_resume_copy_removed_after_fit_loads_it(tmp_path):
    """resume_path() without local_dir downloads into a temporary directory:
    gone once fit() has restored from it, not left as a model copy in /tmp."""
    cb_args = dict(num_to_keep=1, storage_path=str(tmp_path / "runs"),
                   experiment_name="exp", trial_name="t0")
    trainer(tmp_path, max_epochs=2, enable_checkpointing=False,
            callbacks=[ReportCheckpointCallback(**cb_args)]).fit(Tiny())
    cb = ReportCheckpointCallback(**cb_args)
    path = cb.resume_path()
    assert path is not None and os.path.isfile(path)
    t = trainer(tmp_path, max_epochs=3, enable_checkpointing=False, callbacks=[cb])
    t.fit(Tiny(), ckpt_path=path)
    assert t.global_step == 6  # resumed at step 4, then one more epoch
    assert not os.path.exists(os.path.dirname(path))
    # Never fit: the copy goes at teardown of a later fit or at exit, not before.
    cb3 = ReportCheckpointCallback(**cb_args)
    kept = cb3.resume_path()
    assert kept is not None and os.path.isfile(kept)
    cb3._drop_resume_copies()  # what the atexit hook and teardown run
    assert not os.path.exists(os.path.dirname(kept))


def test_report_callback_failed_save_then_resume(tmp_path):
    """The third checkpoint's commit fails at its marker (data written): fit()
    raises, the session ends (Lightning runs no teardown hooks then), only the
    two before it are listed, and resume continues from the newer of them.
    (A process dying there instead is covered for the session by tests/crash.)"""
    fs, plain, root = memory_fs()
    failing = faulty_filesystem(fs, permanent={"write": "no_space"},
                                path_contains="checkpoint_000002/.internal_metadata.json")
    where = dict(storage_path=root, experiment_name="exp", trial_name="t")
    cb = ReportCheckpointCallback(num_to_keep=3, storage_filesystem=failing, **where)
    with pytest.raises(OSError, match="No space"):
        trainer(tmp_path, enable_checkpointing=False, callbacks=[cb]).fit(Tiny())
    storage = StorageContext(root, "exp", "t", storage_filesystem=fs)
    assert [m["metrics"]["step"] for _, m in storage.committed_checkpoints()] == [2, 4]
    assert "No space" in storage.read_error().strip().splitlines()[-1]  # errored

    cb2 = ReportCheckpointCallback(num_to_keep=3, storage_filesystem=fs, **where)
    t2 = trainer(tmp_path, enable_checkpointing=False, callbacks=[cb2])
    t2.fit(Tiny(), ckpt_path=cb2.resume_path(tmp_path / "restore"))
    assert t2.global_step == 8
    assert [m["metrics"]["step"] for _, m in storage.committed_checkpoints()] == [4, 6, 8]
    assert storage.read_error() is None  # the clean resume supersedes the failure


def test_report_callback_stops_when_session_stops(tmp_path):
    from checkpoint_store import TrialRunner

    cbs = []

    def train_fn():
        cb = ReportCheckpointCallback()
        cbs.append(cb)
        t = trainer(tmp_path, max_epochs=10, enable_checkpointing=False, callbacks=[cb])
        t.fit(Tiny())
        cbs.append(t.current_epoch)

    runner = TrialRunner(train_fn, {}, storage_path=str(tmp_path / "runs"),
                         experiment_name="exp", trial_name="t")
    first = runner.step(timeout=120)
    assert first is not None and first["epoch"] == 0
    assert runner.stop(timeout=120)
    assert cbs[0].stopped_by_session
    assert cbs[1] <= 1  # fit() ended after the stop, not at max_epochs


def test_report_callback_refuses_store_io(tmp_path):
    from checkpoint_store import InvalidConfigError

    cb = ReportCheckpointCallback(storage_path=str(tmp_path / "runs"))
    t = trainer(tmp_path, enable_checkpointing=False, plugins=[CheckpointStoreIO()],
                callbacks=[cb])
    with pytest.raises(InvalidConfigError, match="cannot be combined"):
        t.fit(Tiny())
    with pytest.raises(InvalidConfigError, match="active session"):
        ReportCheckpointCallback(monitor="val_loss")


# -- packaging -------------------------------------------------------------------------------


def test_old_package_name(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from checkpoint_store.integrations import pytorch_lightning as cs_pl

    class OldTiny(_TinyBody, pl.LightningModule):
        pass

    io = cs_pl.CheckpointStoreIO()
    mc = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="val_loss",
                                      save_top_k=1)
    t = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=1,
                   limit_val_batches=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[io], callbacks=[mc],
                   default_root_dir=str(tmp_path))
    t.fit(OldTiny())
    backend, root = resolve(str(tmp_path / "ck"))
    assert set(committed(backend, root)) == basenames(mc.best_k_models) == {"epoch=1-step=2.ckpt"}


def test_old_package_name_store_model_checkpoint_on_memory():
    pl = pytest.importorskip("pytorch_lightning")
    from checkpoint_store.integrations import pytorch_lightning as cs_pl

    class OldTiny(_TinyBody, pl.LightningModule):
        pass

    dirpath = f"memory://lt-{uuid.uuid4().hex[:8]}/ck"
    mc = cs_pl.StoreModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1)
    assert isinstance(mc, pl.callbacks.ModelCheckpoint)
    t = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=1,
                   limit_val_batches=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[cs_pl.CheckpointStoreIO()],
                   callbacks=[mc])
    t.fit(OldTiny())
    assert mc._fs.exists(f"{dirpath}/epoch=1-step=2.ckpt")  # the plugin's memory store
    backend, root = resolve(dirpath)
    assert set(committed(backend, root)) == basenames(mc.best_k_models) == {"epoch=1-step=2.ckpt"}


def test_core_imports_no_lightning():
    code = ("import sys, checkpoint_store, checkpoint_store.session, checkpoint_store.integrations;"
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'torch') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- several ranks -------------------------------------------------------------------------


@pytest.mark.slow
def test_report_callback_ddp_spawn_two_ranks(tmp_path):
    cb = ReportCheckpointCallback(monitor="val_loss", mode="min", num_to_keep=2,
                                  storage_path=str(tmp_path / "runs"), experiment_name="exp",
                                  trial_name="ddp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(tmp_path, strategy="ddp_spawn", devices=2, enable_checkpointing=False,
                    callbacks=[cb])
        t.fit(Tiny())
    storage = StorageContext(str(tmp_path / "runs"), "exp", "ddp")
    assert len(storage.read_results()) == 4
    kept = storage.committed_checkpoints()
    assert sorted(m["metrics"]["step"] for _, m in kept) == [4, 8]
    for ckpt, meta in kept:
        assert meta["world_size"] == 2
        ckpt.verify()


@pytest.mark.parametrize("bad", [[1, 2], None, "state", b"bytes"])
def test_save_checkpoint_of_something_not_a_dict_is_a_typed_error(tmp_path, bad):
    """What Lightning hands CheckpointIO is a dict; anything else was an
    AttributeError from deep inside. Nothing is written."""
    from checkpoint_store import InvalidConfigError

    io = CheckpointStoreIO()
    with pytest.raises(InvalidConfigError, match="checkpoint dict"):
        io.save_checkpoint(bad, str(tmp_path / "ck" / "a.ckpt"))
    assert not (tmp_path / "ck").exists()


def test_async_save_snapshots_through_bounded_staging(tmp_path):
    """async_save stages the tensors in shared memory of staging_budget bytes
    (a state 4x larger goes through in pieces): the tensors changed right
    after save_checkpoint() returns are saved as they were at the call."""
    io = CheckpointStoreIO(async_save=True, staging_budget=4 << 20)
    weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(4)}  # 16 MiB
    state = {"state_dict": weights, "tied": weights["w1"], "global_step": 3,
             "bf": torch.ones(3, dtype=torch.bfloat16),
             "cplx": torch.ones(2, dtype=torch.complex64), "hparams": {"lr": 0.1}}
    path = str(tmp_path / "ckpts" / "a.ckpt")
    io.save_checkpoint(state, path)
    for w in weights.values():
        w.add_(10.0)
    io.wait()
    assert 0 < io._stager.peak_in_use <= 4 << 20
    loaded = io.load_checkpoint(path)
    for i in range(4):
        assert torch.equal(loaded["state_dict"][f"w{i}"], torch.full((1 << 20,), float(i)))
    assert loaded["bf"].dtype == torch.bfloat16 and loaded["cplx"].dtype == torch.complex64
    assert loaded["hparams"] == {"lr": 0.1} and loaded["global_step"] == 3
    assert torch.equal(loaded["tied"], torch.full((1 << 20,), 1.0))
    io.teardown()
    assert io._stager is None


def test_report_callback_resumes_the_local_tiers_newer_copy(tmp_path):
    """A local tier whose newest copies never reached the storage_path
    (``persist`` selected only the first): resume_path() restores the tier's
    newest copy, not the storage_path's older one, so no epoch is trained or
    recorded twice (issue 37, the Lightning resume path)."""
    from checkpoint_store import LocalTier

    tier = LocalTier(tmp_path / "fast", num_to_keep=4, persist=lambda index, row: index < 1)
    cb_args = dict(num_to_keep=3, storage_path=str(tmp_path / "runs"), experiment_name="exp",
                   trial_name="t0", local_tier=tier)
    trainer(tmp_path, max_epochs=4, enable_checkpointing=False,
            callbacks=[ReportCheckpointCallback(**cb_args)]).fit(Tiny())
    storage = StorageContext(str(tmp_path / "runs"), "exp", "t0")
    assert [m["metrics"]["step"] for _, m in storage.committed_checkpoints()] == [2]
    cb = ReportCheckpointCallback(**cb_args)
    path = cb.resume_path(tmp_path / "restore")
    t = trainer(tmp_path, max_epochs=5, enable_checkpointing=False, callbacks=[cb])
    t.fit(Tiny(), ckpt_path=path)
    assert t.global_step == 10
    rows = storage.read_results()
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    assert [r["training_iteration"] for r in rows] == [1, 2, 3, 4, 5]
