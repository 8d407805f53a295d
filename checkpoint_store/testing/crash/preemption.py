"""Preemption kill harness: signal a training loop at random moments, then check storage.

What a spot VM, a Kubernetes eviction or SLURM does to a job: a SIGTERM (to
the trainer, or to its whole process group), a grace period, then SIGKILL.
:class:`PreemptionHarness` does the same to a child training loop, over and
over, on any storage URI (local disk, S3, a plugin's backend), and checks
after each signal what the next run would find.

The child (:func:`preemption_child_main`, forked in its own session and
process group, as ``Popen(start_new_session=True)``) resumes the trial with
``session.start(preemption=PreemptionConfig(grace_period_s=...))`` (or
without ``preemption=``, see below), optionally through a local tier, and
reports ``state=`` (numpy arrays, through the shared-memory staging and the
persist process) forever. It prints one JSON line per event to a file the
driver reads: each acknowledged report (``report()`` returned), the moments
it enters and leaves, the persist process's pid, and the ``Preempted`` that
ends it.

The driver picks a moment for each signal, waits until the child enters it
(its n-th occurrence), then sends the signal at a random point within the
moment's usual duration:

* ``step``: inside a training step (between two reports);
* ``staging``: while ``report()`` copies the state into staging;
* ``upload``: while the persist process writes the state's files and the
  checkpoint is committed on the storage_path (in ``report()`` or in the
  background, ``upload_mode="sync"`` or ``"async"``);
* ``tier_copy``: during the local tier's durable copy to the storage_path
  (these children save through a ``LocalTier``);
* ``start``: during ``session.start`` (before the session's handler exists,
  the signal's default action ends the child: allowed, nothing was
  acknowledged by it).

The signal goes to the child alone or to its process group (``os.killpg``:
what torchrun, SLURM and a container stop send). The driver waits up to the
grace period, then SIGKILLs the group. After each child it checks:

* the exit: ``Preempted`` with the configured exit status (or, without
  opt-in, the status the program's signal path gives: 143 for SIGTERM, 130
  for SIGINT's ``KeyboardInterrupt``, the user handler's ``sys.exit`` code);
  never a SIGKILL after the grace;
* a committed checkpoint of a step at or after the last acknowledged one
  exists on the storage_path, and every acknowledged save is committed
  there (or was evicted by retention after enough newer ones), with its
  ``result.json`` row; a child that saved through the local tier and was
  preempted may leave older copies on the tier only (the preemption
  checkpoint, newer, supersedes them), and a new session with that tier
  must resume from a complete checkpoint at least as new as its last ack;
* the preemption checkpoint (the step of the report that raised
  ``Preempted``) is committed and its internal metadata has
  ``"preemption"`` naming the signal and the grace;
* the newest complete checkpoint from before the signal is never lost;
* no partial checkpoint is resumable: every committed checkpoint verifies
  and holds its own step's bytes, and a new session's ``get_checkpoint()``
  returns the newest committed one (with a local tier: one that verifies and
  is at least as new as the last acknowledged report);
* no persist process outlives the child (checked by pid).

Usage (what ``tests/crash/test_preemption_crash.py`` does)::

    from checkpoint_store.testing.crash.preemption import (
        PreemptionCrashConfig, PreemptionHarness)

    cfg = PreemptionCrashConfig(storage_path="s3://bucket/ckpt", work_dir=str(tmp_path),
                                storage_options={...}, preload=("s3fs",))
    report = PreemptionHarness(cfg, seed=0).run(200)                  # SIGTERM, opted in
    assert report.violations == [], report.summary()
    report = PreemptionHarness(cfg, seed=1).run(                      # no opt-in
        8, opt_in=False, signals=("SIGINT", "SIGTERM"), handlers=(False, True),
        targets=("group",))

:func:`time_preemption` measures one signal (sent as a step starts, the
worst moment) to the committed preemption checkpoint, next to what one
step, a copy of the state and an fsync cost in the same child
(``benchmarks/bench_preemption.py``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from checkpoint_store.testing.crash._child import CrashConfig, Zygote, payload

__all__ = [
    "MOMENTS",
    "PreemptionCrashConfig",
    "PreemptionHarness",
    "PreemptionReport",
    "preemption_child_main",
    "time_preemption",
]

#: The moments a signal is aimed at.
MOMENTS = ("step", "staging", "upload", "tier_copy", "start")

_CHILD_MAIN = "checkpoint_store.testing.crash.preemption:preemption_child_main"
_PRELOAD = ("numpy", "checkpoint_store.tiers", "checkpoint_store.state",
            "checkpoint_store.testing.crash.preemption", "google_crc32c")
_TYPICAL = {"start": 0.2, "step": 0.02, "staging": 0.01, "upload": 0.05, "tier_copy": 0.05}


@dataclass(frozen=True)
class PreemptionCrashConfig:
    """Where and how the child trains, and how it is signalled.

    Args:
        storage_path: local path or URI of the storage (any backend).
        work_dir: a local directory for the children's event files, the
            acknowledgement log, scratch files and the local tier (default
            ``<work_dir>/tier``).
        storage_options: backend options for a URI.
        env: environment variables set in the child (credentials, endpoints).
        preload: modules the forking helper imports once (a plugin's package,
            ``"s3fs"`` ...), so that children start in milliseconds.
        experiment_name, trial_name: the trial the children write.
        num_to_keep: the storage_path's retention (>= 2: the previous
            complete checkpoint and the preemption one).
        files, file_size: the state: ``files`` uint8 arrays of ``file_size``
            bytes, whose bytes depend on the step (:func:`payload`).
        step_s: seconds a training step sleeps (besides building the state).
        grace_period_s: the ``PreemptionConfig``'s, and how long the driver
            waits after the signal before it SIGKILLs the process group.
        exit_code: the ``PreemptionConfig``'s ``exit_code``: the status a
            preempted child must exit with.
        tier_path: the local tier's path (None: ``<work_dir>/tier``).
        tier_fsync: the local tier's ``fsync``.
        tier_backlog: the local tier holds at most this many states
            (``max_bytes``), so its durable copies lag by at most about as
            many saves; None: no bound (a backlog as long as the storage_path
            is slower than the tier).

    The remaining fields are set per child by the harness: ``opt_in``
    (``preemption=`` given), ``signal`` (its name), ``handler`` (the
    program installs a handler of ``signal`` that calls
    ``sys.exit(handler_exit_code)`` before ``session.start``), ``use_tier``,
    ``upload_mode``, ``out_path`` (the event file) and ``calibrate`` (time a
    copy of the state and an fsync first, see :func:`time_preemption`).
    """

    storage_path: str
    work_dir: str
    storage_options: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    experiment_name: str = "preemption"
    trial_name: str = "trial"
    num_to_keep: int = 2
    files: int = 2
    file_size: int = 1024 * 1024
    step_s: float = 0.02
    grace_period_s: float = 10.0
    exit_code: int = 99
    tier_path: str | None = None
    tier_fsync: bool = True
    tier_backlog: int | None = 4
    opt_in: bool = True
    signal: str = "SIGTERM"
    handler: bool = False
    handler_exit_code: int = 3
    use_tier: bool = False
    upload_mode: str = "async"
    out_path: str = ""
    calibrate: bool = False

    @property
    def log_path(self) -> str:
        """Every acknowledged report of every child, one JSON line each."""
        return os.path.join(self.work_dir, "acks.log")

    @property
    def durable_log_path(self) -> str:
        """The acknowledged reports that must each be committed on the
        storage_path: all but those of a child that saved through the local
        tier and was preempted (its older copies may stay on the local tier,
        superseded by the preemption checkpoint)."""
        return os.path.join(self.work_dir, "durable-acks.log")

    @property
    def local_tier_path(self) -> str:
        return self.tier_path or os.path.join(self.work_dir, "tier")

    def crash_config(self) -> CrashConfig:
        """The same trial as the SIGKILL harness's checks see it (a state source)."""
        return CrashConfig(storage_path=self.storage_path, log_path=self.durable_log_path,
                           storage_options=self.storage_options,
                           experiment_name=self.experiment_name, trial_name=self.trial_name,
                           num_to_keep=self.num_to_keep, files=self.files,
                           file_size=self.file_size, source="state")


@dataclass
class PreemptionReport:
    """What :meth:`PreemptionHarness.run` saw."""

    kills: int = 0
    #: moment -> signals aimed at it; -> signals that landed while it ran.
    per_moment: Counter[str] = field(default_factory=Counter)
    inside: Counter[str] = field(default_factory=Counter)
    #: "child" / "group" -> signals sent that way.
    per_target: Counter[str] = field(default_factory=Counter)
    #: how the children ended: "preempted", "before_handler" (the signal's
    #: default action during session.start), "exit_<code>".
    outcomes: Counter[str] = field(default_factory=Counter)
    #: moments the child did not reach in time (the signal was sent then).
    timeouts: int = 0
    acknowledged: int = 0
    #: signals after which the child had acknowledged nothing.
    before_any_ack: int = 0
    preemption_checkpoints: int = 0
    orphans: int = 0
    killed_after_grace: int = 0
    #: seconds from the signal to the child's exit; to its Preempted raised.
    signal_to_exit_s: list[float] = field(default_factory=list)
    signal_to_preempted_s: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        def stats(xs: list[float]) -> str:
            if not xs:
                return "-"
            return f"median {statistics.median(xs):.3f} s, max {max(xs):.3f} s"

        moments = ", ".join(f"{m} {self.per_moment[m]} ({self.inside[m]} inside)"
                            for m in MOMENTS if self.per_moment[m])
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        targets = ", ".join(f"{k} {v}" for k, v in sorted(self.per_target.items()))
        head = (f"{self.kills} signals [{moments}; {self.timeouts} by timeout; to {targets}], "
                f"ended: {outcomes}; {self.acknowledged} reports acknowledged, "
                f"{self.before_any_ack} signals before any ack, "
                f"{self.preemption_checkpoints} preemption checkpoints, {self.orphans} orphans, "
                f"{self.killed_after_grace} SIGKILLed after the grace, "
                f"{len(self.violations)} violations in {self.seconds:.1f}s; signal to exit "
                f"{stats(self.signal_to_exit_s)}; to Preempted {stats(self.signal_to_preempted_s)}")
        return "\n".join([head, *self.violations[:20]])


# -- the child -------------------------------------------------------------------------------


class _Emitter:
    """One JSON line per event, appended with one write (readable while it runs)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, ev: str, **kw: Any) -> None:
        kw.update(ev=ev, t=time.monotonic(), wall=time.time())
        os.write(self._fd, (json.dumps(kw) + "\n").encode())


def _instrument(emit: _Emitter) -> None:
    """Wrap the functions of each moment so the child says when it enters and leaves it."""
    from checkpoint_store.session._committers import SingleCommitter
    from checkpoint_store.session._sources import StateSource, StateStaging
    from checkpoint_store.state._persist import PersistProcess
    from checkpoint_store.tiers.local import FastTier

    depth: Counter[str] = Counter()
    lock = threading.Lock()

    def wrap(owner: Any, name: str, moment: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                depth[moment] += 1
                first = depth[moment] == 1
            if first:
                emit("enter", m=moment)
            try:
                return original(*args, **kwargs)
            finally:
                with lock:
                    depth[moment] -= 1
                    last = depth[moment] == 0
                if last:
                    emit("leave", m=moment)

        setattr(owner, name, wrapper)

    wrap(StateStaging, "stage", "staging")
    wrap(StateSource, "write", "upload")
    wrap(SingleCommitter, "commit", "upload")
    wrap(FastTier, "persist", "tier_copy")
    wrap(FastTier, "commit", "tier_commit")  # timing only, not aimed at
    wrap(FastTier, "commit_in_place", "tier_commit")

    started = PersistProcess.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        started(self, *args, **kwargs)
        emit("persist_pid", pid=self.pid)

    PersistProcess.__init__ = init  # type: ignore[method-assign]


def _tier_bytes(cfg: PreemptionCrashConfig) -> int | None:
    if cfg.tier_backlog is None:
        return None
    return cfg.tier_backlog * (cfg.files * cfg.file_size + 64 * 1024)  # + metadata


def _calibrate(cfg: PreemptionCrashConfig, emit: _Emitter, where: str) -> None:
    """Time, in this process: one copy of the state in memory (the best of
    three) and writing it to ``where`` then its fsync."""
    import numpy as np

    arrays = [np.frombuffer(payload(0, i, cfg.file_size), dtype=np.uint8)
              for i in range(cfg.files)]
    copies = [np.empty_like(a) for a in arrays]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for a, c in zip(arrays, copies, strict=True):
            np.copyto(c, a)
        best = min(best, time.perf_counter() - t0)
    del copies
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, f"calibrate-{os.getpid()}.bin")
    with open(path, "wb") as f:
        t0 = time.perf_counter()
        for a in arrays:
            f.write(a.data)
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
        t2 = time.perf_counter()
    os.unlink(path)
    emit("calibrate", memcpy_s=best, write_s=t1 - t0, fsync_s=t2 - t1,
         state_bytes=cfg.files * cfg.file_size)


def preemption_child_main(cfg_dict: dict[str, Any]) -> None:
    """The child: resume, then train and report ``state=`` until a signal ends it."""
    os.environ.update(cfg_dict.get("env") or {})
    cfg = PreemptionCrashConfig(**cfg_dict)
    emit = _Emitter(cfg.out_path)
    # Every thread's stack on SIGUSR1: what the driver reads from a child
    # still running after the grace period, before it SIGKILLs it.
    faulthandler.register(signal.SIGUSR1, file=open(cfg.out_path + ".stacks", "w"),  # noqa: SIM115
                          all_threads=True)
    signum = int(getattr(signal, cfg.signal))
    if cfg.handler:  # the program's own handler, set before the session starts
        signal.signal(signum, lambda s, f: sys.exit(cfg.handler_exit_code))
    _instrument(emit)
    import numpy as np

    from checkpoint_store import CheckpointConfig, LocalTier, PreemptionConfig, session
    from checkpoint_store.errors import Preempted

    warnings.simplefilter("ignore")
    tier = (LocalTier(cfg.local_tier_path, num_to_keep=2, fsync=cfg.tier_fsync,
                      max_bytes=_tier_bytes(cfg)) if cfg.use_tier else None)
    preemption = (PreemptionConfig(signals=(cfg.signal,), grace_period_s=cfg.grace_period_s,
                                   exit_code=cfg.exit_code) if cfg.opt_in else None)
    emit("enter", m="start")
    active = session.start(
        storage_path=cfg.storage_path, storage_options=cfg.storage_options,
        experiment_name=cfg.experiment_name, trial_name=cfg.trial_name,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_to_keep),
        local_tier=tier, preemption=preemption)
    emit("leave", m="start")
    with active as s:
        latest = s.get_checkpoint()
        step = int(latest.internal_metadata["metrics"]["step"]) + 1 if latest else 0
        emit("resumed", step=step - 1 if latest else None)
        if cfg.calibrate:
            _calibrate(cfg, emit, cfg.local_tier_path if cfg.use_tier else cfg.work_dir)
        while True:
            emit("enter", m="step", step=step)
            state = {"files": {str(i): np.frombuffer(payload(step, i, cfg.file_size),
                                                     dtype=np.uint8)
                               for i in range(cfg.files)}, "step": step}
            time.sleep(cfg.step_s)
            emit("leave", m="step", step=step)
            try:
                row = s.report({"step": step}, state=state, upload_mode=cfg.upload_mode)
            except Preempted as exc:
                emit("preempted", step=step, code=exc.code, signal=exc.signal)
                raise
            emit("ack", step=step, dir=row["checkpoint_dir_name"],
                 kept=s.manager.kept_dir_names)
            step += 1


# -- the driver ------------------------------------------------------------------------------


class _Events:
    """The events a child wrote so far (read incrementally)."""

    def __init__(self, path: str):
        self.path = path
        self._pos = 0
        self._rest = b""
        self.all: list[dict[str, Any]] = []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return
        self._pos += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            try:
                self.all.append(json.loads(line))
            except ValueError:
                pass

    def of(self, ev: str, m: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.all if e["ev"] == ev and (m is None or e.get("m") == m)]

    def intervals(self, moment: str) -> list[tuple[float, float | None]]:
        """(enter, leave or None) of each occurrence of ``moment``."""
        out: list[tuple[float, float | None]] = []
        for e in self.all:
            if e.get("m") != moment:
                continue
            if e["ev"] == "enter":
                out.append((e["t"], None))
            elif e["ev"] == "leave" and out and out[-1][1] is None:
                out[-1] = (out[-1][0], e["t"])
        return out


def _stacks_of(pid: int, out_path: str) -> str:
    """Every thread's stack of the child ``pid`` (its faulthandler, on
    SIGUSR1), the last 6,000 characters; or why there are none."""
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(the child is gone)"
    deadline = time.monotonic() + 2.0
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            with open(out_path + ".stacks") as f:
                text = f.read()
        except OSError:
            continue
        if text.rstrip().endswith(")") or "most recent call first" in text:
            time.sleep(0.2)  # let it finish writing every thread
            with open(out_path + ".stacks") as f:
                text = f.read()
            break
    return text[-6000:] or "(no stacks written within 2 s)"


def _log_acks(cfg: PreemptionCrashConfig, events: _Events) -> None:
    """Append the child's acknowledged reports to the logs the checks read."""
    lines = [json.dumps({"step": a["step"], "dir": a["dir"], "kept": a["kept"]}) + "\n"
             for a in events.of("ack")]
    logs = [cfg.log_path]
    if not (cfg.use_tier and events.of("preempted")):
        logs.append(cfg.durable_log_path)
    for path in logs:
        with open(path, "a") as log:
            log.writelines(lines)


def _alive_persist(pid: int) -> bool:
    """The persist process ``pid`` still runs (not gone, not a zombie, not another program)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and b"checkpoint_store.state._persist" in cmdline


class PreemptionHarness:
    """Runs the child, signals it at a moment, waits up to the grace, checks, repeats.

    Args:
        config: see :class:`PreemptionCrashConfig`.
        seed: seeds the moments' occurrences, delays, targets and upload modes.
        moment_timeout_s: a child that has not entered the chosen moment by
            then is signalled anyway (counted in ``timeouts``).
        orphan_wait_s: how long a persist process may outlive its child.
    """

    def __init__(self, config: PreemptionCrashConfig, *, seed: int = 0,
                 moment_timeout_s: float = 30.0, orphan_wait_s: float = 5.0):
        if config.num_to_keep is not None and config.num_to_keep < 2:
            raise ValueError("num_to_keep must be >= 2 (the previous checkpoint and the "
                             "preemption one)")
        self.config = config
        self.rng = random.Random(seed)
        self.moment_timeout_s = moment_timeout_s
        self.orphan_wait_s = orphan_wait_s
        self._durations: dict[str, list[float]] = {}

    def _typical(self, moment: str) -> float:
        seen = self._durations.get(moment)
        if seen:
            return statistics.median(seen[-20:])
        return self.config.step_s if moment == "step" else _TYPICAL[moment]

    def run(self, kills: int, *, opt_in: bool = True, signals: tuple[str, ...] = ("SIGTERM",),
            handlers: tuple[bool, ...] = (False,), targets: tuple[str, ...] = ("child", "group"),
            moments: tuple[str, ...] = MOMENTS, upload_modes: tuple[str, ...] = ("async", "sync"),
            stop_on_violation: bool = True) -> PreemptionReport:
        """Signal ``kills`` children, checking after each.

        Moments and targets (``"child"``: ``os.kill``, ``"group"``:
        ``os.killpg``) go in turn (with five moments and two targets, every
        ten signals cover each pair); the signal, whether the program has its
        own handler (``sys.exit``) and the upload mode are drawn per child.
        ``tier_copy`` children save through the local tier.
        """
        unknown = set(moments) - set(MOMENTS)
        if unknown or not moments:
            raise ValueError(f"moments must be among {MOMENTS}, got {moments}")
        cfg0 = self.config
        os.makedirs(cfg0.work_dir, exist_ok=True)
        report = PreemptionReport()
        t0 = time.monotonic()
        from checkpoint_store.registry import resolve

        backend, root = resolve(cfg0.storage_path, storage_options=cfg0.storage_options)
        zygote = Zygote(tuple(dict.fromkeys((*_PRELOAD, *cfg0.preload))))
        try:
            for k in range(kills):
                moment = moments[k % len(moments)]
                cfg = replace(cfg0, opt_in=opt_in, signal=self.rng.choice(signals),
                              handler=self.rng.choice(handlers),
                              use_tier=moment == "tier_copy",
                              upload_mode=self.rng.choice(upload_modes),
                              out_path=os.path.join(cfg0.work_dir, f"child_{k:04d}.jsonl"))
                target = targets[k % len(targets)]  # every moment meets every target
                bad = self._one(k, cfg, moment, target, zygote, report, backend, root)
                report.violations.extend(
                    f"signal {k + 1} ({cfg.signal} to the {target} during {moment}, "
                    f"{'opted in' if opt_in else 'no opt-in'}"
                    f"{', own handler' if cfg.handler else ''}, "
                    f"{'tier, ' if cfg.use_tier else ''}{cfg.upload_mode}): {v}" for v in bad)
                if report.violations and stop_on_violation:
                    break
        finally:
            zygote.close()
        report.seconds = time.monotonic() - t0
        return report

    def _one(self, k: int, cfg: PreemptionCrashConfig, moment: str, target: str,
             zygote: Zygote, report: PreemptionReport, backend: Any, root: str) -> list[str]:
        from checkpoint_store import StorageContext

        storage = StorageContext.from_backend(backend, root, cfg.experiment_name, cfg.trial_name)
        before = {int(m["index"]): m for _, m in storage.committed_checkpoints()}
        signum = int(getattr(signal, cfg.signal))
        events = _Events(cfg.out_path)
        pid = zygote.ask(op="spawn", config=asdict(cfg), main=_CHILD_MAIN, setsid=True)["pid"]
        occurrence = 1 if moment == "start" else self.rng.randint(1, 3)
        deadline = time.monotonic() + self.moment_timeout_s
        code: int | None = None
        enter: dict[str, Any] | None = None
        while True:
            events.poll()
            entered = events.of("enter", moment)
            if len(entered) >= occurrence:
                enter = entered[occurrence - 1]
                break
            code = zygote.ask(op="poll", pid=pid)["exitcode"]
            if code is not None or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        bad: list[str] = []
        report.kills += 1
        report.per_moment[moment] += 1
        report.per_target[target] += 1
        if code is not None:
            events.poll()
            return [f"the child exited (code {code}) before the signal; its traceback is on "
                    f"stderr; last events {events.all[-3:]}"]
        if enter is None:
            report.timeouts += 1
            when = time.monotonic()
        else:
            when = enter["t"] + self.rng.uniform(0.0, self._typical(moment))
        time.sleep(max(0.0, when - time.monotonic()))
        sent, sent_wall = time.monotonic(), time.time()
        try:
            if target == "group":
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass
        grace_end = sent + cfg.grace_period_s
        while code is None and time.monotonic() < grace_end:
            code = zygote.ask(op="poll", pid=pid)["exitcode"]
            if code is None:
                time.sleep(0.002)
        exited = time.monotonic()
        if code is None:
            report.killed_after_grace += 1
            bad.append(f"still running {cfg.grace_period_s} s after the signal: SIGKILLed; "
                       f"its threads then:\n{_stacks_of(pid, cfg.out_path)}")
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = zygote.ask(op="wait", pid=pid)["exitcode"]
        else:
            report.signal_to_exit_s.append(exited - sent)
        events.poll()
        for m in MOMENTS:
            spans = events.intervals(m)
            self._durations.setdefault(m, []).extend(b - a for a, b in spans if b is not None)
            if m == moment and any(a <= sent and (b is None or sent <= b) for a, b in spans):
                report.inside[m] += 1
        acks = events.of("ack")
        report.acknowledged += len(acks)
        if not acks:
            report.before_any_ack += 1
        _log_acks(cfg, events)
        bad.extend(self._judge_exit(cfg, code, signum, events, report, sent_wall))
        bad.extend(self._check_storage(cfg, storage, backend, root, before, events, report))
        bad.extend(self._check_orphans(events, report))
        return bad

    def _judge_exit(self, cfg: PreemptionCrashConfig, code: int, signum: int, events: _Events,
                    report: PreemptionReport, sent_wall: float) -> list[str]:
        preempted = events.of("preempted")
        started = bool(events.of("leave", "start"))
        if code == -signal.SIGKILL:
            report.outcomes["sigkilled"] += 1
            return []  # already a violation
        if preempted:
            report.outcomes["preempted"] += 1
            report.signal_to_preempted_s.append(preempted[0]["wall"] - sent_wall)
            if not cfg.opt_in:
                return [f"Preempted raised without preemption= (code {code})"]
            if code != cfg.exit_code:
                return [f"the child ended by Preempted exited with {code}, not the "
                        f"configured {cfg.exit_code}"]
            return []
        if code == -signum and not started:
            report.outcomes["before_handler"] += 1  # the default action, during session.start
            return []
        report.outcomes[f"exit_{code}"] += 1
        if cfg.opt_in:
            return [f"the child exited with {code} instead of Preempted ({cfg.exit_code}); "
                    f"last events {events.all[-3:]}"]
        want = (cfg.handler_exit_code if cfg.handler
                else 128 + 2 if signum == signal.SIGINT else 128 + signum)
        if code != want:
            return [f"the child exited with {code}, not {want}; last events {events.all[-3:]}"]
        return []

    def _check_storage(self, cfg: PreemptionCrashConfig, storage: Any, backend: Any, root: str,
                       before: dict[int, dict[str, Any]], events: _Events,
                       report: PreemptionReport) -> list[str]:
        from checkpoint_store.testing.crash.check import _check_rows, _last_ack, check_trial

        bad, newest_step = check_trial(cfg.crash_config(), backend, root)
        # Every acknowledged report has its row; the newest committed step is
        # at or after the last acknowledged one (with a tier: the preemption
        # checkpoint supersedes the copies left on the local tier).
        bad.extend(v for v in _check_rows(storage.read_results(), cfg.log_path) if v not in bad)
        ack = _last_ack(cfg.log_path)
        if ack is not None and newest_step < ack["step"]:
            bad.append(f"the newest committed step on the storage_path is {newest_step}, "
                       f"older than the last acknowledged {ack['step']}")
        after = {int(m["index"]): m for _, m in storage.committed_checkpoints()}
        if before:
            prev = max(before)
            newer = sum(1 for i in after if i > prev)
            if prev not in after and newer < cfg.num_to_keep:
                bad.append(f"the previous complete checkpoint {prev} (step "
                           f"{before[prev]['metrics']['step']}) was lost; only {newer} newer "
                           "ones are committed")
        for p in events.of("preempted"):
            found = [m for m in after.values() if m["metrics"]["step"] == p["step"]]
            if not found:
                bad.append(f"the preemption checkpoint of step {p['step']} is not committed")
                continue
            report.preemption_checkpoints += 1
            mark = found[0].get("preemption")
            if not isinstance(mark, dict) or mark.get("signal") != cfg.signal or (
                    mark.get("grace_period_s") != cfg.grace_period_s):
                bad.append(f"the preemption checkpoint of step {p['step']} has no (or a wrong) "
                           f"'preemption' in its metadata: {mark!r}")
        if cfg.use_tier:
            bad.extend(self._check_tier_resume(cfg))
        return bad

    def _check_tier_resume(self, cfg: PreemptionCrashConfig) -> list[str]:
        """A new session with the local tier resumes from a checkpoint that
        verifies, holds its own step's bytes and is at least as new as the last ack."""
        import google_crc32c

        from checkpoint_store import CheckpointConfig, LocalTier, StorageContext
        from checkpoint_store.errors import CheckpointStoreError
        from checkpoint_store.session import Session
        from checkpoint_store.testing.crash.check import _last_ack

        bad: list[str] = []
        ack = _last_ack(cfg.log_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = Session(StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name,
                                       storage_options=cfg.storage_options,
                                       run_id=f"check{time.time_ns()}"),
                        CheckpointConfig(num_to_keep=cfg.num_to_keep),
                        local_tier=LocalTier(cfg.local_tier_path, num_to_keep=2,
                                             max_bytes=_tier_bytes(cfg)))
            try:
                got = s.get_checkpoint()
                if got is None:
                    if ack is not None:
                        bad.append("with the local tier, get_checkpoint() returned None")
                else:
                    try:
                        got.verify()
                        meta = got.internal_metadata
                        step = int(meta["metrics"]["step"])
                        for i in range(cfg.files):
                            want = f"{google_crc32c.value(payload(step, i, cfg.file_size)):08x}"
                            have = (meta.get("tensors") or {}).get(f"files/{i}", {})
                            if have.get("crc32c") != want:
                                raise CheckpointStoreError(f"files/{i} holds other bytes")
                        if ack is not None and step < ack["step"]:
                            bad.append(f"with the local tier, get_checkpoint() resumed step "
                                       f"{step}, older than the last acknowledged {ack['step']}")
                    except CheckpointStoreError as exc:
                        bad.append(f"with the local tier, get_checkpoint() returned {got.uri}, "
                                   f"which is partial: {exc}")
                s.wait()
            finally:
                s.close()
        return bad

    def _check_orphans(self, events: _Events, report: PreemptionReport) -> list[str]:
        bad = []
        for e in events.of("persist_pid"):
            pid = int(e["pid"])
            deadline = time.monotonic() + self.orphan_wait_s
            while _alive_persist(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if _alive_persist(pid):
                report.orphans += 1
                bad.append(f"the persist process {pid} outlived its child by "
                           f"{self.orphan_wait_s} s")
                try:
                    os.kill(pid, signal.SIGKILL)  # ours: started by the child we ran
                except ProcessLookupError:
                    pass
        return bad


def time_preemption(config: PreemptionCrashConfig, *, acks_before: int = 1,
                    timeout_s: float = 600.0) -> dict[str, Any]:
    """One signal, timed: the child (``config.use_tier``, ``upload_mode``
    as given) saves ``acks_before`` times, then gets SIGTERM to its process
    group as a step starts with no save in flight (the worst moment for the
    signal itself: a whole step before the next ``report()``).

    Returns seconds from the signal to: the preemption checkpoint committed on
    the local tier (``tier_commit``, with a tier), committed on the
    storage_path (``durable_commit``), ``Preempted`` raised (the session
    closed: lease released, ``stopped.json`` written) and the child's exit;
    next to the child's own ``step_s`` (its last step), ``memcpy_s`` (one
    copy of the state in memory), ``write_s`` and ``fsync_s`` (writing it to
    the tier's or the work directory's disk, then its fsync), and whether
    the checks after the signal found violations.
    """
    cfg = replace(config, calibrate=True, opt_in=True, signal="SIGTERM",
                  out_path=os.path.join(config.work_dir, f"timed-{time.time_ns()}.jsonl"))
    os.makedirs(cfg.work_dir, exist_ok=True)
    from checkpoint_store import StorageContext
    from checkpoint_store.registry import resolve

    backend, root = resolve(cfg.storage_path, storage_options=cfg.storage_options)
    storage = StorageContext.from_backend(backend, root, cfg.experiment_name, cfg.trial_name)
    before = {int(m["index"]): m for _, m in storage.committed_checkpoints()}
    harness = PreemptionHarness(cfg)
    report = PreemptionReport()
    zygote = Zygote(tuple(dict.fromkeys((*_PRELOAD, *cfg.preload))))
    events = _Events(cfg.out_path)
    try:
        pid = zygote.ask(op="spawn", config=asdict(cfg), main=_CHILD_MAIN, setsid=True)["pid"]
        deadline = time.monotonic() + timeout_s
        missed = 0  # step starts with a durable copy still running
        seen: dict[str, Any] | None = None
        busy = False
        while True:
            events.poll()
            last = events.all[-1] if events.all else {}

            def open_(*moments: str) -> bool:
                return any(b is None for m in moments for _, b in events.intervals(m))

            if (len(events.of("ack")) >= acks_before and last.get("ev") == "enter"
                    and last.get("m") == "step" and not open_("staging", "upload",
                                                               "tier_commit")):
                # A local tier's copy may outlast every step: after three tries
                # the signal comes with the previous durable copy running.
                busy = open_("tier_copy")
                if not busy or missed >= 3:
                    break
                if seen is not last:
                    seen, missed = last, missed + 1
            if zygote.ask(op="poll", pid=pid)["exitcode"] is not None:
                raise RuntimeError(f"the timed child exited early: {events.all[-3:]}")
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                zygote.ask(op="wait", pid=pid)
                raise TimeoutError(f"no {acks_before} saves within {timeout_s} s")
            time.sleep(0.001)
        sent, sent_wall = time.monotonic(), time.time()
        os.killpg(pid, signal.SIGTERM)
        code = None
        while code is None and time.monotonic() < sent + cfg.grace_period_s:
            code = zygote.ask(op="poll", pid=pid)["exitcode"]
            if code is None:
                time.sleep(0.002)
        exited = time.monotonic()
        if code is None:
            os.killpg(pid, signal.SIGKILL)
            code = zygote.ask(op="wait", pid=pid)["exitcode"]
    finally:
        zygote.close()
    events.poll()
    _log_acks(cfg, events)

    def last_after(ev: str, m: str) -> float | None:
        ts = [e["t"] for e in events.of(ev, m) if e["t"] >= sent]
        return max(ts) - sent if ts else None

    steps = [b - a for a, b in events.intervals("step") if b is not None]
    calib = (events.of("calibrate") or [{}])[0]
    preempted = events.of("preempted")
    bad = harness._judge_exit(cfg, code, signal.SIGTERM, events, report, sent_wall)
    bad += harness._check_storage(cfg, storage, backend, root, before, events, report)
    bad += harness._check_orphans(events, report)
    durable = [e["t"] for e in events.all if e["ev"] == "leave" and e.get("m") == "upload"
               and e["t"] >= sent]
    if cfg.use_tier:
        durable = [e["t"] for e in events.of("leave", "tier_copy") if e["t"] >= sent]
    return {
        "state_bytes": cfg.files * cfg.file_size,
        "exit_code": code,
        "copy_running_at_signal": busy,
        "tier_commit_s": last_after("leave", "tier_commit") if cfg.use_tier else None,
        "durable_commit_s": (max(durable) - sent) if durable else None,
        "preempted_s": (preempted[0]["t"] - sent) if preempted else None,
        "exit_s": exited - sent,
        "step_s": steps[-1] if steps else None,  # the step the signal came in
        "memcpy_s": calib.get("memcpy_s"),
        "write_s": calib.get("write_s"),
        "fsync_s": calib.get("fsync_s"),
        "violations": bad,
    }
