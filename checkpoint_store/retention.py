"""Top-K retention: keep the best ``num_to_keep`` checkpoints of a trial, delete the rest.

:class:`CheckpointConfig` has the fields and meaning of Ray Train's
``CheckpointConfig`` (plus ``keep_latest`` and ``missing_score``);
:class:`CheckpointManager` applies it to the committed checkpoints of one
trial; :func:`select_kept` is the same decision as a pure function, without
storage (the CLI's ``prune`` uses it). The semantics, as a table, are in
docs/retention.md:

* score: ``metrics[attr]`` if that literal key exists, else a nested lookup
  along ``/`` (``"eval/loss"`` -> ``metrics["eval"]["loss"]``). Without a
  score attribute, the most recent checkpoints are kept. A value that is not
  a number (str, bool, list, dict) is refused when it is registered.
* NaN and missing scores follow ``missing_score``: ``"worst"`` ranks them
  below every number in both orders (with one warning per attribute),
  ``"keep"`` never evicts them, ``"raise"`` refuses the report. They are
  never ranked best, and they tie with each other.
* ties go to the newer checkpoint (higher index). The kept set is a function
  of the registered ``(index, score)`` pairs alone.
* the latest checkpoint is kept besides the best K (resume needs it), unless
  ``keep_latest=False``; ``num_to_keep=None`` keeps everything.
* order is the index recorded in each checkpoint's internal metadata, never
  modification times or names.

Durability and ownership: the state goes to ``<trial>/.checkpoint_manager.json``
(atomically) before any evicted directory is deleted, so a new process
restores it; if the file is missing or corrupt, the state is rebuilt from the
committed checkpoints with a warning. The state holds a run id, which the
session also writes into every checkpoint's internal metadata; the manager
deletes only committed checkpoints of its own run, never an uncommitted
directory or a checkpoint of another run. One live manager per trial holds a
lease (``<trial>/.cs_manager_lease.json``, renewed in the background, expiring
``lease_ttl_s`` after its holder stops renewing); a second one is refused.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import posixpath
import socket
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from checkpoint_store import _clock, _fsutil, _json
from checkpoint_store._layout import FORMAT_VERSION, INTERNAL_PREFIX, MANAGER_STATE
from checkpoint_store._proc import process_alive, process_token
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointStoreError,
    InvalidConfigError,
)
from checkpoint_store.storage import StorageContext
from checkpoint_store.transfer import read_internal_metadata

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointRecord",
    "LEASE_FILE",
    "lookup_metric",
    "rank_key",
    "score_of",
    "select_kept",
]

logger = logging.getLogger(__name__)

_MISSING_POLICIES = ("worst", "keep", "raise")

#: The lease file of the live manager of a trial (docs/retention.md).
LEASE_FILE = f"{INTERNAL_PREFIX}manager_lease.json"
_STATE_KIND = "checkpoint_manager_state"
_LEASE_KIND = "checkpoint_manager_lease"


# -- configuration ---------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointConfig:
    """Which checkpoints to keep. Same semantics as Ray Train's ``CheckpointConfig``.

    Args:
        num_to_keep: how many best checkpoints to keep (int >= 1), or None to
            keep every checkpoint.
        checkpoint_score_attribute: metric to rank by; a literal key first,
            else a ``/``-separated nested path (``"eval/loss"``). None ranks by
            recency (the newest K are kept).
        checkpoint_score_order: ``"max"`` (higher is better) or ``"min"``.
        keep_latest: also keep the newest checkpoint, so a resume always
            starts from the last one (default True; False keeps exactly K).
        missing_score: what a NaN or missing score does: ``"worst"`` ranks it
            below every number (with a warning), ``"keep"`` keeps it and never
            evicts it (it does not count towards K), ``"raise"`` refuses the
            report with :class:`InvalidConfigError`.
        upload_mode: ``"sync"`` (default: ``report()`` returns once the
            checkpoint is committed) or ``"async"`` (``report()`` stages a copy
            and returns; the upload runs in the background, commits keep report
            order; see :mod:`checkpoint_store._async`). Overridable per report.
        max_pending_uploads: with ``"async"``, ``report()`` blocks while this
            many uploads are still pending (default 1, as Orbax's async saves).
        staging: with ``"async"``, how the checkpoint directory is staged:
            ``"copy"`` (default), ``"hardlink"`` or ``"move"``.

    Raises:
        InvalidConfigError: at construction, for any invalid value (say
            ``num_to_keep=0``, ``2.5`` or ``True``; an empty attribute; an
            order other than ``"max"``/``"min"``).
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    keep_latest: bool = True
    missing_score: Literal["worst", "keep", "raise"] = "worst"
    upload_mode: Literal["sync", "async"] = "sync"
    max_pending_uploads: int = 1
    staging: Literal["copy", "hardlink", "move"] = "copy"

    def __post_init__(self) -> None:
        from checkpoint_store import _async

        _async.check_upload_mode(self.upload_mode)
        _async.check_max_pending(self.max_pending_uploads)
        _async.check_staging(self.staging)
        k = self.num_to_keep
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidConfigError(
                f"num_to_keep must be an int >= 1, or None to keep every checkpoint; got {k!r}"
            )
        attr = self.checkpoint_score_attribute
        if attr is not None and (not isinstance(attr, str) or not attr):
            raise InvalidConfigError(
                "checkpoint_score_attribute must be a non-empty metric name (nested: "
                f"'eval/loss') or None to keep the most recent; got {attr!r}"
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise InvalidConfigError(
                "checkpoint_score_order must be 'max' (higher is better) or 'min'; "
                f"got {self.checkpoint_score_order!r}"
            )
        if not isinstance(self.keep_latest, bool):
            raise InvalidConfigError(f"keep_latest must be True or False, got {self.keep_latest!r}")
        if self.missing_score not in _MISSING_POLICIES:
            raise InvalidConfigError(
                f"missing_score must be one of {_MISSING_POLICIES}, got {self.missing_score!r}"
            )

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object (stored in the manager state)."""
        return {
            "num_to_keep": self.num_to_keep,
            "checkpoint_score_attribute": self.checkpoint_score_attribute,
            "checkpoint_score_order": self.checkpoint_score_order,
            "keep_latest": self.keep_latest,
            "missing_score": self.missing_score,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckpointConfig:
        """Inverse of :meth:`to_json`; unknown keys are ignored.

        Raises:
            InvalidConfigError: a value is invalid.
        """
        fields = (
            "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order",
            "keep_latest", "missing_score",
        )
        return cls(**{k: obj[k] for k in fields if k in obj})


# -- scores ------------------------------------------------------------------------------

_NOT_FOUND = object()


def lookup_metric(metrics: Mapping[str, Any], attribute: str) -> Any:
    """``metrics[attribute]`` if that literal key exists, else the value along the
    ``/``-separated path (``"eval/loss"`` -> ``metrics["eval"]["loss"]``).

    Returns:
        The value, or the private sentinel ``_NOT_FOUND`` when absent.
    """
    if attribute in metrics:
        return metrics[attribute]
    node: Any = metrics
    for part in attribute.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return _NOT_FOUND
        node = node[part]
    return node


def score_of(metrics: Mapping[str, Any], attribute: str) -> float | None:
    """The numeric score of ``metrics`` for ``attribute``, or None when missing or NaN.

    ``None`` values count as missing; ints, floats and numpy scalars count as
    numbers (``±inf`` included: they rank like any number).

    Raises:
        InvalidConfigError: the value exists but is not a number (str, bool,
            list, dict ...), or is an int beyond the float range; the message
            names the attribute and the type.
    """
    value = lookup_metric(metrics, attribute)
    if value is _NOT_FOUND or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidConfigError(
            f"checkpoint_score_attribute {attribute!r} has value {value!r} of type "
            f"{type(value).__name__}; scores must be numbers (report float(x), or pick "
            "another checkpoint_score_attribute)"
        )
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range (10**400) has no rank
        raise InvalidConfigError(
            f"checkpoint_score_attribute {attribute!r} is an int too large for a float "
            f"(about {int(value.bit_length() * 0.30103)} digits); scores must fit a float "
            "(up to about 1.8e308)"
        ) from None
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint as :func:`select_kept` sees it.

    Attributes:
        index: the checkpoint index from its internal metadata (defines order).
        dir_name: the directory name relative to the trial (``checkpoint_000042``).
        metrics: the metrics reported with it (the score is looked up here).
    """

    index: int
    dir_name: str
    metrics: Mapping[str, Any]


@dataclass(slots=True)
class _Entry:
    index: int
    dir_name: str
    score: float | None
    metrics: Mapping[str, Any]


def rank_key(score: float | None, index: int, order: str = "max") -> tuple[int, float, int]:
    """The manager's rank of one checkpoint; bigger is better.

    Numbers rank above missing (None) scores, then the score in ``order``'s
    direction (``"max"``: higher is better, anything else: lower), then the
    newer index, so ties go to the newer checkpoint. ``max(..., key=...)`` over
    this picks what the manager calls the best checkpoint.
    """
    if score is None:
        return (0, 0.0, index)
    return (1, score if order == "max" else -score, index)


def _rank_key(config: CheckpointConfig) -> Callable[[_Entry], tuple[int, float, int]]:
    """:func:`rank_key` under ``config``; without a score attribute the index is the score."""
    if config.checkpoint_score_attribute is None:
        return lambda e: rank_key(float(e.index), e.index)
    order = config.checkpoint_score_order
    return lambda e: rank_key(e.score, e.index, order)


class _Selection:
    """The kept set, updated one registration at a time in O(K) memory.

    Incremental is exact: an entry evicted once had K entries ranked above it
    (a strict total order, the index breaks ties) that stay registered, and a
    newer latest; so it is outside the kept set of every later superset.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.key = _rank_key(config)
        self.kept: dict[str, _Entry] = {}
        self.latest_index: int | None = None
        # Rank keys are computed once per entry: _trim runs on every registration.
        self._rank: dict[str, tuple[int, float, int]] = {}
        self._keep_missing = (
            config.missing_score == "keep" and config.checkpoint_score_attribute is not None
        )

    def add(self, entry: _Entry) -> list[_Entry]:
        """Add (or replace, by directory name) one entry; returns the evicted ones."""
        name = entry.dir_name
        self.kept.pop(name, None)
        self.kept[name] = entry
        self._rank[name] = self.key(entry)
        if self.latest_index is None or entry.index > self.latest_index:
            self.latest_index = entry.index
        return self._trim()

    def _trim(self) -> list[_Entry]:
        k = self.config.num_to_keep
        kept = self.kept
        if k is None or len(kept) <= k:
            return []
        if self._keep_missing:
            candidates = [n for n, e in kept.items() if e.score is not None]
        else:
            candidates = list(kept)
        candidates.sort(key=self._rank.__getitem__, reverse=True)
        keep = set(candidates[:k])
        if self._keep_missing:
            keep.update(n for n, e in kept.items() if e.score is None)
        if self.config.keep_latest:
            latest = self.latest_index
            keep.update(n for n, e in kept.items() if e.index == latest)
        evicted = [kept.pop(n) for n in list(kept) if n not in keep]
        for e in evicted:
            del self._rank[e.dir_name]
        evicted.sort(key=lambda e: e.index)
        return evicted

    def ordered(self) -> list[_Entry]:
        return sorted(self.kept.values(), key=lambda e: e.index)

    def ranked(self) -> list[_Entry]:
        return sorted(self.kept.values(), key=self.key, reverse=True)


def _entry_score(
    config: CheckpointConfig,
    metrics: Mapping[str, Any],
    index: int,
    warned: set[str],
    *,
    lenient: bool = False,
    stacklevel: int = 3,
) -> float | None:
    """The score used for ranking (the index without a score attribute).

    ``lenient`` (used when restoring what was already accepted): a
    non-numeric value or ``missing_score="raise"`` counts as missing instead
    of raising, because refusing would only leave the trial unmanageable.
    """
    attr = config.checkpoint_score_attribute
    if attr is None:
        return float(index)
    try:
        score = score_of(metrics, attr)
    except InvalidConfigError:
        if not lenient:
            raise
        score = None
    if score is None:
        if config.missing_score == "raise" and not lenient:
            raise InvalidConfigError(
                f"metric {attr!r} is missing or NaN in the metrics of checkpoint index "
                f"{index} (missing_score='raise'); report a number, or use "
                "missing_score='worst' or 'keep'"
            )
        if config.missing_score == "worst" and attr not in warned:
            warned.add(attr)
            warnings.warn(
                f"checkpoint_score_attribute {attr!r} is missing or NaN for checkpoint index "
                f"{index}; such checkpoints rank below every number and are evicted first "
                "(this warning is given once per attribute)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
    return score


def select_kept(
    records: Iterable[CheckpointRecord | tuple[int, str, Mapping[str, Any]]],
    config: CheckpointConfig,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """Split checkpoints into kept and evicted, with exactly the manager's semantics.

    A pure function: no storage is touched. The result depends only on the
    ``(index, score)`` pairs, not on the order of ``records``. A record whose
    ``dir_name`` repeats replaces the earlier one. Memory besides the output
    is O(num_to_keep) (plus the NaN/missing ones under ``missing_score="keep"``).

    Args:
        records: :class:`CheckpointRecord` or ``(index, dir_name, metrics)``
            tuples, in any order.
        config: the retention rules.

    Returns:
        ``(kept, evicted)``, each sorted by index (oldest first).

    Raises:
        InvalidConfigError: a score is not numeric, or is missing under
            ``missing_score="raise"``, or a record is malformed.
    """
    if not isinstance(config, CheckpointConfig):
        raise InvalidConfigError(f"config must be a CheckpointConfig, got {type(config).__name__}")
    sel = _Selection(config)
    warned: set[str] = set()
    evicted: dict[str, CheckpointRecord] = {}
    originals: dict[str, CheckpointRecord] = {}
    for rec in records:
        if not isinstance(rec, CheckpointRecord):
            try:
                index, dir_name, metrics = rec
            except (TypeError, ValueError):
                raise InvalidConfigError(
                    f"records must be CheckpointRecord or (index, dir_name, metrics); got {rec!r}"
                ) from None
            rec = CheckpointRecord(index, dir_name, metrics)
        if isinstance(rec.index, bool) or not isinstance(rec.index, int):
            raise InvalidConfigError(f"record index must be an int, got {rec.index!r}")
        if not isinstance(rec.metrics, Mapping):
            raise InvalidConfigError(
                f"record metrics must be a mapping, got {type(rec.metrics).__name__}"
            )
        score = _entry_score(config, rec.metrics, rec.index, warned, stacklevel=3)
        evicted.pop(rec.dir_name, None)
        originals[rec.dir_name] = rec
        for e in sel.add(_Entry(rec.index, rec.dir_name, score, rec.metrics)):
            evicted[e.dir_name] = originals.pop(e.dir_name)
    kept = [originals[e.dir_name] for e in sel.ordered()]
    return kept, sorted(evicted.values(), key=lambda r: r.index)


# -- the lease ------------------------------------------------------------------------------


def live_lease(storage: StorageContext) -> dict[str, Any] | None:
    """The lease of a live checkpoint manager on this trial, or None.

    Returns the lease file's fields (``host``, ``pid``, ``expires_at`` in Unix
    seconds, ``trial``) when, by the rule every manager applies before taking
    over: it is unexpired on the storage's clock, names this trial's canonical
    location (a lease copied in with the directory does not), and its holder
    is not a dead or zombie process on this host, nor a pid since reused by
    another process. Used by tools that must not delete behind a running
    job's back (the CLI's prune and gc).

    Raises:
        OSError: the lease file exists but cannot be read.
    """
    lease = _Lease(storage, ttl_s=0.0)
    cur, mtime = lease._read_stamped()
    return cur if lease._seconds_left(cur, mtime) is not None else None


#: Slack (seconds) for stores that stamp modification times to the whole
#: second (S3): a lease renewed 0.1 s ago may carry a stamp 0.9 s older.
_MTIME_SLACK_S = 1.0


class _Lease:
    """Who manages a trial right now: one JSON file renewed in the background.

    A lease is live for ``ttl_s`` after its last renewal, measured on the
    storage's clock (the lease file's modification time against a probe
    written now, :mod:`checkpoint_store._clock`), so a machine whose clock
    is off never takes over a live lease. Unless its holder is a dead
    process on this very host: then it is taken over at once, so a crashed
    run restarts without waiting. The holder is named by pid *and* process
    incarnation (:func:`checkpoint_store._proc.process_token`): a pid reused
    by a newer process does not keep a dead holder's lease alive. The lease
    names the trial's canonical location (:meth:`StorageContext.canonical_uri`:
    on local disks the resolved real path), so every spelling of one trial
    (symlinks, ``..``, ``file://``) meets the same lease; a lease copied in
    with a whole trial directory names another location and is ignored.
    Object stores without conditional writes make the take-over best-effort:
    we write, read back, and refuse if another holder won.
    """

    def __init__(self, storage: StorageContext, ttl_s: float):
        self._storage = storage
        self.path = posixpath.join(storage.trial_path, LEASE_FILE)
        self.trial_uri = storage.canonical_uri(storage.trial_path)
        self._local = _fsutil.local_path(storage.filesystem, storage.trial_path) is not None
        self.ttl_s = float(ttl_s)
        self.holder = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.token = process_token()
        self.lost = False
        self.interval = max(self.ttl_s / 3.0, 0.05)
        self.next_renewal = 0.0
        self._released = False
        self._lock = threading.Lock()

    def _read_stamped(self) -> tuple[dict[str, Any] | None, float | None]:
        """The lease body and the modification time the store gave the file."""
        cur = self._read()
        if cur is None:
            return None, None
        return cur, _clock.mtime_of(_fsutil.info(self._storage.filesystem, self.path))

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = _fsutil.read_bytes(self._storage.filesystem, self.path)
            obj = _json.loads(raw)
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            return None
        except OSError:
            if not _fsutil.exists(self._storage.filesystem, self.path):
                return None
            raise
        return obj if isinstance(obj, dict) else None

    def _write(self) -> None:
        now = _clock.local_time()
        body = {
            "kind": _LEASE_KIND,
            "format_version": FORMAT_VERSION,
            "holder": self.holder,
            "host": self.host,
            "pid": self.pid,
            "proc": self.token,
            "trial": self.trial_uri,
            "ttl_s": self.ttl_s,
            "renewed_at": now,
            "expires_at": now + self.ttl_s,
        }
        self._storage.ensure_trial_dir()
        _fsutil.write_bytes(
            self._storage.filesystem, self.path, _json.dumps(body),
            self._storage.backend.capabilities, fsync=False,
        )

    def _holder_dead(self, cur: Mapping[str, Any]) -> bool:
        """The holder ran on this host and is gone (or its pid now names another process)."""
        pid = cur.get("pid")
        if cur.get("host") != self.host or not isinstance(pid, int):
            return False
        token = cur.get("proc")
        return not process_alive(pid, token if isinstance(token, str) else None)

    def _seconds_left(self, cur: dict[str, Any] | None, mtime: float | None) -> float | None:
        """Seconds until another holder's lease expires, or None when it is not
        live (absent, ours, copied in, expired, or its holder is dead)."""
        if cur is None or cur.get("holder") == self.holder:
            return None
        if cur.get("trial") != self.trial_uri and (
            cur.get("host") == self.host or not self._local
        ):
            # Copied in with a moved trial directory. Only a local path on another
            # host may name the same directory differently (an NFS mount point).
            return None
        if self._holder_dead(cur):
            return None
        ttl = cur.get("ttl_s")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and mtime is not None:
            now = self._storage_now()
            if now is not None:
                left = mtime + float(ttl) + _MTIME_SLACK_S - now
                return left if left > 0 else None
        # A lease of an older version, or a store without modification times:
        # its holder's clock against ours.
        expires = cur.get("expires_at")
        if not isinstance(expires, (int, float)):
            return None
        left = float(expires) - _clock.local_time()
        return left if left > 0 else None

    def _storage_now(self) -> float | None:
        """The store's clock, or None when it cannot be read: read-only
        credentials (``ui``, ``live_lease`` callers) may not write the probe."""
        try:
            return _clock.storage_now(self._storage.filesystem, self._storage.trial_path,
                                      self._storage.backend.capabilities)
        except (OSError, CheckpointStoreError) as exc:
            logger.info("could not read the storage's clock under %s (%s); judging the "
                        "lease by the local clock", self.trial_uri, exc)
            return None

    def _conflict(self, cur: dict[str, Any], left: float) -> CheckpointConflictError:
        return CheckpointConflictError(
            f"trial {self.trial_uri} is managed by another live checkpoint manager "
            f"(host {cur.get('host')!r}, pid {cur.get('pid')}); its lease expires in "
            f"{max(left, 0.0):.0f} s unless renewed. Two managers on one trial would delete "
            "each other's checkpoints. End the other run (its lease is released when its "
            "session ends), wait for the lease to expire if that process crashed, or open "
            "this trial with CheckpointManager(..., read_only=True) to only read it. If this "
            f"directory was copied from {cur.get('trial')!r} while that run was live, the "
            f"lease came with the copy: delete {self._storage.uri(self.path)}."
        )

    def acquire(self) -> None:
        """Take the lease or raise :class:`CheckpointConflictError`; starts renewal."""
        cur, mtime = self._read_stamped()
        left = self._seconds_left(cur, mtime)
        if left is not None:
            assert cur is not None
            raise self._conflict(cur, left)
        self._write()
        back = self._read()
        if back is None or back.get("holder") != self.holder:
            raise self._conflict(back or {}, self.ttl_s)
        _KEEPER.add(self)

    def renew(self) -> bool:
        """Extend the lease; returns False (and marks it lost) when another holder
        took it over. I/O errors are logged and retried at the next renewal."""
        with self._lock:
            if self.lost or self._released:
                return not self.lost
            try:
                cur = self._read()
                if cur is not None and cur.get("holder") != self.holder:
                    self._mark_lost(cur)
                    return False
                self._write()
            except Exception as exc:  # a renewal failing must not kill training
                logger.warning("could not renew the lease %s: %s", self.path, exc)
            return True

    def check(self) -> bool:
        """Read the lease now: True if still ours (before anything is deleted)."""
        with self._lock:
            if self.lost:
                return False
            try:
                cur = self._read()
            except Exception as exc:
                logger.warning("could not read the lease %s: %s", self.path, exc)
                return False
            if cur is not None and cur.get("holder") != self.holder:
                self._mark_lost(cur)
                return False
            return True

    def _mark_lost(self, cur: Mapping[str, Any]) -> None:
        self.lost = True
        _KEEPER.remove(self)
        logger.warning(
            "the lease on %s was taken over by host %r pid %s; this checkpoint manager is "
            "now read-only and deletes nothing",
            self.trial_uri, cur.get("host"), cur.get("pid"),
        )

    def stop_renewing(self) -> None:
        _KEEPER.remove(self)

    def release(self) -> None:
        """Stop renewing and delete the lease file if it is still ours. Idempotent;
        never raises (it runs while an exception may be propagating)."""
        self.stop_renewing()
        with self._lock:
            if self._released:
                return
            self._released = True
            if self.lost:
                return
            try:
                cur = self._read()
                if cur is not None and cur.get("holder") == self.holder:
                    _fsutil.delete_file(self._storage.filesystem, self.path)
            except Exception as exc:
                logger.warning("could not release the lease %s (it will expire): %s",
                               self.path, exc)


def _release_lease(lease: _Lease) -> None:
    lease.release()


class _LeaseKeeper:
    """One daemon thread per process renews every live lease when it is due.

    Shared so that a process managing many trials (a tuning loop) runs one
    thread, not one per trial, and so that releasing a lease never waits for
    a thread to stop. A renewal runs outside the keeper's lock; a lease
    released meanwhile ignores it (``_Lease.renew`` checks under its own lock).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._leases: set[_Lease] = set()
        self._thread: threading.Thread | None = None

    def add(self, lease: _Lease) -> None:
        with self._cv:
            lease.next_renewal = time.monotonic() + lease.interval
            self._leases.add(lease)
            # After a fork the child has no keeper thread: start one.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="cs-lease-keeper", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def remove(self, lease: _Lease) -> None:
        with self._cv:
            self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due = [le for le in self._leases if le.next_renewal <= now]
                if not due:
                    wake = min((le.next_renewal for le in self._leases), default=now + 3600.0)
                    self._cv.wait(timeout=max(wake - now, 0.01))
                    continue
                for le in due:
                    le.next_renewal = now + le.interval
            for le in due:
                le.renew()


_KEEPER = _LeaseKeeper()


# -- the manager ------------------------------------------------------------------------------


class CheckpointManager:
    """Keeps the best K committed checkpoints of one trial and deletes the rest.

    Args:
        config: the retention rules.
        storage: the trial's :class:`StorageContext`; every I/O goes through it.
        read_only: restore and answer queries, but never write the state,
            delete, take the lease or register (for inspection tools).
        lease_ttl_s: seconds after which the lease of a holder that stopped
            renewing (a crash on another host) expires. Renewed every third of it.

    A new manager on a trial that already has checkpoints restores its state
    from ``.checkpoint_manager.json``, or rebuilds it from the committed
    checkpoints' internal metadata with a warning when the file is missing
    or corrupt. Memory is O(num_to_keep) however many checkpoints are
    registered. Use as a context manager, or call :meth:`close`, to release
    the lease (a :class:`~checkpoint_store.session.Session` does it when it ends).

    Raises:
        InvalidConfigError: bad arguments, or a state file from a newer format.
        CheckpointConflictError: another live manager holds the trial's lease.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        storage: StorageContext,
        *,
        read_only: bool = False,
        lease_ttl_s: float = 60.0,
    ):
        if not isinstance(config, CheckpointConfig):
            raise InvalidConfigError(
                f"config must be a CheckpointConfig, got {type(config).__name__}"
            )
        if not isinstance(storage, StorageContext):
            raise InvalidConfigError(
                f"storage must be a StorageContext, got {type(storage).__name__}"
            )
        if (
            isinstance(lease_ttl_s, bool)
            or not isinstance(lease_ttl_s, (int, float))
            or not lease_ttl_s > 0
            or not math.isfinite(lease_ttl_s)
        ):
            raise InvalidConfigError(f"lease_ttl_s must be a positive number, got {lease_ttl_s!r}")
        self.config = config
        self._storage = storage
        self._read_only = bool(read_only)
        self._sel = _Selection(config)
        self._warned: set[str] = set()
        self._pending: list[str] = []
        self._foreign: list[str] = []
        self._uncommitted: list[str] = []
        self._next_index = 0
        self._closed = False
        self.run_id: str = ""
        self._lease: _Lease | None = None
        if not self._read_only:
            self._lease = _Lease(storage, lease_ttl_s)
            self._lease.acquire()
            weakref.finalize(self, _release_lease, self._lease)
        try:
            self._restore()
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Release the lease. Idempotent; safe while an exception propagates.
        The manager is read-only afterwards."""
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def read_only(self) -> bool:
        """True when this manager writes and deletes nothing: opened read-only,
        closed, or its lease was taken over by another manager."""
        return (
            self._read_only or self._closed or (self._lease is not None and self._lease.lost)
        )

    # -- registration --------------------------------------------------------------------

    def validate_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Raise exactly as :meth:`register` would for these metrics, touching nothing.

        The session calls it before uploading, so a refused report leaves no
        checkpoint behind.

        Raises:
            MetadataError: ``metrics`` is not a JSON object of serialisable values.
            InvalidConfigError: the score is not numeric, or missing under
                ``missing_score="raise"``.
        """
        _json.to_json_object(metrics, "metrics")
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return
        score = score_of(metrics, attr)
        if score is None and self.config.missing_score == "raise":
            raise InvalidConfigError(
                f"metric {attr!r} is missing or NaN (missing_score='raise'); report a number, "
                "or use missing_score='worst' or 'keep'"
            )

    def register(self, checkpoint: Checkpoint, metrics: Mapping[str, Any]) -> list[str]:
        """Track a newly committed checkpoint of this trial and apply retention.

        The state is written before anything is deleted. A delete that fails
        is logged and retried at the next registration (or by the next
        manager); it never makes this call fail.

        Args:
            checkpoint: a committed checkpoint directly inside this trial.
            metrics: the metrics reported with it (JSON-serialisable).

        Returns:
            Directory names evicted by this call (deleted, or scheduled for a
            retried delete).

        Raises:
            InvalidConfigError: the score is not numeric, or missing under
                ``missing_score="raise"``; the checkpoint is not committed, or not
                in this trial. Nothing is written or deleted then.
            MetadataError: ``metrics`` is not JSON-serialisable.
            CheckpointConflictError: the checkpoint's internal metadata names
                another run.
            CheckpointStoreError: this manager is read-only or closed.
        """
        if self._read_only or self._closed:
            raise CheckpointStoreError(
                "this checkpoint manager is read-only or closed; create a new "
                "CheckpointManager (or session) to register checkpoints"
            )
        clean = _json.to_json_object(metrics, "metrics")
        trial = self._storage.trial_path.rstrip("/")
        if posixpath.dirname(checkpoint.path.rstrip("/")) != trial:
            raise InvalidConfigError(
                f"checkpoint {checkpoint.uri} is not a directory of trial "
                f"{self._storage.uri(trial)}; persist it with StorageContext.persist_checkpoint"
            )
        meta = checkpoint.internal_metadata
        index = meta.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidConfigError(
                f"{checkpoint.uri} is not a committed checkpoint (no index in its internal "
                "metadata); only committed checkpoints can be registered"
            )
        owner = meta.get("run_id")
        if owner is not None and owner != self.run_id:
            raise CheckpointConflictError(
                f"{checkpoint.uri} belongs to run {owner!r}, not to this trial's run "
                f"{self.run_id!r}; it is left alone"
            )
        score = _entry_score(self.config, clean, index, self._warned, stacklevel=3)
        dir_name = posixpath.basename(checkpoint.path.rstrip("/"))
        if dir_name in self._pending:
            self._pending.remove(dir_name)
        evicted = self._sel.add(_Entry(index, dir_name, score, clean))
        self._next_index = max(self._next_index, index + 1)
        names = [e.dir_name for e in evicted]
        self._pending.extend(n for n in names if n not in self._pending)
        if self.read_only:  # lease lost: remember, never write or delete
            return names
        if self._save_state():
            self._delete_pending()
        return names

    # -- queries ------------------------------------------------------------------------------

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest kept checkpoint (highest index), or None.

        With ``keep_latest=True`` (the default) it is the newest registered
        one; a checkpoint that was evicted is never returned.
        """
        kept = self._sel.ordered()
        return self._storage.checkpoint(kept[-1].dir_name) if kept else None

    @property
    def latest_index(self) -> int | None:
        """The highest index registered (or restored), kept or not; None before any."""
        return self._sel.latest_index

    @property
    def next_index(self) -> int:
        """An index no checkpoint of this trial has used: numbering continues after
        restores and evictions."""
        return self._next_index

    @property
    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Kept checkpoints with their metrics, best first (ties: newer first;
        NaN/missing last). Without a score attribute, most recent first."""
        return [
            (self._storage.checkpoint(e.dir_name), dict(e.metrics)) for e in self._sel.ranked()
        ]

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        """The best kept checkpoint, or None before the first registration.

        A NaN or missing score is never best while any number is kept."""
        ranked = self._sel.ranked()
        return self._storage.checkpoint(ranked[0].dir_name) if ranked else None

    @property
    def kept_dir_names(self) -> list[str]:
        """Directory names of the kept checkpoints, oldest first."""
        return [e.dir_name for e in self._sel.ordered()]

    @property
    def kept_scores(self) -> dict[str, float | None]:
        """``dir_name -> score`` of the kept checkpoints (None: NaN or missing;
        the index when ranking by recency)."""
        return {e.dir_name: e.score for e in self._sel.ordered()}

    @property
    def pending_deletes(self) -> list[str]:
        """Evicted directory names whose delete failed and will be retried."""
        return list(self._pending)

    @property
    def foreign_dir_names(self) -> list[str]:
        """Committed checkpoints in this trial that name another run or trial in
        their internal metadata. Never deleted, never ranked."""
        return list(self._foreign)

    @property
    def uncommitted_dir_names(self) -> list[str]:
        """``checkpoint_NNNNNN`` directories without a commit marker found at restore
        (an interrupted upload, a hand-made directory). Never deleted by the manager."""
        return list(self._uncommitted)

    # -- state ---------------------------------------------------------------------------------

    @property
    def state_path(self) -> str:
        """Path (within the storage filesystem) of ``.checkpoint_manager.json``."""
        return posixpath.join(self._storage.trial_path, MANAGER_STATE)

    def _state_json(self) -> dict[str, Any]:
        return {
            "kind": _STATE_KIND,
            "format_version": FORMAT_VERSION,
            "run_id": self.run_id,
            "config": self.config.to_json(),
            "latest_index": self._sel.latest_index,
            "next_index": self._next_index,
            "checkpoints": [
                {"index": e.index, "dir_name": e.dir_name, "score": e.score,
                 "metrics": dict(e.metrics)}
                for e in self._sel.ordered()
            ],
            "pending_deletes": list(self._pending),
            "updated_at": time.time(),
        }

    def _save_state(self) -> bool:
        """Write the state atomically; False (logged) when storage refused it, in
        which case nothing may be deleted yet."""
        try:
            self._storage.ensure_trial_dir()
            _fsutil.write_bytes(
                self._storage.filesystem, self.state_path, _json.dumps(self._state_json()),
                self._storage.backend.capabilities, fsync=self._storage.fsync,
            )
            return True
        except Exception as exc:
            logger.warning(
                "could not write retention state %s (deletes postponed, retried at the next "
                "report): %s", self._storage.uri(self.state_path), exc,
            )
            return False

    def _is_ours(self, meta: Mapping[str, Any]) -> bool:
        owner = meta.get("run_id")
        if owner is not None:
            return owner == self.run_id
        # Written before run ids existed (or by hand): judge by the trial name.
        trial = meta.get("trial_name")
        return trial is None or trial == self._storage.trial_name

    def _delete_pending(self) -> None:
        if not self._pending:
            return
        if self._lease is not None and not self._lease.check():
            return
        remaining: list[str] = []
        for name in self._pending:
            try:
                path = posixpath.join(self._storage.trial_path, name)
                meta = read_internal_metadata(self._storage.filesystem, path)
                if meta is not None and not self._is_ours(meta):
                    # Replaced by another run's checkpoint since we evicted it.
                    logger.warning("not deleting %s: it now belongs to run %r",
                                   name, meta.get("run_id"))
                    if name not in self._foreign:
                        self._foreign.append(name)
                    continue
                self._storage.delete_checkpoint(name)
            except Exception as exc:  # never fail a report for a delete
                logger.warning("could not delete %s (retried at the next report): %s", name, exc)
                remaining.append(name)
        if remaining != self._pending:
            self._pending = remaining
            self._save_state()

    def retry_deletes(self) -> list[str]:
        """Retry the failed deletes now; returns the names still pending."""
        if not self.read_only:
            self._delete_pending()
        return list(self._pending)

    def _load_state(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(state, problem)``: the parsed state, or None with why ("missing",
        "corrupt: ...")."""
        fs = self._storage.filesystem
        try:
            raw = _fsutil.read_bytes(fs, self.state_path)
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            if not _fsutil.exists(fs, self.state_path):
                return None, "missing"
            return None, f"unreadable ({exc})"
        try:
            state = _json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None, "corrupt (not JSON)"
        if not isinstance(state, dict):
            return None, "corrupt (not a JSON object)"
        version = state.get("format_version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise InvalidConfigError(
                f"{self._storage.uri(self.state_path)} has format version {version}, newer "
                f"than this checkpoint-store reads ({FORMAT_VERSION}); upgrade checkpoint-store"
            )
        ok = (
            version == FORMAT_VERSION
            and isinstance(state.get("run_id"), str) and state["run_id"]
            and isinstance(state.get("checkpoints"), list)
            and all(
                isinstance(c, dict) and isinstance(c.get("dir_name"), str)
                and isinstance(c.get("index"), int) and not isinstance(c.get("index"), bool)
                for c in state["checkpoints"]
            )
            and all(isinstance(n, str) for n in state.get("pending_deletes", []))
        )
        if not ok:
            return None, "corrupt (unexpected fields)"
        return state, None

    def _restore(self) -> None:
        storage = self._storage
        state, problem = self._load_state()
        committed: list[tuple[int, str, dict[str, Any]]] = []
        present: set[str] = set()
        highest = -1
        for dir_index, name in storage.checkpoint_dirs():
            present.add(name)
            highest = max(highest, dir_index)
            meta = read_internal_metadata(storage.filesystem, posixpath.join(storage.trial_path,
                                                                             name))
            if meta is None:
                self._uncommitted.append(name)
            else:
                committed.append((meta["index"], name, meta))
        committed.sort(key=lambda c: c[0])

        if state is not None:
            self.run_id = state["run_id"]
        else:
            mine: list[str] = [m["run_id"] for _, _, m in committed
                    if m.get("trial_name") in (None, storage.trial_name)
                    and isinstance(m.get("run_id"), str)]
            self.run_id = mine[-1] if mine else uuid.uuid4().hex

        pending_before = set(state.get("pending_deletes", [])) if state else set()
        stored = {c["dir_name"]: c for c in state["checkpoints"]} if state else {}
        # Pending deletes resume, also for half-deleted directories (marker gone).
        self._pending = [n for n in sorted(pending_before) if n in present]
        self._uncommitted = [n for n in self._uncommitted if n not in pending_before]

        entries: list[_Entry] = []
        for index, name, meta in committed:
            if not self._is_ours(meta):
                self._foreign.append(name)
                continue
            if name in pending_before:
                continue
            metrics = meta.get("metrics")
            if not isinstance(metrics, Mapping):
                metrics = (stored.get(name) or {}).get("metrics") or {}
            score = _entry_score(self.config, metrics, index, self._warned, lenient=True,
                                 stacklevel=5)
            entries.append(_Entry(index, name, score, dict(metrics)))
        evicted: list[_Entry] = []
        for e in entries:
            evicted.extend(self._sel.add(e))
        if state is not None and isinstance(state.get("latest_index"), int):
            li = state["latest_index"]
            if self._sel.latest_index is None or li > self._sel.latest_index:
                # The latest was deleted by hand: the index still counts for numbering.
                self._next_index = max(self._next_index, li + 1)
        self._next_index = max(
            self._next_index,
            highest + 1,
            (self._sel.latest_index + 1) if self._sel.latest_index is not None else 0,
            state.get("next_index", 0) if state and isinstance(state.get("next_index"), int)
            else 0,
        )
        for e in evicted:
            if e.dir_name not in self._pending:
                self._pending.append(e.dir_name)

        if state is None and committed:
            warnings.warn(
                f"retention state {storage.uri(self.state_path)} is {problem}; rebuilt it from "
                f"{len(committed)} committed checkpoint(s)' internal metadata",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._foreign:
            logger.warning(
                "trial %s holds checkpoints of another run, left alone: %s",
                storage.uri(storage.trial_path), ", ".join(self._foreign),
            )
        if self._uncommitted:
            logger.warning(
                "trial %s holds uncommitted checkpoint directories, ignored and never deleted "
                "by retention: %s", storage.uri(storage.trial_path), ", ".join(self._uncommitted),
            )
        if self._read_only:
            return
        needs_write = state is None and bool(committed) or bool(evicted) or bool(self._pending)
        if state is not None and state.get("config") != self.config.to_json():
            needs_write = True
        if needs_write and self._save_state():
            self._delete_pending()
