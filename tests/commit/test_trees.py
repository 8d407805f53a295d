"""Trees that cannot be copied as they are: every refusal comes before the first
byte, on uploads, copies and downloads alike (issues 11 and 12).

* nothing is written outside its place (a ``..`` key on an object store, a
  symlink leading out of a checkpoint, a download into the checkpoint);
* helper names built from a user's name stay within 255 bytes;
* source trees that cannot be a checkpoint (a symlink cycle, a name that does
  not round-trip) are refused naming the file; only the root's metadata names
  are reserved;
* a download into a directory leaves exactly that checkpoint's files.
"""

from __future__ import annotations

import os
import posixpath

import pytest
from _commit_helpers import local_tree, make_source

from checkpoint_store import (
    Checkpoint,
    CheckpointConflictError,
    InvalidConfigError,
    UnsafePathError,
    session,
)
from checkpoint_store._format.layout import (
    NAME_MAX,
    download_lock_name,
    download_marker_name,
    parse_staging_dir_name,
    staging_dir_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.registry import resolve


def _names(root) -> list[str]:
    """Every name (file or directory) under ``root``, recursively."""
    out = []
    for _, dirnames, filenames in os.walk(root):
        out += dirnames + filenames
    return out


def _session(trial, **kw):
    return session.start(**trial.session_kwargs(), **kw)


def _trial_listing(trial) -> dict[str, int]:
    return dict(_fsutil.walk_files(trial.backend.filesystem, trial.root))


# -- nothing is written outside its place ------------------------------------------------


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_s3_source_with_a_dotdot_key_is_refused(engine, s3_server, s3_bucket):
    """The key is planted with s3fs (which keeps it literally); each engine
    must refuse to report it: today it wrote ``escape.bin`` outside the trial."""
    planter, root = resolve(f"s3://{s3_bucket}/runs", storage_options=s3_server.storage_options(
        "s3fs"))
    src = posixpath.join(root, "src")
    rel = "sub/../../../escape.bin"
    caps = planter.capabilities
    _fsutil.write_bytes(planter.filesystem, posixpath.join(src, "model.bin"), b"m", caps)
    _fsutil.write_bytes(planter.filesystem, posixpath.join(src, rel), b"escape", caps)
    keys_before = s3_server.list_keys(s3_bucket)
    assert f"runs/src/{rel}" in keys_before

    opts = s3_server.storage_options(engine)
    backend, _ = resolve(f"s3://{s3_bucket}/runs", storage_options=opts)
    with session.start(storage_path=f"s3://{s3_bucket}/runs", storage_options=opts,
                       experiment_name="e", trial_name="t"):
        with pytest.raises(UnsafePathError, match=r"sub/\.\./\.\./\.\./escape\.bin") as err:
            session.report({"a": 1}, checkpoint=Checkpoint(src, filesystem=backend.filesystem))
    assert err.value.file == rel
    keys = s3_server.list_keys(s3_bucket)
    assert [k for k in keys if k.endswith("escape.bin")] == [f"runs/src/{rel}"]
    assert not [k for k in keys if "checkpoint_" in k]
    assert {k: v for k, v in keys.items() if k.startswith("runs/src/")} == {
        k: v for k, v in keys_before.items() if k.startswith("runs/src/")}


def test_download_into_the_checkpoint_or_its_trial_is_refused(trial, tmp_path):
    """``to_directory(<the checkpoint itself>/restore)`` made the checkpoint
    invalid (it dropped out of ``ls`` and resume). The conformance suite runs
    this on every backend; here the lock and marker are checked too."""
    storage = trial.storage()
    storage.ensure_trial_dir()
    ckpt = storage.persist_checkpoint(Checkpoint.from_directory(make_source(tmp_path / "s", 1)),
                                      0, {"metrics": {}})
    local = _fsutil.local_path(ckpt.filesystem, ckpt.path)
    if local is None:
        pytest.skip("a remote checkpoint cannot overlap a local directory")
    names_before = sorted(_names(os.path.dirname(os.path.dirname(local))))
    for target in (os.path.join(local, "restore"), os.path.join(local, "shards", "x"),
                   os.path.dirname(local)):
        with pytest.raises(UnsafePathError, match="choose a directory outside it"):
            ckpt.to_directory(target)
    # The same place reached through a symlink is the same place.
    os.symlink(local, tmp_path / "alias")
    with pytest.raises(UnsafePathError, match="inside the checkpoint"):
        ckpt.to_directory(tmp_path / "alias" / "restore")
    assert sorted(_names(os.path.dirname(os.path.dirname(local)))) == names_before
    assert [c.path for c, _ in storage.committed_checkpoints()] == [ckpt.path]


# -- helper names that grow with the user's names --------------------------------------


def test_download_into_a_241_character_name(trial, tmp_path):
    storage = trial.storage()
    storage.ensure_trial_dir()
    src = make_source(tmp_path / "s", 1)
    ckpt = storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    target = tmp_path / "dl" / ("d" * 241)
    assert ckpt.to_directory(target) == str(target)
    assert local_tree(str(target)) == local_tree(src)
    assert ckpt.to_directory(target) == str(target)  # the marker is found again: skipped
    helpers = [n for n in os.listdir(tmp_path / "dl") if n != "d" * 241]
    assert helpers and all(len(n.encode()) <= NAME_MAX for n in helpers)
    # A multi-byte name of 250 bytes too.
    wide = tmp_path / "dl" / ("é" * 125)
    ckpt.to_directory(wide)
    assert local_tree(str(wide)) == local_tree(src)


def test_a_name_that_cannot_fit_is_refused_naming_it_and_leaves_nothing(any_trial, tmp_path):
    trial = any_trial
    with pytest.raises(InvalidConfigError, match="trial_name 'tttt.*300 bytes"):
        session.start(storage_path=trial.uri, storage_options=trial.storage_options or None,
                      experiment_name="e", trial_name="t" * 300)
    with pytest.raises(InvalidConfigError, match="experiment_name"):
        session.start(storage_path=trial.uri, storage_options=trial.storage_options or None,
                      experiment_name="é" * 128, trial_name="t")
    assert dict(_fsutil.walk_files(trial.backend.filesystem, trial.root)) == {}
    assert not _fsutil.exists(trial.backend.filesystem, posixpath.join(trial.root, "e"))

    storage = trial.storage()
    storage.ensure_trial_dir()
    ckpt = storage.persist_checkpoint(Checkpoint.from_directory(make_source(tmp_path / "s", 1)),
                                      0, {"metrics": {}})
    parent = tmp_path / "new-parent"
    with pytest.raises(InvalidConfigError, match="download directory name 'ddd.*300 bytes"):
        ckpt.to_directory(parent / ("d" * 300))
    assert not parent.exists()


def test_staging_and_temp_names_of_a_long_checkpoint_name_fit(tmp_path):
    """A checkpoint named with many digits (the CLI accepts any
    ``checkpoint_NNNNNN`` name) commits on local disk: the staging directory
    and the temporary files built from it stay within 255 bytes."""
    from checkpoint_store._commit.commit import commit_checkpoint
    from checkpoint_store.registry import resolve as _resolve

    backend, root = _resolve(str(tmp_path / "store"))
    name = "checkpoint_" + "7" * 244  # the name of that index: its identity
    assert len(name) == 255
    dest = posixpath.join(root, "e", "t", name)
    src = make_source(tmp_path / "s", 1)
    meta = commit_checkpoint(backend.filesystem, src, backend, dest, {"index": int("7" * 244)})
    assert meta["index"] == int("7" * 244)
    assert Checkpoint(dest).is_committed
    _fsutil.write_bytes(backend.filesystem, posixpath.join(dest, "n" * 255), b"x",
                        backend.capabilities)
    assert (tmp_path / "store" / "e" / "t" / name / ("n" * 255)).read_bytes() == b"x"
    assert all(len(n.encode()) <= NAME_MAX for n in _names(tmp_path / "store"))


def test_bounded_names_stay_distinct_and_parseable():
    a = staging_dir_name("x" * 300 + "a", "run.1.abc")
    b = staging_dir_name("x" * 300 + "b", "run.1.abc")
    assert a != b
    assert len(a.encode()) == NAME_MAX and a.endswith("-run.1.abc")
    assert parse_staging_dir_name(a) == "run.1.abc"
    assert download_lock_name("short") == ".short.cs_lock"
    wide = download_marker_name("名" * 100)
    assert len(wide.encode()) <= NAME_MAX
    wide.encode("utf-8")  # cut on a character boundary


# -- source trees that cannot be a checkpoint ----------------------------------------


def _refused_before_anything(trial, src, match, file):
    with _session(trial):
        before = _trial_listing(trial)
        with pytest.raises(UnsafePathError, match=match) as err:
            session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        assert err.value.file == file
        assert _trial_listing(trial) == before
        assert trial.storage().checkpoint_dirs() == []
        assert trial.storage().scan().uncommitted == []


def test_a_symlink_cycle_is_refused_naming_the_link(any_trial, tmp_path):
    trial = any_trial
    src = make_source(tmp_path / "s", 1)
    os.symlink("..", os.path.join(src, "shards", "up"))
    _refused_before_anything(trial, src, r"'shards/up'.*symlink cycle", "shards/up")


@pytest.mark.parametrize("upload_mode", ["sync", "async"])
def test_a_symlink_cycle_at_the_root_is_refused_in_both_modes(trial, tmp_path, upload_mode):
    from checkpoint_store import CheckpointConfig

    src = make_source(tmp_path / "s", 1)
    os.symlink(".", os.path.join(src, "self"))
    with _session(trial, checkpoint_config=CheckpointConfig(upload_mode=upload_mode)):
        with pytest.raises(UnsafePathError, match="'self'") as err:
            session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        session.wait()
    assert err.value.file == "self"
    assert trial.storage().checkpoint_dirs() == []


def test_a_backslash_name_is_refused_before_anything_is_written(any_trial, tmp_path):
    trial = any_trial
    src = make_source(tmp_path / "s", 1)
    (tmp_path / "s" / "a\\b.bin").write_bytes(b"x")
    _refused_before_anything(trial, src, r"a\\\\b\.bin.*backslash", "a\\b.bin")


def test_a_name_that_is_not_utf8_is_refused_naming_it(any_trial, tmp_path):
    trial = any_trial
    src = make_source(tmp_path / "s", 1)
    try:
        with open(os.path.join(os.fsencode(src), b"caf\xe9.bin"), "wb") as f:
            f.write(b"x")
    except OSError:
        pytest.skip("this filesystem refuses names that are not UTF-8")
    _refused_before_anything(trial, src, r"caf\\udce9\.bin.*not valid UTF-8", "caf\udce9.bin")


def test_a_broken_symlink_is_refused_naming_it(trial, tmp_path):
    src = make_source(tmp_path / "s", 1)
    os.symlink(tmp_path / "gone.bin", os.path.join(src, "weights.bin"))
    _refused_before_anything(trial, src, r"'weights.bin' .*broken symlink", "weights.bin")


def test_a_link_to_a_file_outside_a_fresh_source_is_uploaded(trial, tmp_path):
    """A user's own source directory may link large files in (``cp -L``)."""
    big = tmp_path / "elsewhere.bin"
    big.write_bytes(b"w" * 5000)
    src = make_source(tmp_path / "s", 1)
    os.symlink(big, os.path.join(src, "linked.bin"))
    storage = trial.storage()
    storage.ensure_trial_dir()
    ckpt = storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    out = ckpt.to_directory(tmp_path / "out")
    assert (tmp_path / "out" / "linked.bin").read_bytes() == b"w" * 5000
    assert local_tree(out)["linked.bin"] == b"w" * 5000


def test_only_the_root_metadata_names_are_reserved(any_trial, tmp_path):
    src = make_source(tmp_path / "s", 1)
    deep = {"sub/.internal_metadata.json": b'{"mine": 1}', "sub/.user_metadata.json": b"[2]"}
    for rel, data in deep.items():
        os.makedirs(os.path.join(src, "sub"), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(data)
    with session.start(**any_trial.session_kwargs()):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        ckpt = session.get_checkpoint()
    assert ckpt is not None and ckpt.is_committed
    ckpt.verify()
    listed = {e["path"] for e in ckpt.internal_metadata["manifest"]}
    assert set(deep) <= listed
    ckpt.to_directory(tmp_path / "out")
    for rel, data in deep.items():
        assert (tmp_path / "out" / rel).read_bytes() == data


# -- a download leaves exactly the checkpoint's files -------------------------------------


def _two_checkpoints(trial, tmp_path):
    storage = trial.storage()
    storage.ensure_trial_dir()
    c0_src = tmp_path / "c0"
    c0_src.mkdir()
    (c0_src / "model.pt").write_bytes(b"model-0")
    (c0_src / "optimizer.pt").write_bytes(b"optim-0")
    c0 = storage.persist_checkpoint(Checkpoint.from_directory(c0_src), 0, {"metrics": {}})
    c0.set_metadata({"step": 100})
    c1_src = tmp_path / "c1"
    c1_src.mkdir()
    (c1_src / "model.pt").write_bytes(b"model-1")
    c1 = storage.persist_checkpoint(Checkpoint.from_directory(c1_src), 1, {"metrics": {}})
    return c0, c1


def test_a_re_download_leaves_exactly_the_new_checkpoints_files(any_trial, tmp_path):
    trial = any_trial
    c0, c1 = _two_checkpoints(trial, tmp_path)
    d = tmp_path / "d"
    c0.to_directory(d)
    assert sorted(os.listdir(d)) == [".user_metadata.json", "model.pt", "optimizer.pt"]
    c1.to_directory(d)
    assert sorted(os.listdir(d)) == ["model.pt"]
    assert (d / "model.pt").read_bytes() == b"model-1"
    assert Checkpoint.from_directory(d).get_metadata() == {}
    # And back: c0's files again, its metadata included.
    c0.to_directory(d)
    assert local_tree(str(d)) == {"model.pt": b"model-0", "optimizer.pt": b"optim-0"}
    assert Checkpoint.from_directory(d).get_metadata() == {"step": 100}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cs_download")]


def test_a_target_holding_someone_elses_files_is_refused_unchanged(trial, tmp_path):
    _, c1 = _two_checkpoints(trial, tmp_path)
    d = tmp_path / "d"
    (d / "notes").mkdir(parents=True)
    (d / "notes" / "todo.txt").write_bytes(b"mine")
    with pytest.raises(CheckpointConflictError, match="'notes/todo.txt'.*no earlier download"):
        c1.to_directory(d)
    assert local_tree(str(d)) == {"notes/todo.txt": b"mine"}
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no lock, no marker


def test_a_file_added_after_a_download_makes_the_next_one_refuse(trial, tmp_path):
    c0, c1 = _two_checkpoints(trial, tmp_path)
    d = tmp_path / "d"
    c0.to_directory(d)
    (d / "eval.csv").write_bytes(b"1,2")
    with pytest.raises(CheckpointConflictError, match="'eval.csv'"):
        c1.to_directory(d)
    assert local_tree(str(d)) == {"model.pt": b"model-0", "optimizer.pt": b"optim-0",
                                  "eval.csv": b"1,2"}
    os.unlink(d / "eval.csv")
    c1.to_directory(d)
    assert local_tree(str(d)) == {"model.pt": b"model-1"}


def test_a_download_onto_a_file_fails_at_once_without_a_lock(trial, tmp_path):
    _, c1 = _two_checkpoints(trial, tmp_path)
    f = tmp_path / "dl" / "model"
    f.parent.mkdir()
    f.write_bytes(b"a file")
    with pytest.raises(InvalidConfigError, match="exists and is not a directory"):
        c1.to_directory(f)
    assert os.listdir(tmp_path / "dl") == ["model"]
    assert f.read_bytes() == b"a file"


def test_an_empty_existing_target_is_filled(trial, tmp_path):
    _, c1 = _two_checkpoints(trial, tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    c1.to_directory(d)
    assert local_tree(str(d)) == {"model.pt": b"model-1"}
