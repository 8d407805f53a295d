"""Issue 38, kinds 1 and 3: a checkpoint's identity on storage is its directory
name. An entry that disagrees with its name (a marker naming another index, a
negative or huge one, a name spelling its index otherwise, a link or a file in
a checkpoint's place) is invalid for every reader (resume, ``ls``, ``best``,
``verify``, ``show``, ``prune``, ``gc``, the web page's data), is named, and is
never a reason to delete another checkpoint.

Each damage is made on local disk and on memory:// (links on local disk only),
in a trial written by a session (with a retention state) and in one written
by ``persist_checkpoint`` alone (read checkpoint by checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import warnings

import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointCorruptError,
    StorageContext,
    session,
)
from checkpoint_store.retention import recorded_invalid
from checkpoint_store.ui._model import StoreView

LOSSES = [0.5, 0.1, 0.3]  # checkpoint_000001 is the best by min loss
BEST = "checkpoint_000001"
MARKER = ".internal_metadata.json"

#: damage -> the entry it makes invalid.
DAMAGES = {
    "claims_best": "checkpoint_000002",  # "index": 1 inside checkpoint_000002
    "negative": "checkpoint_000002",
    "float_huge": "checkpoint_000002",  # "index": 1e30
    "int_huge": "checkpoint_000002",  # "index": 10**30
    "alias": "checkpoint_0000001",  # a copy of the best under a second spelling of 1
    "file": "checkpoint_000003",  # a stray file where the next checkpoint goes
    "link": "checkpoint_000002",  # -> checkpoint_000001
    "link_elsewhere": "checkpoint_000002",  # -> another trial's checkpoint_000002
}


def _trial(store: Store, tmp_path, *, with_state: bool, trial: str = "t1") -> StorageContext:
    ctx = store.ctx(trial=trial)
    if not with_state:
        for i, loss in enumerate(LOSSES):
            src = write_tree(str(tmp_path / f"src-{trial}-{i}"), {"model.bin": bytes([i]) * 300})
            ctx.persist_checkpoint(Checkpoint.from_directory(src), i,
                                   {"metrics": {"loss": loss}})
        return ctx
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name=trial,
                       checkpoint_config=CheckpointConfig(checkpoint_score_attribute="loss",
                                                          checkpoint_score_order="min"),
                       storage_options=dict(store.options) or None):
        for i, loss in enumerate(LOSSES):
            src = write_tree(str(tmp_path / f"src-{trial}-{i}"), {"model.bin": bytes([i]) * 300})
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(src))
    return ctx


def _read(ctx: StorageContext, path: str) -> bytes:
    with ctx.filesystem.open_input_stream(path) as f:
        return bytes(f.read())


def _write(ctx: StorageContext, path: str, data: bytes) -> None:
    if ctx.backend.capabilities.directories:
        ctx.filesystem.create_dir(posixpath.dirname(path), recursive=True)
    with ctx.filesystem.open_output_stream(path) as out:
        out.write(data)


def _set_index(ctx: StorageContext, name: str, raw: str) -> None:
    """Write ``raw`` (JSON text) as the ``index`` of ``name``'s marker."""
    path = posixpath.join(ctx.trial_path, name, MARKER)
    meta = json.loads(_read(ctx, path))
    meta["index"] = "@@"
    _write(ctx, path, json.dumps(meta).replace('"@@"', raw).encode())


def _damage(store: Store, ctx: StorageContext, how: str, tmp_path) -> str:
    trial = ctx.trial_path
    if how == "claims_best":
        _set_index(ctx, "checkpoint_000002", "1")
    elif how == "negative":
        _set_index(ctx, "checkpoint_000002", "-1")
    elif how == "float_huge":
        _set_index(ctx, "checkpoint_000002", "1e30")
    elif how == "int_huge":
        _set_index(ctx, "checkpoint_000002", str(10**30))
    elif how == "alias":
        for rel in (MARKER, "model.bin"):
            _write(ctx, posixpath.join(trial, "checkpoint_0000001", rel),
                   _read(ctx, posixpath.join(trial, BEST, rel)))
    elif how == "file":
        _write(ctx, posixpath.join(trial, "checkpoint_000003"), b"a stray file")
    else:
        import shutil

        shutil.rmtree(posixpath.join(trial, "checkpoint_000002"))
        if how == "link":
            os.symlink(BEST, posixpath.join(trial, "checkpoint_000002"))
        else:
            other = _trial(store, tmp_path, with_state=False, trial="t2")
            os.symlink(other.checkpoint_path(2), posixpath.join(trial, "checkpoint_000002"))
    return DAMAGES[how]


def _exists(ctx: StorageContext, name: str) -> bool:
    """Whether anything (a link too) is at ``name`` in the trial."""
    import pyarrow.fs as pafs

    from checkpoint_store._util.fs import local_path

    path = posixpath.join(ctx.trial_path, name)
    local = local_path(ctx.filesystem, path)
    if local is not None:
        return os.path.lexists(local)
    return ctx.filesystem.get_file_info(path).type != pafs.FileType.NotFound


def _best_intact(ctx: StorageContext) -> None:
    """The best is still a committed checkpoint whose every byte verifies."""
    ckpt = ctx.checkpoint(BEST)
    assert ckpt.is_committed
    ckpt.verify()
    assert ckpt.internal_metadata["index"] == 1


@pytest.fixture(params=list(DAMAGES))
def damage(request, near_store: Store) -> str:
    if request.param.startswith("link") and "://" in near_store.uri:
        pytest.skip("symbolic links exist on local disks only")
    return str(request.param)


# -- the inputs (kind 1) -----------------------------------------------------------


@pytest.mark.parametrize("with_state", [True, False])
def test_prune_keeps_the_best_another_marker_claims_the_index_of(near_store: Store, tmp_path,
                                                                with_state: bool) -> None:
    """`"index": 1` inside checkpoint_000002 pruned checkpoint_000001 (the best), exit 0."""
    ctx = _trial(near_store, tmp_path, with_state=with_state)
    _set_index(ctx, "checkpoint_000002", "1")
    res = invoke(["prune", near_store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [d["name"] for d in out["kept"]] == [BEST]
    assert [d["name"] for d in out["deleted"]] == ["checkpoint_000000"]
    assert [d["name"] for d in out["invalid"]] == ["checkpoint_000002"]
    assert "records index 1" in out["invalid"][0]["reason"]
    assert "checkpoint_000002" in res.stderr and "invalid" in res.stderr
    _best_intact(ctx)
    assert _exists(ctx, "checkpoint_000002")  # invalid: never deleted either


@pytest.mark.parametrize("with_state", [True, False])
def test_prune_keeps_the_best_a_linked_checkpoint_points_at(tmp_path, with_state: bool) -> None:
    """checkpoint_000002 -> checkpoint_000001 pruned the best, exit 0."""
    store = Store(str(tmp_path / "store"))
    ctx = _trial(store, tmp_path, with_state=with_state)
    _damage(store, ctx, "link", tmp_path)
    res = invoke(["prune", store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--no-keep-latest"])
    assert res.exit_code == 0, res.output
    assert "checkpoint_000002" in res.stderr and "symbolic link" in res.stderr
    assert "deleted" in res.stdout and BEST not in res.stdout.split("kept")[0]
    _best_intact(ctx)
    assert os.path.islink(posixpath.join(ctx.trial_path, "checkpoint_000002"))


def test_prune_and_gc_never_follow_a_link_out_of_what_they_delete(tmp_path) -> None:
    """A link inside an evicted checkpoint, or inside a leftover of ours, goes
    as a link: what it points at stays."""
    store = Store(str(tmp_path / "store"))
    ctx = _trial(store, tmp_path, with_state=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "same-size.bin").write_bytes(b"\x00" * 300)  # model.bin of checkpoint 0
    (outside / "keep.txt").write_bytes(b"not the store's")
    victim = posixpath.join(ctx.trial_path, "checkpoint_000000")
    os.remove(posixpath.join(victim, "model.bin"))
    os.symlink(outside / "same-size.bin", posixpath.join(victim, "model.bin"))
    assert ctx.checkpoint("checkpoint_000000").is_committed  # the bytes match
    leftover = posixpath.join(ctx.trial_path, "checkpoint_000009")
    os.makedirs(leftover)
    with open(posixpath.join(leftover, ".cs_claim-1-deadrun.1.abcd"), "wb") as f:
        f.write(b"{}")
    os.symlink(outside, posixpath.join(leftover, "linked-dir"))
    res = invoke(["prune", store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min"])
    assert res.exit_code == 0, res.output
    assert not os.path.lexists(victim)
    res = invoke(["gc", store.join("exp", "t1"), "--min-age", "0"])
    assert res.exit_code == 0, res.output
    assert "checkpoint_000009" in res.stdout and not os.path.lexists(leftover)
    assert sorted(os.listdir(outside)) == ["keep.txt", "same-size.bin"]
    assert (outside / "same-size.bin").read_bytes() == b"\x00" * 300
    _best_intact(ctx)


# -- every damage, every command (kinds 1 and 3) --------------------------------------------


@pytest.mark.parametrize("with_state", [True, False])
def test_every_command_names_an_entry_its_name_disagrees_with(near_store: Store, tmp_path,
                                                              damage: str,
                                                              with_state: bool) -> None:
    ctx = _trial(near_store, tmp_path, with_state=with_state)
    bad = _damage(near_store, ctx, damage, tmp_path)
    trial = near_store.join("exp", "t1")

    for long in ([], ["--long"]):
        res = invoke(["ls", trial, *long])
        assert res.exit_code == 0, res.output
        assert bad not in res.stdout  # never listed as a checkpoint
        assert bad in res.stderr  # but named
        assert BEST in res.stdout
    data = json.loads(invoke(["ls", trial, "--json"]).stdout)
    assert bad not in [r["name"] for r in data["checkpoints"]]
    assert bad in [c["name"] for c in data["corrupt"] + data["invalid"]]

    res = invoke(["verify", trial])
    assert res.exit_code == 1, res.output
    assert f"CORRUPT  {near_store.join('exp', 't1', bad)}" in res.stdout \
        or f"{bad}:" in res.stdout

    res = invoke(["best", trial, "--metric", "loss", "--mode", "min"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith(BEST)
    assert bad in res.stderr

    res = invoke(["show", near_store.join("exp", "t1", bad)])
    assert res.exit_code == (2 if damage == "file" else 1), res.output
    assert "Traceback" not in res.output

    res = invoke(["gc", trial, "--min-age", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert bad not in json.loads(res.stdout)["removed"]

    model = StoreView(near_store.uri, {})
    model.experiments()
    rows = {r["name"]: r for r in model.trial("exp", "t1", full=True)["checkpoints"]}
    assert rows[bad]["kind"] == "invalid" and rows[bad]["reason"]
    assert rows[bad]["index"] == int(bad.rsplit("_", 1)[1])  # the name's, not the marker's
    assert rows[BEST]["kind"] != "invalid"
    assert model.checkpoint("exp", "t1", bad)["state"] == "invalid"

    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min",
                  "--no-keep-latest", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [d["name"] for d in out["kept"]] == [BEST]
    assert bad in [d["name"] for d in out["invalid"]]
    assert bad not in [d["name"] for d in out["deleted"]]
    _best_intact(ctx)
    assert _exists(ctx, bad)


@pytest.mark.parametrize("with_state", [True, False])
def test_resume_names_the_entry_and_numbers_past_it(near_store: Store, tmp_path, damage: str,
                                                    with_state: bool, caplog) -> None:
    """Resume never hands out (or commits over) an entry its name disagrees
    with, warns naming it, and a stray file at the next index no longer
    blocks every resume (PermanentBackendError): numbering skips it."""
    ctx = _trial(near_store, tmp_path, with_state=with_state)
    bad = _damage(near_store, ctx, damage, tmp_path)
    src = write_tree(str(tmp_path / "next"), {"model.bin": b"next" * 10})
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with session.start(storage_path=near_store.uri, experiment_name="exp",
                           trial_name="t1", storage_options=dict(near_store.options) or None):
            resumed = session.get_checkpoint()
            session.report({"loss": 0.9}, checkpoint=Checkpoint.from_directory(src))
    said = " ".join(str(w.message) for w in seen) + caplog.text
    assert bad in said
    assert resumed is not None
    newest_good = "checkpoint_000002" if bad != "checkpoint_000002" else BEST
    assert posixpath.basename(resumed.path) == newest_good
    names = [posixpath.basename(c.path) for c, _ in ctx.committed_checkpoints()]
    expected_next = "checkpoint_000004" if damage == "file" else "checkpoint_000003"
    assert names[-1] == expected_next
    assert bad not in names and _exists(ctx, bad)
    _best_intact(ctx)


@pytest.mark.parametrize("with_state", [True, False])
def test_retention_restore_names_the_entry_and_never_hands_it_out(near_store: Store, tmp_path,
                                                                  damage: str,
                                                                  with_state: bool) -> None:
    from checkpoint_store import CheckpointManager

    ctx = _trial(near_store, tmp_path, with_state=with_state)
    bad = _damage(near_store, ctx, damage, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = CheckpointManager(CheckpointConfig(num_to_keep=1,
                                                     checkpoint_score_attribute="loss",
                                                     checkpoint_score_order="min"),
                                    ctx, read_only=True)
    assert bad in manager.invalid
    assert bad not in [n for n, _ in manager.resume_candidates().named()]
    assert manager.best_checkpoint is not None
    assert posixpath.basename(manager.best_checkpoint.path) == BEST
    assert manager.next_index == (4 if damage == "file" else 3)
    assert bad not in manager.known_committed()


def test_prune_leaves_a_checkpoint_the_state_records_damaged_alone(near_store: Store,
                                                                   tmp_path) -> None:
    """Found here: prune ranked a checkpoint the retention state records as
    found damaged by a read (a CRC32C no listing shows): the damaged best was
    kept and the good ones deleted."""
    ctx = _trial(near_store, tmp_path, with_state=True)
    path = posixpath.join(ctx.trial_path, BEST, "model.bin")
    data = bytearray(_read(ctx, path))
    data[0] ^= 0xFF  # same size: only the checksum tells
    _write(ctx, path, bytes(data))
    from checkpoint_store import CheckpointManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = CheckpointManager(CheckpointConfig(), ctx)
        with pytest.raises(CheckpointCorruptError):
            manager.resume_candidates()[1][0].verify()  # the read that finds it: recorded
        manager.close()
    assert BEST in recorded_invalid(ctx)
    res = invoke(["prune", near_store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [d["name"] for d in out["invalid"]] == [BEST]
    assert [d["name"] for d in out["kept"]] == ["checkpoint_000002"]  # the best good one
    assert _exists(ctx, BEST)
    assert [posixpath.basename(c.path) for c, _ in ctx.committed_checkpoints()] == \
        [BEST, "checkpoint_000002"]


def test_no_writer_makes_a_second_spelling_of_an_index(near_store: Store, tmp_path) -> None:
    """Found here: `upload` to checkpoint_0000007 and `adopt` of such a name
    committed index 7 under a name every reader now calls invalid; both are
    refused before anything is written, naming the name of that index."""
    from checkpoint_store import InvalidConfigError

    ctx = _trial(near_store, tmp_path, with_state=False)
    src = write_tree(str(tmp_path / "up"), {"w.bin": b"w" * 20})
    res = invoke(["upload", src, near_store.join("exp", "t1", "checkpoint_0000007")])
    assert res.exit_code == 2, res.output
    assert "checkpoint_000007" in res.stderr
    assert not _exists(ctx, "checkpoint_0000007")
    _write(ctx, posixpath.join(ctx.trial_path, "checkpoint_0000008", "w.bin"), b"w" * 20)
    with pytest.raises(InvalidConfigError, match="checkpoint_000008"):
        ctx.adopt("checkpoint_0000008")
    assert not ctx.checkpoint("checkpoint_0000008").is_committed
    res = invoke(["upload", src, near_store.join("exp", "t1", "checkpoint_000007")])
    assert res.exit_code == 0, res.output  # the name of that index


# -- a copy under another name (kind 1, by hand) -------------------------------------------

COPIES = {"backup": BEST, "checkpoint_000000 (copy)": "checkpoint_000000"}


def _copy_by_hand(ctx: StorageContext) -> None:
    """`cp -r checkpoint_000001 backup`, and a copy of checkpoint_000000 beside it."""
    for copy, original in COPIES.items():
        for rel in (MARKER, "model.bin"):
            _write(ctx, posixpath.join(ctx.trial_path, copy, rel),
                   _read(ctx, posixpath.join(ctx.trial_path, original, rel)))


@pytest.mark.parametrize("with_state", [True, False])
def test_prune_keeps_the_best_a_copy_under_another_name_claims_the_index_of(
        store: Store, tmp_path, with_state: bool) -> None:
    """`cp -r checkpoint_000001 backup`: prune ranked both as index 1, kept the
    copy and deleted checkpoint_000001 (the best, the one retention keeps), and
    deleted the copy of checkpoint_000000 too. A directory named otherwise whose
    marker records a checkpoint_NNNNNN entry's index is that entry's copy: invalid,
    never ranked or deleted, as the retention manager leaves it."""
    ctx = _trial(store, tmp_path, with_state=with_state)
    _copy_by_hand(ctx)
    trial = store.join("exp", "t1")
    opts = store.opt_args()
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min",
                  "--no-keep-latest", "--json", *opts])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [d["name"] for d in out["kept"]] == [BEST]
    assert [d["name"] for d in out["deleted"]] == ["checkpoint_000000", "checkpoint_000002"]
    assert sorted(d["name"] for d in out["invalid"]) == sorted(COPIES)
    assert all("a copy of" in d["reason"] for d in out["invalid"])
    _best_intact(ctx)
    assert all(_exists(ctx, copy) for copy in COPIES)


def test_every_reader_names_a_copy_under_another_name(near_store: Store, tmp_path) -> None:
    """The page ranked `backup` first and called both copies kept; `ls` listed two
    checkpoints of index 1, `best` could name the copy, `show` said committed."""
    from checkpoint_store.ui._server import create_app

    ctx = _trial(near_store, tmp_path, with_state=True)
    _copy_by_hand(ctx)
    trial = near_store.join("exp", "t1")
    data = json.loads(invoke(["ls", trial, "--json"]).stdout)
    assert [r["name"] for r in data["checkpoints"]] == ["checkpoint_000000", BEST,
                                                       "checkpoint_000002"]
    assert sorted(c["name"] for c in data["corrupt"] + data["invalid"]) == sorted(COPIES)
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].endswith(BEST), res.output
    assert "backup" in res.stderr
    out = json.loads(invoke(["show", near_store.join("exp", "t1", "backup"), "--json"]).stdout)
    assert out["state"] == "invalid" and BEST in out["reason"]
    assert invoke(["verify", trial]).exit_code == 1

    model = StoreView(near_store.uri, {})
    model.experiments()
    summary = model.trial("exp", "t1", full=True)
    rows = {r["name"]: r for r in summary["checkpoints"]}
    assert summary["best_checkpoint"] == BEST
    assert all(rows[c]["kind"] == "invalid" and "a copy of" in rows[c]["reason"]
               for c in COPIES)
    assert rows[BEST]["kind"] == "best" and rows[BEST]["rank"] == 1
    client = create_app(model).test_client()
    reply = client.get("/api/checkpoint", query_string={
        "experiment": "exp", "trial": "t1", "checkpoint": "backup"},
        headers={"Host": "127.0.0.1"})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert reply.get_json()["state"] == "invalid"


@pytest.mark.parametrize("link", ["linked", "checkpoint_latest"])
def test_the_page_never_reads_through_a_link_under_another_name(tmp_path, link: str) -> None:
    """A link under another name to a committed directory outside the store: `ls`
    named it invalid, but the page ranked it (best, by its marker's index 7),
    served its manifest and metadata and verified its bytes, all read outside
    the storage root."""
    from checkpoint_store.ui._server import create_app

    store = Store(str(tmp_path / "store"))
    ctx = _trial(store, tmp_path, with_state=True)
    outside = tmp_path / "outside" / "ck"
    src = write_tree(str(tmp_path / "src-out"), {"outside-only.bin": b"o" * 64})
    Checkpoint.from_directory(src).set_metadata({"note": "outside-only"})
    StorageContext(str(tmp_path / "other"), "e", "t").persist_checkpoint(
        Checkpoint.from_directory(src), 7, {"metrics": {"loss": 0.01}})
    outside.parent.mkdir()
    os.rename(tmp_path / "other" / "e" / "t" / "checkpoint_000007", outside)
    os.symlink(outside, posixpath.join(ctx.trial_path, link))

    model = StoreView(store.uri, {})
    model.experiments()
    trial = model.trial("exp", "t1", full=True)
    rows = {r["name"]: r for r in trial["checkpoints"]}
    assert trial["best_checkpoint"] == BEST
    assert rows[link]["kind"] == "invalid" and "symbolic link" in rows[link]["reason"]
    client = create_app(model).test_client()
    host = {"Host": "127.0.0.1"}
    args = {"experiment": "exp", "trial": "t1", "checkpoint": link}
    for reply in (client.get("/api/checkpoint", query_string=args, headers=host),
                  client.post("/api/verify", json=args,
                              headers={**host, "X-Checkpoint-Store": "verify"})):
        assert reply.status_code == 400, reply.get_data(as_text=True)
        assert "outside-only" not in reply.get_data(as_text=True)
    res = invoke(["ls", store.join("exp", "t1")])
    assert link in res.stderr and "symbolic link" in res.stderr
