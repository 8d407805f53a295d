"""A committed checkpoint whose files live as chunks, handed in as the source
of a new checkpoint: its directory lacks those files, so a commit of it is
refused before anything is written, never committed without its tensors."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from checkpoint_store import Checkpoint, StorageContext, UploadConfig, session
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.testing.chunked import write_chunked_state_checkpoint


def _chunked(tmp_path: Any) -> Checkpoint:
    ck = Checkpoint(str(tmp_path / "src" / "exp" / "t" / "checkpoint_000000"))
    write_chunked_state_checkpoint(ck.filesystem, ck.path,
                                   {"w": np.arange(40_000, dtype=np.float32), "step": 3},
                                   chunk_bytes=24_000)
    return ck


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("form", ["checkpoint", "directory", "async"])
def test_report_of_a_chunked_checkpoint_is_refused(tmp_path: Any, dedup: bool,
                                                   form: str) -> None:
    src = _chunked(tmp_path)
    given = src if form == "checkpoint" else Checkpoint.from_directory(src.path)
    root = str(tmp_path / "dst")
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(dedup=dedup)) as s:
        with pytest.raises(InvalidConfigError, match="chunks") as exc:
            s.report({"x": 1}, checkpoint=given,
                     upload_mode="async" if form == "async" else "sync")
        assert "to_directory" in str(exc.value) and src.path in str(exc.value)
    assert StorageContext(root, "e", "t").committed_checkpoints() == []
    # A real copy of it commits, and loads bit for bit.
    local = str(tmp_path / "copy")
    src.to_directory(local)
    with session.start(storage_path=root, experiment_name="e", trial_name="t2",
                       upload_config=UploadConfig(dedup=dedup)) as s:
        s.report({"x": 1}, checkpoint=Checkpoint.from_directory(local))
    [(ck, _)] = StorageContext(root, "e", "t2").committed_checkpoints()
    np.testing.assert_array_equal(ck.load_state()["w"], np.arange(40_000, dtype=np.float32))
    assert os.path.isdir(local)
