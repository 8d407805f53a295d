"""Control files read again while torn: ``_fsutil.read_control`` and the
fault plan's ``torn_reads`` that shows a reader what a rewrite in place does."""

from __future__ import annotations

import json

import pytest

from checkpoint_store._util import fs as _fsutil
from checkpoint_store.registry import resolve
from checkpoint_store.testing.faults import FaultPlan, faulty_backend

_BODY = json.dumps({"kind": "control", "pad": "x" * 40}).encode()


def _torn(tmp_path, count: int):
    backend, root = resolve(str(tmp_path / "root"))
    backend.filesystem.create_dir(root, recursive=True)
    path = f"{root}/control.json"
    _fsutil.write_bytes(backend.filesystem, path, _BODY, backend.capabilities)
    torn = faulty_backend(backend, torn_reads="control.json", torn_read_count=count)
    return torn.filesystem, path


def test_torn_reads_come_empty_then_cut_short_then_whole(tmp_path):
    fs, path = _torn(tmp_path, count=3)
    got = [_fsutil.read_bytes(fs, path) for _ in range(4)]
    assert got == [b"", _BODY[: len(_BODY) // 2], b"", _BODY]
    assert fs.handler.injected["torn"] == 3
    with fs.open_input_file(path) as f:  # random access reads are whole after the count
        assert f.read() == _BODY


def test_torn_read_count_must_not_be_negative():
    with pytest.raises(ValueError, match="torn_read_count"):
        FaultPlan(torn_reads="x", torn_read_count=-1)


def test_a_torn_control_file_is_read_again_until_it_parses(tmp_path):
    fs, path = _torn(tmp_path, count=2)
    assert _fsutil.read_control(fs, path) == json.loads(_BODY)
    assert fs.handler.calls["open_input_stream"] == 3


def test_a_whole_control_file_costs_one_read(tmp_path):
    fs, path = _torn(tmp_path, count=0)
    assert _fsutil.read_control(fs, path) == json.loads(_BODY)
    assert fs.handler.calls["open_input_stream"] == 1


def test_a_control_file_that_stays_torn_is_unparsable_not_absent(tmp_path):
    fs, path = _torn(tmp_path, count=100)
    with pytest.raises(_fsutil.UnparsableFileError) as info:
        _fsutil.read_control(fs, path)
    assert info.value.path == path
    assert isinstance(info.value, ValueError)  # the callers' `except ValueError` still holds
    assert fs.handler.calls["open_input_stream"] == _fsutil.CONTROL_READS


def test_an_absent_control_file_is_not_found_at_once(tmp_path):
    fs, path = _torn(tmp_path, count=100)
    with pytest.raises(FileNotFoundError):
        _fsutil.read_control(fs, path + ".missing")
    assert fs.handler.calls["open_input_stream"] == 1


def test_a_file_cut_short_for_good_is_unparsable_after_two_reads(tmp_path):
    """The same bytes twice are no write in flight: a writer killed half way
    (or a file damaged by hand) costs one read more, not the whole budget
    (a restart reading a damaged retention state paid 0.75 s per read)."""
    backend, root = resolve(str(tmp_path / "root"))
    backend.filesystem.create_dir(root, recursive=True)
    path = f"{root}/control.json"
    _fsutil.write_bytes(backend.filesystem, path, _BODY[:20], backend.capabilities)
    spy = faulty_backend(backend).filesystem
    with pytest.raises(_fsutil.UnparsableFileError, match="after 2 read"):
        _fsutil.read_control(spy, path)
    assert spy.handler.calls["open_input_stream"] == 2


def test_an_empty_file_is_read_for_the_whole_budget(tmp_path):
    """Empty is how pyarrow's Azure client shows a blob for as long as its
    writer has it open: read again until the budget is spent."""
    backend, root = resolve(str(tmp_path / "root"))
    backend.filesystem.create_dir(root, recursive=True)
    path = f"{root}/control.json"
    _fsutil.write_bytes(backend.filesystem, path, b"", backend.capabilities)
    spy = faulty_backend(backend).filesystem
    with pytest.raises(_fsutil.UnparsableFileError):
        _fsutil.read_control(spy, path)
    assert spy.handler.calls["open_input_stream"] == _fsutil.CONTROL_READS
