"""A source file that changes while its chunks are stored: the commit is
refused with a typed error, and no chunk object is left holding bytes other
than those its name hashes (such an object would corrupt every later
checkpoint that holds the genuine bytes, since a save trusts a chunk it
finds present)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from checkpoint_store import Checkpoint
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store.errors import SourceChangedError, SourceDeletedError
from tests.stores import make_store

MiB = 1 << 20


def _while_stored(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Run ``change`` once the writer's intent is written and the store
    checked: between the hashing of the source and the upload of its chunks."""
    begin = ChunkStore.begin
    done: list[bool] = []

    def changing_begin(self: ChunkStore, names: Any, **kw: Any) -> Any:
        w = begin(self, names, **kw)
        if not done:
            done.append(True)
            change()
        return w

    monkeypatch.setattr(ChunkStore, "begin", changing_begin)


def _source(tmp_path: Any, name: str, fill: bytes = b"A") -> str:
    src = tmp_path / name
    src.mkdir()
    (src / "model.bin").write_bytes(fill * (2 * MiB))
    return str(src)


def _rewrite_head(path: str, *, keep_stamp: bool) -> Callable[[], None]:
    def change() -> None:
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.write(b"B" * 100)
        if keep_stamp:  # a clock too coarse to tell, or a writer that sets the mtime back
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return change


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("keep_stamp", [False, True], ids=["mtime", "same-mtime"])
def test_a_file_rewritten_while_its_chunks_are_stored_commits_nothing_and_poisons_nothing(
        kind, keep_stamp, monkeypatch, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    ctx = store.ctx(dedup=True)
    src = _source(tmp_path, "src")
    _while_stored(monkeypatch, _rewrite_head(os.path.join(src, "model.bin"),
                                             keep_stamp=keep_stamp))
    with pytest.raises(SourceChangedError, match="rewritten") as err:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert err.value.file == "model.bin"
    assert ctx.committed_checkpoints() == []
    monkeypatch.undo()
    # A later save of the genuine bytes finds their chunk's name in the
    # store: the object under it must hold those bytes.
    again = ctx.persist_checkpoint(Checkpoint.from_directory(_source(tmp_path, "again")), 1, {})
    again.verify()
    with again.as_directory() as d:
        assert open(os.path.join(d, "model.bin"), "rb").read() == b"A" * (2 * MiB)


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize(("how", "error"), [
    ("shrink", SourceChangedError), ("grow", SourceChangedError),
    ("delete", SourceDeletedError),
])
def test_a_file_shrunk_grown_or_deleted_while_stored_is_a_typed_error(
        kind, how, error, monkeypatch, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    ctx = store.ctx(dedup=True)
    src = _source(tmp_path, "src")
    path = os.path.join(src, "model.bin")

    def change() -> None:
        if how == "shrink":
            os.truncate(path, MiB)
        elif how == "grow":
            with open(path, "ab") as f:
                f.write(b"C" * 10)
        else:
            os.remove(path)

    _while_stored(monkeypatch, change)
    with pytest.raises(error) as err:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert err.value.file == "model.bin"
    assert ctx.committed_checkpoints() == []
