"""Run every benchmark side by side and write docs/benchmarks.md (+ JSON).

Usage (from the repository root; see the README's "Benchmarks" section)::

    .venv/bin/python -m benchmarks.run            # full run, ~25 min on 2 cores
    .venv/bin/python -m benchmarks.run --quick    # 1/16 of the data, ~3 min
    .venv/bin/python -m benchmarks.run --only scale --merge --scale-label after
        # cost against a trial's history only (benchmarks/bench_scale.py), kept
        # beside the runs of other labels (e.g. "before") already in the JSON

It installs the optional tools it compares against (the ``benchmarks``
extra: Ray, s3fs, adlfs, ZipNN) unless ``--no-install``, starts moto and Azurite on
127.0.0.1 (``checkpoint_store.testing.servers``), runs the candidates
alternating (A B C A B C ...), and writes medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from benchmarks._common import (
    FULL_INCREMENTAL,
    FULL_SHAPES,
    QUICK_INCREMENTAL,
    QUICK_SHAPES,
    Cell,
    machine,
    make_tree,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _log(msg: str) -> None:
    print(msg, flush=True)


def ensure_tools(install: bool) -> None:
    missing = []
    for mod in ("ray", "s3fs", "adlfs", "zipnn"):
        try:
            __import__(mod)
        except Exception:
            missing.append(mod)
    if not missing or not install:
        if missing:
            _log(f"not installed (those columns are skipped): {', '.join(missing)}")
        return
    _log(f"installing the benchmarks extra ({', '.join(missing)} missing) ...")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "-c", os.path.join(ROOT, "constraints.txt"), "-e", f"{ROOT}[benchmarks]"]
    subprocess.run(cmd, check=False)


def _cells_json(rows: dict[str, Cell]) -> dict[str, Any]:
    return {name: {"times_s": c.times, "median_s": c.median, "error": c.error,
                   "peak_rss_mib": max(c.rss_mib) if c.rss_mib else None}
            for name, c in rows.items()}


def merge_transfers(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Put the transfer rows of a ``--merge`` run (backend -> shape -> direction
    -> cells) into ``old``, shape by shape: a run of some shapes (``--shapes``)
    replaces those and keeps the backend's other shapes."""
    for backend, rows in new.items():
        old.setdefault(backend, {}).update(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/16 of the data, one repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    ap.add_argument("--only",
                    default="local,s3,azure,s3-link,azure-link,incremental,report,async,rss,"
                            "import,retention,scale,state,tiers,formats,codec,dedup",
                    help="comma-separated parts to run (the -link parts go through a "
                         "delaying proxy, see benchmarks/latency_link.py)")
    ap.add_argument("--link-rtt-ms", type=float, default=10.0,
                    help="round-trip time the -link parts add (ms)")
    ap.add_argument("--link-mbit", type=float, default=1000.0,
                    help="bandwidth of the -link parts' link (Mbit/s, shared by all connections)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated shape names to run (e.g. '4 x 256 MiB'), default all")
    ap.add_argument("--scale-label", default="current",
                    help="name of the scale run (e.g. before, after): with --merge, runs of "
                         "other labels stay and the page shows them side by side")
    ap.add_argument("--scale-args", default="",
                    help="extra arguments for benchmarks/bench_scale.py, e.g. "
                         "'--max-n 10000 --backends local'")
    ap.add_argument("--scale-from", default=None, metavar="FILE",
                    help="with --only scale: take the scale run from FILE (the JSON "
                         "`python -m benchmarks.bench_scale` printed) instead of running it")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "benchmarks.json"))
    ap.add_argument("--data-dir", default=None, help="where test data is generated (reused)")
    ap.add_argument("--no-install", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="update the parts run here in an existing --json, keep the rest")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    quick = args.quick
    reps = args.reps or (1 if quick else 3)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ensure_tools(not args.no_install)

    import tempfile

    from benchmarks import bench_misc, bench_transfer

    t_start = time.time()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    if args.shapes:
        wanted = {w.strip() for w in args.shapes.split(",")}
        shapes = [s for s in shapes if s.name in wanted] or shapes
    data_root = args.data_dir or os.path.join(tempfile.gettempdir(), "cs-bench-data")
    os.makedirs(data_root, exist_ok=True)
    data: dict[str, str] = {}
    if parts & {"local", "s3", "azure", "s3-link", "azure-link", "async", "rss"}:
        _log("generating data ...")
        data = {s.name: make_tree(os.path.join(data_root, s.name.replace(" ", "")), s)
                for s in shapes}
    big = shapes[-1]
    work = tempfile.mkdtemp(prefix="cs-bench-")
    results: dict[str, Any] = {"machine": machine(), "quick": quick, "reps": reps,
                               "shapes": [s.name for s in shapes], "transfers": {},
                               "errors": {}}

    def guarded(name: str, fn) -> Any:
        try:
            return fn()
        except Exception as exc:
            _log(f"{name} FAILED: {exc}")
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None

    if "local" in parts:
        for s in shapes:
            rows = guarded(f"local {s.name}",
                           lambda s=s: bench_transfer.local_rows(data[s.name], s, work, reps, _log))
            if rows:
                for direction, cells in rows.items():
                    results["transfers"].setdefault("local", {}).setdefault(s.name, {})[
                        direction] = _cells_json(cells)

    servers: list[Any] = []
    s3 = az = None
    if parts & {"s3", "azure", "async", "rss", "s3-link", "azure-link", "incremental", "tiers"}:
        from checkpoint_store.testing.servers import AzureServer, S3Server, find_azurite

        if parts & {"s3", "async", "rss", "s3-link", "incremental", "tiers"}:
            s3 = guarded("moto", lambda: S3Server.start())
            if s3:
                servers.append(s3)
        if parts & {"azure", "rss", "azure-link"}:
            az = guarded("azurite", lambda: AzureServer.start(executable=find_azurite(ROOT)))
            if az:
                servers.append(az)
    try:
        budget = None if quick else 100.0
        # moto answers CompleteMultipartUpload of a 1 GiB object only once it has
        # assembled it, sending nothing meanwhile: the raw clients' default
        # timeouts (pyarrow 3 s without progress, s3fs 15 s) expire, they send the
        # Complete again and moto fails the repeat. That row is left out for S3.
        s3_shapes = [s for s in shapes if quick or s.count > 1]
        if len(s3_shapes) < len(shapes):
            results.setdefault("notes", []).append(
                f"S3 (moto): the {big.name} row is left out: moto 5.2.5 fails "
                "CompleteMultipartUpload of one 1 GiB object here for the raw clients "
                "(pyarrow: INTERNAL_FAILURE after ~45 s; s3fs: 'upload does not exist' "
                "after its retry): moto sends nothing until the object is assembled, the "
                "clients' default timeouts expire and their repeated Complete fails. "
                "The S3 memory and async rows use 4 x 256 MiB (1 GiB).")
        from benchmarks.latency_link import Link

        link_name = f"{args.link_rtt_ms:g} ms RTT, {args.link_mbit:g} Mbit/s link"

        def s3_spec(endpoint_url: str) -> dict[str, str]:
            return {"kind": "s3", "bucket": s3.create_bucket(),
                    **s3.storage_options(), "endpoint_url": endpoint_url}

        def azure_spec(endpoint_url: str) -> dict[str, str]:
            return {"kind": "azure", "bucket": az.create_container(), "engine": "adlfs",
                    "connection_string": az.connection_string.replace(az.endpoint_url,
                                                                      endpoint_url)}

        def remote_part(key: str, spec: dict[str, str], part_shapes: list[Any]) -> None:
            remote = bench_transfer.connect(spec)
            for s in part_shapes:
                rows = guarded(f"{key} {s.name}", lambda s=s: bench_transfer.remote_rows(
                    key, data[s.name], s, work, reps, _log, remote=remote,
                    budget_s=budget))
                if rows:
                    for direction, cells in rows.items():
                        results["transfers"].setdefault(key, {}).setdefault(s.name, {})[
                            direction] = _cells_json(cells)

        def s3_part(key: str, endpoint_url: str) -> None:
            remote_part(key, s3_spec(endpoint_url), s3_shapes)

        def azure_part(key: str, endpoint_url: str) -> None:
            remote_part(key, azure_spec(endpoint_url), shapes)

        def through_link(server: Any, fn: Any, key: str) -> None:
            link = Link(server.endpoint_url, rtt_ms=args.link_rtt_ms, mbit=args.link_mbit)
            try:
                fn(key, link.url)
            finally:
                link.stop()

        if s3 is not None and "s3" in parts:
            s3_part("s3", s3.endpoint_url)
        if az is not None and "azure" in parts:
            azure_part("azure", az.endpoint_url)
        if s3 is not None and "s3-link" in parts:
            through_link(s3, s3_part, "s3-link")
        if az is not None and "azure-link" in parts:
            through_link(az, azure_part, "azure-link")
        results["link"] = link_name
        if s3 is not None and "incremental" in parts:
            inc = QUICK_INCREMENTAL if quick else FULL_INCREMENTAL
            inc_src = make_tree(os.path.join(data_root, inc.name.replace(" ", "")), inc)

            def inc_part(key: str, endpoint_url: str) -> None:
                bucket = s3.create_bucket()
                rows = guarded(f"incremental {key}", lambda: bench_transfer.incremental_rows(
                    key, inc_src, inc, work, reps, _log, uri_root=f"s3://{bucket}",
                    options={**s3.storage_options(), "endpoint_url": endpoint_url},
                    changed_size=inc.size))
                if rows:
                    results.setdefault("incremental", {}).setdefault(key, {})[inc.name] = {
                        d: _cells_json(c) for d, c in rows.items()}

            inc_part("s3", s3.endpoint_url)
            through_link(s3, inc_part, "s3-link")

        if "report" in parts:
            n, nc = (2000, 20) if quick else (5000, 50)
            results["report"] = {
                "ours": guarded("report ours", lambda: bench_misc.ours_report(n, nc)),
                "ray": guarded("report ray", lambda: bench_misc.ray_report(n // 5, nc)),
            }
            _log(f"report(): {results['report']}")

        if "async" in parts and s3 is not None:
            bucket = s3.create_bucket()
            one_gib = shapes[0] if not quick else big
            results["async"] = guarded("async", lambda: bench_misc.async_blocked(
                data[one_gib.name], f"s3://{bucket}", s3.storage_options(), 2, _log))
            if results["async"] is not None:
                results["async"]["data"] = one_gib.name
                results["async"]["storage"] = "S3 (moto)"

        if "tiers" in parts and s3 is not None:
            from benchmarks import bench_tiers

            results["tiers"] = guarded("tiers", lambda: bench_tiers.main(
                ["--quick"] if quick else [], s3=s3))

        if "rss" in parts:
            # Each candidate in a fresh interpreter (bench_misc.fresh_rss); S3 on
            # 4 x 256 MiB for the reason of the note above.
            rss: dict[str, Any] = {"data": big.name, "method": "fresh interpreter per candidate"}
            plan: list[tuple[str, dict[str, str] | None, Any]] = [("local", None, big)]
            if s3 is not None:
                plan.append(("s3", s3_spec(s3.endpoint_url), big if quick else shapes[0]))
            if az is not None:
                plan.append(("azure", azure_spec(az.endpoint_url), big))
            for backend, spec, shape in plan:
                for direction in ("upload", "download"):
                    key = f"{backend} {direction} ({shape.name})"
                    cands = guarded(
                        f"rss {backend} {direction}",
                        lambda backend=backend, spec=spec, direction=direction, shape=shape:
                        bench_misc.fresh_rss(backend, direction, data[shape.name], work, spec,
                                             _log))
                    rss[key] = {"backend": backend, "shape": shape.name,
                                "direction": direction, "candidates": cands or {}}
            results["rss"] = rss
    finally:
        for srv in servers:
            try:
                srv.stop()
            except Exception:
                pass

    if "import" in parts:
        results["import"] = guarded("import", bench_misc.import_time)
        _log(f"import: {results['import']}")
    if "retention" in parts:
        results["retention"] = guarded("retention", lambda: bench_misc.retention(quick))
        _log(f"retention: {results['retention']}")

    if "scale" in parts:
        import shlex

        from benchmarks import bench_scale

        scale_argv = [*(["--quick"] if quick else []), "--label", args.scale_label,
                      *shlex.split(args.scale_args)]
        if args.scale_from:
            with open(args.scale_from) as f:
                scale = json.load(f)
            args.scale_label = scale.get("label", args.scale_label)
        else:
            scale = guarded("scale", lambda: bench_scale.main(scale_argv, log=_log))
        if scale is not None:
            results["scale"] = {args.scale_label: scale}

    if "state" in parts:
        from benchmarks import bench_state

        results["state"] = guarded("state", lambda: bench_state.main(
            ["--quick"] if quick else [], log=_log))

    if "formats" in parts:
        from benchmarks import bench_formats

        results["formats"] = guarded("formats", lambda: bench_formats.main(
            ["--quick"] if quick else [], log=_log))

    if "codec" in parts:
        from benchmarks import bench_codec

        codec_argv = [*(["--quick"] if quick else []), "--data-dir", data_root]
        results["codec"] = guarded("codec", lambda: bench_codec.main(codec_argv, log=_log))
    if "dedup" in parts:
        from benchmarks import bench_dedup

        results["dedup"] = guarded("dedup", lambda: bench_dedup.main(
            ["--quick"] if quick else [], log=_log))

    results["wall_s"] = time.time() - t_start
    from benchmarks.report_md import render

    if args.merge and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        stamp = time.strftime("%H:%M UTC", time.gmtime(t_start))
        for key, value in results.items():
            if key == "transfers":
                merge_transfers(old.setdefault("transfers", {}), value)
            elif key in ("report", "async", "rss", "import", "retention", "incremental",
                         "link", "state", "tiers", "formats", "codec", "dedup"):
                old[key] = value
            elif key == "scale":
                from benchmarks.bench_scale import merge_runs

                merge_runs(old.setdefault("scale", {}), value)
            elif key == "errors":
                old.setdefault("errors", {}).update(value)
        if parts != {"scale"}:  # the scale section dates each of its runs itself
            load = results.get("machine", {}).get("load_avg_at_start", "?")
            old.setdefault("notes", []).append(
                f"Re-measured in a second run started at {stamp} (--only {args.only}; load "
                f"average at its start {load}), after a change to the code those rows "
                "exercise; the other parts keep their numbers from the earlier run(s).")
        old["wall_s"] = old.get("wall_s", 0) + results["wall_s"]
        results = old
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    if results.get("scale"):
        from benchmarks import bench_scale
        from benchmarks.report_md import SCALE_PLOT

        guarded("scale plot", lambda: bench_scale.plot(
            results["scale"], os.path.join(os.path.dirname(args.out), SCALE_PLOT)))
    with open(args.out, "w") as f:
        f.write(render(results))
    _log(f"wrote {args.out} and {args.json} in {results['wall_s']:.0f} s")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
