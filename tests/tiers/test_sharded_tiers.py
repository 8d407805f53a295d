"""``report(state=...)`` on several ranks, each with its own local tier
(docs/sharded-state.md, docs/tiers.md): each rank commits its part on its
tier, the durable copies meet through storage, rank 0 commits one state
whose format is the tier-less one, so it loads on any number of ranks.

Ranks run as threads here (storage rendezvous, no process group); the kills
run ranks as processes (``_sharded_tier_worker.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _sharded_tier_worker import full_state, rank_state
from _tier_helpers import child_env, tiered_rank

from checkpoint_store import Checkpoint, LocalTier, StorageContext, session
from checkpoint_store.errors import CheckpointAbortedError
from checkpoint_store.session import Session
from checkpoint_store.state import STATE_FILE, StateSlice
from checkpoint_store.testing import session_internals
from checkpoint_store.tiers import read_tier_state
from tests.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "_sharded_tier_worker.py")


def _start(store: Any, tier_root: Path | None, rank: int, n: int, attempt: str,
           **kw: Any) -> Session:
    if tier_root is not None:
        kw["local_tier"] = LocalTier(tier_root / f"node{rank}")
    return session.start(storage_path=str(store) if isinstance(store, Path) else store,
                         experiment_name="e", trial_name="t", world_rank=rank, world_size=n,
                         attempt_id=attempt, sync_timeout_s=30, **kw)


def _committed(store: Path) -> list[tuple[Checkpoint, dict[str, Any]]]:
    return StorageContext(str(store), "e", "t").committed_checkpoints()


def _rows(n: int, size: int) -> list[tuple[int, int]]:
    """Rank r of n's rows of a tensor of ``size`` rows (any split will do)."""
    cuts = [size * r // n for r in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _check_loads_on(ckpt: Checkpoint, step: int, n: int) -> None:
    """``ckpt`` read as ``n`` ranks would (each its rows of ``w``, its columns
    of ``emb``) and whole: bit-exact."""
    full = full_state(step)["model"]
    for lo, hi in _rows(n, 1037):
        w = np.empty((hi - lo, 300), dtype=np.float32)
        ckpt.load_state(into={"model": {"w": StateSlice(w, (lo, 0))}})
        assert w.tobytes() == full["w"][lo:hi].tobytes()
    for lo, hi in _rows(n, 160):
        emb = np.empty((2048, hi - lo), dtype=np.float32)
        ckpt.load_state(into={"model": {"emb": StateSlice(emb, (0, lo))}})
        assert emb.tobytes() == np.ascontiguousarray(full["emb"][:, lo:hi]).tobytes()
    whole = ckpt.load_state()
    for key in ("w", "emb", "bias"):
        assert whole["model"][key].tobytes() == full[key].tobytes(), key
    assert whole["step"] == step


def test_each_rank_commits_its_part_locally_and_rank_0_one_state_durably(tmp_path):
    """Two ranks, a local tier each: the local copies hold each rank's own
    pieces (no state.json), the durable ones the whole state, byte for byte
    what the same reports commit without a tier; ``upload_mode="sync"``
    returns with its durable copy committed; get_checkpoint() never hands
    out a rank's part."""
    store, plain = tmp_path / "durable", tmp_path / "plain"

    def rank(r: int, tiers: Path | None, where: Path) -> Any:
        with _start(where, tiers, r, 2, "a1") as s:
            s.report({"i": 0}, state=rank_state(0, r))
            row = s.report({"i": 1}, state=rank_state(1, r), upload_mode="sync")
            durable_after_sync = s.durable_index if tiers is not None else None
            s.report({"i": 2}, state=rank_state(2, r))
            s.wait()
            got = s.get_checkpoint()
            return row["checkpoint_dir_name"], durable_after_sync, got.path, got.is_local

    tiered = run_ranks(2, lambda r: rank(r, tmp_path / "fast", store))
    run_ranks(2, lambda r: rank(r, None, plain))
    newest = str(store / "e" / "t" / "checkpoint_000002")
    assert tiered == [("checkpoint_000001", 1, newest, True)] * 2  # the storage_path's copy
    for r in range(2):
        part = tmp_path / "fast" / f"node{r}" / "e" / "t" / f"rank_{r}"
        # The newest two (LocalTier's num_to_keep), their durable copies committed.
        assert {i: e.durable for i, e in read_tier_state(str(part)).items()} == {
            1: "durable", 2: "durable"}
        local = Checkpoint.from_directory(str(part / "checkpoint_000002"))
        local.verify()
        assert sorted(e["path"] for e in local.internal_metadata["manifest"]) == [
            f"tensors-rank{r:05d}-00001-of-00001.safetensors"]
        assert set(local.internal_metadata["state_part"]) == {"tree", "tensors", "sharding"}
    committed, without = _committed(store), _committed(plain)
    assert [m["index"] for _, m in committed] == [0, 1, 2]
    for (ck, meta), (ck_plain, meta_plain) in zip(committed, without, strict=True):
        assert sorted(e["path"] for e in meta["manifest"]) == [STATE_FILE] + [
            f"tensors-rank{r:05d}-00001-of-00001.safetensors" for r in range(2)]
        assert meta["world_size"] == 2 and meta["format_version"] == 2
        assert meta["tensors"] == meta_plain["tensors"]
        with ck.as_directory() as d, ck_plain.as_directory() as d_plain:
            for name in os.listdir(d_plain):
                if not name.startswith("."):
                    assert Path(d, name).read_bytes() == Path(d_plain, name).read_bytes(), name
        ck.verify()
        _check_loads_on(ck, meta["index"], 1)
        whole = ck.load_state()
        assert [int(whole["rng"][k][0]) for k in ("0", "1")] == [meta["index"], 10 + meta["index"]]


def test_four_ranks_save_two_and_three_ranks_load(tmp_path):
    """Four ranks with local tiers save; the durable checkpoint loads bit-exact
    as 2 and 3 ranks read it, and whole. A restart on 2 ranks, on the same
    tier paths, resumes from the storage_path: the 4-rank parts on its tiers
    are not its own."""
    store, tiers = tmp_path / "durable", tmp_path / "fast"

    def save(r: int) -> None:
        with _start(store, tiers, r, 4, "a1") as s:
            s.report({"i": 0}, state=rank_state(0, r))
            s.report({"i": 1}, state=rank_state(1, r))

    assert run_ranks(4, save) == [None] * 4
    [*_, (ck, meta)] = _committed(store)
    assert meta["index"] == 1 and len(meta["tensors"]["model/w"]["shards"]) == 4
    for n in (2, 3):
        _check_loads_on(ck, 1, n)

    def resume(r: int) -> str:
        with _start(store, tiers, r, 2, "a2") as s:
            got = s.get_checkpoint()
            lo, hi = _rows(2, 1037)[r]
            w = np.empty((hi - lo, 300), dtype=np.float32)
            got.load_state(into={"model": {"w": StateSlice(w, (lo, 0))}})
            assert w.tobytes() == full_state(1)["model"]["w"][lo:hi].tobytes()
            return got.path

    assert run_ranks(2, resume) == [str(store / "e" / "t" / "checkpoint_000001")] * 2


def test_two_ranks_save_three_ranks_load(tmp_path):
    store = tmp_path / "durable"

    def save(r: int) -> None:
        with _start(store, tmp_path / "fast", r, 2, "a1") as s:
            s.report({"i": 0}, state=rank_state(0, r), upload_mode="sync")

    assert run_ranks(2, save) == [None] * 2
    [(ck, meta)] = _committed(store)
    assert len(meta["tensors"]["model/emb"]["shards"]) == 2
    _check_loads_on(ck, 0, 3)


def test_a_failed_durable_part_aborts_the_index_and_the_restart_persists_it(tmp_path):
    """Rank 1's upload of its part of checkpoint 1 is refused: rank 0 commits
    nothing under that index (no checkpoint with a rank's part missing);
    both parts stay pending on the local tiers. A restart on as many ranks
    persists them (the parts' index from the local copies' metadata) and
    get_checkpoint() waits for that copy: the newest complete checkpoint."""
    store, tiers = tmp_path / "durable", tmp_path / "fast"

    def first(r: int) -> Any:
        # Rank 1's files of checkpoint 1 (attempt a1's staging) cannot be written.
        s = tiered_rank(store, r, 2, tiers / f"node{r}",
                        refused="checkpoint_000001-a1/tensors-rank00001" if r == 1 else None)
        try:
            s.report({"i": 0}, state=rank_state(0, r), upload_mode="sync")
            s.report({"i": 1}, state=rank_state(1, r))
            try:
                s.wait()
            except Exception as exc:
                return type(exc).__name__, session_internals(s).tier.pending()
            return None, session_internals(s).tier.pending()
        finally:
            try:
                s.close()
            except Exception:  # the refused copy's error, raised at the end
                pass

    got = run_ranks(2, first)
    assert [g[1] for g in got] == [[1], [1]]
    assert got[0][0] == CheckpointAbortedError.__name__
    assert [m["index"] for _, m in _committed(store)] == [0]
    assert not (store / "e" / "t" / "checkpoint_000001").exists()

    def second(r: int) -> Any:
        with _start(store, tiers, r, 2, "a2") as s:
            got = s.get_checkpoint()
            return got.path, got.load_state(keys="step")["step"], s.durable_index

    newest = str(store / "e" / "t" / "checkpoint_000001")
    assert run_ranks(2, second) == [(newest, 1, 1)] * 2
    [_, (ck, meta)] = _committed(store)
    assert meta["world_size"] == 2
    _check_loads_on(ck, 1, 2)


def test_a_state_on_ranks_with_tiers_keeps_the_local_only_copies_local(tmp_path):
    """``persist`` selects every other index: the others stay on the local
    tiers only (never on the storage_path), and a restart resumes from the
    newest durable copy, never from a local part."""
    store, tiers = tmp_path / "durable", tmp_path / "fast"

    def run(r: int) -> Any:
        tier = LocalTier(tiers / f"node{r}", num_to_keep=3,
                         persist=lambda index, metrics: index % 2 == 0)
        with session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="a1", sync_timeout_s=30,
                           local_tier=tier) as s:
            for i in range(4):
                s.report({"i": i}, state=rank_state(i, r))
            s.wait()
        with _start(store, None, r, 2, "a2") as s:
            return s.get_checkpoint().path

    assert run_ranks(2, run) == [str(store / "e" / "t" / "checkpoint_000002")] * 2
    assert [m["index"] for _, m in _committed(store)] == [0, 2]
    part = tiers / "node1" / "e" / "t" / "rank_1"
    assert {i: e.durable for i, e in read_tier_state(str(part)).items()} == {
        1: "local_only", 2: "durable", 3: "local_only"}


@pytest.mark.parametrize("kind", ["state", "directory"])
def test_max_bytes_bounds_each_ranks_tier(tmp_path, kind):
    """``LocalTier(max_bytes=)`` holds on every rank as it does on one: the
    tier keeps 3 (num_to_keep) but only 2.5 checkpoints' bytes fit, so
    before each report stages, each rank evicts its oldest part whose
    durable copy is committed. Every index still reaches the storage_path."""
    store = tmp_path / "durable"

    def save(r: int, i: int, s: Session) -> None:
        if kind == "state":
            s.report({"i": i}, state=rank_state(i, r))
        else:
            d = tmp_path / "src" / f"r{r}-{i}-{os.urandom(4).hex()}"
            d.mkdir(parents=True)
            (d / f"part-{r}.bin").write_bytes(os.urandom(300_000))
            s.report({"i": i}, checkpoint=Checkpoint.from_directory(str(d)))

    def part_bytes(r: int) -> int:  # one checkpoint's part on this rank's tier
        with _start(tmp_path / "probe", tmp_path / "probe-fast", r, 2, "a0") as s:
            save(r, 0, s)
            s.wait()
            return session_internals(s).tier.used_bytes

    limit = int(2.5 * max(run_ranks(2, part_bytes)))

    def run(r: int) -> list[tuple[int, list[int]]]:
        seen = []
        tier = LocalTier(tmp_path / "fast" / f"node{r}", num_to_keep=3, max_bytes=limit)
        with _start(store, None, r, 2, "a1", local_tier=tier) as s:
            for i in range(5):
                save(r, i, s)
                s.wait()
                t = session_internals(s).tier
                seen.append((t.used_bytes, [e.index for e in t.entries()]))
        return seen

    for r, seen in enumerate(run_ranks(2, run)):
        assert all(used <= limit for used, _ in seen), (r, limit, seen)
        assert [kept for _, kept in seen][-1] == [3, 4], (r, seen)
    assert [m["index"] for _, m in _committed(store)] == [0, 1, 2, 3, 4]


# -- ranks as processes: kills and a preemption signal --------------------------------


def _spawn(tmp_path: Path, rank: int, phase: str, attempt: str, **plan: Any
           ) -> subprocess.Popen:
    args = [sys.executable, WORKER, str(tmp_path / "durable"), str(tmp_path / "fast"),
            str(tmp_path / "out"), str(rank), phase, attempt, json.dumps(plan)]
    return subprocess.Popen(args, env=child_env(OMP_NUM_THREADS="1"), cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank exited ({p.returncode}) before {path.name}: "
                                     + p.stderr.read()[-3000:])
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen]) -> list[int]:
    codes = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        codes.append(p.returncode)
        if p.returncode not in (0, 42, -signal.SIGKILL):
            raise AssertionError(err[-3000:])
    return codes


def _result(tmp_path: Path, name: str) -> Any:
    return json.loads((tmp_path / "out" / name).read_text())


@pytest.mark.slow  # two launches of two rank processes: about 10 s each
@pytest.mark.parametrize("hold", ["durable", "local"])
def test_a_rank_killed_before_its_durable_copy_leaves_no_partial_checkpoint(tmp_path, hold):
    """Rank 1 is killed while checkpoint 2 is being saved: before its part's
    durable copy (``durable``: its local commit done), or before its local
    commit (``local``); the launcher then kills rank 0, which waits for rank
    1's part. Nothing is committed under index 2 on the storage_path. The
    restart on both ranks resumes from the newest complete checkpoint: 2
    itself when every rank's part was committed locally (persisted at the
    restart), else 1."""
    (tmp_path / "out").mkdir()
    procs = [_spawn(tmp_path, r, "save", "a1", hold=hold if r == 1 else None, steps=3)
             for r in range(2)]
    _wait_for(tmp_path / "out" / "held-1", procs)
    procs[1].kill()  # before its part of checkpoint 2 reaches the storage_path
    # Rank 0 reported 2 and its durable copy waits for rank 1's part: its
    # marker is in the shared staging directory, no commit can follow.
    _wait_for(tmp_path / "out" / "reported-0", procs[:1])
    staging = tmp_path / "durable" / "e" / "t" / ".cs_staging-checkpoint_000002-a1"
    _wait_for(staging / ".cs_rank-000000.json", procs[:1])
    time.sleep(0.3)
    procs[0].kill()
    assert _finish(procs) == [-signal.SIGKILL] * 2
    assert [m["index"] for _, m in _committed(tmp_path / "durable")] == [0, 1]
    assert not (tmp_path / "durable" / "e" / "t" / "checkpoint_000002").exists()

    again = [_spawn(tmp_path, r, "resume", "a2") for r in range(2)]
    assert _finish(again) == [0, 0]
    expect = 2 if hold == "durable" else 1
    for r in range(2):
        got = _result(tmp_path, f"resume-{r}.json")
        assert got["resumed"] == expect and got["ok"], got
    committed = _committed(tmp_path / "durable")
    assert [m["index"] for _, m in committed] == [0, 1, 2][:expect + 1]
    _check_loads_on(committed[-1][0], expect, 1)
    assert not [n for n in os.listdir(tmp_path / "durable" / "e" / "t")
                if n.startswith(".cs_staging")]


def test_a_preemption_signal_commits_the_state_durably_on_every_rank(tmp_path):
    """A SIGTERM to every rank before the same report (as torchrun, SLURM and
    Kubernetes send it; storage rendezvous), the tiers' ``persist`` selecting
    nothing: that state report is the preemption checkpoint, committed on
    the storage_path with every rank's part before the processes exit with
    the configured code; the local-only copies before it never reach it."""
    (tmp_path / "out").mkdir()
    procs = [_spawn(tmp_path, r, "save", "a1", signal=2, steps=6, never_persist=True)
             for r in range(2)]
    assert _finish(procs) == [42, 42]
    [(ck, meta)] = _committed(tmp_path / "durable")
    assert meta["index"] == 2 and meta["preemption"]["signal"] == "SIGTERM"
    _check_loads_on(ck, 2, 1)
    assert StorageContext(str(tmp_path / "durable"), "e", "t").read_stop()["status"] == (
        "preempted")
