"""One rank: a preemption report that fails (its files vanished, storage
down, the other ranks gone) still ends the run as preempted, with the
configured exit code and the failure as the cause, instead of leaving the
loop running with the flag spent and the watchdog off."""

from __future__ import annotations

import os
import signal as signals

import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointNotFoundError,
    PreemptionConfig,
    StorageContext,
    session,
)
from checkpoint_store.errors import Preempted

CODE = 42


def test_a_failed_preemption_report_still_ends_the_run_as_preempted(tmp_path):
    store = tmp_path / "store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"1")
    with pytest.raises(Preempted) as info:
        with session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                           preemption=PreemptionConfig(exit_code=CODE)) as s:
            s.report({"step": 0}, checkpoint=Checkpoint.from_directory(str(src)))
            os.kill(os.getpid(), signals.SIGTERM)
            assert s.reached_preemption
            gone = Checkpoint.from_directory(str(src))
            (src / "w.bin").unlink()
            src.rmdir()  # the preemption report's files vanish: nothing to commit
            s.report({"step": 1}, checkpoint=gone)
    # Not a loop left running with the flag spent: the run ended, as preempted.
    assert info.value.code == CODE
    assert isinstance(info.value.__cause__, CheckpointNotFoundError)
    ctx = StorageContext(str(store), "e", "t")
    assert ctx.read_stop()["status"] == "preempted"
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
