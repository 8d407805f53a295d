"""Upload settings live in UploadConfig; CheckpointConfig's old upload keywords
still work, with a DeprecationWarning, and never reach the retention state."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
    TrialRunner,
    UploadConfig,
    session,
)
from checkpoint_store._format.layout import MANAGER_STATE


def _write_ckpt(path, step: int) -> Checkpoint:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.bin"), "wb") as f:
        f.write(bytes([step]) * 1000)
    return Checkpoint.from_directory(str(path))


def test_old_upload_keywords_warn_and_are_still_honoured(tmp_path) -> None:
    with pytest.warns(DeprecationWarning, match="upload_config=UploadConfig"):
        cfg = CheckpointConfig(num_to_keep=2, upload_mode="async", staging="move")
    assert cfg.legacy_upload_config() == UploadConfig(upload_mode="async", staging="move")
    with session.start(storage_path=str(tmp_path / "r"), experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        assert s.upload_config == UploadConfig(upload_mode="async", max_pending_uploads=1,
                                               staging="move")
        src = tmp_path / "src"
        session.report({"step": 0}, checkpoint=_write_ckpt(src, 0))
        # staging="move" reached the uploader: the files left the source directory.
        assert os.listdir(src) == []
        session.wait()
        assert session.get_checkpoint() is not None


def test_new_configs_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss")
        dataclasses.replace(cfg, num_to_keep=3)
        UploadConfig(upload_mode="async", max_pending_uploads=4, staging="hardlink")
        CheckpointConfig.from_json({"num_to_keep": 1, "upload_mode": "async"})
    assert cfg.legacy_upload_config() is None
    assert cfg.upload_mode is None


@pytest.mark.parametrize("bad, match", [
    ({"upload_mode": "later"}, "upload_mode"),
    ({"max_pending_uploads": 0}, "max_pending_uploads"),
    ({"max_pending_uploads": True}, "max_pending_uploads"),
    ({"staging": "symlink"}, "staging"),
])
def test_upload_config_refuses_bad_values_in_both_spellings(bad, match) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        UploadConfig(**bad)
    with pytest.raises(InvalidConfigError, match=match):
        CheckpointConfig(**bad)


def test_upload_config_is_frozen() -> None:
    cfg = UploadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.upload_mode = "async"  # type: ignore[misc]


def test_session_takes_upload_config_and_report_overrides_it(tmp_path) -> None:
    with session.start(storage_path=str(tmp_path / "r"), experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(upload_mode="async", staging="move")) as s:
        assert s.checkpoint_config == CheckpointConfig()
        moved, copied = tmp_path / "moved", tmp_path / "copied"
        session.report({"step": 0}, checkpoint=_write_ckpt(moved, 0))
        session.report({"step": 1}, checkpoint=_write_ckpt(copied, 1), staging="copy")
        session.wait()
        assert os.listdir(moved) == []
        assert os.listdir(copied) == ["model.bin"]
        session.report({"step": 2}, checkpoint=_write_ckpt(tmp_path / "sync", 2),
                       upload_mode="sync")
        assert s.manager.kept_dir_names == [
            "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]


def test_upload_settings_given_twice_are_refused_before_any_write(tmp_path) -> None:
    with pytest.warns(DeprecationWarning):
        legacy = CheckpointConfig(upload_mode="async")
    root = tmp_path / "r"
    with pytest.raises(InvalidConfigError, match="given twice"):
        session.start(storage_path=str(root), experiment_name="e", trial_name="t",
                      checkpoint_config=legacy, upload_config=UploadConfig(upload_mode="sync"))
    assert not root.exists()
    # The same settings twice say one thing: accepted.
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t",
                       checkpoint_config=legacy,
                       upload_config=UploadConfig(upload_mode="async")) as s:
        assert s.upload_config.upload_mode == "async"


def test_trial_runner_checks_and_passes_upload_config(tmp_path) -> None:
    with pytest.raises(InvalidConfigError, match="upload_config must be an UploadConfig"):
        TrialRunner(lambda cfg: None, storage_path=str(tmp_path), experiment_name="e",
                    trial_name="t", upload_config={"upload_mode": "async"})  # type: ignore[arg-type]
    seen = []

    def train(cfg):
        seen.append(session.get_session().upload_config)
        session.report({"step": 0}, checkpoint=_write_ckpt(tmp_path / "src", 0))

    runner = TrialRunner(train, storage_path=str(tmp_path / "r"), experiment_name="e",
                         trial_name="t", upload_config=UploadConfig(upload_mode="async"))
    while runner.step() is not None:
        pass
    assert seen == [UploadConfig(upload_mode="async")]
    assert runner.best_checkpoints


def test_upload_settings_never_reach_the_retention_state(tmp_path) -> None:
    with pytest.warns(DeprecationWarning):
        cfg = CheckpointConfig(num_to_keep=1, upload_mode="async", max_pending_uploads=3)
    assert set(cfg.to_json()) == {"num_to_keep", "checkpoint_score_attribute",
                                  "checkpoint_score_order", "keep_latest", "missing_score"}
    storage = StorageContext(str(tmp_path / "r"), "e", "t")
    with session.start(storage_path=str(tmp_path / "r"), experiment_name="e", trial_name="t",
                       checkpoint_config=cfg):
        session.report({"step": 0}, checkpoint=_write_ckpt(tmp_path / "src", 0))
        session.wait()
    stored = json.loads((tmp_path / "r" / "e" / "t" / MANAGER_STATE).read_text())["config"]
    assert stored == cfg.to_json()
    # The stored config reads back as the same retention rules, without a warning,
    # and a manager reopening the trial keeps its state (no rewrite for upload keys).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CheckpointConfig.from_json(stored) == dataclasses.replace(
            CheckpointConfig(), num_to_keep=1)
        with CheckpointManager(CheckpointConfig(num_to_keep=1), storage,
                               read_only=True) as m:
            assert m.kept_dir_names == ["checkpoint_000000"]
