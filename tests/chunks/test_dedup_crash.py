"""A trial saving with dedup, killed at every mutating storage call (its chunk
uploads and intents, its commits, retention's evictions and the gc after
each): no committed checkpoint of it, or of a second trial sharing its
chunks, ever misses a chunk; once the dead writer's intent expires a gc
leaves exactly the chunks the committed checkpoints reference; and the
trial resumes and saves again."""

from __future__ import annotations

import posixpath
import time
import warnings

import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager, StorageContext
from checkpoint_store._chunks.gc import INTENT_TTL_S, collect
from checkpoint_store._chunks.refs import experiment_refs
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store._format.layout import LEASE_FILE
from checkpoint_store.state import write_state
from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend
from tests.chunks.test_dedup_save import _chunk_objects

KiB = 1024


def _tree(i: int, frozen: torch.Tensor) -> dict:
    return {"frozen": frozen, "adapter": torch.full((8 * KiB,), float(i)), "step": i}


def _sources(tmp_path, frozen: torch.Tensor, n: int) -> list[Checkpoint]:
    out = []
    for i in range(n):
        d = tmp_path / "src" / str(i)
        write_state(_tree(i, frozen), d)
        out.append(Checkpoint.from_directory(d))
    return out


def _verify_all(ctx: StorageContext) -> list[str]:
    bad = []
    for _, name in ctx.checkpoint_dirs():
        try:
            ctx.checkpoint(name).verify()
        except Exception as exc:  # noqa: BLE001 - reported with the point
            bad.append(f"{ctx.trial_name}/{name}: {exc}")
    return bad


@pytest.mark.slow
def test_a_dedup_trial_killed_at_every_storage_call_never_loses_a_kept_chunk(tmp_path) -> None:
    frozen = torch.randn(512 * KiB)  # 2 MiB: a shard of its own chunks
    sources = _sources(tmp_path, frozen, 5)
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="step")
    problems: list[str] = []
    for point in range(10_000):
        root = str(tmp_path / f"p{point}")
        # Another trial of the experiment holds the frozen tensor's chunks too.
        other = StorageContext(root, "exp", "other", fsync=False, dedup=True)
        other.persist_checkpoint(sources[0], 0, {"metrics": {"step": 0}})
        real = StorageContext(root, "exp", "t", fsync=False, dedup=True)
        dying = StorageContext.from_backend(
            faulty_backend(real.backend, crash_after_writes=point), real.storage_path,
            "exp", "t", fsync=False, dedup=True)
        crashed = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager = None
            try:
                manager = CheckpointManager(config, dying)
                for i, src in enumerate(sources):
                    ck = dying.persist_checkpoint(src, i, {"metrics": {"step": i},
                                                           "run_id": manager.run_id})
                    manager.register(ck, {"step": i})
                manager.close()
            except SimulatedCrash:
                crashed = True
                if manager is not None and manager._lease is not None:
                    manager._lease.stop_renewing()  # a dead process releases nothing
                    manager._lease._released = True
        # At the crash: every committed checkpoint of both trials is whole.
        problems += [f"point {point}, at the crash: {p}" for p in
                     _verify_all(real) + _verify_all(other)]
        # Once the dead writer's intent expires, a gc frees exactly the garbage.
        store = ChunkStore(real.filesystem, posixpath.join(real.experiment_path, ".cs_chunks"))
        collect(store, lambda r=real: experiment_refs(r.filesystem, r.experiment_path),
                now=lambda: time.time() + INTENT_TTL_S + 60)
        refs = experiment_refs(real.filesystem, real.experiment_path)
        objects = set(_chunk_objects(real))
        if objects != refs:
            problems.append(f"point {point}: after gc, {len(objects - refs)} leaked, "
                            f"{len(refs - objects)} missing")
        problems += [f"point {point}, after gc: {p}" for p in
                     _verify_all(real) + _verify_all(other)]
        # The trial resumes and saves again (the dead process's lease removed,
        # as its expiry would).
        lease = posixpath.join(real.trial_path, LEASE_FILE)
        if real.filesystem.get_file_info(lease).type == pafs.FileType.File:
            real.filesystem.delete_file(lease)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager = CheckpointManager(config, real)
            nxt = max([i for i, _ in real.checkpoint_dirs()], default=-1) + 1
            ck = real.persist_checkpoint(sources[4], nxt, {"metrics": {"step": 9},
                                                           "run_id": manager.run_id})
            manager.register(ck, {"step": 9})
            manager.close()
        assert torch.equal(ck.load_state()["frozen"], frozen)
        if not crashed:
            break
    assert point > 10, "the sweep crossed every storage call of five saves"
    assert not problems, "\n".join(problems[:20])
