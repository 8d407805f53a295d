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

# An earlier test in this process may have left a SIGTERM handler of its own
# (ray.init installs one): the signal must reach the session's.
pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")

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


def test_a_handler_another_library_set_over_ours_is_taken_back(tmp_path):
    """ray.init sets its own SIGTERM handler (one that exits at once). A
    session starting after it, with our handler already installed by an
    earlier one (install_preemption_handlers pins it), takes the signal back:
    the SIGTERM is a preemption, and signals no session watches still reach
    the other library's handler."""
    seen = []

    def theirs(signum, frame):
        seen.append(signum)

    session.install_preemption_handlers()
    signals.signal(signals.SIGTERM, theirs)  # what ray.init does
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"1")
    with pytest.raises(Preempted) as info:
        with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                           trial_name="t", preemption=PreemptionConfig(exit_code=CODE)) as s:
            os.kill(os.getpid(), signals.SIGTERM)
            assert s.reached_preemption
            s.report({"step": 0}, checkpoint=Checkpoint.from_directory(str(src)))
    assert info.value.code == CODE and seen == []
    os.kill(os.getpid(), signals.SIGTERM)  # no session watches it now: theirs runs
    assert seen == [signals.SIGTERM]
