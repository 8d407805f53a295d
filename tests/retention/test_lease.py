"""One live manager per trial: the lease, its release, expiry and take-over."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _retention_helpers import committed_names, save

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointManager,
    CheckpointStoreError,
    StorageContext,
    session,
)
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.retention import LEASE_FILE
from checkpoint_store.retention.statelog import load_state

FAST = pytest.mark.parametrize("backend_name", ["local", "memory"])


def _lease(storage: StorageContext) -> dict | None:
    path = posixpath.join(storage.trial_path, LEASE_FILE)
    if not _fsutil.exists(storage.filesystem, path):
        return None
    return json.loads(_fsutil.read_bytes(storage.filesystem, path))


def _write_lease(storage: StorageContext, body: dict) -> None:
    storage.ensure_trial_dir()
    path = posixpath.join(storage.trial_path, LEASE_FILE)
    with storage.filesystem.open_output_stream(path) as f:
        f.write(json.dumps(body).encode())


def test_second_live_manager_is_refused_with_a_clear_message(make_storage):
    m = CheckpointManager(CheckpointConfig(2), make_storage())
    with pytest.raises(CheckpointConflictError) as info:
        CheckpointManager(CheckpointConfig(2), make_storage())
    msg = str(info.value)
    assert "another live checkpoint manager" in msg
    assert f"pid {os.getpid()}" in msg
    assert "read_only=True" in msg
    m.close()
    # Released: the next one gets it.
    with CheckpointManager(CheckpointConfig(2), make_storage()) as m2:
        assert not m2.read_only
        assert _lease(make_storage())["holder"]
    assert _lease(make_storage()) is None


@FAST
def test_read_only_manager_beside_a_live_one(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "score", "max"), storage)
    for v in [0.9, 0.1]:
        save(m, storage, source_dir, {"score": v})
    ro = CheckpointManager(CheckpointConfig(1, "score", "max"), make_storage(), read_only=True)
    assert ro.read_only
    assert ro.kept_dir_names == m.kept_dir_names
    ckpt = storage.persist_checkpoint(Checkpoint(source_dir), 5, {"run_id": m.run_id})
    with pytest.raises(CheckpointStoreError, match="read-only"):
        ro.register(ckpt, {"score": 1.0})
    assert _lease(storage)["holder"]  # the live manager's lease is untouched
    m.close()


@FAST
def test_session_ends_by_keyboard_interrupt_releases_the_lease(make_storage, source_dir):
    storage = make_storage()
    root = storage.storage_path if storage.backend.scheme == "file" else storage.uri(
        storage.storage_path)
    kw = dict(storage_path=root, experiment_name="exp", trial_name="t",
              checkpoint_config=CheckpointConfig(1))
    with pytest.raises(KeyboardInterrupt):
        with session.start(**kw):
            session.report({"x": 1}, checkpoint=Checkpoint.from_directory(source_dir))
            assert _lease(storage) is not None
            # A second session on the same trial (another thread) is refused.
            errors: list[BaseException] = []

            def other() -> None:
                try:
                    session.start(_thread_only=True, **kw).end()
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=other)
            t.start()
            t.join()
            assert len(errors) == 1 and isinstance(errors[0], CheckpointConflictError)
            raise KeyboardInterrupt
    assert _lease(storage) is None
    with session.start(**kw) as s:
        assert s.manager.kept_dir_names == ["checkpoint_000000"]
        # The run id is recorded in the state and in each checkpoint.
        row = session.report({"x": 2}, checkpoint=Checkpoint.from_directory(source_dir))
        assert row["checkpoint_dir_name"] == "checkpoint_000001"
        meta = s.manager.latest_checkpoint.internal_metadata
        assert meta["run_id"] == s.manager.run_id
    assert _lease(storage) is None


def test_crashed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    root = str(tmp_path / "runs")
    code = textwrap.dedent(f"""
        import os
        from checkpoint_store import CheckpointConfig, CheckpointManager, StorageContext
        m = CheckpointManager(CheckpointConfig(1), StorageContext({root!r}, "exp", "t"))
        os._exit(0)  # dies without releasing anything
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    storage = StorageContext(root, "exp", "t")
    stale = _lease(storage)
    assert stale is not None and stale["pid"] != os.getpid()
    assert stale["expires_at"] > time.time()  # not expired, but its process is gone
    with CheckpointManager(CheckpointConfig(1), storage) as m:
        assert _lease(storage)["pid"] == os.getpid()
        assert not m.read_only


@FAST
def test_crashed_holder_on_another_host_expires(make_storage, monkeypatch):
    storage = make_storage()
    _write_lease(storage, {
        "holder": "elsewhere", "host": "some-other-node", "pid": 1,
        "trial": storage.uri(storage.trial_path), "expires_at": time.time() + 60.0,
    })
    with pytest.raises(CheckpointConflictError, match="some-other-node"):
        CheckpointManager(CheckpointConfig(1), make_storage())
    # The expiry passes on the local clock (its one seam), not by sleeping: a
    # 1 s expiry and a sleep raced a slow first manager under load.
    monkeypatch.setattr(_clock, "local_time", lambda: time.time() + 61.0)
    with CheckpointManager(CheckpointConfig(1), make_storage()) as m:
        assert not m.read_only


@FAST
def test_lease_is_renewed_while_the_manager_lives(make_storage):
    m = CheckpointManager(CheckpointConfig(1), make_storage(), lease_ttl_s=0.3)
    first = _lease(make_storage())["expires_at"]
    # Renewed every 0.1 s in the background: waited for, not slept on.
    deadline = time.monotonic() + 30
    while _lease(make_storage())["expires_at"] <= first + 0.5:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.05)
    with pytest.raises(CheckpointConflictError):
        CheckpointManager(CheckpointConfig(1), make_storage())
    m.close()


@FAST
def test_lost_lease_makes_the_manager_read_only(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, keep_latest=False), storage)
    save(m, storage, source_dir, {})
    state_before = load_state(storage)[0]
    # Another process took the trial over (say, after this one hung past expiry).
    _write_lease(storage, {"holder": "usurper", "host": "other", "pid": 1,
                           "trial": storage.uri(storage.trial_path),
                           "expires_at": time.time() + 60})
    save(m, storage, source_dir, {})
    assert m.read_only
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000001"]
    # The state was written before the deletion was refused; nothing is deleted
    # and nothing more is written from now on.
    assert load_state(storage)[0] != state_before
    frozen = load_state(storage)[0]
    save(m, storage, source_dir, {})
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000001",
                                        "checkpoint_000002"]
    m.close()
    assert _lease(storage)["holder"] == "usurper"  # not released: not ours
    assert load_state(storage)[0] == frozen


def test_bad_lease_ttl_is_refused(tmp_path):
    from checkpoint_store import InvalidConfigError

    storage = StorageContext(str(tmp_path), "exp", "t")
    for bad in (0, -1, float("nan"), float("inf"), True, "60"):
        with pytest.raises(InvalidConfigError, match="lease_ttl_s"):
            CheckpointManager(CheckpointConfig(1), storage, lease_ttl_s=bad)


def test_live_manager_in_another_process_is_detected(tmp_path):
    root = str(tmp_path / "runs")
    code = textwrap.dedent(f"""
        import sys, time
        from checkpoint_store import CheckpointConfig, CheckpointManager, StorageContext
        m = CheckpointManager(CheckpointConfig(1), StorageContext({root!r}, "exp", "t"))
        print("ready", flush=True)
        time.sleep(120)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointConflictError, match=f"pid {child.pid}"):
            CheckpointManager(CheckpointConfig(1), StorageContext(root, "exp", "t"))
        child.kill()  # SIGKILL: nothing is released
        child.wait(timeout=30)
        with CheckpointManager(CheckpointConfig(1), StorageContext(root, "exp", "t")) as m:
            assert not m.read_only
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_local_lease_from_another_host_under_another_path_is_honoured(tmp_path):
    # The same shared directory can be mounted at another path on another host.
    storage = StorageContext(str(tmp_path), "exp", "t")
    _write_lease(storage, {"holder": "h", "host": "gpu-node-7", "pid": 4242,
                           "trial": "file:///mnt/shared/exp/t",
                           "expires_at": time.time() + 60})
    with pytest.raises(CheckpointConflictError, match="gpu-node-7") as info:
        CheckpointManager(CheckpointConfig(1), storage)
    assert "copied from 'file:///mnt/shared/exp/t'" in str(info.value)
    assert LEASE_FILE in str(info.value)


def test_live_lease_reports_a_live_manager_and_ignores_a_copied_lease(tmp_path):
    from checkpoint_store.retention import live_lease

    storage = StorageContext(str(tmp_path / "a"), "e", "t")
    assert live_lease(storage) is None
    manager = CheckpointManager(CheckpointConfig(num_to_keep=1), storage)
    try:
        held = live_lease(storage)
        assert held is not None and held["pid"] == os.getpid()
        # The same lease file under another trial location came with a copy.
        other = StorageContext(str(tmp_path / "b"), "e", "t")
        _write_lease(other, _lease(storage))
        assert live_lease(other) is None
    finally:
        manager.close()
    assert live_lease(storage) is None


@FAST
def test_a_forked_child_never_releases_its_parents_lease(make_storage):
    """A child forked while a manager lives holds a copy of the lease object; its
    exit (or its close) must not delete the lease the parent still holds."""
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(2), storage)
    holder = _lease(storage)["holder"]
    lease = m._lease
    assert lease is not None
    real_pid, lease.pid = lease.pid, -1  # what a forked child sees: not its pid
    try:
        lease.release()
        assert _lease(storage)["holder"] == holder
    finally:
        lease.pid = real_pid
    m.close()
    assert _lease(storage) is None


def test_a_collected_manager_whose_storage_died_raises_nothing_into_the_collector(tmp_path):
    """The handed CI failure: a manager left unclosed on a storage client that
    then "died" (a SimulatedCrash, a BaseException) was collected during a
    later, unrelated test, and its finalizer's lease release escaped as an
    unraisable exception there. The finalizer drops it; the lease expires."""
    import gc

    from checkpoint_store.registry import resolve
    from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend

    backend, root = resolve(str(tmp_path / "root"))
    backend = faulty_backend(backend)
    fs = backend.filesystem
    storage = StorageContext.from_backend(backend, root, "exp", "t")
    storage.ensure_trial_dir()
    manager = CheckpointManager(CheckpointConfig(2), storage)
    assert _lease(storage) is not None
    fs.handler.crashed = True  # the client is dead from here on
    with pytest.raises(SimulatedCrash):
        fs.get_file_info(str(tmp_path))
    seen: list = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        del manager
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert seen == []
    fs.handler.crashed = False
    # Nothing was released: the crashed process's lease is left to expire.
    assert _lease(storage) is not None


def test_a_lease_removed_while_the_keeper_is_busy_never_waits(tmp_path):
    """The finalizer of a manager collected unclosed removes its lease from
    the keeper. The cycle collector ran it on the keeper thread that add()
    was starting under the keeper's mutex, waiting for that thread to
    begin: remove() waited for the mutex, and both waited for ever (a whole
    test run hung in a session start). remove() now returns at once, and
    the lease is dropped by the mutex's next holder."""
    from checkpoint_store.retention import lease as _lease

    keeper = _lease._LeaseKeeper()
    storage = StorageContext(str(tmp_path / "runs"), "e", "t")
    lease = _lease.Lease(storage, ttl_s=30.0)
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with keeper._mutex:
            keeper._leases.add(lease)
            held.set()
            go.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    remover = threading.Thread(target=keeper.remove, args=(lease,))
    remover.start()
    remover.join(10)
    returned = not remover.is_alive()
    go.set()
    holder.join(30)
    remover.join(30)
    assert returned, "remove() waited for the keeper's mutex"
    other = _lease.Lease(StorageContext(str(tmp_path / "runs"), "e", "t2"), ttl_s=30.0)
    keeper.add(other)  # the next holder drops what was removed meanwhile
    try:
        assert keeper._leases == {other}
    finally:
        keeper.remove(other)
    deadline = time.monotonic() + 30  # no lease left: the keeper's loop ends
    while keeper._worker.last is not None and keeper._worker.last.is_alive() \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not keeper._worker.last.is_alive()


def test_a_renewal_on_its_way_writes_nothing_once_an_acquire_gave_the_lease_back(
        tmp_path, monkeypatch):
    """A signal's exception cuts ``acquire`` once the keeper has the lease:
    the acquire gives the lease back (deletes it). A renewal already on its
    way wrote it again: the released mark was reset for the object's next
    try before that renewal ran, so the lease stayed, unrenewed, and kept
    the trial from the next run until it expired. It writes nothing now,
    and the same object may still take the lease."""
    from checkpoint_store._results import writer as _results
    from checkpoint_store.retention.lease import Lease

    storage = StorageContext(str(tmp_path / "runs"), "e", "t")
    lease = Lease(storage, ttl_s=30.0)
    go = threading.Event()
    renewed: list[bool] = []
    renewer = threading.Thread(target=lambda: (go.wait(30), renewed.append(lease.renew())))

    def cut(owner) -> None:
        renewer.start()  # the keeper's renewal, taken out of its queue
        raise KeyboardInterrupt

    monkeypatch.setattr(_results, "release_after_exit_flush", cut)
    with pytest.raises(KeyboardInterrupt):
        lease.acquire()
    assert _lease(storage) is None
    go.set()
    renewer.join(30)
    assert renewed == [True]
    assert _lease(storage) is None, "a renewal wrote a lease the acquire gave back"
    monkeypatch.undo()
    lease.acquire()
    try:
        assert _lease(storage)["holder"] == lease.holder
        assert lease.renew() and _lease(storage)["holder"] == lease.holder
    finally:
        lease.release()
    assert _lease(storage) is None


def _race(contexts: list[StorageContext]) -> list[bool]:
    """Each context's manager takes the lease at the same instant (a
    barrier, one thread each); which of them got it."""
    from checkpoint_store.errors import TrialInUseError
    from checkpoint_store.retention.lease import Lease

    leases = [Lease(ctx, ttl_s=30.0) for ctx in contexts]
    go = threading.Barrier(len(leases))
    won: list[bool | None] = [None] * len(leases)

    def take(i: int) -> None:
        go.wait(30)
        try:
            leases[i].acquire()
            won[i] = True
        except TrialInUseError:
            won[i] = False

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for lease, w in zip(leases, won, strict=True):
        if w:
            lease.release()
    assert None not in won, "an acquire neither took the lease nor was refused"
    return [bool(w) for w in won]


@pytest.mark.parametrize("backend_name,latency", [("memory", True), ("s3", False)],
                         ids=["memory-wrapped-latency", "s3"])
def test_two_managers_starting_at_once_without_a_shared_lock_one_takes_the_lease(
        backend_name, latency, make_storage):
    """Two jobs started on one trial in the same instant, on a store with no
    lock between processes and no conditional write: both found no lease,
    both wrote theirs and each read its own back before the other's write
    landed, so both managed the trial (until a later check). Now each
    waits longer than such a check and write take and reads again: exactly
    one holds it, round after round. (Each manager has its own filesystem
    client, as a process of its own would; the memory store, wrapped so
    that no lock of this process spans the two, gets random latency per
    call, so the rounds interleave differently.)"""
    from checkpoint_store.testing.faults import faulty_backend

    rounds = 12 if latency else 4
    for r in range(rounds):
        contexts = []
        for i in range(2):
            ctx = make_storage(trial=f"t{r}")
            if latency:
                ctx = StorageContext.from_backend(
                    faulty_backend(ctx.backend, seed=r * 2 + i, latency=(0.0, 0.02)),
                    ctx.storage_path, "exp", f"t{r}", fsync=False)
            contexts.append(ctx)
        won = _race(contexts)
        assert sum(won) == 1, f"round {r}: {won}"


@pytest.mark.parametrize("backend_name", ["memory"])
def test_managers_of_the_memory_store_share_one_lock_and_never_wait(make_storage,
                                                                    monkeypatch):
    """Every client of the in-process memory store reads and writes one
    store: a lock of this process spans them all, so two managers started at
    once with their own clients never both take the lease, and neither pays
    the wait that stores without such a lock need."""
    from checkpoint_store.retention import lease as lease_mod

    waits: list[float] = []
    settle = lease_mod._settle_s
    monkeypatch.setattr(lease_mod, "_settle_s",
                        lambda took, ttl: waits.append(settle(took, ttl)) or waits[-1])
    for r in range(12):
        won = _race([make_storage(trial=f"t{r}") for _ in range(2)])
        assert sum(won) == 1, f"round {r}: {won}"
    assert waits == []
