"""What must hold of a trial after the saving child was killed (see :func:`check_trial`)."""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from checkpoint_store.testing.crash._child import CrashConfig, file_name, payload

__all__ = ["check_trial"]


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
    from checkpoint_store._format.layout import parse_checkpoint_dir_name
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
        if cfg.source == "state":  # the tensor index's CRC32C, written by the persist process
            crcs = {f"files/{i}": (meta.get("tensors") or {}).get(f"files/{i}", {}).get("crc32c")
                    for i in range(cfg.files)}
        for i in range(cfg.files):
            want = f"{google_crc32c.value(payload(step, i, cfg.file_size)):08x}"
            key = f"files/{i}" if cfg.source == "state" else file_name(i)
            if crcs.get(key) != want:
                bad.append(f"{name} (step {step}): {key} holds other bytes")
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
