"""The rows the web page shows, read from a trial's files: no state of its own.

:class:`~checkpoint_store.ui._model.StoreView` keeps one :class:`_TrialCache` per
trial and calls these to read a trial's
new result rows and segments, its error and stop files, its config, and to
build the checkpoint table (each row's status: best, latest, kept, evicted,
uncommitted, invalid) and the decimated metric series of the charts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import shlex
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from checkpoint_store._browse.locations import (
    manifest_size,
)
from checkpoint_store._browse.status import preemption_of, stop_of
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    STATE_KIND,
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
    validate_component,
)
from checkpoint_store._results.reader import (
    Segment,
    parse_result_rows,
    unfolded_rows,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.inspect import Inspection, inspect_checkpoint
from checkpoint_store.errors import (
    InvalidConfigError,
)
from checkpoint_store.retention import (
    CheckpointConfig,
    CheckpointRecord,
    rank_key,
    score_or_none,
    select_kept,
)
from checkpoint_store.retention.recorded import foreign_names
from checkpoint_store.tiers.view import TierView, describe

__all__ = ["BEST", "EVICTED", "INVALID", "KEPT", "LATEST", "SERIES_POINTS", "UNCOMMITTED"]


# Kinds of a checkpoint on the chart and in the tables.
BEST = "best"  # committed, among the best num_to_keep by the trial's score attribute
LATEST = "latest"  # committed, the newest, kept for resume though not among the best
KEPT = "kept"  # committed, neither (no score attribute, another run's, pending delete)
EVICTED = "evicted"  # reported with a checkpoint that retention has deleted since
UNCOMMITTED = "uncommitted"  # the directory is there without a commit marker (yet)
INVALID = "invalid"  # committed, then found damaged: never ranked, resumed from or deleted
LOCAL = "local"  # committed on a local tier only (its durable copy pending, or not wanted)


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
    # The trial's local tiers (session.start(local_tier=...)), read at each refresh.
    tiers: list[TierView] = dataclasses.field(default_factory=list)
    # Recorded by the retention state: dir_name -> why; read again when its files change.
    invalid: dict[str, str] = dataclasses.field(default_factory=dict)
    # Why the retention state there cannot be used (then its config is not
    # shown either), or None.
    state_problem: str | None = None
    state_files: tuple[tuple[str, int | None, int | None], ...] = ()
    params: dict[str, Any] | None = None
    config: CheckpointConfig | None = None
    # Whose checkpoints are the trial's (foreign_names): its name, and the run
    # id its retention state records (None without a usable state).
    trial_name: str = ""
    run_id: str | None = None
    status: str = "finished"
    error: str | None = None  # the last line of error.txt: "ValueError: loss is nan"
    error_size: int = -1  # bytes of error.txt when ``error`` was read
    # stopped.json: {status, reason, time} (status_of), and its size when read.
    stop: tuple[dict[str, Any], int | None] | None = None
    # (metric, x) -> (rows seen, [(x, y, row index)]): a metric switch reads no row twice.
    columns: dict[tuple[str, str], tuple[int, list[tuple[float, float, int]]]] = \
        dataclasses.field(default_factory=dict)

    # Numeric metric names of rows[:metrics_seen], in first-seen order.
    metric_names: dict[str, None] = dataclasses.field(default_factory=dict)
    metrics_seen: int = 0
    flat_shapes: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)

    def metrics(self) -> list[str]:
        """Numeric metric names in the rows (nested keys joined by ``/``); only
        rows not seen before are read."""
        if self.metrics_seen > len(self.rows):
            self.metric_names, self.metrics_seen, self.flat_shapes = {}, 0, set()
        for row in self.rows[self.metrics_seen:]:
            # Reports of one run mostly repeat one flat shape: a shape seen
            # before adds no name (a nested row is always flattened). The shape
            # (keys, then their values' types) is built without a Python loop.
            shape = (*row, *map(type, row.values()))
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
               tuple(sorted(self.uncommitted)), self.state_problem,
               self.status, self.error, self.config.to_json() if self.config else None)
        return hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()


def _require_checkpoint_name(name: str, marked: Iterable[str] = ()) -> None:
    """A ``checkpoint_NNNNNN`` name, or one of ``marked`` (directories of the
    trial with a commit marker under another name, as Ray Train names them)."""
    validate_component(name, "checkpoint")
    if parse_checkpoint_dir_name(name) is None and name not in set(marked):
        raise InvalidConfigError(
            f"{name!r} is neither a checkpoint_NNNNNN directory name nor a directory "
            "with a commit marker")


#: Checkpoint directories inspected at once on a trial's first read: each is a
#: listing and a marker read, which object stores answer in parallel.
INSPECT_THREADS = 8


def _inspect_all(fs: Any, trial_path: str, names: list[str]) -> list[tuple[str, Inspection]]:
    """``[(name, inspect_checkpoint(...))]`` of the directories ``names`` of the
    trial, in order; up to :data:`INSPECT_THREADS` at once. The first error
    raised by an inspection is raised (a storage error: the answer is a 502)."""
    def one(name: str) -> Inspection:
        return inspect_checkpoint(fs, posixpath.join(trial_path, name))

    if len(names) < 2:
        return [(name, one(name)) for name in names]
    with ThreadPoolExecutor(min(INSPECT_THREADS, len(names)),
                            thread_name_prefix="cs-ui-inspect") as pool:
        return list(zip(names, pool.map(one, names), strict=True))


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
    def _read() -> bytes:
        with fs.open_input_file(path) as f:
            return f.read_at(size - cache.offset, cache.offset)

    try:
        data = _retry.call(_read, store=fs, what=f"read {path}")
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
               cache: _TrialCache) -> dict[str, Any] | None:
    """``{status, reason, time}`` of ``stopped.json`` (:func:`stop_of`; read
    again only when its size changed), or None when there is none."""
    if info is None:
        cache.stop = None
        return None
    if cache.stop is None or cache.stop[1] != info.size:
        stop = stop_of(_read_json(fs, path))
        if stop is None:
            cache.stop = None
            return None
        cache.stop = (stop, info.size)
    return cache.stop[0]


def _read_json(fs: Any, path: str) -> Any:
    try:
        return _json.loads(_fsutil.read_bytes(fs, path))
    except (OSError, ValueError):
        return None


def _read_config(fs: Any, path: str) -> CheckpointConfig | None:
    """The trial's retention rules, as its manager recorded them."""
    state = _read_json(fs, path)
    try:
        if state["kind"] != STATE_KIND:  # another file under its name: no config of it
            return None
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
    """The committed checkpoints but those the retention state records as invalid
    and those another run or trial wrote (copied in): never ranked, best or
    latest, as the retention manager ranks."""
    foreign = foreign_names(sorted(cache.metas.items(), key=lambda nm: nm[1]["index"]),
                            cache.trial_name, cache.run_id)
    return {n: m for n, m in cache.metas.items() if n not in cache.invalid and n not in foreign}


def _checkpoint_rows(cache: _TrialCache) -> list[dict[str, Any]]:
    """Every checkpoint the trial has or had, oldest first: ``name``, ``index``,
    ``kind`` (best, latest, kept, invalid, evicted, uncommitted), ``is_best``
    (ranked first), ``rank`` (1 for the best by the score attribute, None when
    unranked), ``is_latest``, ``score``, ``size``, ``files``, ``created_at``,
    ``iteration`` (the ``training_iteration`` of the report that named it),
    ``preemption`` (``{signal, signalled_at, grace_period_s}`` of a checkpoint
    committed on a preemption signal, else None) and, for ``invalid``,
    ``reason`` (what does not match, naming the file). An invalid one (its
    files no longer match its manifest, or a read found it damaged) is never
    best, latest nor ranked."""
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
            "preemption": preemption_of(meta),
            **({"reason": cache.invalid[name]} if name in cache.invalid else {}),
        })
    for name, (meta, reason) in cache.unmatched.items():
        row = reported.get(name, {})
        # The name is a checkpoint's identity: a marker naming another index lies.
        index = parse_checkpoint_dir_name(name)
        if index is None and isinstance(meta.get("index"), int):
            index = meta["index"]
        out.append({
            "name": name, "index": index, "kind": INVALID, "is_best": False, "rank": None,
            "is_latest": False, "score": score_or_none(meta.get("metrics") or row, attr),
            "size": manifest_size(meta) if meta.get("manifest") else None,
            "files": len(meta.get("manifest", [])) or None,
            "created_at": meta.get("created_at"), "iteration": row.get("training_iteration"),
            "preemption": preemption_of(meta), "reason": reason,
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
            "iteration": row.get("training_iteration"), "preemption": None,
        })
    if cache.tiers:
        _add_tiers(out, cache)
    out.sort(key=lambda c: (c["index"] is None, c["index"] or 0))
    return out


def _add_tiers(rows: list[dict[str, Any]], cache: _TrialCache) -> None:
    """With a local tier: ``tiers`` (``durable``, ``local``) and ``durable``
    (``committed``, ``pending``, ``local only``, ``evicted``) on every row
    (:func:`checkpoint_store.tiers.view.describe`); a reported checkpoint that
    only a local tier holds is of kind ``local``, not evicted nor uncommitted."""
    known = {r["index"] for r in rows if isinstance(r.get("index"), int)}
    for r in rows:
        index = r.get("index")
        if not isinstance(index, int):
            continue
        r.update(describe(index, r["name"] in cache.metas, cache.tiers))
        if r["kind"] in (EVICTED, UNCOMMITTED) and "local" in r["tiers"]:
            r["kind"] = LOCAL
    for t in cache.tiers:
        for index in sorted(set(t.status) - known):  # its row not read yet
            known.add(index)
            rows.append({"name": checkpoint_dir_name(index), "index": index, "kind": LOCAL,
                         "is_best": False, "rank": None, "is_latest": False, "score": None,
                         "size": None, "files": None, "created_at": None, "iteration": None,
                         **describe(index, False, cache.tiers)})


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
    nested = "/" in metric
    rows = cache.rows
    for i in range(seen, len(rows)):
        row = rows[i]
        # Parsed JSON: a number is an int or a float (the common case tested
        # inline, without a call per row); NaN is no point.
        vy: Any = row.get(metric)  # a literal key first, as score_or_none reads it
        ty = type(vy)
        py: float | None
        if (ty is float and vy == vy) or ty is int:
            py = float(vy)
        elif nested:
            py = score_or_none(row, metric)
            if py is None:
                continue
        else:
            continue
        vx: Any = row.get(x)
        tx = type(vx)
        if (tx is float and vx == vx) or tx is int:
            points.append((float(vx), py, i))
        elif (px := _number(vx)) is not None:
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


def _snippets(uri: str, name: str, state_keys: list[str] | None = None) -> dict[str, str]:
    """Copy-paste commands for a checkpoint. Storage options are never written in:
    they may hold credentials. A state checkpoint (``state_keys``: its tensor
    keys) is loaded with :meth:`Checkpoint.load_state`, a directory one through
    :meth:`Checkpoint.as_directory`."""
    shell = ("# plus the -o KEY=VALUE options given to `ui`, if any\n"
             f"checkpoint-store download {shlex.quote(uri)} {shlex.quote('./' + name)}")
    python = (
        "from checkpoint_store import Checkpoint\n\n"
        "# storage_options={...} as given to `ui`, or the backend's environment variables\n"
        f"checkpoint = Checkpoint({uri!r})\n"
    )
    if state_keys is not None:
        some = state_keys[0] if state_keys else "model/*"
        python += (
            "state = checkpoint.load_state()  # the whole tree, tensors as saved\n"
            "# or only some tensors, by name or glob over the flattened keys:\n"
            f"part = checkpoint.load_state(keys=[{some!r}])\n"
        )
    else:
        python += (
            "with checkpoint.as_directory() as path:\n"
            "    ...  # load your model and optimizer state from path\n"
        )
    return {"shell": shell, "python": python}


def _tensor_rows(meta: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A state checkpoint's tensor index (``internal["tensors"]``, docs/state.md) as
    table rows in key order: ``name``, ``dtype``, ``shape`` (a list), ``size``
    (bytes: the entry's ``offsets`` end minus begin, its pieces' summed for a
    tensor stored in pieces), ``file`` (the safetensors shard, or "N pieces
    in M files") and ``alias_of`` (the key it shares storage with, or None). None for
    a checkpoint that holds no state."""
    index = meta.get("tensors")
    if not isinstance(index, Mapping):
        return None
    out = []
    for key, e in index.items():
        if not isinstance(e, Mapping):
            continue
        offsets, file = e.get("offsets"), e.get("file")
        size = (offsets[1] - offsets[0] if isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) else None)
        if isinstance(e.get("shards"), list):  # pieces of several ranks (docs/sharded-state.md)
            from checkpoint_store.state._shards import stored_bytes

            size = stored_bytes({key: {k: v for k, v in e.items() if k != "alias_of"}})
            files = {p.get("file") for p in e["shards"] if isinstance(p, Mapping)}
            file = f"{len(e['shards'])} pieces in {len(files)} files"
        out.append({"name": key, "dtype": e.get("dtype"), "shape": list(e.get("shape") or []),
                    "size": size, "file": file, "alias_of": e.get("alias_of")})
    return out

