"""Cost per operation against a trial's history: N checkpoints, M result rows.

Standalone::

    python -m benchmarks.bench_scale [--quick] [--max-n 100000] [--max-rows 1000000]
                                     [--backends local,s3] [--label before]

prints one JSON object (:func:`main` returns it as a dict). ``python -m
benchmarks.run --only scale`` runs it too and adds it to docs/benchmarks.json
and docs/benchmarks.md (with ``--scale-label``, several labelled runs, e.g.
before and after a change, sit side by side).

One trial per backend grows from N to the next N (10, 100, ... checkpoints,
each one 64-byte file, keep-all retention scored by ``loss``) and at each N
the benchmark measures, through the public API only:

* ``start``: ``session.start`` + ``get_checkpoint()`` on the trial (and its end);
* ``ckpt_report``: one checkpoint ``report()`` (bytes written outside the new
  checkpoint's directory: retention state, result rows, leases);
* ``metrics_report``: a metrics-only ``report()``, bytes amortised over a batch
  (see :func:`_measure_reports`);
* ``cli_best``, ``cli_show``, ``cli_ls``: ``checkpoint-store best|show|ls`` of the
  trial (``show`` of its newest checkpoint);
* ``manager``: a read-only ``CheckpointManager`` and its ``latest_checkpoint``.

A second local trial grows by metrics-only reports (M = 10 ... 1,000,000 rows)
and ``session.start`` is measured after each M, against an empty trial's.

Per operation: wall time; storage requests by kind (a forwarding pyarrow
``FileSystemHandler`` around the backend's filesystem, registered as the URI
scheme ``counted+<scheme>`` so that sessions, managers and the CLI all go through
it: one handler call, which may be more than one HTTP request); bytes written;
growth of peak RSS (Linux VmHWM). Reads (start, CLI, manager) run in a fresh
interpreter each, so memory and caches of the builder do not blur them. On the
local disk the library uses os-level calls (append, fsync, rename) past any
pyarrow wrapper, so local rows count bytes from the trial directory's files
(inode and size before and after) and give no request counts.

Building a trial through ``report()`` costs what the benchmark measures: when
a phase would take longer than ``--grow-budget-s``, the rest of it is filled
through ``StorageContext.persist_checkpoint`` (the commit protocol without the
session, several commits at once; the next ``session.start`` adopts those
checkpoints and is measured as ``grow.adopt_start``) and the row says how many
were filled that way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from benchmarks._common import _hwm_growth, _hwm_reset
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.forwarding import ForwardingHandler

EXPERIMENT = "scale"
CKPT_BYTES = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- counting storage requests ----------------------------------------------------------

KINDS = ("stat", "list", "get", "put", "delete", "move_copy", "mkdir")
_KIND = {
    "get_file_info": "stat", "get_file_info_selector": "list",
    "open_input_stream": "get", "open_input_file": "get",
    "open_output_stream": "put", "open_append_stream": "put",
    "delete_dir": "delete", "delete_dir_contents": "delete",
    "delete_root_dir_contents": "delete", "delete_file": "delete",
    "move": "move_copy", "copy_file": "move_copy", "create_dir": "mkdir",
}
_CKPT_DIR = re.compile(r"(^|/)checkpoint_\d+(/|$)")


class Tally:
    """Requests by kind and bytes written by path, for the whole process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.written: Counter[str] = Counter()

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.written.clear()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            calls = {k: self.calls.get(k, 0) for k in KINDS}
            outside = sum(n for p, n in self.written.items() if not _CKPT_DIR.search(p))
            return {"requests": calls, "requests_total": sum(calls.values()),
                    "bytes_written": sum(self.written.values()),
                    "bytes_written_outside_checkpoints": outside}


TALLY = Tally()


class _CountingWriter:
    """A file object for ``pa.PythonFile`` that counts what goes through it."""

    def __init__(self, inner: pa.NativeFile, path: str):
        self._inner, self._path = inner, path

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._inner.write(data)
        with TALLY.lock:
            TALLY.written[self._path] += n
        return n

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def tell(self) -> int:
        return self._inner.tell()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False


class CountingHandler(ForwardingHandler):
    """Forwards every call to ``inner`` and counts it in :data:`TALLY`."""

    def _count(self, method: str, n: int = 1) -> None:
        with TALLY.lock:
            TALLY.calls[_KIND[method]] += n

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        self._count("get_file_info", len(paths))
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._count("get_file_info_selector")
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self._count("create_dir")
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._count("delete_dir")
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._count("delete_dir_contents")
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self._count("delete_root_dir_contents")
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self._count("delete_file")
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._count("move")
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._count("copy_file")
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._count("open_input_stream")
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        self._count("open_input_file")
        return self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._count("open_output_stream")
        out = self.inner.open_output_stream(path, metadata=metadata)
        return pa.PythonFile(_CountingWriter(out, path), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._count("open_append_stream")
        out = self.inner.open_append_stream(path, metadata=metadata)
        return pa.PythonFile(_CountingWriter(out, path), mode="w")


def counted_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Backend factory for ``counted+<scheme>://``: the ``<scheme>`` backend (same
    scheme, capabilities and commit protocol) behind a :class:`CountingHandler`."""
    from checkpoint_store.registry import backend_for_scheme, split_scheme

    scheme, _, rest = uri.partition("://")
    inner_uri = f"{scheme[len('counted+'):]}://{rest}"
    inner = backend_for_scheme(split_scheme(inner_uri) or "file", inner_uri,
                               dict(storage_options))

    def rebuild() -> pafs.FileSystem:
        fs = inner.rebuild() if inner.rebuild is not None else inner.filesystem
        return pafs.PyFileSystem(CountingHandler(fs))

    return Backend(pafs.PyFileSystem(CountingHandler(inner.filesystem)), scheme=inner.scheme,
                   capabilities=inner.capabilities, name=f"{inner.name} (counted)",
                   rebuild=rebuild)


def register_counted(scheme: str = "s3") -> None:
    from checkpoint_store.registry import register_backend

    register_backend(f"counted+{scheme}", "benchmarks.bench_scale:counted_backend",
                     clobber=True)


# -- local disk: bytes written from the trial directory's files -------------------------


def _local_files(trial_dir: str) -> dict[str, tuple[int, int]]:
    """``{relative path: (inode, size)}`` of the trial's files outside its
    ``checkpoint_NNNNNN`` directories."""
    out: dict[str, tuple[int, int]] = {}

    def walk(d: str, rel: str) -> None:
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:
            r = f"{rel}{e.name}"
            if e.is_dir(follow_symlinks=False):
                if not (rel == "" and re.fullmatch(r"checkpoint_\d+", e.name)):
                    walk(e.path, r + "/")
            else:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    out[r] = (st.st_ino, st.st_size)

    walk(trial_dir, "")
    return out


def _local_written(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> int:
    """Bytes written between two :func:`_local_files`: a new or replaced file
    (another inode) counts whole, an appended one its growth."""
    n = 0
    for path, (ino, size) in after.items():
        old = before.get(path)
        n += size if old is None or old[0] != ino else max(0, size - old[1])
    return n


# -- RSS --------------------------------------------------------------------------------


# Peak-RSS reset and growth: benchmarks._common (_hwm_reset, _hwm_growth).


# -- probes: one read operation in a fresh interpreter ----------------------------------


class _Measure:
    """Time, requests, bytes and peak RSS growth of the block it wraps."""

    def __init__(self, local_trial: str | None):
        self.local_trial = local_trial
        self.result: dict[str, Any] = {}

    def __enter__(self) -> _Measure:
        self._files = _local_files(self.local_trial) if self.local_trial else None
        TALLY.reset()
        self._base = _hwm_reset()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        rss = _hwm_growth(self._base)
        self.result = {"wall_s": wall, "rss_growth_mib": rss}
        if self.local_trial:
            written = _local_written(self._files or {}, _local_files(self.local_trial))
            self.result.update(requests=None, requests_total=None, bytes_written=written,
                               bytes_written_outside_checkpoints=written)
        else:
            self.result.update(TALLY.snapshot())


def _probe(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run one read operation (``spec["op"]``) and measure it."""
    from checkpoint_store import CheckpointManager, StorageContext, session

    register_counted()
    uri, trial, opts = spec["uri"], spec["trial"], spec.get("options") or None
    local_trial = spec.get("local_trial")
    op = spec["op"]
    out: dict[str, Any] = {"op": op}
    if op == "start":
        with _Measure(local_trial) as m:
            ctx = session.start(storage_path=uri, experiment_name=EXPERIMENT, trial_name=trial,
                                storage_options=opts, checkpoint_config=_config())
            sess = ctx.__enter__()
            ckpt = sess.get_checkpoint()
        out.update(m.result)
        out["latest"] = None if ckpt is None else os.path.basename(ckpt.path.rstrip("/"))
        with _Measure(local_trial) as m:
            ctx.__exit__(None, None, None)
        out["end"] = m.result
    elif op == "manager":
        with _Measure(local_trial) as m:
            st = StorageContext(uri, EXPERIMENT, trial, storage_options=opts)
            mgr = CheckpointManager(_config(), st, read_only=True)
            latest = mgr.latest_checkpoint
            mgr.close()
        out.update(m.result)
        out["latest"] = None if latest is None else os.path.basename(latest.path.rstrip("/"))
    elif op == "cli":
        from checkpoint_store.cli import main as cli_main

        args = list(spec["args"])
        for k, v in (opts or {}).items():
            args += ["-o", f"{k}={v}"]
        buf = io.StringIO()
        code: Any = 0
        with _Measure(local_trial) as m, contextlib.redirect_stdout(buf):
            try:
                cli_main.main(args, standalone_mode=False)
            except SystemExit as exc:
                code = exc.code
            except Exception as exc:  # a failing command is a row note
                code = f"{type(exc).__name__}: {exc}"[:300]
        out.update(m.result)
        out["exit"] = code
        out["first_line"] = buf.getvalue().splitlines()[0][:200] if buf.getvalue() else ""
    else:
        raise ValueError(f"unknown probe {op!r}")
    return out


def run_probe(spec: Mapping[str, Any], timeout: float = 900) -> dict[str, Any]:
    """:func:`_probe` in a fresh interpreter; failures become ``{"error": ...}``."""
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_scale", "--probe", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"op": spec["op"], "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"op": spec["op"], "error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- building and measuring a trial -----------------------------------------------------


def _config() -> Any:
    from checkpoint_store import CheckpointConfig

    return CheckpointConfig(num_to_keep=None, checkpoint_score_attribute="loss",
                            checkpoint_score_order="min")


def _metrics(i: int) -> dict[str, Any]:
    return {"step": i, "loss": 1.0 / (i + 1) + (i * 2654435761 % 1000) * 1e-6}


class Target:
    """One backend's trials: where they are and how to reach them."""

    def __init__(self, name: str, uri: str, options: dict[str, Any] | None,
                 local_root: str | None, src: str):
        self.name, self.uri, self.options = name, uri, options
        self.local_root = local_root
        self.src = src  # the one-file checkpoint every report uploads

    def local_trial(self, trial: str) -> str | None:
        if self.local_root is None:
            return None
        return os.path.join(self.local_root, EXPERIMENT, trial)

    def start(self, trial: str) -> Any:
        from checkpoint_store import session

        return session.start(storage_path=self.uri, experiment_name=EXPERIMENT,
                             trial_name=trial, storage_options=self.options,
                             checkpoint_config=_config())

    def probe(self, op: str, trial: str, **extra: Any) -> dict[str, Any]:
        return run_probe({"op": op, "uri": self.uri, "trial": trial, "options": self.options,
                          "local_trial": self.local_trial(trial), **extra})


def _grow(t: Target, trial: str, have: int, want: int, rows: int, budget_s: float,
          log: Callable[[str], None]) -> tuple[int, int, dict[str, Any]]:
    """Report checkpoints ``have .. want-1``; past ``budget_s`` (projected), commit
    the rest with ``StorageContext.persist_checkpoint``. Returns the new
    checkpoint count, the new row count and how the phase went."""
    from checkpoint_store import Checkpoint, CheckpointManager, StorageContext
    from checkpoint_store.errors import CheckpointConflictError, CheckpointStoreError

    info: dict[str, Any] = {"by_report": 0, "bulk": 0}
    t0 = time.perf_counter()
    i = have
    with t.start(trial) as sess:
        while i < want:
            sess.report(_metrics(i), checkpoint=Checkpoint.from_directory(t.src))
            i += 1
            rows += 1
            done = i - have
            if done % 20 == 0:
                spent = time.perf_counter() - t0
                if spent + spent / done * (want - i) > budget_s:
                    break
    info["by_report"] = i - have
    info["report_s"] = time.perf_counter() - t0
    if i < want:
        log(f"  {t.name} {trial}: {i - have} reports took {info['report_s']:.0f} s; "
            f"committing {want - i} more through persist_checkpoint")
        t1 = time.perf_counter()
        st = StorageContext(t.uri, EXPERIMENT, trial, storage_options=t.options,
                            fsync=False, incremental=False)
        mgr = CheckpointManager(_config(), st, read_only=True)
        run_id = mgr.run_id
        mgr.close()
        src = Checkpoint.from_directory(t.src)

        def commit(j: int) -> None:
            for attempt in range(6):
                try:
                    st.persist_checkpoint(src, j, {"metrics": _metrics(j), "run_id": run_id})
                    return
                except CheckpointConflictError:  # an earlier attempt committed it
                    return
                except CheckpointStoreError:
                    # moto, busy with several commits at once on a loaded machine,
                    # sometimes answers 500: another attempt, as a user would.
                    if attempt == 5:
                        raise
                    time.sleep(2.0 * (attempt + 1))

        # One commit at a time on object stores: moto fails listings (500) that
        # race other commits' writes under the same prefix.
        workers = 2 if t.local_root is not None else 1
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(commit, range(i, want)))
        info["bulk"] = want - i
        info["bulk_s"] = time.perf_counter() - t1
        # The first start after that adopts them: measured, as what a bulk fill costs.
        info["adopt_start"] = t.probe("start", trial)
    return want, rows, info


def _measure_reports(t: Target, trial: str, first: int, n_ckpt: int,
                     n_metrics: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``n_ckpt`` checkpoint reports, each measured; then ``n_metrics``
    metrics-only reports followed by one checkpoint report (which flushes any
    buffered rows), whose bytes beyond the median checkpoint report's are the
    rows' share: amortised = (batch bytes + that excess) / ``n_metrics``."""
    from checkpoint_store import Checkpoint

    local = t.local_trial(trial)
    ckpt: list[dict[str, Any]] = []
    with t.start(trial) as sess:
        i = first
        for _ in range(n_ckpt):
            with _Measure(local) as m:
                sess.report(_metrics(i), checkpoint=Checkpoint.from_directory(t.src))
            ckpt.append(m.result)
            i += 1
        with _Measure(local) as batch:
            for _ in range(n_metrics):
                sess.report(_metrics(i))
                i += 1
        with _Measure(local) as flush:
            sess.report(_metrics(i), checkpoint=Checkpoint.from_directory(t.src))
    outside = sorted(c["bytes_written_outside_checkpoints"] for c in ckpt)
    med = outside[len(outside) // 2]
    excess = max(0, flush.result["bytes_written_outside_checkpoints"] - med)
    ck = {"n": n_ckpt, "wall_s": sorted(c["wall_s"] for c in ckpt)[n_ckpt // 2],
          "bytes_outside_checkpoint": med, "bytes_outside_checkpoint_max": outside[-1],
          "requests_total": ckpt[n_ckpt // 2]["requests_total"],
          "requests": ckpt[n_ckpt // 2]["requests"]}
    mr = {"n": n_metrics, "wall_s": batch.result["wall_s"] / n_metrics,
          "bytes_in_batch": batch.result["bytes_written"],
          "bytes_flushed_after": excess,
          "bytes_amortised": (batch.result["bytes_written"] + excess) / n_metrics,
          "requests_in_batch": batch.result["requests_total"]}
    return ck, mr


def series_n(t: Target, ns: list[int], budget_s: float, log: Callable[[str], None],
             out: list[dict[str, Any]] | None = None,
             on_row: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """The checkpoint series on one backend: grow, then measure at each N (each row
    appended to ``out`` as it is measured, then ``on_row()``)."""
    trial = "ckpts"
    have = rows = 0
    out = [] if out is None else out
    for n in ns:
        try:
            have, rows = _row_at(t, trial, n, have, rows, budget_s, log, out)
        except Exception as exc:  # a failed phase ends the series; what came before stays
            log(f"  {t.name} N={n}: FAILED {type(exc).__name__}: {exc}"[:600])
            out.append({"n": n, "error": f"{type(exc).__name__}: {exc}"[:600]})
            on_row()
            break
        on_row()
    return out


def _row_at(t: Target, trial: str, n: int, have: int, rows: int, budget_s: float,
            log: Callable[[str], None], out: list[dict[str, Any]]) -> tuple[int, int]:
    """Grow the trial to ``n`` checkpoints and measure every operation there."""
    t0 = time.perf_counter()
    have, rows, grew = _grow(t, trial, have, n, rows, budget_s, log)
    grew["grow_s"] = time.perf_counter() - t0
    row: dict[str, Any] = {"n": n, "rows": rows, "grow": grew}
    row["start"] = t.probe("start", trial)
    row["manager"] = t.probe("manager", trial)
    trial_uri = _join(t.uri, EXPERIMENT, trial)
    last = f"{trial_uri}/checkpoint_{n - 1:06d}"
    row["cli_best"] = t.probe("cli", trial, args=["best", trial_uri])
    row["cli_show"] = t.probe("cli", trial, args=["show", last])
    row["cli_ls"] = t.probe("cli", trial, args=["ls", trial_uri])
    n_ck, n_m = 5, 50
    row["ckpt_report"], row["metrics_report"] = _measure_reports(t, trial, have, n_ck, n_m)
    have += n_ck + 1
    rows += n_ck + n_m + 1
    out.append(row)
    s = row["start"]
    log(f"  {t.name} N={n}: start {s.get('wall_s', float('nan')):.3f} s "
        f"{s.get('requests_total')} req; ckpt report "
        f"{row['ckpt_report']['bytes_outside_checkpoint']} B; metrics report "
        f"{row['metrics_report']['bytes_amortised']:.0f} B; best "
        f"{row['cli_best'].get('requests_total')} req "
        f"{row['cli_best'].get('wall_s', float('nan')):.2f} s (grow {grew['grow_s']:.0f} s)")
    return have, rows


def series_m(t: Target, ms: list[int], log: Callable[[str], None],
             out: list[dict[str, Any]] | None = None,
             on_row: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """The metrics-only series: ``session.start`` after M reports (M=0: empty trial)."""
    trial = "rows"
    out = [] if out is None else out
    out.append({"m": 0, "start": t.probe("start", trial)})
    have = 0
    for m in ms:
        t0 = time.perf_counter()
        with t.start(trial) as sess:
            for i in range(have, m):
                sess.report(_metrics(i))
        grow_s = time.perf_counter() - t0
        have = m
        local = t.local_trial(trial)
        n_batch = 1000
        with t.start(trial) as sess, _Measure(local) as batch:
            for i in range(have, have + n_batch):
                sess.report(_metrics(i))
        have += n_batch
        row = {"m": m, "grow_s": grow_s, "start": t.probe("start", trial),
               "metrics_report": {"n": n_batch, "wall_s": batch.result["wall_s"] / n_batch,
                                  "bytes_amortised": batch.result["bytes_written"] / n_batch}}
        out.append(row)
        on_row()
        s = row["start"]
        log(f"  {t.name} M={m}: start {s.get('wall_s', float('nan')):.3f} s, "
            f"RSS +{s.get('rss_growth_mib') or 0:.1f} MiB (grow {grow_s:.0f} s)")
    return out


def _join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def _decades(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 10
    return out


@contextlib.contextmanager
def _s3_target(work: str, src: str) -> Iterator[Target]:
    from checkpoint_store.testing.servers import S3Server

    srv = S3Server.start()
    try:
        bucket = srv.create_bucket()
        register_counted("s3")
        yield Target("s3", f"counted+s3://{bucket}/runs", srv.storage_options(), None, src)
    finally:
        srv.stop()


def _git_commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    return None


def main(argv: list[str] | None = None, log: Callable[[str], None] | None = None
         ) -> dict[str, Any]:
    """Run the benchmark; returns (and prints, when run as a script) a dict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--probe"]:
        return _probe(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N ≤ 1,000 and M ≤ 10,000")
    p.add_argument("--max-n", type=int, default=100_000, help="largest N on the local disk")
    p.add_argument("--max-n-s3", type=int, default=10_000, help="largest N on moto S3")
    p.add_argument("--min-n", type=int, default=10, help="smallest N")
    p.add_argument("--max-rows", type=int, default=1_000_000,
                   help="largest M (metrics-only reports, local disk); 0 skips the series")
    p.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    p.add_argument("--grow-budget-s", type=float, default=150.0,
                   help="time for growing a trial by report() from one N to the next; "
                        "the rest is committed directly")
    p.add_argument("--label", default="current", help="name of this run (before, after ...)")
    p.add_argument("--note", action="append", default=[],
                   help="a sentence for the results page about this run (repeatable)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the result here, rewritten after every measured row "
                        "(a run stopped early leaves what it measured, marked partial)")
    args = p.parse_args(argv)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    max_n, max_n_s3, max_rows = args.max_n, args.max_n_s3, args.max_rows
    if args.quick:
        max_n, max_n_s3, max_rows = min(max_n, 1000), min(max_n_s3, 1000), min(max_rows, 10_000)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    from benchmarks._common import machine

    result: dict[str, Any] = {
        "benchmark": "scale", "label": args.label, "commit": _git_commit(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {"max_n": max_n, "max_n_s3": max_n_s3, "max_rows": max_rows,
                 "backends": args.backends, "grow_budget_s": args.grow_budget_s},
        "machine": machine(), "backends": {}, "notes": list(args.note),
    }
    t_start = time.perf_counter()

    def save(partial: bool = True) -> None:
        result["wall_s"] = time.perf_counter() - t_start
        result["partial"] = partial
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, sort_keys=True)
            os.replace(args.out + ".tmp", args.out)

    work = tempfile.mkdtemp(prefix="cs-bench-scale-")
    try:
        src = os.path.join(work, "src")
        os.makedirs(src)
        with open(os.path.join(src, "w.bin"), "wb") as f:
            f.write(os.urandom(CKPT_BYTES))
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        if "local" in backends:
            root = os.path.join(work, "store")
            t = Target("local", root, None, root, src)
            say(f"local: N = {_decades(args.min_n, max_n)}")
            res: dict[str, Any] = result["backends"].setdefault("local", {"n": []})
            series_n(t, _decades(args.min_n, max_n), args.grow_budget_s, say, res["n"], save)
            if max_rows:
                say(f"local: M = {_decades(10, max_rows)}")
                series_m(t, _decades(10, max_rows), say, res.setdefault("m", []), save)
            shutil.rmtree(root, ignore_errors=True)
        if "s3" in backends and max_n_s3 >= args.min_n:
            with _s3_target(work, src) as t:
                say(f"s3: N = {_decades(args.min_n, max_n_s3)}")
                res = result["backends"].setdefault("s3", {"n": []})
                series_n(t, _decades(args.min_n, max_n_s3), args.grow_budget_s, say,
                         res["n"], save)
        save(partial=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t_start
    return result


def merge_runs(old: dict[str, Any], new: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Fold labelled runs ``new`` into ``old`` (both ``{label: result}``), in place: a
    label already there keeps the backends and series the new run did not measure
    (a run of ``--backends s3`` adds to one of ``--backends local``)."""
    for label, run in new.items():
        prev = old.get(label)
        if prev is None:
            old[label] = dict(run)
            continue
        merged = dict(run)
        backends = dict(prev.get("backends") or {})
        for name, series in (run.get("backends") or {}).items():
            backends[name] = {**backends.get(name, {}), **series}
        merged["backends"] = backends
        merged["wall_s"] = (prev.get("wall_s") or 0) + (run.get("wall_s") or 0)
        if prev.get("commit") != run.get("commit"):
            merged["commit"] = f"{prev.get('commit')}, {run.get('commit')}"
        merged["started_utc"] = f"{prev.get('started_utc')}; {run.get('started_utc')}"
        merged["notes"] = [*(prev.get("notes") or []), *(run.get("notes") or [])]
        old[label] = merged
    return old


# -- the plot of the results page -------------------------------------------------------

_OPS = (("start", "session.start"), ("ckpt_report", "checkpoint report"),
        ("cli_best", "CLI best"), ("cli_show", "CLI show"), ("manager", "read-only manager"))


def _value(row: Mapping[str, Any], op: str, what: str) -> float | None:
    cell = row.get(op) or {}
    if what == "bytes" and op == "ckpt_report":
        return cell.get("bytes_outside_checkpoint")
    if what == "bytes" and op == "metrics_report":
        return cell.get("bytes_amortised")
    key = {"time": "wall_s", "requests": "requests_total", "rss": "rss_growth_mib"}[what]
    return cell.get(key)


def plot(runs: Mapping[str, Mapping[str, Any]], path: str) -> str:
    """Draw cost against N (and M) of each labelled run, log-log, into ``path`` (PNG).

    Args:
        runs: ``{label: result of main()}``; earlier runs are drawn dashed, the
            latest solid.
    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    panels = [
        (axes[0][0], "local", "n", "time", "local disk: time (s)"),
        (axes[0][1], "s3", "n", "time", "moto S3: time (s)"),
        (axes[0][2], "s3", "n", "requests", "moto S3: storage requests"),
        (axes[1][0], "local", "n", "bytes", "bytes written per report (besides the checkpoint)"),
        (axes[1][1], "s3", "n", "bytes", "moto S3: bytes PUT per report (besides the checkpoint)"),
        (axes[1][2], "local", "m", "time", "local: session.start after M metrics reports (s; MiB)"),
    ]
    from benchmarks.report_md import run_order

    labels = run_order(dict(runs))
    colours = ["C0", "C1", "C2", "C3", "C4", "C5"]
    for ax, backend, series, what, title in panels:
        drew = False
        for li, label in enumerate(labels):
            rows = ((runs[label].get("backends") or {}).get(backend) or {}).get(series) or []
            style = "-" if li == len(labels) - 1 else "--"
            if series == "m":
                ops: tuple[tuple[str, str], ...] = (
                    ("start", "session.start, s"), ("start_rss", "its peak RSS growth, MiB"))
                xkey = "m"
            elif what == "bytes":
                ops = (("ckpt_report", "checkpoint report"),
                       ("metrics_report", "metrics-only report (amortised)"))
                xkey = "n"
            else:
                ops = _OPS
                xkey = "n"
            for oi, (op, name) in enumerate(ops):
                kind = "rss" if op == "start_rss" else what
                pts = [(max(r[xkey], 1), _value(r, op.removesuffix("_rss"), kind)) for r in rows]
                pts = [(x, y) for x, y in pts if y is not None and y > 0]
                if not pts:
                    continue
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o",
                        markersize=3, color=colours[oi % len(colours)],
                        label=f"{name} ({label})")
                drew = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("M (result rows; M = 0 drawn at 1)" if series == "m" else "N (checkpoints)")
        if drew:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(fontsize=6)
        ax.grid(True, which="both", alpha=0.3)
    title = "Cost per operation against a trial's history (log-log; flat is the goal)"
    if len(labels) > 1:
        title += f"; dashed: {', '.join(labels[:-1])}, solid: {labels[-1]}"
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


if __name__ == "__main__":
    # Run as the importable module, so that the ``counted+`` backend the registry
    # imports by dotted path counts into the same TALLY as this code reads.
    from benchmarks import bench_scale

    print(json.dumps(bench_scale.main(), sort_keys=True))
