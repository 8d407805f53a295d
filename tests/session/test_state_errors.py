"""The same failure is the same error type on the state path as on the
directory path (issue 37 item 6).

``report(state=...)`` has its files written by the persist process; an
error there crosses a process boundary. A full disk must still be a
``StorageFullError`` (not a ``PersistProcessError`` around a traceback),
sync and async, with a local tier and without, as it is for
``report(checkpoint=...)``. ``PersistProcessError`` is left for a persist
process that dies.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from checkpoint_store import Checkpoint, LocalTier, session
from checkpoint_store.errors import PersistProcessError, StorageFullError
from checkpoint_store.state import ENV_STAGING_DIR

#: 1 MiB of tensor data: more than the small disk holds.
BIG = 1 << 18


def _report(s, tmp_path, kind: str, mode: str, n: int) -> None:
    if kind == "state":
        s.report({"i": 0}, state={"w": np.ones(n, dtype=np.float32), "step": 0},
                 upload_mode=mode)
    else:
        src = tmp_path / f"src-{mode}"
        src.mkdir(exist_ok=True)
        (src / "w.bin").write_bytes(np.ones(n, dtype=np.float32).tobytes())
        s.report({"i": 0}, checkpoint=Checkpoint.from_directory(src), upload_mode=mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("tier", [True, False], ids=["tier", "no-tier"])
@pytest.mark.parametrize("kind", ["state", "directory"])
def test_a_full_disk_is_a_storage_full_error_on_every_path(small_disk, tmp_path, kind,
                                                           tier, mode):
    """The issue's input: a full local tier with report(state=...) was a
    PersistProcessError wrapping ``OSError: [Errno 28]``. Without a tier the
    storage_path itself is on the full disk (the state is written in place)."""
    if tier:
        kw = {"storage_path": str(tmp_path / "store"),
              "local_tier": LocalTier(os.path.join(small_disk, "tier"))}
    else:
        kw = {"storage_path": os.path.join(small_disk, "store")}
    with session.start(experiment_name="e", trial_name="t", **kw) as s:
        with pytest.raises(StorageFullError, match="disk is full") as err:
            _report(s, tmp_path, kind, mode, BIG)
            s.wait()
        assert isinstance(err.value, OSError) and not isinstance(err.value, PersistProcessError)
        assert "Errno 28" in str(err.value) or "No space left" in str(err.value)
        assert s.get_checkpoint() is None  # nothing committed
        # The disk is usable again for what fits: the session goes on.
        _report(s, tmp_path, kind, mode, 16)
        s.wait()
        got = s.get_checkpoint()
        assert got is not None and got.path.endswith("checkpoint_000001")
    if kind == "state":
        assert got.load_state()["step"] == 0


@pytest.mark.parametrize("kind", ["state", "directory"])
def test_a_full_staging_disk_is_a_storage_full_error_for_a_remote_trial(
        small_disk, tmp_path, monkeypatch, kind):
    """Found by ourselves: a trial on storage that is not local (memory://)
    has its state written into a scratch directory under the staging root
    (and an async directory report copied there); that disk full is a
    StorageFullError on both paths too."""
    monkeypatch.setenv(ENV_STAGING_DIR, small_disk)
    with session.start(storage_path=f"memory://{tmp_path.name}-full", experiment_name="e",
                       trial_name="t") as s:
        with pytest.raises(StorageFullError):
            if kind == "state":
                _report(s, tmp_path, kind, "async", BIG)
            else:
                src = tmp_path / "src"
                src.mkdir()
                (src / "w.bin").write_bytes(np.ones(BIG, dtype=np.float32).tobytes())
                s.report({"i": 0}, checkpoint=Checkpoint.from_directory(src),
                         upload_mode="async", staging="copy")
            s.wait()
        assert s.get_checkpoint() is None
    assert os.listdir(small_disk) == [] or all(
        not os.listdir(os.path.join(small_disk, d)) for d in os.listdir(small_disk))


def test_an_error_of_ours_in_the_persist_process_keeps_its_type(tmp_path):
    """Found by ourselves: the persist process refuses to write over a state
    (``InvalidConfigError``, what ``write_state`` raises in-process for the
    same directory); the trainer now gets that class, with the message and
    the process's traceback as a note, not a PersistProcessError."""
    from checkpoint_store.errors import InvalidConfigError
    from checkpoint_store.state import write_state
    from checkpoint_store.state._staging import Stager

    tree = {"w": np.arange(4, dtype=np.float32)}
    write_state(tree, tmp_path / "d")
    with pytest.raises(InvalidConfigError, match="exists there already") as inline:
        write_state(tree, tmp_path / "d")
    stager = Stager(1 << 20)
    try:
        staged = stager.stage(tree, str(tmp_path / "d"))
        with pytest.raises(InvalidConfigError, match="exists there already") as err:
            staged.write_to(record=False)
        assert type(err.value) is type(inline.value)
        assert not isinstance(err.value, PersistProcessError)
        assert any("persist process" in n for n in getattr(err.value, "__notes__", []))
        # The process stays up and writes the next state.
        again = stager.stage(tree, str(tmp_path / "e"))
        assert set(again.write_to(record=False)) == {"w"}
    finally:
        stager.close()


def test_from_state_on_a_full_disk_is_a_storage_full_error(small_disk):
    """Found by ourselves: the in-process writer (``Checkpoint.from_state``,
    also what report(state=...) uses under Ray) raised a bare OSError where
    the persist process now says StorageFullError; the files it wrote are
    removed."""
    target = os.path.join(small_disk, "ck")
    with pytest.raises(StorageFullError, match="disk is full"):
        Checkpoint.from_state({"w": np.ones(BIG, dtype=np.float32)}, target)
    assert os.listdir(target) == []
    ok = Checkpoint.from_state({"w": np.ones(4, dtype=np.float32)}, os.path.join(small_disk, "ok"))
    assert ok.load_state()["w"].tolist() == [1.0] * 4
