"""Kills in every phase of a tiered report: fast commit, promotion, durable commit, evictions.

:func:`sweep_tier_crashes` forks a saving child (from the harness's zygote)
that reports with ``LocalTier`` in front of a durable storage_path, forever,
resuming from ``get_checkpoint()``; each child is given one phase and kills
itself with SIGKILL at a random moment inside it (a timer drawn from the
durations of that phase this child already saw):

* ``fast_commit``: the copy and commit on the local tier (``FastTier.commit``);
* ``promotion``: the background upload to the storage_path
  (``StorageContext.persist_checkpoint`` on the durable storage);
* ``durable_commit``: what follows the durable marker: the durable
  retention's registration and the local tier's record that the copy is
  durable (``CommitRecorder.record`` of the session; half of these kills land right at its
  start, between the marker and any record);
* ``fast_eviction`` / ``durable_eviction``: the background deletes of
  evicted checkpoints on each tier (``FastTier._delete_evicted``,
  ``CheckpointManager._delete_names``).

After each kill :func:`check_tiers` checks what the next run sees: every
checkpoint that lists as committed on either tier verifies and holds its
own step's bytes; ``get_checkpoint()`` of a new session with the same local
tier returns a checkpoint that verifies and is at least as new as the last
acknowledged report (nothing partial resumed, nothing reported lost); every
checkpoint the child was told is durable (``session.durable_index``) is on
the storage_path or was evicted there by retention after enough newer ones;
once that session's copies are done, the newest checkpoint is durable; no
leftovers, nothing foreign.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpoint_store.testing.crash._child import Zygote, file_name, payload

__all__ = ["PHASES", "TierCrashConfig", "TierCrashReport", "check_tiers", "sweep_tier_crashes"]

PHASES = ("fast_commit", "promotion", "durable_commit", "fast_eviction", "durable_eviction")


@dataclass(frozen=True)
class TierCrashConfig:
    """Where and how the tiered child saves.

    Args:
        storage_path: the durable tier (local path or URI).
        tier_path: the local tier's path.
        log_path: the child's acknowledgements, one JSON line each:
            ``{"step", "dir"}`` per ``report()`` returned, ``{"durable": index}``
            each time ``session.durable_index`` moved.
        storage_options: backend options for a URI ``storage_path``.
        num_to_keep: the durable retention's (>= 1).
        tier_keep: the local tier's ``num_to_keep``.
        files, file_size: per checkpoint.
        kill_phase, kill_after: the phase to die in and how many of its
            occurrences in the child to let pass first (set per kill).
        seed: the child's random delays.
    """

    storage_path: str
    tier_path: str
    log_path: str
    storage_options: dict[str, Any] | None = None
    experiment_name: str = "crash"
    trial_name: str = "tiers"
    num_to_keep: int = 2
    tier_keep: int = 1
    files: int = 6
    file_size: int = 64 * 1024
    kill_phase: str = "fast_commit"
    kill_after: int = 1
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class TierCrashReport:
    """What :func:`sweep_tier_crashes` saw."""

    kills: int = 0
    #: phase -> kills the child armed in that phase.
    per_phase: Counter[str] = field(default_factory=Counter)
    #: phase -> kills that landed while the phase was running.
    inside: Counter[str] = field(default_factory=Counter)
    #: kills by the parent because the child never reached its phase in time.
    timeouts: int = 0
    reports_acknowledged: int = 0
    durable_acknowledged: int = 0
    resumed_partial: int = 0
    lost_reported_durable: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        phases = ", ".join(f"{p} {self.per_phase[p]} ({self.inside[p]} inside)" for p in PHASES)
        head = (f"{self.kills} kills [{phases}; {self.timeouts} by timeout], "
                f"{self.reports_acknowledged} reports and {self.durable_acknowledged} durable "
                f"copies acknowledged, {self.resumed_partial} partial resumed, "
                f"{self.lost_reported_durable} reported-durable lost, "
                f"{len(self.violations)} violations in {self.seconds:.1f}s")
        return "\n".join([head, *self.violations[:20]])


# -- the child -----------------------------------------------------------------------------


def _arm(cfg: TierCrashConfig, fired_path: str) -> None:
    """Wrap the phases' functions so that the chosen one kills this process at a
    random moment inside its ``kill_after + 1``-th run."""
    from checkpoint_store.retention.manager import CheckpointManager
    from checkpoint_store.session._ledger import CommitRecorder
    from checkpoint_store.storage import StorageContext
    from checkpoint_store.tiers.local import FastTier

    rng = random.Random(cfg.seed)
    seen: list[float] = []
    count = [0]
    active = [0]
    lock = threading.Lock()

    def die(phase: str) -> None:
        with open(fired_path, "w") as f:
            f.write(json.dumps({"phase": phase, "inside": active[0] > 0}))
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner: Any, name: str, phase: str, when: Any = None) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when(*args):
                return original(*args, **kwargs)
            with lock:
                count[0] += 1
                armed = count[0] == cfg.kill_after + 1
                active[0] += 1
            if armed:
                if phase == "durable_commit" and rng.random() < 0.5:
                    die(phase)  # right after the durable marker, before any record
                # Inside the run when it lasts as long as the shortest one seen.
                typical = min(seen) if seen else 0.005
                timer = threading.Timer(rng.uniform(0.0, typical), die, (phase,))
                timer.daemon = True
                timer.start()
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with lock:
                    active[0] -= 1
                    seen.append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)

    phase = cfg.kill_phase
    if phase == "fast_commit":
        wrap(FastTier, "commit", phase)
    elif phase == "promotion":
        tier_root = os.path.abspath(cfg.tier_path)

        def on_durable(self: StorageContext, *_: Any) -> bool:
            return not self.trial_path.startswith(tier_root)  # not the local tier's commit

        wrap(StorageContext, "persist_checkpoint", phase, on_durable)
    elif phase == "durable_commit":
        wrap(CommitRecorder, "record", phase)
    elif phase == "fast_eviction":
        wrap(FastTier, "_delete_evicted", phase)
    elif phase == "durable_eviction":
        wrap(CheckpointManager, "_delete_names", phase, lambda self, names: bool(names))
    else:
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")


def tier_child_main(cfg_dict: dict[str, Any]) -> None:
    """The child: resume with the local tier, then save forever (killed in its phase)."""
    os.environ.update(cfg_dict.get("env") or {})
    from checkpoint_store import Checkpoint, CheckpointConfig, LocalTier, StorageContext
    from checkpoint_store.session import Session

    cfg = TierCrashConfig(**cfg_dict)
    scratch = tempfile.mkdtemp(prefix="cs-crash-tier-",
                               dir=os.path.dirname(os.path.abspath(cfg.log_path)))
    _arm(cfg, cfg.log_path + ".fired")
    warnings.simplefilter("ignore")
    storage = StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name,
                             storage_options=cfg.storage_options, fsync=False)
    s = Session(storage, CheckpointConfig(num_to_keep=cfg.num_to_keep),
                local_tier=LocalTier(cfg.tier_path, num_to_keep=cfg.tier_keep, fsync=False))
    latest = s.get_checkpoint()
    step = int(latest.internal_metadata["metrics"]["step"]) + 1 if latest else 0
    durable = s.durable_index
    while True:
        for i in range(cfg.files):
            path = os.path.join(scratch, file_name(i))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(payload(step, i, cfg.file_size))
        row = s.report({"step": step}, checkpoint=Checkpoint.from_directory(scratch))
        lines = [{"step": step, "dir": row["checkpoint_dir_name"]}]
        now = s.durable_index
        if now is not None and now != durable:
            lines.append({"durable": now})
            durable = now
        with open(cfg.log_path, "a") as log:
            log.write("".join(json.dumps(x) + "\n" for x in lines))
        step += 1


# -- the checks ----------------------------------------------------------------------------


def _acks(log_path: str) -> tuple[dict[str, Any] | None, int | None, int, int]:
    """(last report ack, highest durable ack, reports acked, durable acks)."""
    last, durable, n_rep, n_dur = None, None, 0, 0
    try:
        with open(log_path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None, None, 0, 0
    for line in lines:
        try:
            x = json.loads(line)
        except ValueError:
            continue  # torn by the kill
        if "durable" in x:
            durable = max(durable or -1, int(x["durable"]))
            n_dur += 1
        elif "step" in x:
            last = x
            n_rep += 1
    return last, durable, n_rep, n_dur


def _check_listing(storage: Any, cfg: TierCrashConfig, where: str) -> tuple[list[str], dict]:
    import google_crc32c

    from checkpoint_store.errors import CheckpointStoreError

    bad: list[str] = []
    steps: dict[int, int] = {}
    for ckpt, meta in storage.committed_checkpoints():
        name = ckpt.path.rstrip("/").rsplit("/", 1)[-1]
        try:
            ckpt.verify()
        except CheckpointStoreError as exc:
            bad.append(f"{where} {name} lists as committed but does not verify: {exc}")
            continue
        step = int(meta["metrics"]["step"])
        crcs = {e["path"]: e["crc32c"] for e in meta["manifest"]}
        for i in range(cfg.files):
            want = f"{google_crc32c.value(payload(step, i, cfg.file_size)):08x}"
            if crcs.get(file_name(i)) != want:
                bad.append(f"{where} {name} (step {step}): {file_name(i)} holds other bytes")
        steps[int(meta["index"])] = step
    return bad, steps


def check_tiers(cfg: TierCrashConfig) -> tuple[list[str], dict[str, int]]:
    """Check both tiers after a kill; returns ``(violations, counts)`` with counts
    ``resumed_partial`` and ``lost_reported_durable`` (0 or 1 each)."""
    from checkpoint_store import CheckpointConfig, LocalTier, StorageContext
    from checkpoint_store.errors import CheckpointStoreError
    from checkpoint_store.session import Session

    counts = {"resumed_partial": 0, "lost_reported_durable": 0}
    durable = StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name,
                             storage_options=cfg.storage_options)
    fast = StorageContext(cfg.tier_path, cfg.experiment_name, cfg.trial_name)
    bad, durable_steps = _check_listing(durable, cfg, "durable")
    bad_fast, _ = _check_listing(fast, cfg, "local tier")
    bad += bad_fast
    last, durable_ack, _, _ = _acks(cfg.log_path)
    if durable_ack is not None and durable_ack not in durable_steps:
        newer = sum(1 for i in durable_steps if i > durable_ack)
        if newer < cfg.num_to_keep:
            counts["lost_reported_durable"] = 1
            bad.append(f"checkpoint {durable_ack} was reported durable but is not committed "
                       f"on the storage_path, and only {newer} newer one(s) are")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = Session(StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name,
                                   storage_options=cfg.storage_options,
                                   run_id=f"check{time.time_ns()}"),
                    CheckpointConfig(num_to_keep=cfg.num_to_keep),
                    local_tier=LocalTier(cfg.tier_path, num_to_keep=cfg.tier_keep))
        try:
            got = s.get_checkpoint()
            got_index = None
            if got is not None:
                try:
                    got.verify()
                    got_index = int(got.internal_metadata["index"])
                    step = int(got.internal_metadata["metrics"]["step"])
                    crcs = {e["path"]: e["crc32c"] for e in got.internal_metadata["manifest"]}
                    import google_crc32c

                    for i in range(cfg.files):
                        want = f"{google_crc32c.value(payload(step, i, cfg.file_size)):08x}"
                        if crcs.get(file_name(i)) != want:
                            raise CheckpointStoreError(f"{file_name(i)} holds other bytes")
                except CheckpointStoreError as exc:
                    counts["resumed_partial"] = 1
                    bad.append(f"get_checkpoint() returned {got.uri}, which is partial: {exc}")
            if last is not None:
                want_index = int(last["dir"].rsplit("_", 1)[-1])
                if got_index is None or got_index < want_index:
                    bad.append(f"get_checkpoint() returned index {got_index}, older than the "
                               f"last acknowledged report {last['dir']}")
            s.wait()  # the copies the killed run left pending
            newest = s.durable_index
        finally:
            s.close()
    if last is not None:
        want_index = int(last["dir"].rsplit("_", 1)[-1])
        if newest is None or newest < want_index:
            bad.append(f"after the next session's copies, the newest durable index is "
                       f"{newest}, not the last acknowledged {last['dir']}")
    for where, st in (("durable", durable), ("local tier", fast)):
        found = st.scan()
        if found.foreign:
            bad.append(f"{where}: directories not recognisable as ours: {found.foreign}")
        if found.uncommitted:
            bad.append(f"{where}: a session start left uncommitted directories: "
                       f"{found.uncommitted}")
    return bad, counts


# -- the sweep ------------------------------------------------------------------------------


def sweep_tier_crashes(base: TierCrashConfig, kills: int, *, seed: int = 0,
                       phase_timeout_s: float = 20.0, stop_on_violation: bool = True
                       ) -> TierCrashReport:
    """Kill the tiered child ``kills`` times, phases in turn, checking after each.

    Args:
        base: storage, tier and log paths (``kill_*`` and ``seed`` are set per kill).
        phase_timeout_s: a child that has not died in its phase by then is
            killed by the parent (counted in ``timeouts``).
    """
    from dataclasses import replace

    report = TierCrashReport()
    rng = random.Random(seed)
    t0 = time.monotonic()
    zygote = Zygote(("checkpoint_store.tiers", "checkpoint_store.testing.crash.tiers",
                     "google_crc32c"))
    fired = base.log_path + ".fired"
    try:
        for k in range(kills):
            phase = PHASES[k % len(PHASES)]
            cfg = replace(base, kill_phase=phase, kill_after=rng.randrange(0, 3),
                          seed=rng.randrange(1 << 30))
            if os.path.exists(fired):
                os.unlink(fired)
            pid = zygote.ask(op="spawn", config=asdict(cfg),
                             main="checkpoint_store.testing.crash.tiers:tier_child_main")["pid"]
            deadline = time.monotonic() + phase_timeout_s
            while not os.path.exists(fired) and time.monotonic() < deadline:
                time.sleep(0.01)
            if not os.path.exists(fired):
                report.timeouts += 1
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code = zygote.ask(op="wait", pid=pid)["exitcode"]
            report.kills += 1
            report.per_phase[phase] += 1
            try:
                with open(fired) as f:
                    if json.loads(f.read()).get("inside"):
                        report.inside[phase] += 1
            except (OSError, ValueError):
                pass
            if code != -signal.SIGKILL:
                report.violations.append(f"kill {k + 1} ({phase}): the child exited by itself "
                                         f"(code {code}); its traceback is on stderr")
            bad, counts = check_tiers(cfg)
            report.resumed_partial += counts["resumed_partial"]
            report.lost_reported_durable += counts["lost_reported_durable"]
            report.violations.extend(f"kill {k + 1} ({phase}): {v}" for v in bad)
            if report.violations and stop_on_violation:
                break
    finally:
        zygote.close()
    _, _, report.reports_acknowledged, report.durable_acknowledged = _acks(base.log_path)
    report.seconds = time.monotonic() - t0
    return report
