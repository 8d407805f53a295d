"""What the page and the plots show, read through the library's own readers.

:class:`StoreView` answers for one LOCATION (a storage root, an experiment or
a trial, on any backend): the experiments and trials under it, a trial's
reports and checkpoints, one checkpoint's metadata, and a verify. Names
coming from a request are checked to be one path component *and* one of the
experiments, trials or checkpoints listed under LOCATION, so no request
reaches a path outside it.

Live refresh reads only what changed: ``result.json`` from the byte offset
already parsed (a ranged read, also on object stores, where the assembly at a
session's end keeps the earlier rows as its prefix), the ``result.json``
segments a live run on an object store has written since the last poll
(:mod:`checkpoint_store._results.reader`), and the internal metadata of checkpoint
directories not seen before. A full refresh (``full=True``, a page load)
reads everything again.

Where each answer comes from: the location kind and trial listing are the
CLI's (:mod:`checkpoint_store._browse.locations`); committed checkpoints are those with a
valid commit marker (:func:`~checkpoint_store._util.inspect.read_internal_metadata`,
the rule of :meth:`StorageContext.committed_checkpoints`); "best" is
:func:`~checkpoint_store.retention.select_kept` under the trial's recorded
:class:`~checkpoint_store.retention.CheckpointConfig`; "running" is
:func:`~checkpoint_store.retention.live_lease`; "errored" is the ``error.txt``
a session writes when it ends with an exception
(:meth:`~checkpoint_store.StorageContext.record_error`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import shlex
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from checkpoint_store._browse.locations import (
    classify,
    describe_kind,
    list_entries,
    manifest_size,
    resolve_location,
    trials_under,
)
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    ERROR_FILE,
    LEASE_FILE,
    MANAGER_STATE,
    PARAMS_FILE,
    RESULT_FILE,
    RESULT_SEGMENTS_DIR,
    STOPPED_FILE,
    is_internal_name,
    parse_checkpoint_dir_name,
    parse_state_log_name,
    validate_component,
)
from checkpoint_store._results.reader import (
    Segment,
    list_segments,
    parse_result_rows,
    unfolded_rows,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.retention import (
    CheckpointConfig,
    CheckpointRecord,
    live_lease,
    rank_key,
    recorded_invalid,
    score_or_none,
    select_kept,
)
from checkpoint_store.storage import StorageContext

# Kinds of a checkpoint on the chart and in the tables.
BEST = "best"  # committed, among the best num_to_keep by the trial's score attribute
LATEST = "latest"  # committed, the newest, kept for resume though not among the best
KEPT = "kept"  # committed, neither (no score attribute, another run's, pending delete)
EVICTED = "evicted"  # reported with a checkpoint that retention has deleted since
UNCOMMITTED = "uncommitted"  # the directory is there without a commit marker (yet)
INVALID = "invalid"  # committed, then found damaged: never ranked, resumed from or deleted

# A chart line has at most this many points by default: 4 per bucket (first, last,
# lowest, highest), so a spike survives decimation; markers are never decimated.
SERIES_POINTS = 2000


@dataclasses.dataclass
class _TrialCache:
    """What was read of one trial, so that a poll reads only what changed."""

    offset: int = 0  # bytes of result.json parsed (always at a line end)
    file_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Segments not yet folded into result.json, by name, with their rows.
    segments: dict[str, tuple[Segment, list[dict[str, Any]]]] = dataclasses.field(
        default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # both, in order
    metas: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Directories whose marker is there but does not match them: name -> (the
    # marker's JSON when it parsed, the reason).
    unmatched: dict[str, tuple[dict[str, Any], str]] = dataclasses.field(default_factory=dict)
    uncommitted: set[str] = dataclasses.field(default_factory=set)
    # Recorded by the retention state: dir_name -> why; read again when its files change.
    invalid: dict[str, str] = dataclasses.field(default_factory=dict)
    state_files: tuple[tuple[str, int | None, int | None], ...] = ()
    params: dict[str, Any] | None = None
    config: CheckpointConfig | None = None
    status: str = "finished"
    error: str | None = None  # the last line of error.txt: "ValueError: loss is nan"
    error_size: int = -1  # bytes of error.txt when ``error`` was read
    stop: tuple[str, str, int | None] | None = None  # stopped.json: status, reason, size
    # (metric, x) -> (rows seen, [(x, y, row index)]): a metric switch reads no row twice.
    columns: dict[tuple[str, str], tuple[int, list[tuple[float, float, int]]]] = \
        dataclasses.field(default_factory=dict)

    # Numeric metric names of rows[:metrics_seen], in first-seen order.
    metric_names: dict[str, None] = dataclasses.field(default_factory=dict)
    metrics_seen: int = 0
    flat_shapes: set[tuple[tuple[str, type], ...]] = dataclasses.field(default_factory=set)

    def metrics(self) -> list[str]:
        """Numeric metric names in the rows (nested keys joined by ``/``); only
        rows not seen before are read."""
        if self.metrics_seen > len(self.rows):
            self.metric_names, self.metrics_seen, self.flat_shapes = {}, 0, set()
        for row in self.rows[self.metrics_seen:]:
            # Reports of one run mostly repeat one flat shape: a shape seen
            # before adds no name (a nested row is always flattened).
            shape = tuple((k, type(v)) for k, v in row.items())
            if shape in self.flat_shapes:
                continue
            if not any(isinstance(v, Mapping) for v in row.values()):
                self.flat_shapes.add(shape)
            for key, value in _flatten(row).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.metric_names.setdefault(key, None)
        self.metrics_seen = len(self.rows)
        return list(self.metric_names)

    def version(self) -> str:
        """A token that changes whenever anything shown of the trial changes (an
        HTTP ETag: a poll with nothing new is answered 304 without a body)."""
        key = (self.offset, tuple(sorted(self.segments)), tuple(sorted(self.metas)),
               tuple(sorted(self.unmatched.items())), tuple(sorted(self.invalid.items())),
               tuple(sorted(self.uncommitted)),
               self.status, self.error, self.config.to_json() if self.config else None)
        return hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()


class StoreView:
    """A read-only view of the experiments, trials and checkpoints under one location.

    Args:
        location: a storage root, an experiment or a trial: a local path or any
            backend URI.
        storage_options: backend options (endpoint, credentials); never echoed.

    Raises:
        InvalidConfigError: the location is a checkpoint or a file, or cannot be resolved.
        CheckpointNotFoundError: nothing exists at the location.
    """

    def __init__(self, location: str, storage_options: Mapping[str, Any] | None = None):
        loc = resolve_location(location, dict(storage_options or {}))
        kind = classify(loc)
        self.scope_experiment: str | None = None
        self.scope_trial: str | None = None
        if kind == "trial":
            self.scope_experiment, self.scope_trial = loc.parent.name, loc.name
            self._root = loc.parent.parent
        elif kind == "experiment":
            self.scope_experiment = loc.name
            self._root = loc.parent
        elif kind in ("root", "empty"):
            self._root = loc
        else:
            raise InvalidConfigError(
                f"{loc.uri} is {describe_kind(kind)}; `ui` shows a storage root, an "
                "experiment or a trial (pass the trial directory to see a checkpoint)"
            )
        self.uri = loc.uri
        self.kind = kind
        self._lock = threading.Lock()
        self._caches: dict[tuple[str, str], _TrialCache] = {}
        self._known: dict[str, list[str]] = {}

    # -- what is under the location ----------------------------------------------------

    def experiments(self) -> dict[str, list[str]]:
        """``{experiment: [trial, ...]}`` under the location, names sorted; re-listed."""
        if self.scope_experiment is not None:
            names = [self.scope_experiment]
        else:
            # Dot-named experiments too, as every walk of a root (docs/format.md).
            names = [n for n, is_dir in list_entries(self._root)
                     if is_dir and not is_internal_name(n)]
        out: dict[str, list[str]] = {}
        for exp in names:
            if self.scope_trial is not None:
                trials = [self.scope_trial]
            else:
                trials = [t.name for t in trials_under(self._root.child(exp), "experiment")]
            if trials:
                out[exp] = trials
        self._known = out
        return out

    def storage(self, experiment: str, trial: str) -> StorageContext:
        """The trial's StorageContext, for names listed under the location only.

        Raises:
            InvalidConfigError: a name is not one path component.
            CheckpointNotFoundError: no such trial under the location.
        """
        validate_component(experiment, "experiment")
        validate_component(trial, "trial")
        if trial not in self._known.get(experiment, ()) and trial not in self.experiments().get(
                experiment, ()):
            raise CheckpointNotFoundError(
                f"no trial {trial!r} of experiment {experiment!r} under {self.uri}")
        return StorageContext.from_backend(self._root.backend, self._root.path, experiment, trial)

    # -- trials ------------------------------------------------------------------------

    def _marked(self, ctx: StorageContext) -> list[str]:
        """Committed directories of the trial, whatever their names."""
        with self._lock:
            return list(self._refresh(ctx, False).metas)

    def _refresh(self, ctx: StorageContext, full: bool) -> _TrialCache:
        key = (ctx.experiment_name, ctx.trial_name)
        cache = self._caches.get(key)
        if cache is None or full:
            cache = self._caches[key] = _TrialCache()
        fs = ctx.filesystem
        entries = {posixpath.basename(fi.path.rstrip("/")): fi
                   for fi in _fsutil.list_dir(fs, ctx.trial_path)}
        result = entries.get(RESULT_FILE)
        # Segments are listed before result.json is read: an assembly writes the
        # file before it deletes them, so no row falls between the two reads.
        listed = (list_segments(fs, ctx.trial_path) if RESULT_SEGMENTS_DIR in entries
                  else [])
        result_path = posixpath.join(ctx.trial_path, RESULT_FILE)
        _read_new_rows(fs, result_path, _fsutil.info(fs, result_path).size if listed
                       else (result.size if result is not None else 0), cache)
        if not _read_new_segments(fs, listed, cache):
            # A segment was assembled away after the file was read: the file
            # now holds its rows.
            _read_new_rows(fs, result_path, _fsutil.info(fs, result_path).size, cache)
            _read_new_segments(fs, [s for s in listed if s.name in cache.segments], cache)
        subdirs = {n for n, fi in entries.items()
                   if fi.type != _fsutil.pafs.FileType.File and not is_internal_name(n)}
        dirs = {n for n in subdirs if parse_checkpoint_dir_name(n) is not None}
        for gone in set(cache.metas) - subdirs:
            del cache.metas[gone]
        cache.uncommitted, cache.unmatched = set(), {}
        for name in sorted(subdirs - set(cache.metas)):
            # The marker makes a checkpoint, whatever the name (Ray Train's
            # checkpoint_<time>); only checkpoint_NNNNNN ones count as unfinished.
            insp = inspect_checkpoint(fs, posixpath.join(ctx.trial_path, name))
            if insp.state == "committed" and insp.meta is not None:
                cache.metas[name] = insp.meta
            elif insp.state == "invalid":
                # Committed once, damaged since (a file removed or added): the
                # same "invalid" as `ls` and the checkpoint page, never "not committed".
                cache.unmatched[name] = (insp.meta or {}, insp.reason or "invalid")
            elif name in dirs:
                cache.uncommitted.add(name)
        if cache.params is None and PARAMS_FILE in entries:
            cache.params = _read_json(fs, posixpath.join(ctx.trial_path, PARAMS_FILE))
        if (cache.config is None or full) and MANAGER_STATE in entries:
            cache.config = _read_config(fs, posixpath.join(ctx.trial_path, MANAGER_STATE))
        state_files = tuple(sorted((n, fi.size, fi.mtime_ns) for n, fi in entries.items()
                                   if n == MANAGER_STATE or parse_state_log_name(n) is not None))
        if state_files != cache.state_files or full:
            cache.invalid = ({n: why for n, why in recorded_invalid(ctx).items() if n in subdirs}
                             if MANAGER_STATE in entries else {})
            cache.state_files = state_files
        _read_error(fs, posixpath.join(ctx.trial_path, ERROR_FILE), entries.get(ERROR_FILE),
                    cache)
        # A lease outranks error.txt: a run holding one (live or crashed) is
        # newer than the failure recorded by an earlier run.
        stop = _read_stop(fs, posixpath.join(ctx.trial_path, STOPPED_FILE),
                          entries.get(STOPPED_FILE), cache)
        if LEASE_FILE in entries:
            cache.status = "running" if live_lease(ctx) is not None else "interrupted"
        elif cache.error is not None:
            cache.status = "errored"
        elif stop is not None:
            # Ended early by its driver (a pruner): not "finished".
            cache.status = stop[0]
            cache.error = stop[1]
        else:
            cache.status = "finished"
        return cache

    def trial(self, experiment: str, trial: str, *, since: int | None = 0,
              full: bool = False) -> dict[str, Any]:
        """One trial: its summary, ``result.json`` rows from row ``since`` on, and
        every checkpoint (committed, invalid, uncommitted, or reported and evicted since).

        Args:
            since: the first row to return; None returns no rows (the page asks
                for decimated :meth:`series` instead) and reads only what changed.

        Returns:
            The :meth:`summary` fields plus ``rows`` (``rows[since:]``, absent when
            ``since`` is None), ``total_rows``, ``checkpoints`` (see
            :func:`_checkpoint_rows`), ``metrics`` (numeric metric names in the
            rows), ``config`` and ``version`` (see :meth:`version`).
        """
        ctx = self.storage(experiment, trial)
        with self._lock:
            cache = self._refresh(ctx, full or since == 0)
            out = self._summary(ctx, cache)
            if since is not None:
                out["rows"] = cache.rows[max(since, 0):]
            out["total_rows"] = len(cache.rows)
            out["checkpoints"] = _checkpoint_rows(cache)
            out["metrics"] = cache.metrics()
            out["config"] = cache.config.to_json() if cache.config else None
            out["version"] = cache.version()
        return out

    def version(self, experiment: str, trial: str) -> str:
        """The trial's :meth:`_TrialCache.version` after reading what changed: equal
        tokens mean equal answers of :meth:`trial` and :meth:`series`."""
        ctx = self.storage(experiment, trial)
        with self._lock:
            return self._refresh(ctx, False).version()

    def series(self, experiment: str, trial: str, metric: str, *,
               x: str = "training_iteration", points: int = SERIES_POINTS,
               x_min: float | None = None, x_max: float | None = None) -> dict[str, Any]:
        """One metric of a trial as a chart line, decimated on the server.

        The rows with a number for both ``x`` and ``metric`` (the retention
        manager's lookup: a literal key first, else a ``/``-separated path),
        inside ``[x_min, x_max]`` when given, cut into ``points // 4`` buckets of
        consecutive rows; each bucket keeps its first, last, lowest and highest
        point, so a spike stays visible. Fewer rows than ``points`` are all kept.

        Returns:
            ``metric``, ``x``, ``total`` (rows in range), ``points`` (``[[x, y],
            ...]`` in row order), ``markers`` (``[{name, x, y}]``: every report
            that named a checkpoint, exact, never decimated) and ``version``.

        Raises:
            InvalidConfigError: ``points`` under 4.
        """
        if points < 4:
            raise InvalidConfigError(f"points must be at least 4, got {points}")
        ctx = self.storage(experiment, trial)
        with self._lock:
            cache = self._refresh(ctx, False)
            column = _column(cache, metric, x)
            version = cache.version()
            rows = cache.rows
        inside = [p for p in column if (x_min is None or p[0] >= x_min)
                  and (x_max is None or p[0] <= x_max)]
        markers = []
        for px, py, i in inside:
            name = rows[i].get("checkpoint_dir_name")
            if isinstance(name, str):
                markers.append({"name": name, "x": px, "y": py})
        return {"metric": metric, "x": x, "total": len(inside),
                "points": [[px, py] for px, py, _ in _decimate(inside, points)],
                "markers": markers, "version": version}

    def summary(self, experiment: str, trial: str, *, full: bool = False) -> dict[str, Any]:
        """One row of the experiments table.

        Returns:
            ``experiment``, ``trial``, ``uri``, ``status`` (``running``: a live
            lease; ``interrupted``: a lease left by a process that is gone;
            ``errored``: no lease and an ``error.txt``, the last run ended with
            an exception; ``pruned`` or ``stopped``: its driver ended the last
            run early and said why (``stopped.json``: an Optuna pruner, a
            scheduler); ``finished``), ``error`` (the last line of
            ``error.txt``, e.g. ``"ValueError: loss is nan"``, or the stop's
            reason, or None), ``invalid`` (committed checkpoints that no longer
            match their manifest, counted in ``committed`` too), ``reports``,
            ``committed`` (checkpoints), ``metric``
            and ``mode`` (the recorded score attribute and order), ``best_score``
            and ``best_checkpoint``, ``size`` (bytes in committed checkpoints'
            manifests), ``last_report`` (Unix seconds) and ``params``
            (``params.json`` flattened, nested keys joined by ``/``).
        """
        ctx = self.storage(experiment, trial)
        with self._lock:
            return self._summary(ctx, self._refresh(ctx, full))

    def _summary(self, ctx: StorageContext, cache: _TrialCache) -> dict[str, Any]:
        config = cache.config
        metas = _good(cache)
        best = _best(metas, config)
        last = cache.rows[-1].get("timestamp") if cache.rows else None
        return {
            "experiment": ctx.experiment_name,
            "trial": ctx.trial_name,
            "uri": ctx.uri(ctx.trial_path),
            "status": cache.status,
            "error": cache.error,
            "reports": len(cache.rows),
            "committed": len(cache.metas) + len(cache.unmatched),
            "invalid": len(cache.unmatched) + len(cache.invalid.keys() & cache.metas.keys()),
            "metric": config.checkpoint_score_attribute if config else None,
            "mode": config.checkpoint_score_order if config else None,
            "best_checkpoint": best[0] if best else None,
            "best_score": best[1] if best else None,
            "size": sum(manifest_size(m) for m in metas.values()),
            "last_report": last if isinstance(last, (int, float)) else None,
            "params": _flatten(cache.params or {}),
        }

    def overview(self, *, full: bool = False) -> dict[str, Any]:
        """Every experiment under the location with the :meth:`summary` of each trial."""
        experiments = []
        for exp, trials in self.experiments().items():
            rows = [self.summary(exp, t, full=full) for t in trials]
            params = sorted({k for r in rows for k in r["params"]})
            experiments.append({"name": exp, "trials": rows, "params": params})
        out = {"uri": self.uri, "kind": self.kind, "experiments": experiments}
        if not experiments and self.scope_experiment is None:
            out["stores_below"] = self.stores_below()
        return out

    def stores_below(self) -> list[str]:
        """URIs of the directories right under the location that are storage roots
        themselves (a folder of stores, ``runs/`` and ``tune/``): where to point
        ``ui`` instead, when the location holds no trial of its own."""
        out = []
        for name, is_dir in list_entries(self._root):
            if not is_dir or is_internal_name(name):
                continue
            child = self._root.child(name)
            try:
                if trials_under(child, "root"):
                    out.append(child.uri)
            except (OSError, InvalidConfigError, CheckpointNotFoundError):
                continue  # unreadable: not a hint worth an error
        return out

    def csv_rows(self, experiment: str, trial: str) -> list[dict[str, Any]]:
        """Every ``result.json`` row of the trial, nested keys joined by ``/`` (the
        rows of a CSV export, oldest first)."""
        ctx = self.storage(experiment, trial)
        with self._lock:
            rows = list(self._refresh(ctx, False).rows)
        return [_flatten(r) for r in rows]

    def best_rows(self, experiment: str) -> list[dict[str, Any]]:
        """One row per trial of ``experiment``: its name, status, best checkpoint and
        score, parameters (``param/NAME``), and the metrics of the report that
        named the best checkpoint (a sweep's CSV export).

        Raises:
            InvalidConfigError: ``experiment`` is not one path component.
            CheckpointNotFoundError: no such experiment under the location.
        """
        validate_component(experiment, "experiment")
        trials = self.experiments().get(experiment)
        if trials is None:
            raise CheckpointNotFoundError(f"no experiment {experiment!r} under {self.uri}")
        out = []
        for trial in trials:
            ctx = self.storage(experiment, trial)
            with self._lock:
                cache = self._refresh(ctx, False)
                summary = self._summary(ctx, cache)
                best = summary["best_checkpoint"]
                row: dict[str, Any] = next((r for r in reversed(cache.rows)
                            if best is not None and r.get("checkpoint_dir_name") == best), {})
            out.append({"trial": trial, "status": summary["status"],
                        "best_checkpoint": best, "best_score": summary["best_score"],
                        **{f"param/{k}": v for k, v in summary["params"].items()},
                        **_flatten(row)})
        return out

    # -- one checkpoint ----------------------------------------------------------------

    def checkpoint(self, experiment: str, trial: str, name: str) -> dict[str, Any]:
        """One checkpoint: state, manifest, user and internal metadata, snippets.

        Raises:
            InvalidConfigError: ``name`` is not a ``checkpoint_NNNNNN`` name nor a
                committed directory of the trial under another name.
            CheckpointNotFoundError: no such directory in the trial.
        """
        ctx = self.storage(experiment, trial)
        _require_checkpoint_name(name, self._marked(ctx))
        ckpt = ctx.checkpoint(name)
        insp = inspect_checkpoint(ctx.filesystem, ckpt.path)
        if insp.state == "missing":
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in trial {trial!r}")
        meta = insp.meta or {}
        try:
            user: Any = ckpt.get_metadata()
        except CheckpointCorruptError as exc:
            user = {"(unreadable)": str(exc)}
        internal = {k: v for k, v in meta.items() if k != "manifest"}
        with self._lock:
            cache = self._refresh(ctx, False)
            rows = _checkpoint_rows(cache)
            why = cache.invalid.get(name)
        row = next((r for r in rows if r["name"] == name), {})
        return {
            "experiment": experiment, "trial": trial, "name": name, "uri": ckpt.uri,
            "state": INVALID if why is not None else insp.state,
            "reason": insp.reason or why, "file": insp.file,
            # Why retention keeps it: its kind and rank on the trial's page.
            "kind": row.get("kind"), "rank": row.get("rank"), "score": row.get("score"),
            "is_latest": row.get("is_latest", False),
            "ranked": sum(1 for r in rows if r.get("rank") is not None),
            "score_attribute": cache.config.checkpoint_score_attribute if cache.config else None,
            "manifest": list(meta.get("manifest", [])),
            "size": manifest_size(meta),
            "user_metadata": user, "internal_metadata": internal,
            "snippets": _snippets(ckpt.uri, name),
        }

    def verify(self, experiment: str, trial: str, name: str) -> dict[str, Any]:
        """Run :meth:`Checkpoint.verify` (reads every byte once).

        Returns:
            ``ok``; with ``ok`` the ``files``, ``bytes`` and ``seconds`` checked,
            else ``error`` (the library's message) and ``file`` (the file that
            failed, relative to the checkpoint, when one did).
        """
        ctx = self.storage(experiment, trial)
        _require_checkpoint_name(name, self._marked(ctx))
        ckpt = ctx.checkpoint(name)
        start = time.monotonic()
        try:
            ckpt.verify()
        except CheckpointCorruptError as exc:
            return {"ok": False, "error": str(exc), "file": exc.file}
        except CheckpointNotFoundError as exc:
            return {"ok": False, "error": str(exc), "file": None}
        meta = ckpt.internal_metadata
        return {"ok": True, "files": len(meta.get("manifest", [])),
                "bytes": manifest_size(meta),
                "seconds": round(time.monotonic() - start, 3)}


# -- helpers ---------------------------------------------------------------------------


def _require_checkpoint_name(name: str, marked: Iterable[str] = ()) -> None:
    """A ``checkpoint_NNNNNN`` name, or one of ``marked`` (directories of the
    trial with a commit marker under another name, as Ray Train names them)."""
    validate_component(name, "checkpoint")
    if parse_checkpoint_dir_name(name) is None and name not in set(marked):
        raise InvalidConfigError(
            f"{name!r} is neither a checkpoint_NNNNNN directory name nor a directory "
            "with a commit marker")


def _read_new_rows(fs: Any, path: str, size: int | None, cache: _TrialCache) -> None:
    """Parse the rows appended since ``cache.offset``: one ranged read of the new bytes.

    A file shorter than what was parsed was replaced: start again. A last line
    without its newline is a row being written: left for the next read.
    """
    size = int(size or 0)
    if size < cache.offset:
        cache.offset, cache.file_rows = 0, []
    if size == cache.offset:
        return
    try:
        with fs.open_input_file(path) as f:
            data = f.read_at(size - cache.offset, cache.offset)
    except FileNotFoundError:
        return
    end = data.rfind(b"\n")
    if end < 0:
        return
    cache.file_rows.extend(parse_result_rows(data[: end + 1]))
    cache.offset += end + 1


def _read_new_segments(fs: Any, listed: list[Segment], cache: _TrialCache) -> bool:
    """Read the ``listed`` segments not seen before (a segment never changes),
    forget the ones assembled away, and set ``cache.rows``: ``result.json``'s
    rows, then the segments' rows it does not hold yet. False when a listed
    segment was gone when read."""
    whole = True
    kept: dict[str, tuple[Segment, list[dict[str, Any]]]] = {}
    for seg in listed:
        if seg.name in cache.segments:
            kept[seg.name] = cache.segments[seg.name]
            continue
        try:
            kept[seg.name] = (seg, parse_result_rows(_fsutil.read_bytes(fs, seg.path)))
        except FileNotFoundError:
            whole = False  # assembled into result.json since the listing
    cache.segments = kept
    cache.rows = cache.file_rows + unfolded_rows(
        [kept[s.name] for s in listed if s.name in kept], cache.file_rows)
    return whole


def _read_error(fs: Any, path: str, info: Any, cache: _TrialCache) -> None:
    """Keep the last line of ``error.txt`` in ``cache`` (read again only when
    its size changed; absent: None)."""
    if info is None:
        cache.error, cache.error_size = None, -1
        return
    if info.size == cache.error_size and cache.error is not None:
        return
    try:
        text = _fsutil.read_bytes(fs, path).decode("utf-8", errors="replace")
    except (FileNotFoundError, OSError):
        cache.error, cache.error_size = None, -1
        return
    lines = [line for line in text.splitlines() if line.strip()]
    cache.error = lines[-1].strip() if lines else "(error.txt is empty)"
    cache.error_size = info.size if info.size is not None else -1


def _read_stop(fs: Any, path: str, info: Any,
               cache: _TrialCache) -> tuple[str, str] | None:
    """``(status, reason)`` of ``stopped.json`` (read again only when its size
    changed), or None when there is none."""
    if info is None:
        cache.stop = None
        return None
    if cache.stop is None or cache.stop[2] != info.size:
        body = _read_json(fs, path)
        status = body.get("status") if isinstance(body, dict) else None
        if status not in ("pruned", "stopped"):
            cache.stop = None
            return None
        cache.stop = (status, str(body.get("reason") or status), info.size)
    return cache.stop[0], cache.stop[1]


def _read_json(fs: Any, path: str) -> Any:
    try:
        return _json.loads(_fsutil.read_bytes(fs, path))
    except (OSError, ValueError):
        return None


def _read_config(fs: Any, path: str) -> CheckpointConfig | None:
    """The trial's retention rules, as its manager recorded them."""
    state = _read_json(fs, path)
    try:
        return CheckpointConfig.from_json(state["config"])
    except (TypeError, KeyError, InvalidConfigError):
        return None


def _records(metas: Mapping[str, Mapping[str, Any]]) -> list[CheckpointRecord]:
    return [CheckpointRecord(m["index"], n, m.get("metrics") or {}, _number_or_none(m))
            for n, m in metas.items()]


def _number_or_none(meta: Mapping[str, Any]) -> float | None:
    value = meta.get("created_at")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _top(metas: Mapping[str, Mapping[str, Any]], config: CheckpointConfig,
         k: int) -> list[CheckpointRecord]:
    """The best ``k`` committed checkpoints by the retention manager's own ranking."""
    missing = "worst" if config.missing_score == "raise" else config.missing_score
    # The ranking fields only: a recorded policy decides what is kept, not what is best.
    rules = CheckpointConfig(num_to_keep=k,
                             checkpoint_score_attribute=config.checkpoint_score_attribute,
                             checkpoint_score_order=config.checkpoint_score_order,
                             keep_latest=False, missing_score=missing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing score is shown, not warned about
        try:
            kept, _ = select_kept(_records(metas), rules)
        except InvalidConfigError:  # a non-numeric score: nothing ranks
            return []
    return kept


def _best(metas: Mapping[str, Mapping[str, Any]],
          config: CheckpointConfig | None) -> tuple[str, float | None] | None:
    if not metas or config is None or config.checkpoint_score_attribute is None:
        return None
    top = _top(metas, config, 1)
    if not top:
        return None
    return top[0].dir_name, score_or_none(top[0].metrics, config.checkpoint_score_attribute)


def _good(cache: _TrialCache) -> dict[str, dict[str, Any]]:
    """The committed checkpoints but those the retention state records as invalid."""
    return {n: m for n, m in cache.metas.items() if n not in cache.invalid}


def _checkpoint_rows(cache: _TrialCache) -> list[dict[str, Any]]:
    """Every checkpoint the trial has or had, oldest first: ``name``, ``index``,
    ``kind`` (best, latest, kept, invalid, evicted, uncommitted), ``is_best``
    (ranked first), ``rank`` (1 for the best by the score attribute, None when
    unranked), ``is_latest``, ``score``, ``size``, ``files``, ``created_at``,
    ``iteration`` (the ``training_iteration`` of the report that named it) and,
    for ``invalid``, ``reason`` (what does not match, naming the file). An
    invalid one (its files no longer match its manifest, or a read found it
    damaged) is never best, latest nor ranked."""
    config = cache.config
    attr = config.checkpoint_score_attribute if config else None
    metas = _good(cache)
    best_k: set[str] = set()
    first = None
    if config is not None and attr is not None and metas:
        best_k = {r.dir_name for r in _top(metas, config, config.num_to_keep or 1)}
        top1 = _top(metas, config, 1)
        first = top1[0].dir_name if top1 else None
    ranks = _ranks(metas, config)
    latest = max(metas, key=lambda n: metas[n]["index"]) if metas else None
    reported = {r["checkpoint_dir_name"]: r for r in cache.rows
                if isinstance(r.get("checkpoint_dir_name"), str)}
    out = []
    for name, meta in cache.metas.items():
        kind = (INVALID if name in cache.invalid else BEST if name in best_k
                else LATEST if name == latest else KEPT)
        row = reported.get(name, {})
        out.append({
            "name": name, "index": meta["index"], "kind": kind, "is_best": name == first,
            "rank": ranks.get(name), "is_latest": name == latest,
            "score": score_or_none(meta.get("metrics") or {}, attr),
            "size": manifest_size(meta), "files": len(meta.get("manifest", [])),
            "created_at": meta.get("created_at"),
            "iteration": row.get("training_iteration"),
            **({"reason": cache.invalid[name]} if name in cache.invalid else {}),
        })
    for name, (meta, reason) in cache.unmatched.items():
        row = reported.get(name, {})
        index = meta.get("index") if isinstance(meta.get("index"), int) else \
            parse_checkpoint_dir_name(name)
        out.append({
            "name": name, "index": index, "kind": INVALID, "is_best": False, "rank": None,
            "is_latest": False, "score": score_or_none(meta.get("metrics") or row, attr),
            "size": manifest_size(meta) if meta.get("manifest") else None,
            "files": len(meta.get("manifest", [])) or None,
            "created_at": meta.get("created_at"), "iteration": row.get("training_iteration"),
            "reason": reason,
        })
    for name in cache.invalid.keys() - cache.metas.keys() - reported.keys():
        reported[name] = {}  # recorded damaged, not matching its manifest, no row names it
    for name, row in reported.items():
        if name in cache.metas or name in cache.unmatched:
            continue
        index = parse_checkpoint_dir_name(name)
        out.append({
            "name": name, "index": index,
            "kind": (INVALID if name in cache.invalid else
                     UNCOMMITTED if name in cache.uncommitted else EVICTED),
            "is_best": False, "rank": None, "is_latest": False,
            "score": score_or_none(row, attr), "size": None, "files": None, "created_at": None,
            "iteration": row.get("training_iteration"),
        })
    out.sort(key=lambda c: (c["index"] is None, c["index"] or 0))
    return out


def _ranks(metas: Mapping[str, Mapping[str, Any]],
           config: CheckpointConfig | None) -> dict[str, int]:
    """``name -> 1, 2, ...``: committed checkpoints with a score, best first, in the
    retention manager's order (:func:`~checkpoint_store.retention.rank_key`)."""
    attr = config.checkpoint_score_attribute if config else None
    if config is None or attr is None:
        return {}
    scored = [(score_or_none(m.get("metrics") or {}, attr), m["index"], n)
              for n, m in metas.items()]
    order = config.checkpoint_score_order
    ranked = sorted((s for s in scored if s[0] is not None),
                    key=lambda s: rank_key(s[0], s[1], order), reverse=True)
    return {name: i + 1 for i, (_, _, name) in enumerate(ranked)}


def _column(cache: _TrialCache, metric: str, x: str) -> list[tuple[float, float, int]]:
    """``[(x, y, row index)]`` of the rows with a number for both; extended, not
    recomputed, as rows arrive (a replaced ``result.json`` starts it again)."""
    seen, points = cache.columns.get((metric, x), (0, []))
    if seen > len(cache.rows):
        seen, points = 0, []
    points = list(points)
    for i in range(seen, len(cache.rows)):
        row = cache.rows[i]
        py = _number(row.get(metric))  # a literal key first, as score_or_none reads it
        if py is None:
            py = score_or_none(row, metric)
        px = _number(row.get(x))
        if px is not None and py is not None:
            points.append((px, py, i))
    cache.columns[(metric, x)] = (len(cache.rows), points)
    return points


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def _decimate(points: list[tuple[float, float, int]],
              limit: int) -> list[tuple[float, float, int]]:
    """At most ``limit`` of ``points``, in order: for each of ``limit // 4`` runs of
    consecutive points its first, last, lowest and highest (the M4 rule, which
    draws the same line as every point at the chart's width)."""
    if len(points) <= limit:
        return points
    buckets = limit // 4
    out: list[tuple[float, float, int]] = []
    for b in range(buckets):
        run = points[b * len(points) // buckets:(b + 1) * len(points) // buckets]
        if not run:
            continue
        keep = {0, len(run) - 1,
                min(range(len(run)), key=lambda i: run[i][1]),
                max(range(len(run)), key=lambda i: run[i][1])}
        out.extend(run[i] for i in sorted(keep))
    return out


def _flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested keys joined by ``/``, the way score attributes name nested metrics."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value if not isinstance(value, list) else json.dumps(value)
    return out


def _snippets(uri: str, name: str) -> dict[str, str]:
    """Copy-paste commands for a checkpoint. Storage options are never written in:
    they may hold credentials."""
    shell = ("# plus the -o KEY=VALUE options given to `ui`, if any\n"
             f"checkpoint-store download {shlex.quote(uri)} {shlex.quote('./' + name)}")
    python = (
        "from checkpoint_store import Checkpoint\n\n"
        "# storage_options={...} as given to `ui`, or the backend's environment variables\n"
        f"checkpoint = Checkpoint({uri!r})\n"
        "with checkpoint.as_directory() as path:\n"
        "    ...  # load your model and optimizer state from path\n"
    )
    return {"shell": shell, "python": python}


__all__ = ["StoreView"]
