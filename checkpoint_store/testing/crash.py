"""Crash test harness: SIGKILL a saving process at random moments, then check storage.

A child process runs a training-like loop (``session.start`` with retention
on, then ``report(..., checkpoint=...)`` forever, resuming from
``get_checkpoint()``); the parent kills it with ``SIGKILL`` after a random
delay and, after every kill, checks the trial:

* no partial checkpoint is visible: every checkpoint that lists as committed
  verifies (sizes, CRC32C) and holds exactly the bytes of its own step (no
  mix of two saves);
* every checkpoint the child was told was committed and that retention did
  not evict (or may not have evicted by the next save) still loads and
  verifies, and nothing newer than the last acknowledged one was lost;
* ``result.json`` (with the segments a killed run left on object stores)
  holds the row of every acknowledged save, and no row twice, before and
  after the next session assembles it;
* a new session's ``get_checkpoint()`` returns the newest committed one, and
  its start leaves no uncommitted leftovers; nothing is ever classified as
  foreign (all leftovers are recognisably ours).

Usage (what ``tests/crash`` and ``scripts/soak.py`` do)::

    from checkpoint_store.testing.crash import CrashConfig, CrashHarness

    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks"))
    report = CrashHarness(cfg, seed=0).run(kills=100)
    assert report.violations == [], report.summary()

:func:`sweep_state_crashes` is the deterministic complement for the
retention state (log records, snapshots, chunks): one run per mutating
storage call, crashed exactly there, each followed by the same checks on
the state as stored and on what the next manager makes of it.
:func:`sweep_lease_crashes` does the same for the lease (acquire, take-over
of an expired or dead holder's lease, renewals, release): after each crash a
new writer gets the trial once the dead holder's lease expires, never
alongside a live holder, and nothing but the lease file is touched.

Children are forked from a helper process (the "zygote") that has already
imported checkpoint-store, so a child starts in milliseconds, not the
half-second an interpreter plus pyarrow take.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CrashConfig",
    "CrashHarness",
    "CrashReport",
    "LeaseCrashReport",
    "StateCrashReport",
    "check_trial",
    "payload",
    "sweep_lease_crashes",
    "sweep_state_crashes",
]


@dataclass(frozen=True)
class CrashConfig:
    """Where and how the child saves.

    Args:
        storage_path: local path or URI of the storage.
        log_path: a local file where the child appends one JSON line per
            acknowledged save (``report()`` returned).
        storage_options: backend options (credentials, endpoint) for a URI.
        experiment_name, trial_name: the trial the child writes.
        num_to_keep: retention's ``num_to_keep`` (>= 1).
        files: files per checkpoint; file sizes are ``file_size`` bytes.
        file_size: bytes per file.
        env: environment variables to set in the child (credentials, endpoints).
        preload: modules the forking helper imports once, so that children
            do not pay for them (e.g. ``("s3fs", "checkpoint_store_s3")``).
    """

    storage_path: str
    log_path: str
    storage_options: dict[str, Any] | None = None
    experiment_name: str = "crash"
    trial_name: str = "trial"
    num_to_keep: int = 2
    files: int = 3
    file_size: int = 32 * 1024
    env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()


def payload(step: int, i: int, size: int) -> bytes:
    """The bytes of file ``i`` of the checkpoint saved at ``step`` (deterministic)."""
    seed = hashlib.blake2b(f"{step}/{i}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _file_name(i: int) -> str:
    return f"shard_{i}/data.bin" if i % 2 else f"data_{i}.bin"


def _child_main(cfg_dict: dict[str, Any]) -> None:
    """The child: resume, then save forever. Killed by the parent."""
    os.environ.update(cfg_dict.get("env") or {})
    from checkpoint_store import Checkpoint, CheckpointConfig, session

    cfg = CrashConfig(**cfg_dict)
    # Next to the log, so whoever owns the log's directory cleans up after kills.
    scratch = tempfile.mkdtemp(prefix="cs-crash-child-",
                               dir=os.path.dirname(os.path.abspath(cfg.log_path)))
    warnings.simplefilter("ignore")
    with session.start(
        storage_path=cfg.storage_path, storage_options=cfg.storage_options,
        experiment_name=cfg.experiment_name, trial_name=cfg.trial_name,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_to_keep),
    ) as s:
        latest = s.get_checkpoint()
        step = int(latest.internal_metadata["metrics"]["step"]) + 1 if latest else 0
        while True:
            for i in range(cfg.files):
                path = os.path.join(scratch, _file_name(i))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(payload(step, i, cfg.file_size))
            row = s.report({"step": step}, checkpoint=Checkpoint.from_directory(scratch))
            ack = {"step": step, "dir": row["checkpoint_dir_name"],
                   "kept": s.manager.kept_dir_names}
            with open(cfg.log_path, "a") as log:
                log.write(json.dumps(ack) + "\n")
            step += 1


def _last_ack(log_path: str) -> dict[str, Any] | None:
    try:
        with open(log_path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # torn by the kill
    return None


def check_trial(
    cfg: CrashConfig, backend: Any = None, root: str | None = None
) -> tuple[list[str], int]:
    """Check the trial after a kill; returns ``(violations, newest committed step)``.

    Starts (and ends) a session on the trial, as the next run would: that
    removes leftovers and must resume from the newest committed checkpoint.

    Args:
        cfg: the harness configuration.
        backend, root: a :class:`~checkpoint_store.backends.Backend` and the
            path for ``cfg.storage_path`` (as ``registry.resolve`` returns
            them) to reuse across checks: building one can cost more than the
            check itself. None builds them.
    """
    import google_crc32c

    from checkpoint_store import StorageContext
    from checkpoint_store._layout import parse_checkpoint_dir_name
    from checkpoint_store.errors import CheckpointStoreError
    from checkpoint_store.registry import resolve
    from checkpoint_store.session import Session

    bad: list[str] = []
    if backend is None or root is None:
        backend, root = resolve(cfg.storage_path, storage_options=cfg.storage_options)
    storage = StorageContext.from_backend(backend, root, cfg.experiment_name, cfg.trial_name)
    committed = storage.committed_checkpoints()
    steps: dict[str, int] = {}
    for ckpt, meta in committed:
        name = ckpt.path.rstrip("/").rsplit("/", 1)[-1]
        try:
            ckpt.verify()
        except CheckpointStoreError as exc:
            bad.append(f"{name} lists as committed but does not verify: {exc}")
            continue
        step = int(meta["metrics"]["step"])
        steps[name] = step
        # verify() proved the bytes match the manifest; the manifest must hold
        # this step's bytes (not another save's): compare checksums, no second read.
        crcs = {e["path"]: e["crc32c"] for e in meta["manifest"]}
        for i in range(cfg.files):
            want = f"{google_crc32c.value(payload(step, i, cfg.file_size)):08x}"
            if crcs.get(_file_name(i)) != want:
                bad.append(f"{name} (step {step}): {_file_name(i)} holds other bytes")
    ack = _last_ack(cfg.log_path)
    newest_step = max(steps.values()) if steps else -1
    if ack is not None:
        if newest_step < ack["step"]:
            bad.append(f"acknowledged step {ack['step']} ({ack['dir']}) was lost; newest "
                       f"committed step is {newest_step}")
        # Retention (keep the newest num_to_keep) may evict a checkpoint only once
        # num_to_keep newer ones were committed; indices grow with time.
        present = sorted(i for i in map(parse_checkpoint_dir_name, steps) if i is not None)
        for name in sorted(set(ack["kept"]) | {ack["dir"]}):
            if name in steps:
                continue
            index = parse_checkpoint_dir_name(name)
            if index is None:
                bad.append(f"the log acknowledged {name!r}, which is no checkpoint directory name")
                continue
            newer = sum(1 for i in present if i > index)
            if newer < cfg.num_to_keep:
                bad.append(f"{name} was committed and kept by retention, and only {newer} newer "
                           "checkpoint(s) exist, but it is gone or broken")
    rows = storage.read_results()
    bad.extend(_check_rows(rows, cfg.log_path))
    found = storage.scan()
    if found.foreign:
        bad.append(f"directories not recognisable as ours: {found.foreign}")
    newest = max(committed, key=lambda cm: cm[1]["index"])[0] if committed else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # What session.start() builds, on the reused backend; a new run id, as
        # a new process would have.
        s = Session(StorageContext.from_backend(backend, root, cfg.experiment_name,
                                                cfg.trial_name, run_id=f"check{time.time_ns()}"))
        try:
            got = s.get_checkpoint()
        finally:
            s.close()
    if (got.path if got else None) != (newest.path if newest else None):
        bad.append(f"get_checkpoint() returned {got} instead of the newest committed {newest}")
    after = storage.scan()
    if after.uncommitted:
        bad.append(f"a session start left uncommitted directories: {after.uncommitted}")
    if storage.read_results() != rows:
        bad.append("the rows of result.json changed when a session assembled them")
    return bad, newest_step


def _check_rows(rows: list[dict[str, Any]], log_path: str) -> list[str]:
    """``result.json`` after a kill (segments included, on object stores): no row
    twice (iterations strictly increase), and the row of every acknowledged
    save is there (a checkpoint report writes its row before it returns)."""
    bad = []
    its = [r.get("training_iteration") for r in rows]
    ints = [i for i in its if isinstance(i, int)]
    if len(ints) != len(its) or ints != sorted(set(ints)):
        bad.append(f"result.json rows do not have strictly increasing iterations: {its[-20:]}")
    reported = {r.get("step") for r in rows}
    try:
        with open(log_path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError):
            continue  # torn by the kill
        if step not in reported:
            bad.append(f"the row of acknowledged step {step} is missing from result.json")
    return bad


@dataclass
class CrashReport:
    """What :meth:`CrashHarness.run` saw."""

    kills: int = 0
    saves_acknowledged: int = 0
    newest_step: int = -1
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        head = (f"{self.kills} kills, {self.saves_acknowledged} saves acknowledged, newest step "
                f"{self.newest_step}, {len(self.violations)} violations in {self.seconds:.1f}s")
        return "\n".join([head, *self.violations[:20]])


class _Zygote:
    """A process that has imported checkpoint-store and forks children on request.

    ``python -m checkpoint_store.testing.crash zygote`` reads JSON commands on
    stdin (``spawn`` with a config -> child pid; ``wait`` with a pid -> exit
    code) and answers one JSON line each. Forking from it makes a child start
    in milliseconds; the parent kills children by pid with SIGKILL.
    """

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint_store.testing.crash", "zygote", *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the crash-harness zygote process died")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except Exception:  # noqa: BLE001
                self._proc.kill()
                self._proc.wait()


def _zygote_main(preload: list[str]) -> None:
    import importlib
    import sys

    import checkpoint_store.session  # noqa: F401  (imported once, before forking)

    for name in preload:
        importlib.import_module(name)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)  # never write into the command channel
                    _child_main(cmd["config"])
                    code = 0
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
            answer: dict[str, Any] = {"pid": pid}
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            answer = {"exitcode": os.waitstatus_to_exitcode(status)}
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class CrashHarness:
    """Runs the child, kills it, checks, repeats.

    Args:
        config: see :class:`CrashConfig`.
        seed: seeds the kill delays (the run is reproducible up to timing).
        min_delay, max_delay: each child is killed after a uniform random
            delay in this range (seconds) from its start; the range should
            cover the session start and a few saves.
    """

    def __init__(self, config: CrashConfig, *, seed: int = 0, min_delay: float = 0.02,
                 max_delay: float = 0.4):
        if not 0 <= min_delay <= max_delay:
            raise ValueError("need 0 <= min_delay <= max_delay")
        self.config = config
        self.rng = random.Random(seed)
        self.min_delay, self.max_delay = min_delay, max_delay

    def _acks(self) -> int:
        try:
            with open(self.config.log_path) as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def run(self, kills: int, *, stop_on_violation: bool = True) -> CrashReport:
        """Kill the child ``kills`` times, checking after each kill."""
        report = CrashReport()
        t0 = time.monotonic()
        cfg = asdict(self.config)
        from checkpoint_store.registry import resolve

        backend, root = resolve(self.config.storage_path,
                                storage_options=self.config.storage_options)
        zygote = _Zygote(self.config.preload)
        try:
            for _ in range(kills):
                pid = zygote.ask(op="spawn", config=cfg)["pid"]
                time.sleep(self.rng.uniform(self.min_delay, self.max_delay))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                code = zygote.ask(op="wait", pid=pid)["exitcode"]
                report.kills += 1
                if code != -signal.SIGKILL:
                    report.violations.append(
                        f"kill {report.kills}: the child exited by itself (code {code}) "
                        "before the kill; it must save until killed (its traceback is on stderr)"
                    )
                bad, newest = check_trial(self.config, backend, root)
                report.newest_step = newest
                report.violations.extend(f"kill {report.kills}: {v}" for v in bad)
                if report.violations and stop_on_violation:
                    break
        finally:
            zygote.close()
        report.saves_acknowledged = self._acks()
        report.seconds = time.monotonic() - t0
        return report


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["zygote"]:
        _zygote_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m checkpoint_store.testing.crash zygote")


# -- every crash point of the retention state ---------------------------------------------


@dataclass
class StateCrashReport:
    """What :func:`sweep_state_crashes` found.

    Attributes:
        points: crash points tried (one run per point).
        violations: ``"point N: what is wrong"``, empty when every point was clean.
    """

    points: int = 0
    violations: list[str] = field(default_factory=list)


def sweep_state_crashes(root: str, *, reports: int = 8, num_to_keep: int | None = 2,
                        compact_every: int = 3, chunk_entries: int = 2,
                        fanout: int = 2) -> StateCrashReport:
    """Crash a reporting process at every mutating storage call, one run each,
    and check what the next manager makes of the trial.

    Each run registers ``reports`` checkpoints on local disk (scores out of
    order, so retention evicts and deletes) through a filesystem that dies
    (:class:`~checkpoint_store.testing.faults.SimulatedCrash`) at its k-th
    mutating call: a checkpoint's upload or commit, a log record, a snapshot's
    chunk or root, a delete of a folded record or replaced chunk, an evicted
    checkpoint's delete. Small state thresholds (``compact_every``,
    ``chunk_entries``, ``fanout``) put every step of a compaction within a few
    reports. After the crash a new manager opens the trial (the dead
    process's lease removed, as its expiry would) and must find: a state
    that reads without a "corrupt" warning, exactly the kept set retention
    gives for the committed checkpoints (docs/retention.md), every
    checkpoint it did not evict still committed, nothing else left once its
    deletes ran, and no state part beyond the root, its chunks and the records
    after it. The sweep ends at the first run that finishes without crashing.
    """
    from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager, StorageContext
    from checkpoint_store._layout import LEASE_FILE
    from checkpoint_store.retention import statelog
    from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend

    config = (CheckpointConfig(num_to_keep, "score", "max") if num_to_keep is not None
              else CheckpointConfig(checkpoint_score_attribute="score"))
    src = os.path.join(root, "src")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"w" * 64)
    scores = [float((i * 7) % 11) for i in range(reports)]
    saved = (statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT)
    statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT = (
        compact_every, chunk_entries, fanout)
    report = StateCrashReport()
    try:
        for point in range(100_000):
            real = StorageContext(os.path.join(root, f"point{point}"), "exp", "t", fsync=False)
            dying = StorageContext.from_backend(
                faulty_backend(real.backend, crash_after_writes=point), real.storage_path,
                "exp", "t", fsync=False)
            crashed = False
            manager = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                acked = 0
                try:
                    manager = CheckpointManager(config, dying)
                    for i, score in enumerate(scores):
                        ckpt = dying.persist_checkpoint(
                            Checkpoint(src), i, {"metrics": {"score": score},
                                                 "run_id": manager.run_id})
                        manager.register(ckpt, {"score": score})
                        acked += 1
                    manager.close()
                except SimulatedCrash:
                    crashed = True
                    if manager is not None and manager._lease is not None:
                        manager._lease.stop_renewing()  # a dead process releases nothing
                        manager._lease._released = True
            report.points += 1
            report.violations += [f"point {point}: {v}" for v in
                                  _check_stored_state(real, config, scores, acked)]
            report.violations += [f"point {point}: {v}" for v in
                                  _check_after_crash(real, config, scores, LEASE_FILE)]
            if not crashed:
                return report
        return report
    finally:
        statelog.COMPACT_EVERY, statelog.CHUNK_ENTRIES, statelog.FANOUT = saved


def _check_stored_state(storage: Any, config: Any, scores: list[float], acked: int
                        ) -> list[str]:
    """The state as stored, before any manager repairs it: every registration
    that returned is in it, with what it evicted; the one cut short may be."""
    from checkpoint_store._layout import checkpoint_dir_name
    from checkpoint_store.retention.state import load_state
    from checkpoint_store.testing.stateful import RetentionModel

    def kept_after(n: int) -> set[str]:
        model = RetentionModel(config)
        for i in range(n):
            model.add(i, scores[i])
        return {checkpoint_dir_name(i) for i in model.kept()}

    state, problem = load_state(storage)
    if state is None:
        return [] if acked == 0 and problem == "missing" else [f"state lost: {problem}"]
    got = set(state.checkpoints)
    allowed = [kept_after(acked), kept_after(min(acked + 1, len(scores)))]
    if got not in allowed:
        return [f"stored kept set {sorted(got)}, after {acked} registrations it is "
                f"{sorted(allowed[0])} (or {sorted(allowed[1])})"]
    evicted = (({checkpoint_dir_name(i) for i in range(acked)} - allowed[0])
               | ({checkpoint_dir_name(i) for i in range(acked + 1)} - allowed[1]))
    if not set(state.pending_deletes) <= evicted:
        return [f"pending deletes {state.pending_deletes} name a checkpoint never evicted"]
    return []


def _check_after_crash(storage: Any, config: Any, scores: list[float],
                       lease_file: str) -> list[str]:
    from checkpoint_store import CheckpointManager, _fsutil
    from checkpoint_store._layout import (
        MANAGER_STATE,
        checkpoint_dir_name,
        parse_state_chunk_name,
        parse_state_log_name,
    )
    from checkpoint_store.retention.state import load_state
    from checkpoint_store.testing.stateful import RetentionModel

    fs, trial = storage.filesystem, storage.trial_path
    _fsutil.delete_file(fs, os.path.join(trial, lease_file))
    committed = [name for _, name in storage.checkpoint_dirs()
                 if storage.checkpoint(name).internal_metadata.get("index") is not None]
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = CheckpointManager(config, storage)
    for w in caught:
        if "corrupt" in str(w.message) or "unreadable" in str(w.message):
            problems.append(f"the state did not survive: {w.message}")
    # The kept set retention gives for the committed checkpoints, whatever was
    # evicted (and deleted) before the crash: those are gone or pending.
    model = RetentionModel(config)
    survivors = {name for name in committed}
    for i, score in enumerate(scores):
        if checkpoint_dir_name(i) in survivors:
            model.add(i, score)
    want = [checkpoint_dir_name(i) for i in model.kept()]
    got = manager.kept_dir_names
    if not set(want) <= set(got) | (set(committed) - survivors):
        problems.append(f"kept {got}, retention keeps {want}")
    if not set(got) <= set(committed):
        problems.append(f"kept but not committed: {sorted(set(got) - set(committed))}")
    manager.retry_deletes()
    left = [name for _, name in storage.checkpoint_dirs()
            if storage.checkpoint(name).internal_metadata.get("index") is not None]
    if sorted(left) != sorted(manager.kept_dir_names):
        problems.append(f"committed {left} after the deletes, kept {manager.kept_dir_names}")
    manager.close()
    state, problem = load_state(storage)
    if state is None and committed:
        problems.append(f"no state after a restart: {problem}")
    if state is not None:
        root = json.loads(_fsutil.read_bytes(fs, os.path.join(trial, MANAGER_STATE)))
        named = {c["name"] for c in root["chunks"]}
        for fi in _fsutil.list_dir(fs, trial):
            name = os.path.basename(fi.path)
            seq = parse_state_log_name(name)
            if (seq is not None and seq <= root["seq"]) or (
                    parse_state_chunk_name(name) is not None and name not in named):
                problems.append(f"state part left behind: {name}")
    return problems


# -- every crash point of the lease ------------------------------------------------------


@dataclass
class LeaseCrashReport:
    """What :func:`sweep_lease_crashes` found.

    Attributes:
        points: crash points tried (one run per point).
        crashed_before: per crash point, the call it stopped (``"create_dir
            <path>"``, ``"open_output_stream <path>"``, ``"delete_file <path>"``).
        violations: ``"point N: what is wrong"``, empty when every point was clean.
    """

    points: int = 0
    crashed_before: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


# Long enough that no renewal thread fires during a run (it renews every ttl/3);
# expiry is brought about by ageing the lease file, not by waiting.
_SWEEP_LEASE_TTL_S = 60.0


def sweep_lease_crashes(root: str, *, stale: str | None = "expired") -> LeaseCrashReport:
    """Crash a lease holder at every mutating storage call of its lease's life,
    one run each, and check what the next writer finds.

    Each run copies a trial with committed checkpoints, a retention state and
    ``result.json`` (local disk), plants the lease a previous holder left
    (``stale``: ``"expired"``, another host's lease past its ttl; ``"dead"``,
    an unexpired lease of a process of this host that has exited; None: no
    lease), then has a holder take the lease over (or acquire it), renew it
    twice and release it, through a filesystem that dies
    (:class:`~checkpoint_store.testing.faults.SimulatedCrash`) at its k-th
    mutating call: the storage clock's probe and its delete, the trial
    directory, the lease's write, each renewal, the release's delete.

    After the crash it checks (:func:`_check_lease_after_crash`): no file but
    the lease (and a clock probe the crash cut short) was added, changed or
    removed; the lease file is absent or a whole lease of a known holder; a
    new writer is refused while the dead holder's lease is unexpired and
    takes the trial once it expires (at once when no live holder is left);
    then a third writer is refused, the dead holder, were it to come back,
    finds its lease lost and never renews over the new one, and the new
    holder's release leaves no lease. The sweep ends at the first run that
    finishes without crashing.
    """
    import shutil

    from checkpoint_store import StorageContext
    from checkpoint_store.retention.lease import Lease
    from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend

    seed = os.path.join(root, "seed")
    _seed_trial(seed)
    dead_pid = _exited_pid() if stale == "dead" else None
    report = LeaseCrashReport()
    for point in range(10_000):
        store = os.path.join(root, f"point{point}")
        shutil.copytree(seed, store)
        real = StorageContext(store, "exp", "t", fsync=False)
        _plant_lease(real, stale, dead_pid)
        before = _trial_files(real)
        dying = StorageContext.from_backend(
            faulty_backend(real.backend, crash_after_writes=point), real.storage_path,
            "exp", "t", fsync=False)
        holder = Lease(dying, _SWEEP_LEASE_TTL_S)
        crashed = False
        try:
            holder.acquire()
            holder.stop_renewing()  # renewals below, at known points
            for _ in range(2):
                if not holder.renew():
                    report.violations.append(f"point {point}: a renewal found the lease lost")
            holder.release()
        except SimulatedCrash as exc:
            crashed = True
            holder.stop_renewing()  # a dead process renews nothing
            report.crashed_before.append(str(exc).removeprefix("crash point before "))
        report.points += 1
        report.violations += [f"point {point}: {v}" for v in
                              _check_lease_after_crash(real, before, holder.holder, crashed)]
        if not crashed:
            return report
    return report


def _seed_trial(store: str) -> None:
    """A closed trial with two committed checkpoints, a retention state and rows."""
    from checkpoint_store import Checkpoint, CheckpointConfig, session

    src = store + "-src"
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"w" * 64)
    with session.start(storage_path=store, experiment_name="exp", trial_name="t",
                       checkpoint_config=CheckpointConfig(num_to_keep=2)) as s:
        for i in range(3):
            s.report({"score": float(i)},
                     checkpoint=Checkpoint.from_directory(src) if i else None)


def _exited_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _plant_lease(storage: Any, stale: str | None, dead_pid: int | None) -> None:
    """The lease a previous holder left: another host's, expired; or an
    unexpired one of an exited process of this host; or none."""
    from checkpoint_store.retention.lease import Lease

    if stale is None:
        return
    old = Lease(storage, _SWEEP_LEASE_TTL_S)
    if stale == "expired":
        old.host = "a-host-gone-for-good"
    elif stale == "dead" and dead_pid is not None:
        old.pid, old.token = dead_pid, None
    else:
        raise ValueError(f"stale must be 'expired', 'dead' or None, not {stale!r}")
    old._write()
    if stale == "expired":
        _age_lease(storage)


def _age_lease(storage: Any) -> None:
    """Make the lease file older than its ttl, as time passing would."""
    from checkpoint_store._layout import LEASE_FILE

    t = time.time() - _SWEEP_LEASE_TTL_S - 60.0
    os.utime(os.path.join(storage.trial_path, LEASE_FILE), (t, t))


def _trial_files(storage: Any) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file of the trial but the lease."""
    from checkpoint_store._layout import LEASE_FILE

    out: dict[str, bytes] = {}
    for dirpath, _, names in os.walk(storage.trial_path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), storage.trial_path)
            if rel != LEASE_FILE:
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[rel] = f.read()
    return out


def _untouched(storage: Any, before: dict[str, bytes]) -> list[str]:
    from checkpoint_store._layout import CLOCK_PROBE_PREFIX

    now = _trial_files(storage)
    changed = sorted(p for p in before if now.get(p) != before[p])
    added = sorted(p for p in set(now) - set(before)
                   if not os.path.basename(p).startswith(CLOCK_PROBE_PREFIX))
    out = [f"committed data changed or removed: {changed}"] if changed else []
    return out + ([f"files added besides the lease: {added}"] if added else [])


def _check_lease_after_crash(storage: Any, before: dict[str, bytes], dead_holder: str,
                             crashed: bool) -> list[str]:
    """See :func:`sweep_lease_crashes`."""
    from checkpoint_store._layout import LEASE_FILE
    from checkpoint_store.retention.lease import Lease

    problems = _untouched(storage, before)
    probe = Lease(storage, _SWEEP_LEASE_TTL_S)
    cur = probe._read()
    if cur is None and os.path.exists(os.path.join(storage.trial_path, LEASE_FILE)):
        problems.append("the lease file is torn or not a lease")
    dead_holds = cur is not None and cur.get("holder") == dead_holder
    if dead_holds and not crashed:
        problems.append("a release that returned left its lease behind")
    new = Lease(storage, _SWEEP_LEASE_TTL_S)
    taken = _try_acquire(new)
    if taken and dead_holds:
        problems.append("a new writer took a lease whose holder's ttl had not run out: "
                        "two live holders")
    if not taken and not dead_holds:
        problems.append("a new writer was refused although no live holder was left")
    if not taken:
        _age_lease(storage)
        taken = _try_acquire(new)
        if not taken:
            problems.append("a new writer was refused after the dead holder's lease expired")
            return problems
    third = Lease(storage, _SWEEP_LEASE_TTL_S)
    if _try_acquire(third):
        problems.append("a third writer took the lease the new writer holds")
        third.release()
    ghost = Lease(storage, _SWEEP_LEASE_TTL_S)
    ghost.holder = dead_holder  # the dead holder, come back
    if ghost.check() or ghost.renew():
        problems.append("the old holder still believes it holds the lease")
    after = new._read()
    if after is None or after.get("holder") != new.holder:
        problems.append("the old holder's renewal overwrote the new holder's lease")
    new.release()
    if new._read() is not None:
        problems.append("the new holder's release left a lease behind")
    return problems + _untouched(storage, before)


def _try_acquire(lease: Any) -> bool:
    from checkpoint_store.errors import TrialInUseError

    try:
        lease.acquire()
    except TrialInUseError:
        return False
    lease.stop_renewing()
    return True
