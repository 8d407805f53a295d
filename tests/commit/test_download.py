"""Downloads: verified, confined to the target, one at a time, never half-done."""

from __future__ import annotations

import logging
import os
import posixpath
import subprocess
import sys
import time

import pytest
from _commit_helpers import local_tree, make_source, read_tree

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import CheckpointConflictError, CheckpointCorruptError


def _committed(trial, tmp_path, seed=1, **kw):
    storage = trial.storage()
    storage.ensure_trial_dir()
    src = make_source(tmp_path / f"src{seed}", seed, **kw)
    return storage, storage.persist_checkpoint(Checkpoint.from_directory(src), 0,
                                               {"metrics": {}}), src


@pytest.mark.parametrize("bad", ["../../evil.bin", "/etc/evil.bin", "a/../../evil.bin"])
def test_manifest_escaping_the_target_is_refused(trial, tmp_path, bad):
    storage, ckpt, _ = _committed(trial, tmp_path)
    marker = posixpath.join(ckpt.path, INTERNAL_METADATA)
    meta = _json.loads(_fsutil.read_bytes(storage.filesystem, marker))
    meta["manifest"][0]["path"] = bad
    _fsutil.write_bytes(storage.filesystem, marker, _json.dumps(meta),
                        storage.backend.capabilities)
    target = tmp_path / "deep" / "out"
    with pytest.raises(CheckpointCorruptError, match="evil.bin"):
        ckpt.to_directory(target)
    assert not target.exists()
    assert not any("evil" in n for _, _, names in os.walk(tmp_path) for n in names)


def test_symlink_pointing_outside_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    src = tmp_path / "ckpt"
    make_source(src, 1)
    os.symlink(secret, src / "leak.txt")
    os.symlink(src / "part0.bin", src / "alias.bin")  # inside: fine
    with pytest.raises(CheckpointCorruptError, match="leak.txt") as err:
        Checkpoint.from_directory(src).to_directory(tmp_path / "out")
    assert err.value.file == "leak.txt"
    assert not (tmp_path / "out").exists()
    os.unlink(src / "leak.txt")
    out = Checkpoint.from_directory(src).to_directory(tmp_path / "out")
    assert (tmp_path / "out" / "alias.bin").read_bytes() == (src / "part0.bin").read_bytes()
    assert out == str(tmp_path / "out")


def test_symlink_in_the_target_is_not_followed_out(tmp_path):
    src = make_source(tmp_path / "src", 1)
    target = tmp_path / "out"
    target.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, target / "shards")
    # Not ours (no download put it there): refused whole, nothing followed or changed.
    with pytest.raises(CheckpointConflictError, match="'shards'"):
        Checkpoint.from_directory(src).to_directory(target)
    assert list(elsewhere.iterdir()) == []
    assert os.listdir(target) == ["shards"]


def test_failed_verification_leaves_no_complete_looking_target(any_trial, tmp_path):
    storage, ckpt, src = _committed(any_trial, tmp_path)
    path = posixpath.join(ckpt.path, "part2.bin")
    data = bytearray(_fsutil.read_bytes(storage.filesystem, path))
    data[0] ^= 0xFF
    with storage.filesystem.open_output_stream(path) as f:
        f.write(bytes(data))
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointCorruptError, match="part2.bin"):
        ckpt.to_directory(fresh)
    assert not fresh.exists()
    # A target an earlier download filled keeps exactly what it had.
    existing = tmp_path / "existing"
    Checkpoint.from_directory(src).to_directory(existing)
    before = local_tree(str(existing))
    with pytest.raises(CheckpointCorruptError, match="part2.bin"):
        ckpt.to_directory(existing)
    assert local_tree(str(existing)) == before
    assert not any(n.startswith(".cs_download") for n in os.listdir(tmp_path))
    # verify=False is the documented way to take the bytes anyway.
    out = ckpt.to_directory(tmp_path / "anyway", verify=False)
    assert (tmp_path / "anyway" / "part2.bin").read_bytes() == bytes(data)
    assert out


def test_repeated_download_is_skipped_only_while_complete(trial, tmp_path, caplog):
    _, ckpt, src = _committed(trial, tmp_path)
    target = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="checkpoint_store.checkpoint"):
        ckpt.to_directory(target)
        ckpt.to_directory(target)
        assert sum("downloaded" in r.message for r in caplog.records) == 1
        os.unlink(target / "shards" / "part1.bin")  # damaged by hand: downloaded again
        ckpt.to_directory(target)
        assert sum("downloaded" in r.message for r in caplog.records) == 2
    assert local_tree(str(target)) == local_tree(src)


def test_as_directory_removes_its_temporary_directory_when_the_body_raises(memory_trial,
                                                                         tmp_path):
    _, ckpt, src = _committed(memory_trial, tmp_path)
    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.as_directory() as d:
            seen.append(d)
            assert local_tree(d) == local_tree(src)
            raise RuntimeError("boom")
    assert seen and not os.path.exists(seen[0])
    with ckpt.as_directory() as d:
        seen.append(d)
    assert not os.path.exists(seen[1])


_CHILD = r"""
import json, logging, os, sys, time
root, target, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
from checkpoint_store import StorageContext
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("checkpoint_store.checkpoint").addHandler(H())
logging.getLogger("checkpoint_store.checkpoint").setLevel(logging.INFO)
ckpt = StorageContext(root, "exp", "trial").checkpoint("checkpoint_000000")
while time.time() < start_at:
    time.sleep(0.001)
out = ckpt.to_directory(target)
# On return the data must be complete: every file, every byte.
sizes = {}
for d, _, names in os.walk(out):
    for n in names:
        p = os.path.join(d, n)
        sizes[os.path.relpath(p, out)] = os.path.getsize(p)
print(json.dumps({"downloaded": sum("downloaded" in m for m in records), "sizes": sizes}))
"""


@pytest.mark.slow
def test_eight_processes_download_once_and_all_return_complete(tmp_path):
    root = str(tmp_path / "store")
    storage = StorageContext(root, "exp", "trial")
    storage.ensure_trial_dir()
    src = make_source(tmp_path / "src", 3, files=8, size=2 * 1024 * 1024)
    storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    target = str(tmp_path / "shared" / "out")
    start_at = time.time() + 2.5  # after every child has imported checkpoint_store
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, root, target, str(start_at)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(_json.loads(out.strip().splitlines()[-1]))
    assert sum(r["downloaded"] for r in results) == 1
    want = {os.path.relpath(os.path.join(d, n), src): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(src) for n in names}
    for r in results:
        assert r["sizes"] == want
    assert local_tree(target) == local_tree(src)
    assert read_tree(storage.filesystem, storage.checkpoint_path(0)) == local_tree(src)




@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_download_where_the_lock_cannot_be_created_fails_at_once(trial, tmp_path):
    from checkpoint_store.errors import InvalidConfigError

    _, ckpt, _ = _committed(trial, tmp_path)
    started = time.monotonic()
    with pytest.raises(InvalidConfigError, match="choose a directory you can write to"):
        ckpt.to_directory("/proc/checkpoint-store-no-such-target")
    assert time.monotonic() - started < 5  # filelock alone would wait forever
