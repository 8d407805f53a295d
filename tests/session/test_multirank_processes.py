"""Ranks as real processes rendezvousing through storage alone (no torch.distributed):
the launcher sets RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID, as torchrun would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest

from checkpoint_store import StorageContext

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    from checkpoint_store import Checkpoint, session
    store, opts, crash_at = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    errors = []
    with session.start(storage_path=store, storage_options=opts or None,
                       experiment_name="e", trial_name="t", sync_timeout_s=3):
        for step in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, f"shard_{rank}.bin"), "wb") as f:
                    f.write(f"{os.environ['TORCHELASTIC_RUN_ID']}:{step}".encode())
                if step == crash_at and rank == 1:
                    os._exit(3)  # a rank dies mid-run, before its upload
                try:
                    session.report({"step": step, "rank": rank},
                                   checkpoint=Checkpoint.from_directory(tmp))
                except Exception as exc:
                    errors.append(type(exc).__name__)
    print(json.dumps(errors))
""")


def _launch(store, opts, attempt, crash_at=-1, n=3):
    env = {**os.environ, "WORLD_SIZE": str(n), "TORCHELASTIC_RUN_ID": attempt}
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT, store, json.dumps(opts), str(crash_at)],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append((p.returncode, stdout.strip().splitlines()[-1] if stdout.strip() else "",
                    stderr[-2000:]))
    return out


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store"), {}
    loc = request.getfixturevalue("s3_location")
    return loc.uri, loc.storage_options


@pytest.mark.slow
def test_processes_crash_then_restart_never_mix_attempts(location):
    store, opts = location
    # Attempt 1: rank 1 dies before its first upload; ranks 0 and 2 time out on it.
    first = _launch(store, opts, "job-1", crash_at=0)
    assert first[1][0] == 3
    for code, stdout, stderr in (first[0], first[2]):
        assert code == 0, stderr
        assert json.loads(stdout)[0] == "RankTimeoutError"
    ctx = StorageContext(store, "e", "t", storage_options=opts or None)
    assert ctx.committed_checkpoints() == []
    # Attempt 2 (a restart): both reports commit, past anything attempt 1 left.
    second = _launch(store, opts, "job-2")
    assert [(c, s) for c, s, _ in second] == [(0, "[]")] * 3, second
    committed = ctx.committed_checkpoints()
    assert len(committed) == 2
    for ck, meta in committed:
        assert sorted(e["path"] for e in meta["manifest"]) == [f"shard_{r}.bin" for r in range(3)]
        with ck.as_directory() as d:
            for r in range(3):
                data = open(os.path.join(d, f"shard_{r}.bin")).read()
                assert data.startswith("job-2:")  # nothing from the crashed attempt
        assert meta["metrics"]["rank"] == 0
    # Attempt 1's partial upload was cleaned up before attempt 2 wrote (or skipped).
    files = ctx.filesystem.get_file_info(pafs.FileSelector(ctx.trial_path, recursive=True))
    assert not [f.path for f in files if "job-1" in f.path]
