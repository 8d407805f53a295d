"""A checkpoint that a read finds damaged keeps no slot: it leaves the ranking
and the resume candidates, good checkpoints are kept in its place, the
retention state records it (it survives a restart), and it is never deleted
by retention nor handed out."""

from __future__ import annotations

import json
import posixpath
import uuid
import warnings
from collections.abc import Iterator

import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    StorageContext,
    session,
)
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store._util.fs import delete_dir
from checkpoint_store.cli import main
from checkpoint_store.retention.statelog import load_state
from checkpoint_store.ui._model import StoreView

K1 = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc",
                      checkpoint_score_order="max")
DATA = "model.bin"


@pytest.fixture(params=["local", "memory", "s3"])
def root(request, tmp_path) -> Iterator[tuple[str, dict | None]]:
    """``(storage_path, storage_options)`` of a fresh root on each backend."""
    if request.param == "local":
        yield str(tmp_path / "runs"), None
    elif request.param == "memory":
        uri = f"memory://invalid-{uuid.uuid4().hex}"
        yield uri, None
        ctx = StorageContext(uri, "exp", "t")
        delete_dir(ctx.filesystem, ctx.storage_path)
    else:
        loc = request.getfixturevalue("s3_location")
        yield loc.uri, dict(loc.storage_options)


def _ctx(root) -> StorageContext:
    return StorageContext(root[0], "exp", "t", storage_options=root[1], fsync=False)


def _start(root, config=K1):
    return session.start(storage_path=root[0], storage_options=root[1], experiment_name="exp",
                         trial_name="t", checkpoint_config=config)


def _report(tmp_path, acc: float) -> None:
    d = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    (d / DATA).write_bytes(f"weights {acc}".encode() * 8)
    session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(d))


def _path(ctx: StorageContext, name: str, rel: str = DATA) -> str:
    return posixpath.join(ctx.trial_path, name, rel)


def _read(ctx: StorageContext, path: str) -> bytes:
    with ctx.filesystem.open_input_stream(path) as f:
        return bytes(f.read())


def _write(ctx: StorageContext, path: str, data: bytes) -> None:
    with ctx.filesystem.open_output_stream(path) as f:
        f.write(data)


def _damage(ctx: StorageContext, name: str, how: str) -> None:
    """Flip a byte (same size: only the CRC32C tells), delete the data file, or
    add a file the manifest does not list."""
    path = _path(ctx, name)
    if how == "flipped":
        data = bytearray(_read(ctx, path))
        data[3] ^= 0xFF
        _write(ctx, path, bytes(data))
    elif how == "missing":
        ctx.filesystem.delete_file(path)
    else:
        _write(ctx, _path(ctx, name, "extra.bin"), b"not in the manifest")


def _dirs(ctx: StorageContext) -> list[str]:
    import pyarrow.fs as pafs

    infos = ctx.filesystem.get_file_info(pafs.FileSelector(ctx.trial_path))
    return sorted(posixpath.basename(fi.path) for fi in infos
                  if fi.type == pafs.FileType.Directory
                  and posixpath.basename(fi.path).startswith("checkpoint_"))


def _cli(root, *args: str):
    from click.testing import CliRunner

    opts = [a for k, v in (root[1] or {}).items() for a in ("-o", f"{k}={v}")]
    return CliRunner().invoke(main, [*args, *opts], catch_exceptions=False)


def _trial_uri(root) -> str:
    ctx = _ctx(root)
    return ctx.uri(ctx.trial_path)


def test_a_damaged_best_and_latest_keeps_no_slot(root, tmp_path):
    with _start(root):
        _report(tmp_path, 0.5)
        _report(tmp_path, 0.9)
    ctx = _ctx(root)
    _damage(ctx, "checkpoint_000001", "flipped")
    with _start(root) as s:
        with pytest.warns(RuntimeWarning, match="checkpoint_000001 .* is invalid"):
            assert session.get_checkpoint() is None  # #0 was evicted: nothing good is left
        assert s.manager.invalid.keys() == {"checkpoint_000001"}
        for acc in (0.6, 0.7, 0.65):
            _report(tmp_path, acc)
        assert s.manager.best_checkpoint.path.endswith("checkpoint_000003")
    # The damaged one stays on storage; the good 0.7 is kept in its place.
    assert _dirs(ctx) == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"]
    state, _ = load_state(ctx)
    assert "checkpoint_000001" in state.invalid and "CRC32C" in state.invalid[
        "checkpoint_000001"].upper()
    res = _cli(root, "best", _trial_uri(root))
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000003")
    assert "checkpoint_000001 is invalid" in res.stderr
    ls = json.loads(_cli(root, "ls", _trial_uri(root), "--json").stdout)
    assert [r["name"] for r in ls["checkpoints"]] == ["checkpoint_000003", "checkpoint_000004"]
    assert [c["name"] for c in ls["invalid"]] == ["checkpoint_000001"]
    show = _cli(root, "show", _trial_uri(root) + "/checkpoint_000001")
    assert "invalid" in show.stdout
    # A restart knows it without reading its bytes again, and never resumes from it.
    with _start(root) as s:
        assert s.manager.invalid.keys() == {"checkpoint_000001"}
        assert session.get_checkpoint().path.endswith("checkpoint_000004")
        for acc in (0.1, 0.2):
            _report(tmp_path, acc)
    assert _dirs(ctx) == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000006"]


@pytest.mark.parametrize("how", ["flipped", "missing", "extra"])
def test_a_damaged_best_found_by_a_download_is_replaced(root, tmp_path, how):
    with _start(root) as s:
        for acc in (0.9, 0.2):
            _report(tmp_path, acc)
        best = s.manager.best_checkpoint
        assert best.path.endswith("checkpoint_000000")
        _damage(_ctx(root), "checkpoint_000000", how)
        with pytest.warns(RuntimeWarning, match="is invalid"), \
                pytest.raises(CheckpointCorruptError):
            best.to_directory(str(tmp_path / "dl"))
        assert s.manager.best_checkpoint.path.endswith("checkpoint_000001")
        for acc in (0.3, 0.1):
            _report(tmp_path, acc)
        assert s.manager.kept_dir_names == ["checkpoint_000002", "checkpoint_000003"]
    ctx = _ctx(root)
    assert _dirs(ctx) == ["checkpoint_000000", "checkpoint_000002", "checkpoint_000003"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = CheckpointManager(K1, _ctx(root), read_only=True)
    assert list(m.invalid) == ["checkpoint_000000"]
    assert m.best_checkpoint.path.endswith("checkpoint_000002")
    model = StoreView(root[0], root[1])
    model.experiments()
    rows = {r["name"]: r for r in model.trial("exp", "t", full=True)["checkpoints"]}
    assert rows["checkpoint_000000"]["kind"] == "invalid"
    assert model.summary("exp", "t")["best_checkpoint"] == "checkpoint_000002"
    assert model.checkpoint("exp", "t", "checkpoint_000000")["state"] == "invalid"


def test_a_damaged_latest_resumes_from_the_newest_good_one(root, tmp_path):
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc",
                              checkpoint_score_order="max")
    with _start(root, config):
        for acc in (0.9, 0.8, 0.1):
            _report(tmp_path, acc)
    ctx = _ctx(root)
    _damage(ctx, "checkpoint_000002", "flipped")
    with _start(root, config) as s:
        with pytest.warns(RuntimeWarning, match="does not verify"):
            assert session.get_checkpoint().path.endswith("checkpoint_000001")
        assert "checkpoint_000002" in s.manager.invalid
        _report(tmp_path, 0.85)  # evicts the good 0.8 (#1), never the damaged #2
    assert _dirs(ctx) == ["checkpoint_000000", "checkpoint_000002", "checkpoint_000003"]
    state, _ = load_state(ctx)
    assert list(state.invalid) == ["checkpoint_000002"]
    assert "checkpoint_000002" not in state.checkpoints
    assert MANAGER_STATE in {posixpath.basename(p) for p in _listed_files(ctx)}


def _listed_files(ctx: StorageContext) -> list[str]:
    import pyarrow.fs as pafs

    return [fi.path for fi in ctx.filesystem.get_file_info(pafs.FileSelector(ctx.trial_path))
            if fi.type == pafs.FileType.File]


def test_keep_all_records_a_damaged_one_across_snapshots_and_lazy_restarts(root, tmp_path):
    keep_all = CheckpointConfig(num_to_keep=None, checkpoint_score_attribute="acc",
                                checkpoint_score_order="max")
    with _start(root, keep_all) as s:
        for i in range(4):
            _report(tmp_path, 0.1 * i)
        damaged = dict((c.path.rsplit("/", 1)[-1], c) for c, _ in s.manager.best_checkpoints)
        _damage(_ctx(root), "checkpoint_000002", "flipped")
        with pytest.warns(RuntimeWarning, match="is invalid"), \
                pytest.raises(CheckpointCorruptError):
            damaged["checkpoint_000002"].verify()
        for i in range(20):  # past a snapshot: the root carries it, not only a record
            _report(tmp_path, 0.01 * i)
    ctx = _ctx(root)
    with _start(root, keep_all) as s:  # a keep-all restart reads no chunk to know it
        assert s.manager.invalid.keys() == {"checkpoint_000002"}
        assert "checkpoint_000002" not in s.manager.kept_dir_names
        assert len(s.manager.kept_dir_names) == 23
        assert s.manager.best_checkpoint.path.endswith("checkpoint_000003")
        names = [n for n, _ in s.manager.resume_candidates().named()]
        assert "checkpoint_000002" not in names
    assert "checkpoint_000002" in _dirs(ctx)
    ls = json.loads(_cli(root, "ls", _trial_uri(root), "--json", "--long").stdout)
    assert [c["name"] for c in ls["invalid"]] == ["checkpoint_000002"]
    assert "checkpoint_000002" not in [r["name"] for r in ls["checkpoints"]]


def test_a_handed_out_latest_that_fails_a_download_is_not_handed_out_again(root, tmp_path):
    with _start(root) as s:
        _report(tmp_path, 0.9)
        _report(tmp_path, 0.1)
        latest = session.get_checkpoint()
        assert latest.path.endswith("checkpoint_000001")
        _damage(_ctx(root), "checkpoint_000001", "missing")
        with pytest.warns(RuntimeWarning, match="is invalid"), \
                pytest.raises(CheckpointCorruptError, match="missing"):
            latest.to_directory(str(tmp_path / "dl"))
        assert session.get_checkpoint().path.endswith("checkpoint_000000")
        assert s.manager.kept_dir_names == ["checkpoint_000000"]
