"""What a source tree holds is what gets committed, or the upload is refused.

* a fifo, a socket or a device (a symlink to ``/dev/zero`` too) is refused
  naming it, on every upload path, before the first write;
* a user's file taking one of our names (``.internal_metadata.json`` at the
  top, ``.cs_*`` anywhere) is refused naming it, from a local disk and from
  an object store; a committed checkpoint handed in again is still fine;
* a directory that cannot be listed is an ``UnreadableSourceError`` naming it;
* a source 1,000 directories deep is committed and downloaded whole;
* a full disk while the commit marker is written is a ``StorageFullError``
  whose message and CLI hint say to free space, and nothing is committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile

import pytest
from _commit_helpers import local_tree, make_source
from click.testing import CliRunner

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    StorageContext,
    StorageFullError,
    UnreadableSourceError,
    UnsafePathError,
    session,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import main
from checkpoint_store.testing.faults import faulty_backend


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _listing(trial) -> dict[str, int]:
    fs = trial.backend.filesystem
    return dict(_fsutil.walk_files(fs, trial.root)) if _fsutil.exists(fs, trial.root) else {}


def _fifo(src: str) -> str:
    os.mkfifo(os.path.join(src, "pipe"))
    return "pipe"


def _socket(src: str) -> str:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(src, "shards", "ipc.sock"))
    sock.close()
    return "shards/ipc.sock"


def _device_link(src: str) -> str:
    os.symlink("/dev/zero", os.path.join(src, "zeros.bin"))
    return "zeros.bin"


SPECIAL = {"fifo (named pipe)": _fifo, "socket": _socket, "character device": _device_link}


def _reserved_marker(src: str) -> str:
    with open(os.path.join(src, ".internal_metadata.json"), "w") as f:
        f.write('{"mine": true}')
    return ".internal_metadata.json"


def _reserved_notes(src: str) -> str:
    with open(os.path.join(src, "shards", ".cs_notes.txt"), "w") as f:
        f.write("notes")
    return "shards/.cs_notes.txt"


RESERVED = {"marker": _reserved_marker, "notes": _reserved_notes}


def _report_refused(trial, src: str, rel: str, match: str, upload_mode: str) -> None:
    cfg = CheckpointConfig(upload_mode=upload_mode)  # type: ignore[arg-type]
    with session.start(**trial.session_kwargs(), checkpoint_config=cfg):
        before = _listing(trial)
        with pytest.raises(UnsafePathError, match=match) as err:
            session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
            session.wait()
        assert err.value.file == rel
        assert _listing(trial) == before
        assert trial.storage().checkpoint_dirs() == []


@pytest.mark.parametrize("upload_mode", ["sync", "async"])
@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_a_special_file_is_refused_by_report_naming_it(trial, tmp_path, kind, upload_mode):
    src = make_source(tmp_path / "s", 1)
    rel = SPECIAL[kind](src)
    _report_refused(trial, src, rel, rf"{rel!r} .*is a {re.escape(kind)}", upload_mode)


@pytest.mark.parametrize("upload_mode", ["sync", "async"])
@pytest.mark.parametrize("kind", sorted(RESERVED))
def test_a_reserved_name_in_the_users_tree_is_refused(trial, tmp_path, kind, upload_mode):
    src = make_source(tmp_path / "s", 1)
    rel = RESERVED[kind](src)
    _report_refused(trial, src, rel, rf"{rel!r} .*reserves for its own files", upload_mode)


@pytest.mark.parametrize("make", [_fifo, _reserved_notes])
def test_persist_checkpoint_refuses_the_same(trial, tmp_path, make):
    src = make_source(tmp_path / "s", 1)
    rel = make(src)
    storage = trial.storage()
    storage.ensure_trial_dir()
    with pytest.raises(UnsafePathError) as err:
        storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    assert err.value.file == rel
    assert storage.checkpoint_dirs() == [] and storage.scan().uncommitted == []


@pytest.mark.parametrize("make", [_device_link, _reserved_marker])
def test_cli_upload_refuses_the_same(trial, tmp_path, make):
    src = make_source(tmp_path / "s", 1)
    rel = make(src)
    res = _cli("upload", src, f"{trial.uri}/exp/trial")
    assert res.exit_code == 1, res.output
    assert repr(rel) in res.output and "nothing was written" in res.output
    assert _listing(trial) == {}


def test_cli_cp_refuses_a_fifo_planted_in_a_committed_checkpoint(tmp_path, memory_trial):
    src = make_source(tmp_path / "s", 1)
    store = str(tmp_path / "store")
    with session.start(storage_path=store, experiment_name="exp", trial_name="trial"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    os.mkfifo(os.path.join(store, "exp", "trial", "checkpoint_000000", "pipe"))
    res = _cli("cp", os.path.join(store, "exp", "trial"), f"{memory_trial.uri}/exp/trial")
    assert res.exit_code != 0
    assert "'pipe'" in res.output
    assert memory_trial.storage().checkpoint_dirs() == []


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_a_reserved_name_on_an_object_store_source_is_refused(engine, s3_server, s3_bucket,
                                                               tmp_path):
    """The user's tree lies on S3 (handed in as a filesystem and a path)."""
    from checkpoint_store.registry import resolve

    opts = s3_server.storage_options(engine)
    backend, root = resolve(f"s3://{s3_bucket}/src-{engine}", storage_options=opts)
    fs, caps = backend.filesystem, backend.capabilities
    _fsutil.write_bytes(fs, f"{root}/model.bin", b"m", caps)
    _fsutil.write_bytes(fs, f"{root}/sub/.cs_notes.txt", b"notes", caps)
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t"):
        with pytest.raises(UnsafePathError, match="'sub/.cs_notes.txt'") as err:
            session.report({"a": 1}, checkpoint=Checkpoint(root, filesystem=fs))
    assert err.value.file == "sub/.cs_notes.txt"
    assert not (tmp_path / "store" / "e" / "t" / "checkpoint_000000").exists()


def test_a_committed_checkpoint_handed_in_again_is_still_committed(trial, tmp_path):
    """Its own ``.internal_metadata.json`` is ours, not the user's: skipped."""
    src = make_source(tmp_path / "s", 1)
    store = str(tmp_path / "first")
    with session.start(storage_path=store, experiment_name="exp", trial_name="trial"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    committed = os.path.join(store, "exp", "trial", "checkpoint_000000")
    with session.start(**trial.session_kwargs()):
        session.report({"a": 2}, checkpoint=Checkpoint.from_directory(committed))
        ckpt = session.get_checkpoint()
    assert ckpt is not None and ckpt.is_committed
    assert local_tree(ckpt.to_directory(tmp_path / "out")) == local_tree(src)


def test_a_symlink_loop_is_refused_as_a_loop_naming_it(trial, tmp_path):
    """``a -> b -> a``: following it fails with ELOOP, said as such."""
    src = make_source(tmp_path / "s", 1)
    os.symlink("b", os.path.join(src, "shards", "a"))
    os.symlink("a", os.path.join(src, "shards", "b"))
    _report_refused(trial, src, "shards/a", r"'shards/a' .*is a symlink loop", "sync")


# -- unreadable and deep trees ------------------------------------------------------

def _walk_as_nobody(src: str) -> dict:
    """Walk ``src`` in a forked child that drops to ``nobody`` when run as
    root (root reads any directory); what it raised, as a dict."""
    import pyarrow.fs as pafs

    from checkpoint_store._transfer.trees import source_files

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                source_files(pafs.LocalFileSystem(), src)
                got: dict = {"raised": None}
            except UnreadableSourceError as e:
                got = {"raised": type(e).__name__, "file": e.file, "msg": str(e)}
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                got = {"raised": type(e).__name__, "msg": str(e)}
            os.write(w, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.parametrize("where", ["shards", "", "shards/part1.bin"])
def test_an_unreadable_directory_is_an_unreadable_source_error(where):
    base = tempfile.mkdtemp(prefix="cs-unreadable-")  # pytest's tmp_path is root's alone
    src = make_source(os.path.join(base, "s"), 1)
    for d, _, _ in os.walk(base):
        os.chmod(d, 0o755)
    target = os.path.join(src, where) if where else src
    os.chmod(target, 0o311 if os.path.isdir(target) else 0o200)  # not listable / readable
    try:
        got = _walk_as_nobody(src)
    finally:
        os.chmod(target, 0o755 if os.path.isdir(target) else 0o644)
        shutil.rmtree(base, ignore_errors=True)
    assert got["raised"] == "UnreadableSourceError", got
    assert got["file"] == where
    assert "Permission denied" in got["msg"] and "Make it readable" in got["msg"]
    assert (repr(where) if where else repr(src)) in got["msg"]


def _deep_tree(root: str, depth: int) -> str:
    """``root/a`` and ``root/d/d/.../d/f`` (``depth`` levels), made without recursion."""
    os.mkdir(root)
    with open(os.path.join(root, "a"), "w") as f:
        f.write("a")
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
        f.write("deep")
    os.close(fd)
    return "/".join(["d"] * depth + ["f"])


def _remove_deep(root: str) -> None:
    """Remove a tree of any depth without recursion (pytest's own clean-up of
    old temporary directories, shutil.rmtree, recurses and gives up on these)."""
    dirs, stack = [], [root]
    while stack:
        d = stack.pop()
        dirs.append(d)
        for e in os.scandir(d):
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            else:
                os.unlink(e.path)
    for d in reversed(dirs):
        os.rmdir(d)


@pytest.fixture
def deep_tmp(tmp_path):
    yield tmp_path
    for name in os.listdir(tmp_path):
        path = os.path.join(tmp_path, name)
        if os.path.isdir(path) and not os.path.islink(path):
            _remove_deep(path)


@pytest.mark.slow
def test_a_source_1000_directories_deep_is_committed_whole(trial, deep_tmp):
    """The walk keeps its own stack, and the copy makes each level's directory
    parents first (both raised RecursionError)."""
    tmp_path = deep_tmp
    src = str(tmp_path / "deep")
    rel = _deep_tree(src, 1000)
    with session.start(**trial.session_kwargs()):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        ckpt = session.get_checkpoint()
    assert ckpt is not None
    assert {e["path"]: e["size"] for e in ckpt.internal_metadata["manifest"]} == \
        {"a": 1, rel: 4}
    ckpt.verify()
    out = ckpt.to_directory(tmp_path / "out")
    with open(os.path.join(out, *rel.split("/"))) as f:
        assert f.read() == "deep"
    # Downloaded again over the same tree: the old one is listed and removed.
    os.unlink(os.path.join(out, "a"))
    assert ckpt.to_directory(out) == out
    assert {"a", "d"} <= set(os.listdir(out))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cs_download")]


# -- a full disk --------------------------------------------------------------------


def test_a_full_disk_at_the_marker_is_a_storage_full_error(trial, tmp_path):
    src = make_source(tmp_path / "s", 1)
    backend = faulty_backend(trial.backend, permanent={"write": "no_space"},
                             path_contains=".internal_metadata.json")
    storage = StorageContext.from_backend(backend, trial.root, "exp", "trial")
    storage.ensure_trial_dir()
    with pytest.raises(StorageFullError, match="disk is full.*Free space") as err:
        storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    assert "credential" not in str(err.value)
    assert trial.storage().scan().committed == []


def test_a_real_full_disk_while_the_marker_is_written(small_disk, tmp_path):
    """The data fills the disk to the last page: only the marker finds no room."""
    storage = StorageContext(os.path.join(small_disk, "store"), "exp", "trial")
    storage.ensure_trial_dir()
    st = os.statvfs(small_disk)
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * (st.f_bavail * st.f_frsize))
    with pytest.raises(StorageFullError, match="No space left on device"):
        storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    assert storage.checkpoint_dirs() == [] and storage.scan().uncommitted == []
    res = _cli("upload", str(src), os.path.join(small_disk, "store", "exp", "trial"))
    assert res.exit_code == 1
    assert "hint: the disk is full: free space on it" in res.output
    assert "credentials" not in res.output
