"""The chunk store and the races the gc design names, step by step on local disk."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from checkpoint_store._chunks.codec import decode_chunk
from checkpoint_store._chunks.gc import collect, collect_steps, usage
from checkpoint_store._chunks.refs import experiment_markers, experiment_refs
from checkpoint_store._chunks.store import CONDEMNED_DIR, INTENTS_DIR, ChunkStore
from checkpoint_store.errors import CheckpointCorruptError, UnsafePathError
from tests.chunks._helpers import Clock, blob, commit


@pytest.fixture
def env(tmp_path):
    fs = pafs.LocalFileSystem()
    exp = f"{tmp_path}/exp"
    store = ChunkStore(fs, f"{exp}/.cs_chunks", workers=4)
    clock = Clock()
    return fs, exp, store, clock, (lambda: experiment_refs(fs, exp))


def _upload_unreferenced(store, clock, i):
    """An object nobody references (a failed writer's upload)."""
    name, data = blob(i)
    with store.begin([name], writer="failed", now=clock) as w:
        w.upload(name, data)
    return name


def test_object_names_and_paths(env):
    _, exp, store, _, _ = env
    name = blob(0)[0]
    assert store.object_path(name) == f"{exp}/.cs_chunks/{name[:2]}/{name}"
    assert store.object_path(name + ".0a1b2c3d").endswith(f"/{name}.0a1b2c3d")
    for bad in (name.upper(), name[:-1], name + ".xyz", "../" + name[3:], name + ".0a1b2c3d4"):
        with pytest.raises(ValueError):
            store.object_path(bad)


def test_for_checkpoint_resolves_and_refuses(env):
    fs, exp, _, _, _ = env
    ckpt = f"{exp}/t1/checkpoint_000000"
    assert ChunkStore.for_checkpoint(fs, ckpt).root == f"{exp}/.cs_chunks"
    for bad in ("../../../.cs_chunks", "/abs/.cs_chunks", "../../other", "..", ""):
        with pytest.raises(UnsafePathError) as err:
            ChunkStore.for_checkpoint(fs, ckpt, chunk_root=bad)
        assert err.value.path == ckpt


def test_read_missing_names_the_chunk(env):
    _, _, store, _, _ = env
    name = blob(1)[0]
    with pytest.raises(CheckpointCorruptError, match=f"chunk {name} is missing.*missing a chunk"):
        store.read(name)


def test_write_read_many_and_list(env):
    _, _, store, clock, _ = env
    blobs = dict(blob(i) for i in range(70))  # over LISTING_THRESHOLD: prefix listings
    with store.begin(blobs, writer="w", now=clock) as w:
        assert w.missing == set(blobs) and w.object_names == {n: n for n in blobs}
        for n in w.missing:
            w.upload(n, blobs[n])
        assert store.read_controls(INTENTS_DIR)[0].chunks == set(blobs)
    assert store.read_controls(INTENTS_DIR) == []
    assert store.list_objects() == {n: len(b) for n, b in blobs.items()}
    assert dict(store.read_many(sorted(blobs))) == blobs
    assert store.begin(blobs, writer="again", now=clock).missing == set()
    with pytest.raises(ValueError):
        store.begin([blob(0)[0]], writer="w", now=clock).upload(blob(1)[0], b"x")


def test_gc_deletes_only_unreferenced_and_reports(env):
    fs, exp, store, clock, refs = env
    (a, da), (b, db) = blob(0), blob(1)
    with store.begin([a, b], writer="w", now=clock) as w:
        w.upload(a, da)
        w.upload(b, db)
        commit(store, f"{exp}/t1/checkpoint_000000", [a], {a: len(da)})
    dry = collect(store, refs, dry_run=True, now=clock)
    assert dry.deleted == [b] and set(store.list_objects()) == {a, b}
    report = collect(store, refs, now=clock)
    assert (report.deleted, report.bytes_freed) == ([b], len(db))
    assert set(store.list_objects()) == {a}
    assert store.read_controls(CONDEMNED_DIR) == []
    u = usage(exp, experiment_markers(fs, exp))
    assert u.trials["t1"].stored_bytes == len(da) and u.total.checkpoints == 1


def test_writer_whose_intent_lands_after_gc_listing(env):
    """Gc condemned and relisted; the writer's intent comes after: it reads the
    condemned file and uploads a fresh copy, which the gc does not delete."""
    _, exp, store, clock, refs = env
    name = _upload_unreferenced(store, clock, 2)
    gc = collect_steps(store, refs, now=clock)
    assert [next(gc), next(gc), next(gc)] == ["listed", "condemned", "relisted"]
    w = store.begin([name], writer="late", now=clock)
    fresh = w.object_names[name]
    assert fresh.startswith(name + ".") and w.missing == {fresh}
    w.upload(fresh, blob(2)[1])
    assert next(gc) == "deleted"
    commit(store, f"{exp}/t1/checkpoint_000000", [fresh], {})
    w.finish()
    assert list(gc) == ["finished"]
    assert set(store.list_objects()) == {fresh}
    assert decode_chunk(store.read(fresh), where=fresh) == b"chunk-2" * 3


def test_fresh_copy_protected_by_intent_from_a_later_gc(env):
    """A fresh copy uploaded before a second gc's first listing, marker not yet
    written: the intent (naming the chunk, not the copy) still protects it."""
    _, exp, store, clock, refs = env
    name = _upload_unreferenced(store, clock, 3)
    gc = collect_steps(store, refs, now=clock)
    next(gc), next(gc)
    w = store.begin([name], writer="w", now=clock)
    fresh = w.object_names[name]
    w.upload(fresh, blob(3)[1])
    list(gc)
    second = collect(store, refs, now=clock)
    assert fresh not in second.deleted
    commit(store, f"{exp}/t1/checkpoint_000000", [fresh], {})
    w.finish()
    assert fresh in store.list_objects()


def test_writer_intent_before_relisting_protects_canonical(env):
    _, exp, store, clock, refs = env
    name = _upload_unreferenced(store, clock, 4)
    gc = collect_steps(store, refs, now=clock)
    next(gc), next(gc)  # condemned
    w = store.prepare([name], writer="w", now=clock)
    steps = w.steps()
    next(steps)  # intent only, before the gc's step 3
    assert list(gc) == ["relisted", "deleted", "finished"]
    list(steps)
    # The gc finished before the writer looked: nothing condemned, and the
    # intent kept the canonical object, which the writer references as is.
    assert w.object_names[name] == name and w.missing == set()
    assert name in store.list_objects()


def test_expired_intent_protects_nothing_and_is_removed(env):
    _, _, store, clock, refs = env
    name, data = blob(5)
    w = store.begin([name], writer="crashed", now=clock)
    w.upload(name, data)  # crashed: never finishes
    assert collect(store, refs, now=clock).deleted == []
    clock.t += 6 * 3600 + 1
    report = collect(store, refs, now=clock)
    assert report.deleted == [name] and report.expired_intents == [w.intent_path]
    assert store.read_controls(INTENTS_DIR) == []


def test_crash_between_condemn_and_delete(env):
    _, exp, store, clock, refs = env
    name = _upload_unreferenced(store, clock, 6)
    gc = collect_steps(store, refs, now=clock)
    next(gc), next(gc)  # condemned, then the gc crashes
    w = store.begin([name], writer="w", now=clock)  # the stale file still condemns
    assert w.object_names[name] != name
    w.finish()
    clock.t += 3601
    report = collect(store, refs, now=clock)
    assert len(report.stale_condemned) == 1 and name in report.deleted
    assert store.read_controls(CONDEMNED_DIR) == []
    with store.begin([name], writer="w2", now=clock) as w2:
        assert w2.object_names[name] == name and w2.missing == {name}


def test_slow_gc_stops_deleting(env):
    _, _, store, clock, refs = env
    name = _upload_unreferenced(store, clock, 7)
    gc = collect_steps(store, refs, now=clock)
    next(gc), next(gc), next(gc)
    clock.t += 1800 + 1
    next(gc)
    report = _finish(gc)
    assert report.deleted == [] and report.kept == [name]
    assert name in store.list_objects()


def _finish(gen):
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def test_candidates_limit_the_pass(env):
    _, _, store, clock, refs = env
    a = _upload_unreferenced(store, clock, 8)
    b = _upload_unreferenced(store, clock, 9)
    assert collect(store, refs, candidates=[a], now=clock).deleted == [a]
    assert set(store.list_objects()) == {b}


def _marker(fs, ckpt, body):
    import json
    import posixpath

    fs.create_dir(ckpt, recursive=True)
    with fs.open_output_stream(posixpath.join(ckpt, ".internal_metadata.json")) as f:
        f.write(json.dumps(body).encode())


def _v3(refs):
    return {"format_version": 3, "chunk_root": "../../.cs_chunks", "index": 0,
            "manifest": [{"path": "model.bin", "size": 21, "crc32c": "00000000",
                          "chunks": refs}]}


def test_a_reference_whose_lengths_do_not_parse_still_protects_its_chunk(env):
    fs, exp, store, clock, refs = env
    (a, da), (b, db) = blob(0), blob(1)
    store.write_object(a, da)
    store.write_object(b, db)
    # Its name is a chunk's; only the stored length is not a number.
    _marker(fs, f"{exp}/t1/checkpoint_000000", _v3([[a, 21, None]]))
    report = collect(store, refs, now=clock)
    assert report.deleted == [b]
    assert store.list_objects() == {a: len(da)}


@pytest.mark.parametrize("how", ["newer format", "reference of another shape",
                                 "chunks not a list", "not an object"])
def test_a_marker_not_understood_whole_frees_nothing(env, how, caplog):
    fs, exp, store, clock, refs = env
    (a, da), (b, db) = blob(0), blob(1)
    store.write_object(a, da)
    store.write_object(b, db)
    if how == "newer format":  # what a later checkpoint-store might write
        body = {**_v3([{"name": a, "size": 21}]), "format_version": 4}
    elif how == "reference of another shape":
        body = _v3([[a.upper(), 21, len(da)]])
    elif how == "chunks not a list":
        body = _v3({a: [21, len(da)]})
    else:
        body = [a]
    _marker(fs, f"{exp}/t1/checkpoint_000000", body)
    with caplog.at_level("WARNING", logger="checkpoint_store._chunks.refs"):
        report = collect(store, refs, now=clock)
    assert report.deleted == []
    assert set(store.list_objects()) == {a, b}
    assert "chunk references unknown" in caplog.text and "t1/checkpoint_000000" in caplog.text
    # Once that checkpoint is gone, the unused chunks go.
    fs.delete_dir(f"{exp}/t1")
    assert sorted(collect(store, refs, now=clock).deleted) == sorted([a, b])


def _torn_store(store, mark):
    """``store``'s objects through a filesystem whose first read of each file
    whose path holds ``mark`` is torn (empty): a file seen while it is
    written in place."""
    from checkpoint_store.backends.base import LOCAL_CAPABILITIES
    from checkpoint_store.testing.faults import faulty_filesystem

    return ChunkStore(faulty_filesystem(store.filesystem, torn_reads=mark), store.root,
                      workers=4, capabilities=LOCAL_CAPABILITIES)


def test_a_condemned_file_read_torn_condemns_only_what_it_names(env):
    _, exp, store, clock, refs = env
    condemned = _upload_unreferenced(store, clock, 5)
    (kept, data) = blob(6)
    store.write_object(kept, data)
    commit(store, f"{exp}/t1/checkpoint_000000", [kept], {})
    gc = collect_steps(store, refs, now=clock)
    assert [next(gc), next(gc)] == ["listed", "condemned"]
    # A writer needing both chunks reads the gc's condemned file torn.
    w = _torn_store(store, CONDEMNED_DIR).begin([condemned, kept], writer="w", now=clock)
    assert w.object_names[kept] == kept  # present, and not condemned: no new copy
    assert w.object_names[condemned].startswith(condemned + ".")
    assert w.missing == {w.object_names[condemned]}
    w.finish()
    list(gc)


def test_an_intent_read_torn_still_names_its_chunks(env):
    _, exp, store, clock, refs = env
    mine, other = _upload_unreferenced(store, clock, 7), _upload_unreferenced(store, clock, 8)
    w = store.begin([mine], writer="w", now=clock)
    # The gc reads the writer's intent torn: it still protects exactly its
    # chunk, and the object no one announced goes.
    report = collect(_torn_store(store, INTENTS_DIR), refs, now=clock)
    assert report.deleted == [other]
    w.finish()
