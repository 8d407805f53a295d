"""Issue 38, kind 3: a retention state that cannot be used is never passed over
in silence. A root of another kind, a log record of another kind, an entry
whose directory name disagrees with its index, a truncated root: resume
replaces it with a warning naming it (also with no checkpoint to rebuild
from), ``verify`` exits 1 naming it, ``ls``, ``best``, ``show`` and ``prune``
name it on stderr, and the web page's data says so instead of ranking by it.

On local disk and memory:// (no link is involved here).
"""

from __future__ import annotations

import json
import posixpath
import warnings

import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store._format.layout import MANAGER_STATE, parse_state_log_name, state_log_name
from checkpoint_store.ui._model import StoreView

LOSSES = [0.5, 0.1, 0.3]
CONFIG = CheckpointConfig(checkpoint_score_attribute="loss", checkpoint_score_order="min")
DAMAGES = ["root_kind", "root_is_a_record", "record_kind", "entry_disagrees", "truncated"]


def _trial(store: Store, tmp_path, losses=LOSSES) -> StorageContext:
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=CONFIG, storage_options=dict(store.options) or None):
        for i, loss in enumerate(losses):
            src = write_tree(str(tmp_path / f"src-{i}"), {"model.bin": bytes([i]) * 200})
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(src))
    return store.ctx()


def _read(ctx: StorageContext, name: str) -> bytes:
    with ctx.filesystem.open_input_stream(posixpath.join(ctx.trial_path, name)) as f:
        return bytes(f.read())


def _write(ctx: StorageContext, name: str, data: bytes) -> None:
    with ctx.filesystem.open_output_stream(posixpath.join(ctx.trial_path, name)) as f:
        f.write(data)


def _records(ctx: StorageContext) -> list[str]:
    import pyarrow.fs as pafs

    names = [posixpath.basename(fi.path) for fi in
             ctx.filesystem.get_file_info(pafs.FileSelector(ctx.trial_path))]
    return sorted(n for n in names if parse_state_log_name(n) is not None)


def _last_record(ctx: StorageContext) -> str:
    """The newest log record; a finished session folds its records into the
    snapshot, so one (changing nothing) is written after it when none is left."""
    records = _records(ctx)
    if records:
        return records[-1]
    root = json.loads(_read(ctx, MANAGER_STATE))
    seq = root["seq"] + 1
    name = state_log_name(seq)
    _write(ctx, name, json.dumps({"kind": "checkpoint_manager_log", "format_version": 2,
                                  "seq": seq, "next_index": root["next_index"]}).encode())
    return name


def _damage(ctx: StorageContext, how: str) -> str:
    """Damage the state; returns the file a message must name."""
    if how == "entry_disagrees":
        root = json.loads(_read(ctx, MANAGER_STATE))
        for entry in root["checkpoints"]:
            if entry["dir_name"] == "checkpoint_000002":
                entry["index"] = 1  # an entry naming checkpoint_000002 as index 1
                _write(ctx, MANAGER_STATE, json.dumps(root).encode())
                return MANAGER_STATE
        how = "record_entry"  # registered by a log record after the snapshot
    if how == "root_kind":
        root = json.loads(_read(ctx, MANAGER_STATE))
        root["kind"] = "checkpoint_manager_lease"
        _write(ctx, MANAGER_STATE, json.dumps(root).encode())
    elif how == "root_is_a_record":
        records = _records(ctx)
        body = _read(ctx, records[-1]) if records else \
            b'{"kind": "checkpoint_manager_log", "format_version": 2, "seq": 1}'
        _write(ctx, MANAGER_STATE, body)
    elif how == "record_kind":
        name = _last_record(ctx)
        record = json.loads(_read(ctx, name))
        record["kind"] = "checkpoint_manager_chunk"
        _write(ctx, name, json.dumps(record).encode())
        return name
    elif how == "record_entry":
        name = _records(ctx)[-1]
        record = json.loads(_read(ctx, name))
        record["register"]["index"] = 1  # registers checkpoint_000002 as index 1
        _write(ctx, name, json.dumps(record).encode())
        return name
    elif how == "truncated":
        raw = _read(ctx, MANAGER_STATE)
        _write(ctx, MANAGER_STATE, raw[: len(raw) // 2])
    return MANAGER_STATE


@pytest.fixture(params=DAMAGES)
def damage(request) -> str:
    return str(request.param)


def test_resume_names_a_state_it_replaces(near_store: Store, tmp_path, damage: str) -> None:
    ctx = _trial(near_store, tmp_path)
    _damage(ctx, damage)
    src = write_tree(str(tmp_path / "next"), {"model.bin": b"next" * 10})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with session.start(storage_path=near_store.uri, experiment_name="exp",
                           trial_name="t1", checkpoint_config=CONFIG,
                           storage_options=dict(near_store.options) or None):
            resumed = session.get_checkpoint()
            session.report({"loss": 0.9}, checkpoint=Checkpoint.from_directory(src))
    said = [str(w.message) for w in seen if MANAGER_STATE in str(w.message)]
    assert said and "rebuilt" in said[0] and ("corrupt" in said[0] or "unreadable" in said[0])
    assert resumed is not None and posixpath.basename(resumed.path) == "checkpoint_000002"
    names = [posixpath.basename(c.path) for c, _ in ctx.committed_checkpoints()]
    assert names == [f"checkpoint_{i:06d}" for i in range(4)]


@pytest.mark.parametrize("how", ["root_kind", "root_is_a_record", "truncated"])
def test_resume_names_a_state_it_replaces_with_nothing_to_rebuild_from(near_store: Store,
                                                                      tmp_path,
                                                                      how: str) -> None:
    """It was replaced without a word when no checkpoint was committed."""
    ctx = near_store.ctx()
    ctx.ensure_trial_dir()
    root = {"kind": "checkpoint_manager_state", "format_version": 2, "run_id": "r1",
            "config": CONFIG.to_json(), "latest_index": None, "next_index": 0,
            "checkpoints": [], "pending_deletes": [], "seq": 0}
    _write(ctx, MANAGER_STATE, json.dumps(root).encode())
    _damage(ctx, how)
    with pytest.warns(RuntimeWarning, match=r"\.checkpoint_manager\.json is (corrupt|unread)"):
        with session.start(storage_path=near_store.uri, experiment_name="exp",
                           trial_name="t1", checkpoint_config=CONFIG,
                           storage_options=dict(near_store.options) or None):
            assert session.get_checkpoint() is None


def test_every_command_names_a_state_it_cannot_use(near_store: Store, tmp_path,
                                                   damage: str) -> None:
    ctx = _trial(near_store, tmp_path)
    named = _damage(ctx, damage)
    trial = near_store.join("exp", "t1")

    res = invoke(["verify", trial])
    assert res.exit_code == 1, res.output
    assert MANAGER_STATE in res.stdout and "CORRUPT" in res.stdout
    out = json.loads(invoke(["verify", trial, "--json"]).stdout)
    assert out["corrupt"] == 0 and len(out["retention_states"]) == 1

    for args in (["ls", trial], ["ls", trial, "--long"], ["ls", trial, "--metric", "loss"],
                 ["best", trial, "--metric", "loss", "--mode", "min"],
                 ["show", near_store.join("exp", "t1", "checkpoint_000001")],
                 ["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min",
                  "--dry-run"]):
        res = invoke(args)
        assert res.exit_code == 0, (args, res.output)
        assert MANAGER_STATE in res.stderr, (args, res.stderr)
        assert "warning" in res.stderr
    # Not ranked by what an unusable state says; told so.
    model = StoreView(near_store.uri, {})
    model.experiments()
    summary = model.summary("exp", "t1")
    assert summary["state_problem"] is not None
    assert named == MANAGER_STATE or named in summary["state_problem"]
    assert summary["metric"] is None


def test_a_sound_state_is_not_named(near_store: Store, tmp_path) -> None:
    """The counterpart: nothing said, verify exits 0."""
    _trial(near_store, tmp_path)
    trial = near_store.join("exp", "t1")
    res = invoke(["verify", trial])
    assert res.exit_code == 0, res.output
    for args in (["ls", trial], ["ls", trial, "--long"],
                 ["best", trial, "--metric", "loss", "--mode", "min"]):
        res = invoke(args)
        assert res.exit_code == 0 and MANAGER_STATE not in res.stderr, (args, res.output)
    model = StoreView(near_store.uri, {})
    model.experiments()
    assert model.summary("exp", "t1")["state_problem"] is None


@pytest.mark.parametrize("how", ["record_newer", "record_kind"])
def test_the_warning_reads_as_one_sentence(near_store: Store, tmp_path, how: str) -> None:
    """The problem was spliced into "the retention state URI is PROBLEM": a log
    record of a newer format read "... .checkpoint_manager.json is
    file:///.../.cs_state-... has format version 99 ..."."""
    ctx = _trial(near_store, tmp_path)
    if how == "record_newer":
        name = _last_record(ctx)
        record = json.loads(_read(ctx, name))
        record["format_version"] = 99
        _write(ctx, name, json.dumps(record).encode())
    else:
        _damage(ctx, how)
    res = invoke(["ls", near_store.join("exp", "t1")])
    assert res.exit_code == 0, res.output
    said = [line for line in res.stderr.splitlines() if MANAGER_STATE in line]
    assert said and f"{MANAGER_STATE} cannot be used: " in said[0], res.stderr
    assert f"{MANAGER_STATE} is " not in said[0], said[0]
    # verify names it in the same words
    res = invoke(["verify", near_store.join("exp", "t1"), "--json"])
    assert res.exit_code == 1, res.output
    (state,) = json.loads(res.stdout)["retention_states"]
    assert f"{MANAGER_STATE} cannot be used: " in state["error"], state
    assert f"{MANAGER_STATE} is " not in state["error"], state
