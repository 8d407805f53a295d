"""The durable copy behind a local tier under trouble: a stalled store, a held
store (backpressure, per-tier retention), transient faults, a killed process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _tier_helpers import REPO, child_env, gated_storage, make_checkpoint, read_files

from checkpoint_store import Checkpoint, LocalTier, StorageContext, session
from checkpoint_store.session import Session
from checkpoint_store.testing import session_internals
from checkpoint_store.testing.relay import FAULTS, FaultRelay
from checkpoint_store.tiers import read_tier_state

MiB = 1024 * 1024


def _fast_names(tmp_path) -> list[str]:
    trial = tmp_path / "fast" / "e" / "t"
    return sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))


@pytest.mark.slow  # engine timeouts against a stalled relay: about 9 s
def test_report_returns_while_the_store_does_not_answer(s3_server, s3_bucket, tmp_path):
    """The relay stops answering: report() still returns at once (the local
    commit); the durable copy lands once the store answers again."""
    with FaultRelay(s3_server.endpoint_url, lifetime_s=300, stall_s=1.0) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url,
                "request_timeout": 1, "connect_timeout": 1}
        uri = f"s3://{s3_bucket}/runs"
        tier = LocalTier(tmp_path / "fast", persist_timeout_s=120)
        with session.start(storage_path=uri, storage_options=opts, experiment_name="e",
                           trial_name="t", local_tier=tier) as s:
            relay.stall()
            t0 = time.monotonic()
            s.report({"i": 0}, checkpoint=make_checkpoint(tmp_path, "c0", {"w.bin": b"x" * 4096}))
            blocked = time.monotonic() - t0
            assert session_internals(s).tier.status(0) == "pending"
            time.sleep(0.5)
            assert session_internals(s).tier.status(0) == "pending"  # still nothing committed there
            relay.resume()
            s.wait(timeout=120, checkpoint=0)
            assert s.durable_index == 0
    ctx = StorageContext(uri, "e", "t", storage_options=s3_server.storage_options())
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
    # Far less than one engine try against the stalled store (1 s).
    assert blocked < 1.0, blocked


def _faulted(relay: FaultRelay) -> int:
    return sum(relay.counts[k] for k in FAULTS)


def _gated_session(tmp_path, gate, tier, **kw):
    storage, handler = gated_storage(str(tmp_path / "durable"), gate)
    return Session(storage, local_tier=tier, **kw), handler


def test_local_retention_never_deletes_a_copy_whose_durable_copy_is_pending(tmp_path):
    gate = threading.Event()
    tier = LocalTier(tmp_path / "fast", num_to_keep=1)
    s, handler = _gated_session(tmp_path, gate, tier)
    try:
        for i in range(4):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))
        # The store holds the first copy: every local copy is still pending.
        assert _fast_names(tmp_path) == [f"checkpoint_00000{i}" for i in range(4)]
        assert session_internals(s).tier.pending() == [0, 1, 2, 3]
        gate.set()
        s.wait(timeout=60)
        assert _fast_names(tmp_path) == ["checkpoint_000003"]  # now only the newest
        assert s.durable_index == 3 and handler.held >= 1
    finally:
        gate.set()
        s.close()
    assert StorageContext(str(tmp_path / "durable"), "e", "t").next_checkpoint_index() == 4


def test_backpressure_at_max_bytes_waits_for_the_durable_copy(tmp_path):
    gate = threading.Event()
    size = 1 * MiB
    tier = LocalTier(tmp_path / "fast", num_to_keep=1, max_bytes=2 * size + 1000)
    s, _handler = _gated_session(tmp_path, gate, tier)
    try:
        for i in range(2):  # two fit
            s.report({}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": os.urandom(size)}))
        assert session_internals(s).tier.pending() == [0, 1]
        third = make_checkpoint(tmp_path, "c2", {"w.bin": os.urandom(size)})
        done = threading.Event()
        waited: list[float] = []

        def report() -> None:
            t0 = time.monotonic()
            s.report({}, checkpoint=third)
            waited.append(time.monotonic() - t0)
            done.set()

        t = threading.Thread(target=report)
        t.start()
        # It waits: the third would go over max_bytes, nothing may be deleted.
        assert not done.wait(1.0)
        assert _fast_names(tmp_path) == ["checkpoint_000000", "checkpoint_000001"]
        gate.set()  # the store takes the copies: the local tier frees room
        assert done.wait(60)
        t.join()
        assert waited[0] >= 1.0
        assert session_internals(s).tier.used_bytes <= 2 * size + 1000
        s.wait(timeout=60)
        assert s.durable_index == 2
        assert session_internals(s).tier.blocked_s >= 1.0
    finally:
        gate.set()
        s.close()
    # Nothing dropped: every checkpoint reached the storage path.
    ctx = StorageContext(str(tmp_path / "durable"), "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1, 2]


def test_without_max_bytes_report_never_waits_for_a_held_store(tmp_path):
    gate = threading.Event()
    s, _ = _gated_session(tmp_path, gate, LocalTier(tmp_path / "fast"))
    try:
        t0 = time.monotonic()
        for i in range(5):
            s.report({}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))
        assert time.monotonic() - t0 < 10
        assert session_internals(s).tier.pending() == [0, 1, 2, 3, 4]
    finally:
        gate.set()
        s.close()


@pytest.mark.slow
def test_every_selected_checkpoint_becomes_durable_through_20_percent_faults(
        s3_server, s3_bucket, tmp_path):
    with FaultRelay(s3_server.endpoint_url, seed=3, lifetime_s=600, stall_s=1.0) as relay:
        opts = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url,
                "request_timeout": 2, "connect_timeout": 2}
        uri = f"s3://{s3_bucket}/runs"
        tier = LocalTier(tmp_path / "fast", num_to_keep=2, persist_timeout_s=300)
        with session.start(storage_path=uri, storage_options=opts, experiment_name="e",
                           trial_name="t", local_tier=tier) as s:
            relay.fault_rate = 0.2
            t0 = time.monotonic()
            for i in range(6):
                s.report({"i": i}, checkpoint=make_checkpoint(
                    tmp_path, f"c{i}", {"a.bin": os.urandom(64 * 1024), "b.bin": b"%d" % i}))
            blocked = time.monotonic() - t0
            # The uploads meet faults for 2 s at least, and until one was
            # injected (a fixed 2 s saw few requests on a loaded machine, and
            # perhaps no fault), unless every copy is durable before.
            since, deadline = time.monotonic(), time.monotonic() + 300
            while ((time.monotonic() - since < 2 or not _faulted(relay))
                   and session_internals(s).tier.pending()):
                assert time.monotonic() < deadline, relay.counts
                time.sleep(0.05)
            relay.fault_rate = 0.0  # the faults stop
            s.wait(timeout=300)
            assert s.durable_index == 5
    assert relay.counts["requests"] > 0 and _faulted(relay)
    ctx = StorageContext(uri, "e", "t", storage_options=s3_server.storage_options())
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == list(range(6))
    for ckpt, _ in ctx.committed_checkpoints():
        ckpt.verify()
    assert blocked < 30, blocked  # six local commits; never the store's faults


_CHILD = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, sys.argv[4])
    from _tier_helpers import gated_storage
    from checkpoint_store import Checkpoint, LocalTier
    from checkpoint_store.session import Session

    store, fast, src = sys.argv[1:4]
    storage, _ = gated_storage(store, threading.Event())  # never opens
    s = Session(storage, local_tier=LocalTier(fast, num_to_keep=1))
    for i in range(3):
        s.report({"i": i}, checkpoint=Checkpoint.from_directory(f"{src}/c{i}"))
    print("reported", flush=True)
    threading.Event().wait(600)
""")


def test_a_killed_run_leaves_its_pending_copies_for_the_next_session(tmp_path):
    """SIGKILL after the local commits, before any durable commit: the next
    session persists them in report order, resumes from the newest."""
    store, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
    for i in range(3):
        make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i})
    helpers = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, store, fast, str(tmp_path / "src"),
                             helpers], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=child_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reported"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    state = read_tier_state(os.path.join(fast, "e", "t"))
    assert state is not None and {i: e.durable for i, e in state.items()} == {
        0: "pending", 1: "pending", 2: "pending"}
    ctx = StorageContext(store, "e", "t")
    assert ctx.committed_checkpoints() == []
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(fast, num_to_keep=1)) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local and read_files(got.path) == {"w.bin": b"2"}
        s.wait(timeout=60)
        assert s.durable_index == 2
        row = s.report({"i": 3}, checkpoint=Checkpoint.from_directory(
            make_checkpoint(tmp_path, "c3", {"w.bin": b"3"}).path))
        assert row["checkpoint_dir_name"] == "checkpoint_000003"
        assert row["training_iteration"] == 4  # after the rows restored from the local tier
    committed = ctx.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [0, 1, 2, 3]
    assert [m["metrics"]["i"] for _, m in committed] == [0, 1, 2, 3]
    with ctx.checkpoint("checkpoint_000001").as_directory() as d:
        assert read_files(d) == {"w.bin": b"1"}
    assert [r["i"] for r in ctx.read_results()] == [0, 1, 2, 3]
    assert _fast_names(tmp_path) == ["checkpoint_000003"]


def test_a_checkpoint_larger_than_max_bytes_is_still_committed(tmp_path, caplog):
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast", num_to_keep=2, max_bytes=1000)
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        for i in range(3):
            s.report({}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i * 900}))
            s.wait()  # each durable copy done: the older local copy may go
        # Only one fits: the older copy (durable) made room for the next.
        assert [e.index for e in session_internals(s).tier.entries()] == [2]
        s.report({}, checkpoint=make_checkpoint(tmp_path, "big", {"w.bin": b"b" * 5000}))
        assert "goes over max_bytes=1000" in caplog.text
        assert [e.index for e in session_internals(s).tier.entries()] == [3]
    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [
        0, 1, 2, 3]
