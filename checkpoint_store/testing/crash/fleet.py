"""Kills across machines and jobs: local tier, ``report(state=...)``, restarts elsewhere.

:class:`FleetHarness` forks saving children (from the harness's zygote) that
start a session (``session.start(storage_path=..., local_tier=LocalTier(...))``
or no tier), resume from ``get_checkpoint()``, load what it returned and save
forever, each save a directory (``source="checkpoint"``) or a state from
memory (``source="state"``, ``upload_mode`` ``"sync"`` or ``"async"``). The
parent kills each child with SIGKILL after a random delay and restarts it.
Two scenarios:

* ``"machines"``: one job; each restart runs on a machine drawn at random:
  the first machine (``tier_paths[0]``), a second machine whose tier is kept
  between its runs and so goes stale (``tier_paths[1]``), a fresh machine
  (a new, empty tier directory) or a machine without a tier, always against
  the same ``storage_path``, and back to the first machine afterwards.
* ``"jobs"``: two jobs (``storage_paths[0]`` and ``[1]``, default experiment
  and trial names) on one tier path (``tier_paths[0]``), started at once,
  each killed and restarted.

Each child fsyncs one JSON line to its job's side file (``<work_dir>/job<j>.log``)
at its start, one once it has resumed (what ``get_checkpoint()`` returned,
whether its bytes are the ones saved at that step, and what the
storage_path holds under the same index) and one per acknowledged step:
``report()`` returned and, with a local tier or ``upload_mode="async"``,
``wait()`` returned (the step is durable). Every save's bytes depend on the
job, the step and the attempt (the restart that saved it), so a copy saved
by another run of the same step, or by the other job, is told apart from
the acknowledged one.

After every kill, per job, :meth:`FleetHarness.check_job` reads (never
writes) the storage_path and the tiers, and the side file; at the end each
job is restarted once more on the first machine, waits for its copies and
is checked again. What counts as a :class:`Violation`, by kind:

* ``wrong_resume``: a restart resumed a step older than the newest
  acknowledged one, or nothing although a step was acknowledged;
* ``stale_resume``: a restart resumed the newest acknowledged step (or one
  of that index) from a copy other than the acknowledged one: another
  attempt's bytes, or a local copy that differs from the storage_path's
  committed copy of the same index;
* ``partial_resume``: what was resumed does not load, or its bytes are not
  those its metadata names;
* ``foreign_resume``: a restart resumed the other job's checkpoint;
* ``lost_ack``: an acknowledged step has no row in ``result.json`` (or only
  another attempt's);
* ``duplicate_row``: a ``training_iteration`` twice (or out of order) in
  ``result.json``, or a step twice where an earlier row was acknowledged;
* ``redone_step``: a step twice in ``result.json``, each earlier row written
  by a run whose save of that step was never acknowledged (``report()``
  returned or was cut short, no ``wait()``), and the restart that saved it
  again could reach, when it started, a complete copy of that step or a
  newer one in the trial's history: committed on the storage_path, or on
  its own machine's tier and not superseded (:func:`live_copies`). It
  should have resumed that copy: a wrong resume. Each child records what
  it can reach (read only, before its session starts) in its start line.
  A redone step whose only copy the restart could not reach is
  ``redone_unreachable``, counted in :attr:`FleetReport.noted`, never a
  violation: a step reported but never acknowledged whose copy sat on
  another machine's tier, or never became durable (an upload killed before
  its commit), must be trained again; its first row stays in
  ``result.json`` (it was reported, and ``training_iteration`` never
  repeats);
* ``duplicate_checkpoint``: two committed checkpoints of one step on the
  storage_path;
* ``partial_checkpoint``: a checkpoint lists as committed (storage_path or
  tier) but does not verify, or holds bytes other than its metadata names;
* ``foreign_checkpoint`` / ``foreign_row``: the other job's checkpoint or
  row in this job's storage_path;
* ``shared_tier``: one tier trial directory holds committed checkpoints of
  both jobs;
* ``child_error``: a child ended by itself (its last error line is kept).

Each violation names its kind, job, kill, step and the copy (URI) involved;
:class:`FleetReport` counts them per kind and keeps every one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store.testing.crash._child import Zygote

__all__ = ["KINDS", "NOTED", "REFUSED_EXIT", "FleetConfig", "FleetHarness", "FleetReport",
           "Violation", "fleet_payload", "live_copies"]

KINDS = ("wrong_resume", "stale_resume", "partial_resume", "foreign_resume", "lost_ack",
         "duplicate_row", "redone_step", "duplicate_checkpoint", "partial_checkpoint",
         "foreign_checkpoint", "foreign_row", "shared_tier", "child_error")

#: Findings counted but never violations (:attr:`FleetReport.noted`).
NOTED = ("redone_unreachable",)

#: A child's exit code when its session start was refused (a typed error that
#: writes nothing: a tier directory bound to another storage_path, or held
#: by the other job's session, ``TrialInUseError``): no
#: violation, counted in :attr:`FleetReport.refused`.
REFUSED_EXIT = 3

#: Kinds judged per restart (each restart's violations count on their own).
_RESTART_KINDS = ("wrong_resume", "stale_resume", "partial_resume", "foreign_resume",
                  "child_error")

#: The session's default names (``session.start`` without experiment or trial name).
_DEFAULT_NAME = "default"


@dataclass(frozen=True)
class FleetConfig:
    """Where and how the children save.

    Args:
        storage_paths: the durable storage_path of each job (local paths or
            URIs); ``"machines"`` uses the first, ``"jobs"`` the first two.
        tier_paths: local tier directories: ``[0]`` the first machine's,
            ``[1]`` (``"machines"`` only) the second machine's.
        work_dir: a local directory for the side files, the children's
            stderr, scratch directories and fresh machines' tiers.
        storage_options: backend options for URI storage_paths.
        env: environment variables set in the children (credentials, endpoints).
        preload: modules the zygote imports once (e.g. ``("s3fs",)``).
        source: ``"checkpoint"`` (a directory of ``files`` files per save)
            or ``"state"`` (``report(state=...)``, ``files`` uint8 tensors).
        upload_mode: ``"sync"`` or ``"async"`` (passed to ``report``).
        num_to_keep: the storage_path retention's (>= 1).
        tier_keep: the local tier's ``num_to_keep``.
        files, file_size: per save; bytes per file.
        machine_weights: ``"machines"``: relative odds of a restart on the
            first machine, the second, a fresh one and one without a tier.
        wait_odds: with a tier or ``upload_mode="async"``, the odds that the
            child calls ``wait()`` after a report (that step and every one
            before it are then acknowledged); the others are logged as
            reported only, so kills leave local copies and uploads pending.
    """

    storage_paths: tuple[str, ...]
    tier_paths: tuple[str, ...]
    work_dir: str
    storage_options: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    source: str = "checkpoint"
    upload_mode: str = "sync"
    num_to_keep: int = 2
    tier_keep: int = 1
    files: int = 2
    file_size: int = 16 * 1024
    machine_weights: tuple[float, float, float, float] = (0.5, 0.2, 0.15, 0.15)
    wait_odds: float = 0.3


@dataclass(frozen=True)
class Violation:
    """One thing that must not happen. ``copy``: the URI of the checkpoint
    involved (resumed, listed) or ``""``; ``step``: the step, or -1."""

    kind: str
    job: int
    kill: int
    step: int
    copy: str
    detail: str

    def __str__(self) -> str:
        where = f" copy {self.copy}" if self.copy else ""
        return f"[{self.kind}] job {self.job} kill {self.kill} step {self.step}{where}: " \
               f"{self.detail}"


@dataclass
class FleetReport:
    """What :meth:`FleetHarness.run` saw."""

    scenario: str = ""
    kills: int = 0
    #: restarts per machine ("first", "second", "fresh", "none").
    machines: Counter[str] = field(default_factory=Counter)
    restarts_checked: int = 0
    #: job -> starts refused with a typed error (exit code :data:`REFUSED_EXIT`).
    refused: Counter[int] = field(default_factory=Counter)
    #: steps acknowledged (report and, where the copy is made in the background, wait).
    acknowledged: int = 0
    #: steps whose report() returned without a wait() (pending copies when killed).
    reported: int = 0
    violations: list[Violation] = field(default_factory=list)
    #: findings of the :data:`NOTED` kinds (inherent, not violations).
    noted: list[Violation] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> Counter[str]:
        """Violations per kind."""
        return Counter(v.kind for v in self.violations)

    def of(self, *kinds: str) -> list[Violation]:
        return [v for v in self.violations if v.kind in kinds]

    def summary(self) -> str:
        machines = ", ".join(f"{k} {n}" for k, n in sorted(self.machines.items()))
        head = (f"{self.scenario}: {self.kills} kills [{machines}], {self.restarts_checked} "
                f"restarts checked, refused {dict(self.refused)}, "
                f"{self.acknowledged} steps acknowledged ({self.reported} more reported), "
                f"{len(self.violations)} violations {dict(self.counts)}, noted "
                f"{dict(Counter(v.kind for v in self.noted))} in {self.seconds:.1f}s")
        first: dict[str, Violation] = {}
        for v in self.violations:
            first.setdefault(v.kind, v)
        return "\n".join([head, *(f"  e.g. {v}" for v in first.values())])


def fleet_payload(job: int, step: int, attempt: int, i: int, size: int) -> bytes:
    """The bytes of file ``i`` of the save of ``step`` by ``job``'s run ``attempt``."""
    seed = hashlib.blake2b(f"{job}/{step}/{attempt}/{i}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _file_name(i: int) -> str:
    return f"part_{i}.bin"


# -- the child -----------------------------------------------------------------------------


def _append(path: str, record: dict[str, Any]) -> None:
    """One JSON line, fsynced before returning (the side file outlives the kill)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _loaded_files(ckpt: Any, source: str, files: int, scratch: str) -> list[bytes]:
    """The files (``source="checkpoint"``) or tensors of ``ckpt``, as bytes."""
    if source == "state":
        import numpy as np

        state = ckpt.load_state()
        return [np.asarray(state["files"][str(i)]).tobytes() for i in range(files)]
    target = os.path.join(scratch, "resumed")
    ckpt.to_directory(target)
    out = []
    for i in range(files):
        with open(os.path.join(target, _file_name(i)), "rb") as f:
            out.append(f.read())
    return out


def _resume_record(ckpt: Any, child: dict[str, Any], names: dict[str, str],
                   scratch: str) -> dict[str, Any]:
    """What the child resumed: step, attempt, job and index from the metadata,
    whether the bytes load and match, and the storage_path's copy of that index."""
    from checkpoint_store import StorageContext
    from checkpoint_store._format.layout import checkpoint_dir_name

    meta = ckpt.internal_metadata
    m = meta.get("metrics") or {}
    rec: dict[str, Any] = {"resumed": m.get("step"), "attempt": m.get("attempt"),
                           "job": m.get("job"), "index": meta.get("index"), "uri": ckpt.uri}
    try:
        got = _loaded_files(ckpt, child["source"], child["files"], scratch)
        want = [fleet_payload(int(m["job"]), int(m["step"]), int(m["attempt"]), i,
                              child["file_size"]) for i in range(child["files"])]
        bad = [i for i in range(child["files"]) if got[i] != want[i]]
        rec["bytes"] = "ok" if not bad else f"files {bad} hold other bytes than its metadata names"
    except Exception as exc:  # noqa: BLE001  (recorded, judged by the parent)
        rec["bytes"] = f"does not load: {type(exc).__name__}: {str(exc)[:300]}"
    try:
        durable = StorageContext(child["storage_path"], names["experiment_name"],
                                 names["trial_name"], storage_options=child["storage_options"])
        index = int(meta["index"])
        for _, dmeta in durable.committed_checkpoints():
            if dmeta.get("index") == index:
                dm = dmeta.get("metrics") or {}
                rec["durable_copy"] = {"step": dm.get("step"), "attempt": dm.get("attempt"),
                                       "job": dm.get("job"),
                                       "uri": durable.uri(durable.trial_path) + "/"
                                       + checkpoint_dir_name(index)}
    except Exception as exc:  # noqa: BLE001
        rec["durable_copy_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return rec


def _reachable(child: dict[str, Any]) -> dict[str, Any]:
    """What a restart can reach before its session starts (read only): this
    job's committed copies on the storage_path and on this machine's tier,
    each ``[where, step, attempt, index]``, and this job's ``result.json``
    rows as ``[step, attempt]`` in order (see :func:`live_copies`)."""
    from checkpoint_store import StorageContext

    job = child["job"]
    out: dict[str, Any] = {"copies": [], "rows": []}
    places = [("storage_path", child["storage_path"], child["storage_options"])]
    if child["tier_path"]:
        places.append(("tier", child["tier_path"], None))
    try:
        for where, path, options in places:
            ctx = StorageContext(path, _DEFAULT_NAME, _DEFAULT_NAME, storage_options=options)
            for _, meta in ctx.committed_checkpoints():
                m = meta.get("metrics") or {}
                if m.get("job") == job:
                    out["copies"].append([where, m.get("step"), m.get("attempt"),
                                          meta.get("index")])
            if where == "storage_path":
                out["rows"] = [[r.get("step"), r.get("attempt")] for r in ctx.read_results()
                               if r.get("job") == job]
    except Exception as exc:  # noqa: BLE001  (judged as "unknown" by the parent)
        out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def live_copies(reachable: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """The copies in ``reachable`` (:func:`_reachable`) that belong to the
    trial's history, ``(where, step, attempt, index)``: every committed copy
    on the storage_path; a tier copy unless the storage_path's committed copy
    of its index is another save, or a row of a later attempt names a step
    at or below its own (a later run went back past it: the history branched
    away from it, docs/tiers.md "One history"). Attempts number the runs of
    a job in time order, so "later" is "a higher attempt"."""
    copies = [(str(c[0]), c[1], c[2], c[3]) for c in reachable.get("copies", [])
              if isinstance(c[1], int) and isinstance(c[2], int)]
    durable = {c[3]: (c[1], c[2]) for c in copies if c[0] == "storage_path"}
    rows = [(r[0], r[1]) for r in reachable.get("rows", [])
            if isinstance(r[0], int) and isinstance(r[1], int)]
    live = []
    for where, step, attempt, index in copies:
        if where != "storage_path":
            if durable.get(index, (step, attempt)) != (step, attempt):
                continue
            if any(a > attempt and st <= step for st, a in rows):
                continue
        live.append((where, step, attempt, index))
    return live


def fleet_child_main(child: dict[str, Any]) -> None:
    """The child: start (on its machine's tier or none), resume, save forever.

    ``child``: ``job``, ``attempt``, ``storage_path``, ``storage_options``,
    ``tier_path`` (None: no tier), ``log_path``, ``source``, ``upload_mode``,
    ``num_to_keep``, ``tier_keep``, ``files``, ``file_size``, ``env``,
    ``final`` (resume, wait for the copies, end the session, return).
    """
    os.environ.update(child.get("env") or {})
    err = os.open(child["log_path"] + ".stderr", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    import numpy as np

    from checkpoint_store import Checkpoint, CheckpointConfig, LocalTier, session
    from checkpoint_store.errors import InvalidConfigError, TrialInUseError

    warnings.simplefilter("ignore")
    job, attempt, log = child["job"], child["attempt"], child["log_path"]
    scratch = os.path.join(os.path.dirname(log), f"scratch-{job}-{attempt}")
    os.makedirs(scratch, exist_ok=True)
    names = {"experiment_name": _DEFAULT_NAME, "trial_name": _DEFAULT_NAME}
    _append(log, {"start": attempt, "tier": child["tier_path"],
                  "reachable": _reachable(child)})
    tier = (LocalTier(child["tier_path"], num_to_keep=child["tier_keep"], fsync=False)
            if child["tier_path"] else None)
    background = tier is not None or child["upload_mode"] == "async"
    try:
        started = session.start(storage_path=child["storage_path"],
                                storage_options=child["storage_options"],
                                checkpoint_config=CheckpointConfig(
                                    num_to_keep=child["num_to_keep"]),
                                local_tier=tier)
    except (InvalidConfigError, TrialInUseError) as exc:
        # A tier directory bound to another storage_path, or held by the other job.
        _append(log, {"refused": f"{type(exc).__name__}: {str(exc)[:300]}"})
        os._exit(REFUSED_EXIT)
    with started as s:
        latest = s.get_checkpoint()
        rec = (_resume_record(latest, child, names, scratch) if latest is not None
               else {"resumed": None})
        _append(log, rec)
        if child.get("final"):
            s.wait()
            return
        resumed = rec.get("resumed")
        step = resumed + 1 if isinstance(resumed, int) else 0
        files, size = child["files"], child["file_size"]
        rng = random.Random(f"{job}/{attempt}")
        while True:
            metrics = {"step": step, "job": job, "attempt": attempt}
            blobs = [fleet_payload(job, step, attempt, i, size) for i in range(files)]
            if child["source"] == "state":
                state = {"files": {str(i): np.frombuffer(b, dtype=np.uint8)
                                   for i, b in enumerate(blobs)}, "step": step}
                row = s.report(metrics, state=state, upload_mode=child["upload_mode"])
            else:
                src = os.path.join(scratch, "save")
                os.makedirs(src, exist_ok=True)
                for i, b in enumerate(blobs):
                    with open(os.path.join(src, _file_name(i)), "wb") as f:
                        f.write(b)
                row = s.report(metrics, checkpoint=Checkpoint.from_directory(src),
                               upload_mode=None if tier is not None else child["upload_mode"])
            rec = {"attempt": attempt, "dir": row["checkpoint_dir_name"],
                   "it": row["training_iteration"], "tier": child["tier_path"]}
            if background and rng.random() >= child["wait_odds"]:
                _append(log, {"reported": step, **rec})  # committed locally or staged only
            else:
                if background:
                    s.wait()
                _append(log, {"ack": step, **rec})
            step += 1


# -- the checks ----------------------------------------------------------------------------


def _read_log(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # cannot happen with fsynced whole lines; tolerated anyway
    return out


def _last_error(path: str) -> str:
    try:
        with open(path + ".stderr") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except FileNotFoundError:
        return "no stderr"
    return lines[-1][:300] if lines else "no stderr"


class FleetHarness:
    """Runs the children of one scenario, kills and restarts them, checks.

    Args:
        config: see :class:`FleetConfig`.
        scenario: ``"machines"`` or ``"jobs"`` (module docstring).
        seed: seeds the kill delays and the machines drawn.
        min_delay, max_delay: each child is killed after a uniform random
            delay in this range (seconds) from its spawn.
    """

    def __init__(self, config: FleetConfig, *, scenario: str = "machines", seed: int = 0,
                 min_delay: float = 0.05, max_delay: float = 0.8) -> None:
        if scenario not in ("machines", "jobs"):
            raise ValueError(f"scenario is 'machines' or 'jobs', not {scenario!r}")
        if not 0 <= min_delay <= max_delay:
            raise ValueError("need 0 <= min_delay <= max_delay")
        needs = (1, 2) if scenario == "machines" else (2, 1)
        if len(config.storage_paths) < needs[0] or len(config.tier_paths) < needs[1]:
            raise ValueError(f"scenario {scenario!r} needs {needs[0]} storage path(s) and "
                             f"{needs[1]} tier path(s)")
        self.config, self.scenario = config, scenario
        self.rng = random.Random(seed)
        self.min_delay, self.max_delay = min_delay, max_delay
        self.jobs = 1 if scenario == "machines" else 2
        self._attempt = [0] * self.jobs
        self._checked = [0] * self.jobs  # log records already judged, per job
        self._fresh = 0
        self._seen: set[tuple[str, int, int, str]] = set()
        os.makedirs(config.work_dir, exist_ok=True)

    def log_path(self, job: int) -> str:
        return os.path.join(self.config.work_dir, f"job{job}.log")

    def _draw_machine(self) -> tuple[str, str | None]:
        if self.scenario == "jobs":
            return "first", self.config.tier_paths[0]
        kind = self.rng.choices(("first", "second", "fresh", "none"),
                                weights=self.config.machine_weights)[0]
        if kind == "first":
            return kind, self.config.tier_paths[0]
        if kind == "second":
            return kind, self.config.tier_paths[1]
        if kind == "fresh":
            self._fresh += 1
            return kind, os.path.join(self.config.work_dir, f"fresh-tier-{self._fresh}")
        return kind, None

    def _child(self, job: int, tier: str | None, final: bool = False) -> dict[str, Any]:
        c = self.config
        self._attempt[job] += 1
        return {"job": job, "attempt": self._attempt[job], "storage_path": c.storage_paths[job],
                "storage_options": c.storage_options, "tier_path": tier,
                "log_path": self.log_path(job), "source": c.source,
                "upload_mode": c.upload_mode, "num_to_keep": c.num_to_keep,
                "tier_keep": c.tier_keep, "files": c.files, "file_size": c.file_size,
                "env": dict(c.env), "final": final, "wait_odds": c.wait_odds}

    def run(self, kills: int) -> FleetReport:
        """Kill children until ``kills`` of them died by SIGKILL (a child that
        ended by itself, refused or failed, is no kill), checking after each
        round; then restart every job on the first machine and check once more.

        Raises:
            RuntimeError: no child was killed in 50 rounds in a row (every
                start refused or failing: see :attr:`FleetReport.violations`)."""
        report = FleetReport(scenario=self.scenario)
        t0 = time.monotonic()
        zygote = Zygote(("checkpoint_store.tiers", "checkpoint_store.testing.crash.fleet",
                         "numpy", *self.config.preload))
        main = "checkpoint_store.testing.crash.fleet:fleet_child_main"
        try:
            idle = 0
            while report.kills < kills:
                before = report.kills
                spawned = []
                for job in range(self.jobs):
                    machine, tier = self._draw_machine()
                    report.machines[machine] += 1
                    pid = zygote.ask(op="spawn", config=self._child(job, tier), main=main)["pid"]
                    spawned.append((job, pid, time.monotonic()
                                    + self.rng.uniform(self.min_delay, self.max_delay)))
                for _job, pid, at in sorted(spawned, key=lambda x: x[2]):
                    time.sleep(max(0.0, at - time.monotonic()))
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                for job, pid, _ in spawned:
                    code = zygote.ask(op="wait", pid=pid)["exitcode"]
                    if code == -signal.SIGKILL:
                        report.kills += 1
                    elif code == REFUSED_EXIT:
                        report.refused[job] += 1
                    else:
                        report.violations.append(Violation(
                            "child_error", job, report.kills, -1, "",
                            f"exited by itself (code {code}): {_last_error(self.log_path(job))}"))
                for job, _, _ in spawned:
                    self._add(report, self.check_job(job, report.kills, report))
                idle = 0 if report.kills > before else idle + 1
                if idle >= 50:
                    raise RuntimeError(f"no child was killed in 50 rounds: {report.summary()}")
            for job in range(self.jobs):  # the last restart, on the first machine, not killed
                report.machines["final"] += 1
                pid = zygote.ask(op="spawn", config=self._child(job, self.config.tier_paths[0],
                                                                final=True), main=main)["pid"]
                code = zygote.ask(op="wait", pid=pid)["exitcode"]
                if code == REFUSED_EXIT:
                    report.refused[job] += 1
                elif code != 0:
                    report.violations.append(Violation(
                        "child_error", job, report.kills, -1, "",
                        f"the final restart failed (code {code}): "
                        f"{_last_error(self.log_path(job))}"))
                self._add(report, self.check_job(job, report.kills, report))
        finally:
            zygote.close()
        logs = [r for j in range(self.jobs) for r in _read_log(self.log_path(j))]
        report.acknowledged = sum(1 for r in logs if "ack" in r)
        report.reported = sum(1 for r in logs if "reported" in r)
        report.seconds = time.monotonic() - t0
        return report

    def _add(self, report: FleetReport, found: list[Violation]) -> None:
        """Each restart's violations count once each; a state of the storage
        (a row twice, a damaged copy) counts once, at the first kill that sees it."""
        for v in found:
            if v.kind in _RESTART_KINDS:
                report.violations.append(v)
                continue
            key = (v.kind, v.job, v.step, v.copy)
            if key not in self._seen:
                self._seen.add(key)
                (report.noted if v.kind in NOTED else report.violations).append(v)

    # -- checks of one job --------------------------------------------------------------

    def check_job(self, job: int, kill: int, report: FleetReport | None = None
                  ) -> list[Violation]:
        """Judge the restarts logged since the last check, then the job's
        storage_path and tiers as they are now (read only)."""
        bad = self._check_restarts(job, kill, report)
        bad += self._check_storage(job, kill)
        return bad

    def _check_restarts(self, job: int, kill: int, report: FleetReport | None
                        ) -> list[Violation]:
        records = _read_log(self.log_path(job))
        bad: list[Violation] = []
        acked: dict[str, Any] | None = None
        local: dict[str, Any] | None = None  # the newest step the previous run committed
        tier: str | None = None  # the tier of the run that starts
        prev: dict[str, Any] | None = None
        # report() returns once the tier holds the copy: always for a directory,
        # for a state with upload_mode="sync" (async: staged in memory only).
        local_commit = self.config.source == "checkpoint" or self.config.upload_mode == "sync"
        for n, rec in enumerate(records):
            if "ack" in rec:
                acked = rec
            if "ack" in rec or "reported" in rec:
                local = rec
            if "start" in rec:
                prev, tier = local, rec.get("tier")
                local = None
            if "resumed" not in rec or n < self._checked[job]:
                continue
            if report is not None:
                report.restarts_checked += 1
            # A copy the previous run committed on this same tier must be resumed.
            same = (prev if prev is not None and "reported" in prev and tier is not None
                    and prev.get("tier") == tier and local_commit else None)
            bad += self._judge_resume(job, kill, rec, acked, same)
        self._checked[job] = len(records)
        return bad

    def _judge_resume(self, job: int, kill: int, rec: dict[str, Any],
                      acked: dict[str, Any] | None, local: dict[str, Any] | None = None
                      ) -> list[Violation]:
        """``acked``: the newest acknowledged step before this restart; ``local``:
        the newest step the previous run reported on the same tier as this
        restart's (a local commit, which a restart there must find), or None."""
        def v(kind: str, detail: str) -> Violation:
            step = rec.get("resumed")
            return Violation(kind, job, kill, step if isinstance(step, int) else -1,
                             rec.get("uri", ""), detail)

        if rec.get("resumed") is None:
            if acked is not None:
                return [v("wrong_resume", f"resumed nothing; step {acked['ack']} "
                                          f"({acked['dir']}, attempt {acked['attempt']}) "
                                          "was acknowledged")]
            return []
        bad = []
        if rec.get("job") != job:
            bad.append(v("foreign_resume", f"resumed job {rec.get('job')}'s checkpoint "
                                           f"(index {rec.get('index')})"))
        if rec.get("bytes") != "ok":
            bad.append(v("partial_resume", str(rec.get("bytes"))))
        step, attempt = rec["resumed"], rec.get("attempt")
        if acked is not None:
            if step < acked["ack"]:
                bad.append(v("wrong_resume", f"resumed step {step} (attempt {attempt}, index "
                                             f"{rec.get('index')}); step {acked['ack']} "
                                             f"({acked['dir']}, attempt {acked['attempt']}) "
                                             "was acknowledged"))
            elif step == acked["ack"] and attempt != acked["attempt"]:
                bad.append(v("stale_resume", f"resumed attempt {attempt}'s save of step {step};"
                                             f" the acknowledged save is attempt "
                                             f"{acked['attempt']}'s ({acked['dir']})"))
        if local is not None and step < local["reported"]:
            bad.append(v("wrong_resume", f"resumed step {step} (attempt {attempt}) on the tier "
                                         f"where the previous run committed step "
                                         f"{local['reported']} ({local['dir']}, attempt "
                                         f"{local['attempt']}) and report() returned"))
        durable = rec.get("durable_copy")
        if durable is not None and (durable.get("step"), durable.get("attempt"),
                                    durable.get("job")) != (step, attempt, rec.get("job")):
            bad.append(v("stale_resume",
                         f"resumed index {rec.get('index')} as step {step} attempt {attempt}; "
                         f"the storage_path's committed copy of that index "
                         f"({durable.get('uri')}) is step {durable.get('step')} attempt "
                         f"{durable.get('attempt')} job {durable.get('job')}"))
        return bad

    def _check_storage(self, job: int, kill: int) -> list[Violation]:
        from checkpoint_store import StorageContext

        c = self.config
        durable = StorageContext(c.storage_paths[job], _DEFAULT_NAME, _DEFAULT_NAME,
                                 storage_options=c.storage_options)
        bad, steps = self._check_listing(durable, job, kill, "storage_path")
        by_step: dict[int, list[str]] = {}
        for uri, step in steps:
            by_step.setdefault(step, []).append(uri)
        for step, uris in sorted(by_step.items()):
            if len(uris) > 1:
                bad.append(Violation("duplicate_checkpoint", job, kill, step, uris[0],
                                     f"{len(uris)} committed checkpoints of step {step}: "
                                     f"{uris}"))
        bad += self._check_rows(durable, job, kill)
        for tier in self._tiers():
            fast = StorageContext(tier, _DEFAULT_NAME, _DEFAULT_NAME)
            tier_bad, _ = self._check_listing(fast, job, kill, "local tier", own_only=False)
            bad += tier_bad
        return bad

    def _tiers(self) -> list[str]:
        c = self.config
        tiers = list(c.tier_paths[: 2 if self.scenario == "machines" else 1])
        tiers += [os.path.join(c.work_dir, f"fresh-tier-{k}") for k in range(1, self._fresh + 1)]
        return [t for t in tiers if os.path.isdir(t)]

    def _check_listing(self, storage: Any, job: int, kill: int, where: str,
                       own_only: bool = True) -> tuple[list[Violation], list[tuple[str, int]]]:
        """Every committed checkpoint verifies and holds the bytes its metadata
        names; on a storage_path, only this job's; on a tier, one job's only."""
        import google_crc32c

        from checkpoint_store.errors import CheckpointStoreError

        bad: list[Violation] = []
        steps: list[tuple[str, int]] = []
        jobs: dict[int, str] = {}
        try:
            committed = storage.committed_checkpoints()
        except Exception as exc:  # noqa: BLE001  (a listing that fails is a finding)
            return [Violation("partial_checkpoint", job, kill, -1, storage.trial_path,
                              f"{where}: listing failed: {type(exc).__name__}: {exc}")], []
        for ckpt, meta in committed:
            uri = ckpt.uri
            m = meta.get("metrics") or {}
            step: int = m["step"] if isinstance(m.get("step"), int) else -1
            try:
                ckpt.verify()
            except (CheckpointStoreError, OSError) as exc:
                bad.append(Violation("partial_checkpoint", job, kill, step, uri,
                                     f"{where}: lists as committed but does not verify: {exc}"))
                continue
            owner = m.get("job")
            if isinstance(owner, int):
                jobs.setdefault(owner, uri)
            if own_only and owner != job:
                bad.append(Violation("foreign_checkpoint", job, kill, step, uri,
                                     f"{where}: a checkpoint of job {owner}"))
                continue
            if not isinstance(owner, int) or not isinstance(m.get("attempt"), int):
                bad.append(Violation("partial_checkpoint", job, kill, step, uri,
                                     f"{where}: metadata without job/step/attempt: {m}"))
                continue
            if self.config.source == "state":
                crcs = {_file_name(i): ((meta.get("tensors") or {}).get(f"files/{i}") or {})
                        .get("crc32c") for i in range(self.config.files)}
            else:
                crcs = {e["path"]: e["crc32c"] for e in meta.get("manifest", [])}
            for i in range(self.config.files):
                want = google_crc32c.value(fleet_payload(owner, step, m["attempt"], i,
                                                         self.config.file_size))
                if crcs.get(_file_name(i)) != f"{want:08x}":
                    bad.append(Violation("partial_checkpoint", job, kill, step, uri,
                                         f"{where}: file {i} holds other bytes than step "
                                         f"{step} attempt {m['attempt']} saved"))
            steps.append((uri, step))
        if not own_only and len(jobs) > 1:
            bad.append(Violation("shared_tier", job, kill, -1, storage.uri(storage.trial_path),
                                 f"{where}: one trial directory holds committed checkpoints of "
                                 f"jobs {sorted(jobs)} (e.g. {sorted(jobs.values())})"))
        return bad, steps

    @staticmethod
    def _judge_redo(step: int, redoers: list[Any], starts: dict[int, dict[str, Any]]
                    ) -> tuple[str, str]:
        """``redone_step`` when a run that saved ``step`` again (``redoers``:
        its attempts) could reach, at its start, a complete copy of ``step``
        or a newer one in the trial's history (:func:`live_copies`): it
        should have resumed that copy. Else ``redone_unreachable``: the only
        copy was on another machine's tier, or never became durable."""
        for attempt in redoers:
            reach = (starts.get(attempt) or {}).get("reachable")
            if reach is None or "error" in reach:
                return "redone_step", (f"attempt {attempt} redid it; what it could reach is "
                                       f"unknown: {reach and reach.get('error')}")
            newer = [c for c in live_copies(reach) if c[1] >= step]
            if newer:
                where, st, a, index = max(newer, key=lambda c: c[1])
                return "redone_step", (f"attempt {attempt} redid it though its {where} held "
                                       f"step {st} (attempt {a}, index {index})")
        return "redone_unreachable", (f"no copy of step {step} or newer was reachable by "
                                      f"attempts {redoers} (another machine's tier, or "
                                      "never durable)")

    def _check_rows(self, storage: Any, job: int, kill: int) -> list[Violation]:
        bad: list[Violation] = []
        where = storage.uri(storage.trial_path) + "/result.json"
        try:
            rows = storage.read_results()
        except Exception as exc:  # noqa: BLE001
            return [Violation("duplicate_row", job, kill, -1, where,
                              f"result.json does not read: {type(exc).__name__}: {exc}")]
        its = Counter(r.get("training_iteration") for r in rows)
        for it, n in sorted(its.items(), key=lambda x: str(x[0])):
            if n > 1:
                bad.append(Violation("duplicate_row", job, kill, -1, where,
                                     f"training_iteration {it} recorded {n} times"))
        seq = [r.get("training_iteration") for r in rows]
        if seq != sorted(seq, key=lambda x: x if isinstance(x, int) else -1):
            bad.append(Violation("duplicate_row", job, kill, -1, where,
                                 f"training_iteration out of order: {seq[-12:]}"))
        own = [r for r in rows if r.get("job") == job]
        for r in rows:
            if r.get("job") != job:
                bad.append(Violation("foreign_row", job, kill, r.get("step", -1), where,
                                     f"a row of job {r.get('job')}: {r}"))
        log = _read_log(self.log_path(job))
        acked = {(r["ack"], r["attempt"]) for r in log if "ack" in r}
        starts = {r["start"]: r for r in log if "start" in r}
        steps = Counter(r.get("step") for r in own)
        for step, n in sorted(steps.items(), key=lambda x: str(x[0])):
            if n > 1:
                attempts = [r.get("attempt") for r in own if r.get("step") == step]
                earlier_unacked = all((step, a) not in acked for a in attempts[:-1])
                what = (f"step {step} recorded {n} times (attempts {attempts}; acknowledged: "
                        f"{[a for a in attempts if (step, a) in acked]})")
                at = step if isinstance(step, int) else -1
                if not (earlier_unacked and len(set(attempts)) == n):
                    bad.append(Violation("duplicate_row", job, kill, at, where, what))
                    continue
                kind, why = self._judge_redo(at, attempts[1:], starts)
                bad.append(Violation(kind, job, kill, at, where, f"{what}; {why}"))
        have = {(r.get("step"), r.get("attempt")) for r in own}
        for rec in log:
            if "ack" in rec and (rec["ack"], rec["attempt"]) not in have:
                others = [r.get("attempt") for r in own if r.get("step") == rec["ack"]]
                bad.append(Violation("lost_ack", job, kill, rec["ack"], where,
                                     f"acknowledged step {rec['ack']} (attempt "
                                     f"{rec['attempt']}, {rec['dir']}) has no row"
                                     + (f"; rows of attempts {others} instead" if others
                                        else "")))
        return bad
