"""StorageContext: resolving storage_path, the layout, persisting (issue: walking skeleton)."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, InvalidConfigError, StorageContext, UnknownSchemeError


def test_relative_storage_path_becomes_absolute_under_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = StorageContext("./results", "exp", "trial")
    assert s.storage_path == str(tmp_path / "results")
    assert os.path.isabs(s.trial_path)
    s.ensure_trial_dir()
    assert (tmp_path / "results" / "exp" / "trial").is_dir()


def test_home_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert StorageContext("~/runs", "e", "t").storage_path == str(tmp_path / "runs")


def test_file_and_memory_uris():
    assert StorageContext("file:///tmp/x/", "e", "t").trial_path == "/tmp/x/e/t"
    s = StorageContext("memory://bucket/root/", "e", "t")
    assert s.uri(s.trial_path) == "memory://bucket/root/e/t"


def test_injected_filesystem_is_used_and_its_path_spelled_as_it_lists():
    fs = pafs.LocalFileSystem()
    s = StorageContext("relative/dir/", "e", "t", storage_filesystem=fs)
    # A local disk lists absolute paths; a relative one would also move with os.chdir().
    assert s.storage_path == os.path.abspath("relative/dir")
    assert s.filesystem is fs


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "a\\b"])
def test_bad_names_refused_before_anything_is_written(tmp_path, name):
    root = tmp_path / "root"
    with pytest.raises(InvalidConfigError, match="experiment_name"):
        StorageContext(str(root), name, "t")
    with pytest.raises(InvalidConfigError, match="trial_name"):
        StorageContext(str(root), "e", name)
    assert not root.exists()


def test_unknown_scheme_lists_registered_schemes(tmp_path):
    with pytest.raises(UnknownSchemeError, match="memory"):
        StorageContext("nosuchscheme://bucket/x", "e", "t")


@pytest.mark.parametrize("uri", ["s3:/bucket/x", "memory:/x", "file:relative"])
def test_malformed_uri_never_treated_as_local_path(tmp_path, monkeypatch, uri):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidConfigError, match="malformed URI"):
        StorageContext(uri, "e", "t")
    assert list(tmp_path.iterdir()) == []


def test_a_source_with_a_foreign_internal_metadata_file_is_refused(tmp_path):
    """A user's file named like our commit marker (not a valid marker of a
    committed checkpoint) would be dropped from the checkpoint: refused, naming
    it, nothing written (docs/format.md, which trees can be a checkpoint)."""
    from checkpoint_store.errors import UnsafePathError

    s = StorageContext(str(tmp_path / "store"), "e", "t")
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"abc")
    first = s.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"a": 1}})
    downloaded = tmp_path / "downloaded"
    first.to_directory(downloaded)
    # A downloaded checkpoint carries no internal file; simulate one that does.
    (downloaded / ".internal_metadata.json").write_text('{"index": 99, "bogus": true}')
    with pytest.raises(UnsafePathError, match="internal_metadata"):
        s.persist_checkpoint(Checkpoint.from_directory(downloaded), 1, {"metrics": {"a": 2}})
    assert [c.path.rsplit("/", 1)[-1] for c, _ in s.committed_checkpoints()] == [
        "checkpoint_000000"]


def test_directory_without_internal_metadata_is_not_a_checkpoint(tmp_path):
    s = StorageContext(str(tmp_path), "e", "t")
    (tmp_path / "e" / "t" / "checkpoint_000000").mkdir(parents=True)
    (tmp_path / "e" / "t" / "checkpoint_000000" / "data").write_bytes(b"x")
    assert s.committed_checkpoints() == []
    assert not Checkpoint(str(tmp_path / "e" / "t" / "checkpoint_000000")).is_committed
