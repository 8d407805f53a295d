"""Issue 42, item 5 (library): a long transfer takes ``progress(done_bytes,
total_bytes)`` so a caller can drive tqdm or rich."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import pytest

from checkpoint_store import Checkpoint, InvalidConfigError, StorageContext
from checkpoint_store.transfer import copy_tree

SMALL = 3000
LARGE = 9 * 1024 * 1024 + 17  # more than one 8 MiB chunk: moved in parts


def _committed(uri: str, tmp_path: Any) -> tuple[Checkpoint, int]:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(LARGE))
    for i in range(5):
        (src / "sub" / f"s{i}.bin").write_bytes(os.urandom(SMALL))
    ctx = StorageContext(uri, "exp", "t", fsync=False)
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(str(src)), 0,
                                  {"metrics": {"loss": 1.0}})
    return ckpt, LARGE + 5 * SMALL


@pytest.mark.parametrize("where", ["local", "memory"])
def test_to_directory_reports_every_byte_in_order(where: str, tmp_path: Any) -> None:
    uri = str(tmp_path / "store") if where == "local" else f"memory://p-{uuid.uuid4().hex[:8]}"
    ckpt, total = _committed(uri, tmp_path)
    calls: list[tuple[int, int]] = []
    threads: set[int] = set()

    def progress(done: int, of: int) -> None:
        calls.append((done, of))
        threads.add(threading.get_ident())

    out = ckpt.to_directory(str(tmp_path / "out"), progress=progress)
    assert os.path.getsize(os.path.join(out, "big.bin")) == LARGE
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones)
    if where == "memory":  # parts of the large file, then the small ones: steps between
        assert len(calls) >= 3, calls
    assert {of for _, of in calls} == {total}
    # Already there: one call, everything done.
    again: list[tuple[int, int]] = []
    ckpt.to_directory(str(tmp_path / "out"), progress=lambda d, t: again.append((d, t)))
    assert again == [(total, total)]
    # A temporary directory too.
    temp: list[tuple[int, int]] = []
    ckpt.to_directory(progress=lambda d, t: temp.append((d, t)))
    assert temp[-1] == (total, total)


def test_copy_tree_progress_and_a_bad_callback(tmp_path: Any) -> None:
    import pyarrow.fs as pafs

    from checkpoint_store.backends.base import Capabilities

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}").write_bytes(b"x" * (1000 * (i + 1)))
    calls: list[tuple[int, int]] = []
    local = pafs.LocalFileSystem()
    copy_tree(local, str(src), local, str(tmp_path / "dst"), Capabilities(directories=True),
              fsync=False, progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, 10_000) and calls[-1] == (10_000, 10_000)
    ckpt = Checkpoint(str(src))
    with pytest.raises(InvalidConfigError, match="progress"):
        ckpt.to_directory(str(tmp_path / "o2"), progress="tqdm")  # type: ignore[arg-type]
    assert not (tmp_path / "o2").exists()
