"""`checkpoint-store du` and the chunk collection of `gc`, on local disk,
memory and S3: what the checkpoints hold against what the store keeps, and
chunks no checkpoint uses (a crashed writer's) freed, referenced ones never."""

from __future__ import annotations

import json
import posixpath

import pytest

from checkpoint_store._chunks.codec import chunk_name, encode_chunk
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store.cli import main
from tests.chunks.test_dedup_save import _chunk_objects, _frozen, _persist, _tree
from tests.stores import make_store


def _invoke(*args: str):
    from click.testing import CliRunner

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _two_trials(store, tmp_path):
    frozen = _frozen(numel=1 << 18)
    a, b = store.ctx(trial="a", dedup=True), store.ctx(trial="b", dedup=True)
    _persist(a, tmp_path / "a", _tree(0, frozen), 0)
    _persist(a, tmp_path / "a", _tree(1, frozen), 1)
    _persist(b, tmp_path / "b", _tree(2, frozen), 0)
    return a, b


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_du_sums_logical_against_stored_bytes_per_trial_and_experiment(
        kind, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    a, _ = _two_trials(store, tmp_path)
    out = _invoke("du", store.join("exp"), *store.opt_args(), "--json")
    assert out.exit_code == 0, out.output
    [exp] = json.loads(out.output)
    trials, total = exp["trials"], exp["total"]
    assert set(trials) == {"a", "b"}
    frozen_bytes = 4 * (1 << 18) * 4
    assert trials["a"]["checkpoints"] == 2 and trials["b"]["checkpoints"] == 1
    # Trial a holds the frozen tensors twice and stores them once.
    assert trials["a"]["logical_bytes"] > 2 * frozen_bytes
    assert trials["a"]["unique_bytes"] < trials["a"]["chunked_bytes"]
    assert trials["a"]["dedup_ratio"] > 1.9
    # The experiment stores the shared chunks once: less than its trials' sum.
    assert total["unique_bytes"] < trials["a"]["unique_bytes"] + trials["b"]["unique_bytes"]
    assert total["stored_bytes"] == sum(_chunk_objects(a).values())
    # One trial: its own row only.
    one = json.loads(_invoke("du", store.join("exp", "b"), *store.opt_args(), "--json").output)
    assert list(one[0]["trials"]) == ["b"]
    assert one[0]["total"] == trials["b"]  # the trial's total, not the experiment's
    text = _invoke("du", store.join("exp"), *store.opt_args())
    assert text.exit_code == 0 and "(experiment)" in text.output


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_gc_frees_a_crashed_writers_chunks_and_never_a_referenced_one(
        kind, request, tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    a, b = _two_trials(store, tmp_path)
    kept = _chunk_objects(a)
    chunks = ChunkStore(a.filesystem, posixpath.join(a.experiment_path, ".cs_chunks"))
    orphan = b"left by a writer killed before its commit" * 1000
    chunks.write_object(chunk_name(orphan), encode_chunk(orphan))
    dry = _invoke("gc", store.join("exp", "a"), *store.opt_args(), "--dry-run", "--json")
    assert json.loads(dry.output)["unused_chunks"]["chunks"] == 1
    assert chunk_name(orphan) in _chunk_objects(a)
    out = _invoke("gc", store.join("exp", "a"), *store.opt_args(), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["unused_chunks"] == {"chunks": 1,
                                                       "bytes": len(encode_chunk(orphan))}
    assert _chunk_objects(a) == kept
    for ctx in (a, b):
        for _, name in ctx.checkpoint_dirs():
            ctx.checkpoint(name).verify()


def test_gc_of_an_experiment_without_chunks_says_nothing_of_them(tmp_path) -> None:
    store = make_store("local", None, tmp_path)  # type: ignore[arg-type]
    ctx = store.ctx(trial="a")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    from checkpoint_store import Checkpoint

    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    out = _invoke("gc", store.join("exp", "a"), "--json")
    assert json.loads(out.output)["unused_chunks"] is None
    assert not (tmp_path / "store" / "exp" / ".cs_chunks").exists()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_gc_frees_no_chunk_while_a_newer_format_marker_names_them(kind, request,
                                                                   tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    a, b = _two_trials(store, tmp_path)
    # Trial b as a later checkpoint-store might write it: chunk references
    # of another shape this version cannot read.
    path = posixpath.join(b.checkpoint_path(0), ".internal_metadata.json")
    with b.filesystem.open_input_stream(path) as f:
        body = json.loads(f.read())
    body["format_version"] = 4
    for entry in body["manifest"]:
        if "chunks" in entry:
            entry["chunks"] = [{"name": c[0], "size": c[1]} for c in entry["chunks"]]
    with b.filesystem.open_output_stream(path) as f:
        f.write(json.dumps(body).encode())
    # b's own chunk (its adapter) is used by no marker this version reads.
    a.delete_checkpoint("checkpoint_000000")
    before = _chunk_objects(b)
    out = _invoke("gc", store.join("exp", "a"), *store.opt_args(), "--min-age", "0",
                  "--json")
    assert out.exit_code == 0, out.output
    assert _chunk_objects(b) == before


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_prune_frees_the_chunks_only_the_evicted_checkpoints_used(kind, request,
                                                                   tmp_path) -> None:
    store = make_store(kind, request, tmp_path)
    ctx = store.ctx(trial="t", dedup=True)
    frozen = _frozen(numel=1 << 17)
    trees = [_tree(i, frozen) for i in range(3)]
    for i, tree in enumerate(trees):
        _persist(ctx, tmp_path / f"s{i}", tree, i)
    assert len(_chunk_objects(ctx)) == 4 + 1 + 3  # frozen, header, each adapter
    out = _invoke("prune", store.join("exp", "t"), *store.opt_args(), "--keep", "1",
                  "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["unused_chunks"]["chunks"] == 2
    assert len(_chunk_objects(ctx)) == 4 + 1 + 1
    [(ckpt, _)] = ctx.committed_checkpoints()
    ckpt.verify()


def test_prune_of_one_trial_frees_nothing_another_trial_uses(tmp_path) -> None:
    store = make_store("local", None, tmp_path)  # type: ignore[arg-type]
    a, b = _two_trials(store, tmp_path)
    before = _chunk_objects(b)
    out = _invoke("prune", store.join("exp", "a"), "--keep", "1", "--no-keep-latest")
    assert out.exit_code == 0, out.output
    assert "freed 1 unused chunk(s)" in out.output  # a's older adapter alone
    assert len(_chunk_objects(b)) == len(before) - 1
    for ctx in (a, b):
        for ckpt, _ in ctx.committed_checkpoints():
            ckpt.verify()
