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

import posixpath
import threading
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store._browse.locations import (
    classify,
    copy_of,
    describe_kind,
    link_fault,
    list_entries,
    manifest_size,
    resolve_location,
    trials_under,
)
from checkpoint_store._browse.status import preemption_of, status_of
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
    list_segments,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.backends.uris import scrub_secrets
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.retention import (
    CheckpointRecord,
    explain_kept,
    live_lease,
    score_or_none,
)
from checkpoint_store.retention.statelog import recorded_state
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers.view import local_tier_views
from checkpoint_store.ui._rows import BEST as BEST
from checkpoint_store.ui._rows import EVICTED as EVICTED
from checkpoint_store.ui._rows import INVALID as INVALID
from checkpoint_store.ui._rows import KEPT as KEPT
from checkpoint_store.ui._rows import LATEST as LATEST
from checkpoint_store.ui._rows import SERIES_POINTS as SERIES_POINTS
from checkpoint_store.ui._rows import UNCOMMITTED as UNCOMMITTED
from checkpoint_store.ui._rows import (
    _best,
    _checkpoint_rows,
    _column,
    _flatten,
    _good,
    _inspect_all,
    _read_config,
    _read_error,
    _read_json,
    _read_new_rows,
    _read_new_segments,
    _read_stop,
    _require_checkpoint_name,
    _snippets,
    _tensor_rows,
    _TrialCache,
)
from checkpoint_store.ui._rows import _decimate as _decimate


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
        # Kept only to hide them from messages (redact): an engine's error may quote one.
        self._secret_options = dict(storage_options or {})
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
        #: URIs of directories holding trials that the last listing did not reach
        #: (:func:`~checkpoint_store._browse.locations.trials_under`).
        self.not_walked: list[str] = []
        # (experiment, trial) -> (the trial's version, _resumes of its rows)
        self._resume_rows: dict[tuple[str, str], tuple[str, list[dict[str, Any]]]] = {}

    def redact(self, text: str) -> str:
        """``text`` (a message for a response or a log line) with the credentials
        among this view's storage options, and any ``?access_token=``-like pair,
        hidden (:func:`~checkpoint_store.backends.uris.scrub_secrets`)."""
        return scrub_secrets(text, self._secret_options)

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
        skipped: list[Any] = []
        for exp in names:
            if self.scope_trial is not None:
                trials = [self.scope_trial]
            else:
                trials = [t.name for t in
                          trials_under(self._root.child(exp), "experiment", skipped)]
            if trials:
                out[exp] = trials
        self._known = out
        self.not_walked = [s.uri for s in skipped]
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
        """Directories of the trial with a commit marker, whatever their names
        (committed ones, and those invalid since: a copy, a failed manifest),
        symbolic links left out."""
        with self._lock:
            cache = self._refresh(ctx, False)
            # Never a link under another name: its metadata and bytes are read
            # through it, from wherever it points (outside the store, say).
            return [*cache.metas, *(n for n in cache.unmatched if link_fault(
                ctx.filesystem, posixpath.join(ctx.trial_path, n)) is None)]

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
        for name, insp in _inspect_all(fs, ctx.trial_path, sorted(subdirs - set(cache.metas))):
            # The marker makes a checkpoint, whatever the name (Ray Train's
            # checkpoint_<time>); only checkpoint_NNNNNN ones count as unfinished.
            if insp.state == "committed" and insp.meta is not None:
                # A link under another name (to a directory outside the store, say)
                # is no checkpoint of the trial's: never ranked, shown or verified
                # through, as `ls` and `verify` name it (a checkpoint_NNNNNN link
                # is found by the inspection itself).
                copy = (copy_of(name, insp.meta, entries)
                        or link_fault(fs, posixpath.join(ctx.trial_path, name)))
                if copy is None:
                    cache.metas[name] = insp.meta
                else:
                    # `cp -r checkpoint_000001 backup`: the original's index, never
                    # ranked beside it (the same "invalid" as `ls` and `verify`).
                    cache.unmatched[name] = (insp.meta, copy)
            elif insp.state == "invalid":
                # Committed once, damaged since (a file removed or added): the
                # same "invalid" as `ls` and the checkpoint page, never "not committed".
                cache.unmatched[name] = (insp.meta or {}, insp.reason or "invalid")
            elif name in dirs:
                cache.uncommitted.add(name)
        for name, fi in entries.items():
            if fi.type == _fsutil.pafs.FileType.File and parse_checkpoint_dir_name(name) \
                    is not None:
                # A file in a checkpoint's place: named as the invalid entry it is.
                cache.unmatched[name] = ({}, "is a file, not a checkpoint directory")
        cache.tiers = local_tier_views(fs, ctx.trial_path, entries)
        if cache.params is None and PARAMS_FILE in entries:
            cache.params = _read_json(fs, posixpath.join(ctx.trial_path, PARAMS_FILE))
        state_files = tuple(sorted((n, fi.size, fi.mtime_ns) for n, fi in entries.items()
                                   if n == MANAGER_STATE or parse_state_log_name(n) is not None))
        if state_files != cache.state_files or full:
            recorded, cache.state_problem = (recorded_state(ctx) if MANAGER_STATE in entries
                                             else ({}, None))
            cache.invalid = {n: why for n, why in recorded.items() if n in subdirs}
            cache.state_files = state_files
        if cache.state_problem is not None:
            cache.config = None  # what an unusable state says is not shown
            cache.run_id = None
        elif (cache.config is None or full) and MANAGER_STATE in entries:
            cache.config = _read_config(fs, posixpath.join(ctx.trial_path, MANAGER_STATE))
            state = _read_json(fs, posixpath.join(ctx.trial_path, MANAGER_STATE))
            run_id = state.get("run_id") if isinstance(state, dict) else None
            cache.run_id = run_id if isinstance(run_id, str) else None
        cache.trial_name = ctx.trial_name
        _read_error(fs, posixpath.join(ctx.trial_path, ERROR_FILE), entries.get(ERROR_FILE),
                    cache)
        # A lease outranks error.txt: a run holding one (live or crashed) is
        # newer than the failure recorded by an earlier run.
        stop = _read_stop(fs, posixpath.join(ctx.trial_path, STOPPED_FILE),
                          entries.get(STOPPED_FILE), cache)
        lease = None
        if LEASE_FILE in entries:
            lease = "running" if live_lease(ctx) is not None else "interrupted"
        # Ended early by its driver (a pruner) or a preemption signal: not "finished".
        cache.status = status_of(lease, cache.error, stop)
        if lease is None and cache.error is None and stop is not None:
            cache.error = stop["reason"]
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
            out["user_metrics"] = [m for m in out["metrics"] if m not in AUTO_FILLED]
            out["auto_metrics"] = [m for m in out["metrics"] if m in AUTO_FILLED]
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
            # Once per version of the trial, not once per metric or panel.
            key = (experiment, trial)
            known = self._resume_rows.get(key)
            if known is None or known[0] != version:
                known = self._resume_rows[key] = (version, _resumes(rows, cache.metas))
            resumes = known[1]
        inside = [p for p in column if (x_min is None or p[0] >= x_min)
                  and (x_max is None or p[0] <= x_max)]
        markers = []
        for px, py, i in inside:
            name = rows[i].get("checkpoint_dir_name")
            if isinstance(name, str):
                markers.append({"name": name, "x": px, "y": py})
        marks = []
        for r in resumes:
            rx = _number_of(rows[r["row"]].get(x))
            if rx is not None and (x_min is None or rx >= x_min) and (
                    x_max is None or rx <= x_max):
                marks.append({"x": rx, **r})
        return {"metric": metric, "x": x, "total": len(inside),
                "points": [[px, py] for px, py, _ in _decimate(inside, points)],
                "markers": markers, "resumes": marks, "version": version}

    def summary(self, experiment: str, trial: str, *, full: bool = False) -> dict[str, Any]:
        """One row of the experiments table.

        Returns:
            ``experiment``, ``trial``, ``uri``, ``status`` (``running``: a live
            lease; ``interrupted``: a lease left by a process that is gone;
            ``errored``: no lease and an ``error.txt``, the last run ended with
            an exception; ``pruned`` or ``stopped``: its driver ended the last
            run early and said why (``stopped.json``: an Optuna pruner, a
            scheduler); ``preempted``: a preemption signal ended the last run
            after its last report committed what it could, resumable from
            the newest committed checkpoint; ``finished``), ``error`` (the
            last line of ``error.txt``, e.g. ``"ValueError: loss is nan"``, or
            the stop's reason, e.g. ``"SIGTERM received at
            2026-01-02T03:04:05Z"``, or None), ``stop`` (``{status, reason,
            time}`` of ``stopped.json`` when the status is its, else None),
            ``invalid`` (committed checkpoints that no longer
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
            "stop": cache.stop[0] if cache.stop is not None
            and cache.stop[0]["status"] == cache.status else None,
            "reports": len(cache.rows),
            "committed": len(cache.metas) + len(cache.unmatched),
            "invalid": len(cache.unmatched) + len(cache.invalid.keys() & cache.metas.keys()),
            # A retention state there but unusable: named, its config not used.
            "state_problem": cache.state_problem,
            "metric": config.checkpoint_score_attribute if config else None,
            "mode": config.checkpoint_score_order if config else None,
            "best_checkpoint": best[0] if best else None,
            "best_score": best[1] if best else None,
            "size": sum(manifest_size(m) for m in metas.values()),
            "last_report": last if isinstance(last, (int, float)) else None,
            "params": _flatten(cache.params or {}),
        }

    def overview(self, *, full: bool = False) -> dict[str, Any]:
        """Every experiment under the location with the :meth:`summary` of each trial,
        and ``not_walked``: URIs of directories holding trials beside the trials
        of an experiment, which are not shown (a stray trial next to experiments
        makes a storage root read as an experiment)."""
        experiments = []
        for exp, trials in self.experiments().items():
            rows = [self.summary(exp, t, full=full) for t in trials]
            params = sorted({k for r in rows for k in r["params"]})
            experiments.append({"name": exp, "trials": rows, "params": params})
        out = {"uri": self.uri, "kind": self.kind, "experiments": experiments,
               "not_walked": list(self.not_walked)}
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

        A state checkpoint (``Checkpoint.from_state``, ``report(state=...)``) has
        ``tensors`` (:func:`_tensor_rows`: name, dtype, shape, size, file) and
        its internal metadata without the index; its Python snippet calls
        ``load_state``. Others have ``tensors`` None. A name a report named
        whose directory retention has deleted since answers ``state``
        ``"evicted"`` with :func:`_eviction`'s fields instead.

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
            with self._lock:
                cache = self._refresh(ctx, False)
                gone = _eviction(cache, name)
            if gone is None:
                raise CheckpointNotFoundError(f"no checkpoint {name!r} in trial {trial!r}")
            return {"experiment": experiment, "trial": trial, "name": name, "uri": ckpt.uri,
                    "state": EVICTED, **gone}
        meta = insp.meta or {}
        tensors = _tensor_rows(meta)
        try:
            user: Any = ckpt.get_metadata()
        except CheckpointCorruptError as exc:
            user = {"(unreadable)": str(exc)}
        # A state's tensor index is shown as its own table, not inside the JSON.
        internal = {k: v for k, v in meta.items()
                    if k != "manifest" and not (k == "tensors" and tensors is not None)}
        with self._lock:
            cache = self._refresh(ctx, False)
            rows = _checkpoint_rows(cache)
            why = cache.invalid.get(name)
            if why is None and name in cache.unmatched:
                why = cache.unmatched[name][1]
        row = next((r for r in rows if r["name"] == name), {})
        return {
            "experiment": experiment, "trial": trial, "name": name, "uri": ckpt.uri,
            "state": INVALID if why is not None else insp.state,
            "reason": insp.reason or why, "file": insp.file,
            # Why retention keeps it: its kind and rank on the trial's page.
            "kind": row.get("kind"), "rank": row.get("rank"), "score": row.get("score"),
            "is_latest": row.get("is_latest", False),
            # Committed on a preemption signal: {signal, signalled_at, grace_period_s}.
            "preemption": preemption_of(meta),
            "ranked": sum(1 for r in rows if r.get("rank") is not None),
            "score_attribute": cache.config.checkpoint_score_attribute if cache.config else None,
            "manifest": list(meta.get("manifest", [])),
            "size": manifest_size(meta),
            "user_metadata": user, "internal_metadata": internal,
            "tensors": tensors,
            "snippets": _snippets(ckpt.uri, name,
                                  None if tensors is None else [t["name"] for t in tensors]),
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
            return {"ok": False, "error": self.redact(str(exc)), "file": exc.file}
        except CheckpointNotFoundError as exc:
            return {"ok": False, "error": self.redact(str(exc)), "file": None}
        meta = ckpt.internal_metadata
        return {"ok": True, "files": len(meta.get("manifest", [])),
                "bytes": manifest_size(meta),
                "seconds": round(time.monotonic() - start, 3)}


# -- helpers ---------------------------------------------------------------------------

#: The keys a session fills into every result row (docs/format.md, "result.json"):
#: listed apart from the user's metrics on the page.
AUTO_FILLED = ("training_iteration", "timestamp", "time_total_s", "time_this_iter_s",
               "trial_id", "checkpoint_dir_name")


def _number_of(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def _numbers(rows: list[dict[str, Any]], key: str) -> list[float | None]:
    """:func:`_number_of` of ``row[key]`` for every row. Rows are parsed JSON: an int
    or a float is tested inline, any other value goes through :func:`_number_of`."""
    values = [r.get(key) for r in rows]
    return [float(v) if (type(v) is float and v == v) or type(v) is int else _number_of(v)
            for v in values]


def _resumes(rows: list[dict[str, Any]],
             metas: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{row, writer}]``: the first row of each run after the first, oldest first.

    Rows carry no run id; three signs of a new run are read instead:

    * a ``training_iteration`` not above the previous row's: a restart from a
      checkpoint (a resume continues from the restored one, DESIGN "Step
      continuity");
    * a session stamps ``timestamp`` and ``time_this_iter_s`` from one clock
      reading, so inside a run a row's ``timestamp`` step equals its
      ``time_this_iter_s``; a new run's first row counts from the session's
      start, its step also holds the time between the runs. Where the rows
      agree to 10 us (most of them: rows of this library's sessions), a step
      over ``time_this_iter_s`` by more than 1 ms starts a run;
    * otherwise (rows stamped by another clock), committed checkpoints record
      the session that wrote them (``writer_id``, else ``run_id``;
      docs/format.md): where it changes between two checkpoints' reports, the
      run began at the row between them whose step exceeds its
      ``time_this_iter_s`` most.

    ``writer`` is the new run's writer id (its first committed checkpoint's),
    or None where none of its checkpoints is still committed.
    """
    at: dict[int, str] = {}
    for i, row in enumerate(rows):
        meta = metas.get(row.get("checkpoint_dir_name"))  # type: ignore[arg-type]
        writer = meta.get("writer_id") or meta.get("run_id") if meta is not None else None
        if isinstance(writer, str):
            at[i] = writer

    # One pass over plain lists: a 20,000-row trial takes a few milliseconds.
    its = _numbers(rows, "training_iteration")
    ts = _numbers(rows, "timestamp")
    dts = _numbers(rows, "time_this_iter_s")
    starts: dict[int, str | None] = {}
    steps: dict[int, float] = {}
    for i in range(1, len(rows)):
        a, b = its[i - 1], its[i]
        if a is not None and b is not None and b <= a:
            starts[i] = None
        t0, t1, dt = ts[i - 1], ts[i], dts[i]
        if t0 is not None and t1 is not None and dt is not None:
            steps[i] = t1 - t0 - dt
    exact = sum(1 for e in steps.values() if abs(e) < 1e-5)
    if steps and exact * 2 > len(steps):
        starts.update({i: None for i, e in steps.items() if e > 1e-3})
    else:
        marked = sorted(at)
        for prev, cur in zip(marked, marked[1:], strict=False):
            if at[prev] != at[cur] and not any(prev < i <= cur for i in starts):
                starts[max(range(prev + 1, cur + 1), key=lambda i: steps.get(i, 0.0))] = None
    for i in starts:
        nxt = min((j for j in starts if j > i), default=len(rows))
        starts[i] = next((at[j] for j in sorted(at) if i <= j < nxt), None)
    return [{"row": i, "writer": starts[i]} for i in sorted(starts)]


def _eviction(cache: Any, name: str) -> dict[str, Any] | None:
    """Why and when a reported checkpoint is gone, or None when no report named it.

    Replays retention (:func:`~checkpoint_store.retention.explain_kept` under the
    trial's recorded config) over the reported checkpoints in report order: the
    first report after which ``name`` is no longer kept is when it was evicted.

    Returns:
        ``reported`` (``{iteration, timestamp}`` of the report that named it),
        ``score`` and ``score_attribute``, ``evicted_at`` (``{iteration,
        timestamp, by}``: the report after which retention no longer kept it
        and the checkpoint that report named; None when the replay cannot
        say), ``kept_instead`` (``[{name, why}]``: what retention kept then,
        with the policies that keep each) and ``reason`` (one sentence).
    """
    rows = [r for r in cache.rows if isinstance(r.get("checkpoint_dir_name"), str)]
    mine = next((r for r in rows if r["checkpoint_dir_name"] == name), None)
    if mine is None:
        return None
    config = cache.config
    attr = config.checkpoint_score_attribute if config else None
    out: dict[str, Any] = {
        "reported": {"iteration": mine.get("training_iteration"),
                     "timestamp": mine.get("timestamp")},
        "score_attribute": attr, "score": score_or_none(mine, attr) if attr else None,
        "evicted_at": None, "kept_instead": [], "reason": "its directory is gone",
    }
    if config is None:
        out["reason"] = ("its directory is gone, and the trial records no retention rules "
                         "(deleted by hand, or by another tool)")
        return out
    records: dict[str, CheckpointRecord] = {}
    for row in rows:
        cname = row["checkpoint_dir_name"]
        index = parse_checkpoint_dir_name(cname)
        if index is None:
            continue
        records[cname] = CheckpointRecord(index, cname, row, _number_of(row.get("timestamp")))
        try:
            kept, _, why = explain_kept(records.values(), config)
        except InvalidConfigError:
            return out
        if name in records and name not in {r.dir_name for r in kept}:
            out["evicted_at"] = {"iteration": row.get("training_iteration"),
                                 "timestamp": row.get("timestamp"), "by": cname}
            out["kept_instead"] = [{"name": r.dir_name, "why": list(why.get(r.dir_name, ()))}
                                   for r in kept]
            rule = ("its policy" if config.policy is not None else
                    f"the best {config.num_to_keep} by {attr} ({config.checkpoint_score_order})"
                    if attr else f"the newest {config.num_to_keep}")
            out["reason"] = (f"retention keeps {rule}"
                             + (" and the newest" if config.keep_latest and attr
                                and config.policy is None else "")
                             + f"; after {cname} was reported, {name} was not among them")
            return out
        records = {r.dir_name: records[r.dir_name] for r in kept}
    return out


__all__ = ["StoreView"]
