"""Issue 38, kind 4 (and kind 2's deleted source): a source that changes, or
lies about its size, while it is read fails the commit with a
``SourceChangedError`` naming the file; nothing of it is committed.

* a link to a pseudo file (``/proc/self/status``: stat size 0, reads a
  page) on every location form: a local path, a pyarrow filesystem and a
  path, a ``memory://`` URI, an fsspec filesystem object and a path, S3
  URIs (both engines), an s3fs object, an Azure URI; through
  ``StorageContext.persist_checkpoint``, ``session.report`` (sync and
  async) and the CLI's ``upload``;
* a ``/sys`` file (stat size 4096, reads a line);
* a file deleted after the listing (raw ``FileNotFoundError`` before), on
  the same forms;
* a file that grows between its size being taken and its bytes being read
  (the small-file paths: one read feeds the copy), local and memory.
"""

from __future__ import annotations

import os
import types
import uuid
from typing import Any

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_store import (
    Checkpoint,
    SourceChangedError,
    SourceDeletedError,
    StorageContext,
    UploadConfig,
    session,
)
from checkpoint_store._commit import protocols as _protocols
from checkpoint_store._transfer import localcopy as _localcopy
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import main

FORMS = ["local-path", "pyarrow-fs", "memory-uri", "fsspec-fs", "s3-uri", "s3fs-uri",
         "s3fs-object", "azure-uri"]


def _context(form: str, tmp_path: Any, request: pytest.FixtureRequest) -> StorageContext:
    """A StorageContext on ``form``: the location as a user passes it."""
    if form == "local-path":
        return StorageContext(str(tmp_path / "store"), "e", "t")
    if form == "pyarrow-fs":
        return StorageContext(str(tmp_path / "store"), "e", "t",
                              storage_filesystem=pafs.LocalFileSystem())
    if form == "memory-uri":
        return StorageContext(f"memory://changing-{uuid.uuid4().hex[:8]}/store", "e", "t")
    if form == "fsspec-fs":
        return StorageContext(f"changing-{uuid.uuid4().hex[:8]}/store", "e", "t",
                              storage_filesystem=MemoryFileSystem())
    if form in ("s3-uri", "s3fs-uri", "azure-uri"):
        loc = request.getfixturevalue({"s3-uri": "s3_location", "s3fs-uri": "s3fs_location",
                                       "azure-uri": "azure_location"}[form])
        return StorageContext(loc.uri, "e", "t", storage_options=dict(loc.storage_options))
    assert form == "s3fs-object"
    s3fs = pytest.importorskip("s3fs")
    srv = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    fs = s3fs.S3FileSystem(key=srv.access_key_id, secret=srv.secret_access_key,
                           client_kwargs={"endpoint_url": srv.endpoint_url,
                                          "region_name": srv.region})
    return StorageContext(f"{bucket}/ckpt", "e", "t", storage_filesystem=fs)


def _source(tmp_path: Any) -> str:
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    (src / "model.bin").write_bytes(os.urandom(3000))
    (src / "shards" / "a.bin").write_bytes(os.urandom(2000))
    return str(src)


def _proc_link(src: str) -> str:
    if not os.path.isfile("/proc/self/status"):
        pytest.skip("no /proc/self/status here")
    os.symlink("/proc/self/status", os.path.join(src, "status"))
    assert os.stat(os.path.join(src, "status")).st_size == 0  # what makes it lie
    return "status"


def _nothing_committed(ctx: StorageContext) -> None:
    """No checkpoint, and no file of the failed one left (an empty directory
    may stay where the store keeps directories: memory)."""
    assert ctx.committed_checkpoints() == []
    assert ctx.scan().committed == []
    left = [fi.path for fi in _fsutil.list_tree(ctx.filesystem, ctx.trial_path)
            if fi.type == pafs.FileType.File and "checkpoint_" in fi.path]
    assert left == []


@pytest.mark.parametrize("form", FORMS)
def test_a_link_to_a_pseudo_file_fails_the_commit_naming_it(form, tmp_path, request):
    ctx = _context(form, tmp_path, request)
    src = _source(tmp_path)
    rel = _proc_link(src)
    with pytest.raises(SourceChangedError, match="changed while it was being copied") as info:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert (info.value.path, info.value.file) == (src, rel)
    assert os.path.join(src, rel) in str(info.value)
    assert "pseudo file" in str(info.value) and "regular file first" in str(info.value)
    _nothing_committed(ctx)
    # The rest of the tree, alone, commits as before.
    os.remove(os.path.join(src, rel))
    assert ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {}).is_committed


def test_a_sys_file_reading_fewer_bytes_than_its_size_fails(tmp_path):
    # sysfs files stat 4096 bytes and read a line: the copy would be cut
    # short (local disk) or hold fewer bytes than the tree listed.
    found = None
    for root, _, names in os.walk("/sys/kernel"):
        for name in names:
            path = os.path.join(root, name)
            try:
                size = os.stat(path).st_size
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if size == 4096 and 0 < len(data) < size:
                found = path
                break
        if found or root.count("/") > 4:
            break
    if found is None:
        pytest.skip("no readable /sys file whose size lies here")
    for ctx in (StorageContext(str(tmp_path / "store"), "e", "t"),
                StorageContext(f"memory://changing-{uuid.uuid4().hex[:8]}/s", "e", "t")):
        src = tmp_path / f"src-{ctx.backend.scheme}"
        src.mkdir()
        (src / "ok.bin").write_bytes(b"ok")
        os.symlink(found, src / "sysfile")
        with pytest.raises(SourceChangedError, match="ended after .* of the 4096 bytes") as info:
            ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        assert info.value.file == "sysfile"
        _nothing_committed(ctx)


def _delete_after_listing(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """The commit lists the source, then ``victim`` is deleted before its copy."""
    real = _protocols.source_files

    def then_delete(*args: Any, **kwargs: Any) -> list[tuple[str, int]]:
        files = real(*args, **kwargs)
        os.remove(victim)
        return files

    monkeypatch.setattr(_protocols, "source_files", then_delete)


@pytest.mark.parametrize("form", FORMS)
def test_a_file_deleted_while_it_is_uploaded_fails_the_commit_naming_it(form, tmp_path,
                                                                        request, monkeypatch):
    ctx = _context(form, tmp_path, request)
    src = _source(tmp_path)
    _delete_after_listing(monkeypatch, os.path.join(src, "shards", "a.bin"))
    with pytest.raises(SourceDeletedError, match="was deleted while it was being copied") \
            as info:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert isinstance(info.value, SourceChangedError)
    assert isinstance(info.value, FileNotFoundError)  # as the OS's error was
    assert (info.value.path, info.value.file) == (src, "shards/a.bin")
    assert os.path.join(src, "shards", "a.bin") in str(info.value)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    _nothing_committed(ctx)


def _growing_after_fstat(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """A writer appends to ``victim`` right after the copy took its size (the
    copy's ``fstat``) and before it reads: as a training loop still writing."""
    real_fstat = os.fstat
    done = [False]

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if not done[0] and os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(victim):
            done[0] = True
            with open(victim, "ab") as f:
                f.write(b"late bytes")
        return st

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os)
                                       if not k.startswith("__")})
    fake_os.fstat = fstat
    monkeypatch.setattr(_localcopy, "os", fake_os)


@pytest.mark.parametrize("form", ["local-path", "memory-uri"])
def test_a_file_growing_while_it_is_read_fails_the_commit(form, tmp_path, request,
                                                          monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell the file's descriptor")
    ctx = _context(form, tmp_path, request)
    src = _source(tmp_path)
    _growing_after_fstat(monkeypatch, os.path.join(src, "model.bin"))
    with pytest.raises(SourceChangedError, match="changed while it was being copied") as info:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert info.value.file == "model.bin"
    _nothing_committed(ctx)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("store", ["local", "memory"])
def test_session_report_of_a_lying_source_raises_it_and_commits_nothing(tmp_path, mode,
                                                                        store):
    src = _source(tmp_path)
    rel = _proc_link(src)
    path = str(tmp_path / "store") if store == "local" else \
        f"memory://changing-{uuid.uuid4().hex[:8]}/s"
    upload = UploadConfig(upload_mode=mode) if mode == "async" else None
    with session.start(storage_path=path, experiment_name="e", trial_name="t",
                       upload_config=upload):
        with pytest.raises(SourceChangedError) as info:
            session.report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(src))
            session.wait()
        assert info.value.file == rel
        assert session.get_checkpoint() is None
    _nothing_committed(StorageContext(path, "e", "t"))


def test_cli_upload_of_a_lying_source_exits_1_naming_the_file(tmp_path):
    src = _source(tmp_path)
    rel = _proc_link(src)
    dest = str(tmp_path / "store" / "e" / "t" / "checkpoint_000000")
    res = CliRunner().invoke(main, ["upload", src, dest], catch_exceptions=False)
    assert res.exit_code == 1, res.output
    assert os.path.join(src, rel) in res.stderr
    assert "nothing was committed" in res.stderr and "Traceback" not in res.output
    assert not Checkpoint(dest).is_committed

