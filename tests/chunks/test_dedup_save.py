"""Tensors stored once: report(state=...) and persist_checkpoint with dedup on
store each large file as chunks in the experiment's chunk store, upload only
the chunks the store lacks, load back bit-exact, and retention frees exactly
the chunks no checkpoint of the experiment uses any more."""

from __future__ import annotations

import posixpath
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    StorageContext,
    UploadConfig,
    session,
)
from checkpoint_store._chunks.codec import chunk_header
from checkpoint_store._chunks.refs import experiment_refs
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.state import write_state
from tests.state.test_remote import FORMS
from tests.stores import make_store

MiB = 1 << 20

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _chunk_objects(ctx: StorageContext) -> dict[str, int]:
    """Every chunk object of ``ctx``'s experiment: name -> stored bytes."""
    root = posixpath.join(ctx.experiment_path, ".cs_chunks")
    out = {}
    sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    for fi in ctx.filesystem.get_file_info(sel):
        rel = fi.path[len(root):].lstrip("/")
        if fi.type == pafs.FileType.File and not rel.startswith("."):
            out[posixpath.basename(rel)] = fi.size
    return out


def _frozen(seed: int = 0, n: int = 4, numel: int = MiB // 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base{i}": torch.randn(numel, generator=g) for i in range(n)}


def _tree(step: int, frozen: dict[str, torch.Tensor]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"model": {**frozen, "adapter": torch.randn(16 * 1024, generator=g)},
            "step": step}


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point else b)
    else:
        assert a == b


def _persist(ctx: StorageContext, tmp_path: Any, tree: Any, index: int) -> Checkpoint:
    src = tmp_path / f"src{index}"
    tensors = write_state(tree, src)
    return ctx.persist_checkpoint(Checkpoint.from_directory(src), index, {"tensors": tensors})


@pytest.fixture(params=list(FORMS))
def form_ctx(request):
    store, build = FORMS[request.param]
    server = request.getfixturevalue(f"{store}_server")
    place = request.getfixturevalue("azure_container" if store == "azure"
                                    else f"{store}_bucket")
    return StorageContext(experiment_name="exp", trial_name="t", dedup=True,
                          **build(server, server.endpoint_url, place))


def _check_second_uploads_only_the_change(ctx: StorageContext, tmp_path: Any) -> None:
    frozen = _frozen()
    first = _tree(0, frozen)
    c0 = _persist(ctx, tmp_path, first, 0)
    before = _chunk_objects(ctx)
    assert before, "the tensors were stored as chunks"
    second = _tree(1, frozen)
    c1 = _persist(ctx, tmp_path, second, 1)
    after = _chunk_objects(ctx)
    new = {n: s for n, s in after.items() if n not in before}
    changed = second["model"]["adapter"].numel() * 4
    # Only the adapter changed: its one chunk is new, the frozen tensors' and
    # the shard header's chunks are referenced again.
    assert len(new) == 1
    assert sum(new.values()) <= 1.05 * changed + 4096
    _same(c0.load_state(), first)
    _same(c1.load_state(), second)
    c1.verify()
    refs = experiment_refs(ctx.filesystem, ctx.experiment_path)
    assert set(after) == refs


@pytest.mark.slow
def test_every_location_form_stores_unchanged_tensors_once(form_ctx, tmp_path) -> None:
    _check_second_uploads_only_the_change(form_ctx, tmp_path)


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_unchanged_tensors_are_stored_once(kind, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    _check_second_uploads_only_the_change(store.ctx(dedup=True), tmp_path)


def _session(store, trial: str = "t", keep: int | None = None, **kw: Any):
    cfg = CheckpointConfig(num_to_keep=keep) if keep else None
    return session.start(storage_path=store.uri, storage_options=store.options or None,
                         experiment_name="exp", trial_name=trial, checkpoint_config=cfg,
                         upload_config=UploadConfig(dedup=True, **kw))


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retention_frees_exactly_the_chunks_no_kept_checkpoint_uses(kind, mode, request,
                                                                     tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    frozen = _frozen(numel=MiB // 8)
    trees = [_tree(i, frozen) for i in range(5)]
    with _session(store, keep=2, upload_mode=mode) as s:
        for tree in trees:
            s.report({"step": tree["step"]}, state=tree)
        s.wait()
    ctx = store.ctx()
    kept = sorted(name for _, name in ctx.checkpoint_dirs())
    assert kept == ["checkpoint_000003", "checkpoint_000004"]
    objects = _chunk_objects(ctx)
    assert set(objects) == experiment_refs(ctx.filesystem, ctx.experiment_path)
    # 4 frozen tensors, the header and the two kept adapters' chunks.
    assert len(objects) == 4 + 2 + 1
    for name, tree in zip(kept, trees[3:], strict=True):
        _same(ctx.checkpoint(name).load_state(), tree)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_trials_of_one_experiment_share_chunks_and_never_free_each_others(
        kind, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    frozen = _frozen(numel=MiB // 8)
    with _session(store, "a", keep=1) as a:
        a.report({"step": 0}, state=_tree(0, frozen))
    with _session(store, "b", keep=3) as b:
        for i in range(3):
            b.report({"step": i}, state=_tree(10 + i, frozen))
    # Trial a evicts everything it had but its newest: b's chunks stay.
    with _session(store, "a", keep=1) as a:
        for i in range(1, 4):
            a.report({"step": i}, state=_tree(20 + i, frozen))
    for trial in ("a", "b"):
        ctx = store.ctx(trial=trial)
        for _, name in ctx.checkpoint_dirs():
            ctx.checkpoint(name).verify()
    b = store.ctx(trial="b")
    _same(b.checkpoint("checkpoint_000000").load_state(), _tree(10, frozen))
    objects = _chunk_objects(b)
    assert set(objects) == experiment_refs(b.filesystem, b.experiment_path)
    assert len(objects) == 4 + 1 + 1 + 3  # frozen, header, a's newest adapter, b's three


def test_a_fork_started_with_resume_from_uploads_only_what_it_changes(tmp_path) -> None:
    store = make_store("memory", None, tmp_path)  # type: ignore[arg-type]
    frozen = _frozen(numel=MiB // 8)
    with _session(store, "parent") as p:
        p.report({"step": 0}, state=_tree(0, frozen))
    parent = store.ctx(trial="parent")
    uri = parent.uri(parent.checkpoint_path(0))
    before = _chunk_objects(parent)
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="fork",
                       upload_config=UploadConfig(dedup=True), resume_from=uri) as f:
        start = f.get_checkpoint().load_state()
        start["model"]["adapter"] = start["model"]["adapter"] + 1
        f.report({"step": 1}, state=start)
    new = set(_chunk_objects(parent)) - set(before)
    assert len(new) == 1  # the fork's adapter; the base is the parent's
    fork = store.ctx(trial="fork")
    _same(fork.checkpoint("checkpoint_000000").load_state(), start)


def test_compression_on_is_bit_exact_and_smaller_for_floats(tmp_path) -> None:
    store = make_store("memory", None, tmp_path)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    tree = {
        "w_bf16": (torch.randn(MiB // 2, generator=g) * 0.02).to(torch.bfloat16),
        "w_f32": torch.randn(MiB // 4, generator=g) * 1e-3,
        "special": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45] * 65536),
        "ints": torch.arange(MiB // 4, dtype=torch.int64),
    }
    ctx = store.ctx(dedup=True, compression="on")
    ckpt = _persist(ctx, tmp_path, tree, 0)
    _same(ckpt.load_state(), tree)
    objects = _chunk_objects(ctx)
    assert "planes-zstd" in _codecs(ctx)
    logical = sum(t.numel() * t.element_size() for t in tree.values())
    assert sum(objects.values()) < 0.9 * logical


def test_a_directory_checkpoint_large_file_is_chunked_and_read_back(tmp_path) -> None:
    store = make_store("memory", None, tmp_path)  # type: ignore[arg-type]
    src = tmp_path / "d"
    src.mkdir()
    big = bytes(range(256)) * (3 * MiB // 256 + 7)
    (src / "model.bin").write_bytes(big)
    (src / "notes.txt").write_text("small")
    with _session(store) as s:
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(src))
    ctx = store.ctx()
    ckpt = ctx.checkpoint("checkpoint_000000")
    entry = {e["path"]: e for e in ckpt.internal_metadata["manifest"]}
    assert "chunks" in entry["model.bin"] and "chunks" not in entry["notes.txt"]
    with ckpt.as_directory() as d:
        assert open(posixpath.join(d, "model.bin"), "rb").read() == big
        assert open(posixpath.join(d, "notes.txt")).read() == "small"


def test_dedup_options_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match="dedup must be True or False"):
        UploadConfig(dedup="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="compression must be one of"):
        UploadConfig(dedup=True, compression="zstd")
    with pytest.raises(InvalidConfigError, match="compression must be one of"):
        StorageContext("memory://x/y", "e", "t", dedup=True, compression=1)  # type: ignore


def test_dedup_on_several_ranks_is_refused_before_anything_is_written(tmp_path) -> None:
    with pytest.raises(InvalidConfigError, match="dedup"):
        session.start(storage_path=str(tmp_path / "s"), experiment_name="e", trial_name="t",
                      upload_config=UploadConfig(dedup=True), world_rank=0, world_size=2,
                      attempt_id="a")
    assert not (tmp_path / "s").exists()


def _codecs(ctx: StorageContext) -> set[str]:
    root = posixpath.join(ctx.experiment_path, ".cs_chunks")
    out = set()
    for name in _chunk_objects(ctx):
        with ctx.filesystem.open_input_stream(posixpath.join(root, name[:2], name)) as f:
            out.add(chunk_header(f.read())["codec"])
    return out


@pytest.mark.parametrize(("kind", "compression", "codec"), [
    ("local", "auto", "raw"), ("memory", "auto", "raw"), ("s3", "auto", "planes-zstd"),
    ("local", "on", "planes-zstd"), ("s3", "off", "raw"),
])
def test_compression_auto_is_on_for_object_stores_only(kind, compression, codec, request,
                                                       tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    ctx = store.ctx(dedup=True, compression=compression)
    tree = _tree(0, _frozen(numel=MiB // 8))
    _same(_persist(ctx, tmp_path, tree, 0).load_state(), tree)
    assert _codecs(ctx) == {codec}


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_a_local_tier_keeps_plain_files_and_its_durable_copies_use_chunks(
        kind, request, tmp_path) -> None:
    from checkpoint_store import LocalTier

    store = make_store(kind, request, tmp_path)
    frozen = _frozen(numel=MiB // 8)
    trees = [_tree(i, frozen) for i in range(3)]
    tier = tmp_path / "nvme"
    with session.start(storage_path=store.uri, storage_options=store.options or None,
                       experiment_name="exp", trial_name="t",
                       upload_config=UploadConfig(dedup=True),
                       local_tier=LocalTier(str(tier))) as s:
        for tree in trees:
            s.report({"step": tree["step"]}, state=tree)
        s.wait()
    # The tier's copies hold their safetensors files themselves.
    shards = list(tier.rglob("*.safetensors"))
    assert shards and all(p.stat().st_size > 0 for p in shards)
    ctx = store.ctx()
    durable = [name for _, name in ctx.checkpoint_dirs()]
    assert durable == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]
    objects = _chunk_objects(ctx)
    assert len(objects) == 4 + 1 + 3  # frozen once, the header, each adapter
    for name, tree in zip(durable, trees, strict=True):
        meta = ctx.checkpoint(name).internal_metadata
        assert meta["format_version"] == 3
        _same(ctx.checkpoint(name).load_state(), tree)
    # A new machine (no tier) resumes from the storage_path's chunked copy.
    with session.start(storage_path=store.uri, storage_options=store.options or None,
                       experiment_name="exp", trial_name="t",
                       upload_config=UploadConfig(dedup=True)) as s:
        _same(s.get_checkpoint().load_state(), trees[-1])
