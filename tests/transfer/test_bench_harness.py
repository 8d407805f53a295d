"""Smoke test of the benchmark harness (benchmarks/): real tools on a tiny
data set, and the markdown report with its target checks. The benchmarks
themselves are not part of the test suite."""

from __future__ import annotations

import pytest

from benchmarks import bench_transfer, report_md
from benchmarks._common import Shape, alternate, make_tree


def test_alternate_rotates_the_first_candidate_and_records_failures() -> None:
    order: list[str] = []

    def ok(name: str):
        def run(rep: int) -> float:
            order.append(name)
            return 0.1 * (rep + 1)
        return run

    def broken(rep: int) -> float:
        raise OSError("no such tool")

    cells = alternate({"a": ok("a"), "b": ok("b"), "x": broken}, 3, log=lambda m: None)
    # Each round starts one candidate later (x, failed in round 0, is skipped).
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert cells["a"].median == pytest.approx(0.2)
    assert cells["x"].times == [] and "no such tool" in cells["x"].error


@pytest.mark.slow
def test_local_rows_on_a_tiny_tree_render_with_ratios(tmp_path) -> None:
    shape = Shape("3 x 4 KiB", 3, 4096)
    src = make_tree(str(tmp_path / "data"), shape)
    rows = bench_transfer.local_rows(src, shape, str(tmp_path / "work"), 1, lambda m: None)
    for direction in ("upload", "download"):
        cells = rows[direction]
        assert "cp -r" in cells and cells["cp -r"].median is not None
        assert [c.error for c in cells.values() if c.error] == []
    results = {
        "machine": {"cpus": 2}, "reps": 1, "shapes": ["4 x 256 MiB", shape.name],
        "transfers": {"local": {shape.name: {
            d: {n: {"times_s": c.times, "median_s": c.median, "error": c.error}
                for n, c in cells.items()} for d, cells in rows.items()}}},
        "report": {"ours": {"metrics_only_s": 15e-6, "small_checkpoint_s": 0.01},
                   "ray": {"metrics_only_s": 2e-3, "small_checkpoint_s": 0.005}},
        "import": {"checkpoint_store_s": 0.2, "pyarrow_fs_alone_s": 0.15},
    }
    md = report_md.render(results)
    assert "## Local disk" in md and "| 3 x 4 KiB |" in md
    targets = {t[0]: t for t in report_md.targets(results)}
    assert targets["report() metrics only ≤ 20 µs"][2] == "yes"
    assert targets["report() metrics only ≥ 10× faster than Ray"][1] == "133.33×"
    assert targets["import checkpoint_store ≤ 150 ms"][2] == "**no**"


def test_latency_link_delays_and_keeps_every_byte() -> None:
    import os
    import socket
    import threading
    import time

    from benchmarks.latency_link import Link

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    link = Link(f"http://127.0.0.1:{port}", rtt_ms=60, mbit=80)
    try:
        payload = os.urandom(1_000_000)  # 8 Mbit: 0.1 s each way at 80 Mbit/s
        host, lport = link.url.split("://")[1].split(":")
        with socket.create_connection((host, int(lport))) as c:
            t0 = time.perf_counter()
            c.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += c.recv(1 << 20)
            dt = time.perf_counter() - t0
        assert got == payload
        assert dt >= 0.06 + 0.1  # one round trip plus the bytes through the cap
    finally:
        link.stop()
        srv.close()


def test_report_renders_link_incremental_and_rss_rows() -> None:
    def cells(**times: float) -> dict:
        return {n: {"times_s": [t], "median_s": t, "error": None, "peak_rss_mib": 10.0}
                for n, t in times.items()}

    results = {
        "machine": {"cpus": 2}, "reps": 1, "shapes": ["4 x 16 MiB"],
        "link": "10 ms RTT, 1000 Mbit/s link",
        "transfers": {"s3-link": {"4 x 16 MiB": {"upload": {
            **cells(**{"checkpoint-store": 1.0, "s3fs put": 2.0}),
            **{"Ray upload path": {"times_s": [3.0], "median_s": 3.0, "error": None,
                                   "peak_rss_mib": None}}}}}},
        "incremental": {"s3": {"16 x 4 MiB": {"upload": cells(
            **{"checkpoint-store (incremental)": 0.1, "checkpoint-store (full upload)": 0.6})}}},
    }
    md = report_md.render(results)
    assert "through a 10 ms RTT, 1000 Mbit/s link" in md
    assert "**1.00 s** · 10 MiB" in md and "2.00 s (2.00×) · 10 MiB" in md
    assert ("| incremental, s3 16 x 4 MiB, one file changed: ≥ 5× a full upload | 6.00× | yes |"
            in md)
    assert "≥ 1.0× best of the raw clients and Ray (s3fs put) | 2.00× | yes" in md


def _fresh_results(ours: float | None, ray: float | None) -> dict:
    """A results dict whose S3 row shows the in-process pooled-allocator effect
    (Ray's path 0 MiB, ours 190 MiB) and fresh-interpreter numbers beside it."""
    row = {
        "checkpoint-store": {"times_s": [2.0], "median_s": 2.0, "error": None,
                             "peak_rss_mib": 190.0},
        "s3fs put": {"times_s": [3.0], "median_s": 3.0, "error": None, "peak_rss_mib": 900.0},
        "Ray upload path": {"times_s": [1.0], "median_s": 1.0, "error": None,
                            "peak_rss_mib": 0.0},
    }
    fresh: dict = {}
    if ours is not None:
        fresh["checkpoint-store"] = {"baseline_mib": 100.0, "peak_mib": 100.0 + ours,
                                     "delta_mib": ours, "seconds": 2.0, "bytes": 1}
    if ray is not None:
        fresh["Ray upload path"] = {"baseline_mib": 150.0, "peak_mib": 150.0 + ray,
                                    "delta_mib": ray, "seconds": 1.0, "bytes": 1}
    fresh["s3fs put"] = {"error": "RuntimeError: exit 1"}
    return {
        "machine": {"cpus": 2}, "reps": 1, "shapes": ["4 x 256 MiB"],
        "transfers": {"s3": {"4 x 256 MiB": {"upload": row}}},
        "rss": {"data": "4 x 256 MiB", "s3 upload (4 x 256 MiB)": {
            "backend": "s3", "shape": "4 x 256 MiB", "direction": "upload",
            "candidates": fresh}},
    }


def test_rss_targets_compare_fresh_interpreter_numbers() -> None:
    res = _fresh_results(ours=204.0, ray=1090.0)
    targets = {t[0]: t for t in report_md.targets(res)}
    row = targets["s3 4 x 256 MiB upload: peak RSS ≤ Ray upload path's"]
    # In one shared process Ray's path showed 0 MiB; fresh, 1090 MiB.
    assert row[1:] == ("204 vs 1090 MiB (fresh interpreters)", "yes")
    budget = ("peak RSS, s3 upload (4 x 256 MiB): ≤ the default memory budget (256 MiB) "
              "above baseline")
    assert targets[budget][1:] == ("204 MiB", "yes")
    md = report_md.render(res)
    assert ("| s3 upload (4 x 256 MiB) | **204 MiB** · 2.00 s | s3fs put: failed "
            "| 1090 MiB · 1.00 s |") in md
    assert "- failed: s3fs put: RuntimeError: exit 1" in md
    assert "pyarrow's jemalloc/mimalloc pool" in md  # what the in-process cells are


def test_rss_target_falls_back_to_in_process_growth_labelled() -> None:
    res = _fresh_results(ours=204.0, ray=None)  # Ray's fresh run missing
    row = {t[0]: t for t in report_md.targets(res)}[
        "s3 4 x 256 MiB upload: peak RSS ≤ Ray upload path's"]
    assert row[1:] == ("190 vs 0 MiB (in-process growth, shared process)", "**no**")


def test_rss_of_the_earlier_layout_reads_as_ours() -> None:
    res = _fresh_results(ours=None, ray=None)
    res["rss"] = {"data": "4 x 256 MiB", "s3 upload (4 x 256 MiB)": {
        "baseline_mib": 99.0, "peak_mib": 303.0, "delta_mib": 204.0, "seconds": 10.0}}
    assert report_md.fresh_rss(res) == {
        ("s3", "4 x 256 MiB", "upload"): {"checkpoint-store": res["rss"][
            "s3 upload (4 x 256 MiB)"]}}
    assert "| s3 upload (4 x 256 MiB) | **204 MiB** · 10.00 s |" in report_md.render(res)


@pytest.mark.slow  # five fresh interpreters, each importing Ray: ~20 s here

def test_fresh_rss_measures_each_local_candidate_in_a_child(tmp_path) -> None:
    from benchmarks import bench_misc

    shape = Shape("3 x 256 KiB", 3, 256 * 1024)
    src = make_tree(str(tmp_path / "data"), shape)
    work = tmp_path / "work"
    work.mkdir()
    got = bench_misc.fresh_rss("local", "download", src, str(work), None, lambda m: None)
    names = list(got)
    assert names[0] == "checkpoint-store (verify)"
    assert {"pyarrow copy_files 64 MiB", "fsspec get"} <= set(names)
    assert "cp -r" not in names  # a child process: its RSS is not measured here
    for name, v in got.items():
        assert v.get("error") is None, (name, v)
        assert set(v) == {"baseline_mib", "peak_mib", "delta_mib", "seconds", "bytes"}
        assert v["delta_mib"] >= 0 and v["peak_mib"] >= v["baseline_mib"] > 0
        # The checkpoint's files (and for raw copies its manifest) arrived.
        assert v["bytes"] >= shape.total, (name, v)
    assert list(work.iterdir()) == []  # destinations and the source store removed


def test_a_merged_run_of_one_shape_keeps_the_other_shapes() -> None:
    from benchmarks.run import merge_transfers

    old = {"azure": {"1 x 1 GiB": {"upload": "old"}, "4 x 256 MiB": {"upload": "kept"}},
           "s3": {"4 x 256 MiB": {"upload": "s3"}}}
    merge_transfers(old, {"azure": {"1 x 1 GiB": {"upload": "new"}},
                          "local": {"1 x 1 GiB": {"upload": "local"}}})
    assert old == {"azure": {"1 x 1 GiB": {"upload": "new"}, "4 x 256 MiB": {"upload": "kept"}},
                   "s3": {"4 x 256 MiB": {"upload": "s3"}},
                   "local": {"1 x 1 GiB": {"upload": "local"}}}


def test_formats_rows_render_and_a_missed_target_names_its_limit() -> None:
    """bench_formats' rows reach the results page: its section, its targets
    (a missed throughput row gives the same run's write / read ratio) and
    the reason beside each missed target, by storage."""
    MiB = 1 << 20
    row = lambda s, r: {"s": s, "MiB/s": 64 / s, "ratio_to_read": r}  # noqa: E731
    formats = {
        "throughput": [
            {"storage": "local", "bytes": 64 * MiB, "largest": 16 * MiB, "reps": 3,
             "rows": {"read": row(0.1, 1.0), "write": row(0.11, 0.91),
                      "export hf": row(0.2, 0.5), "import hf in place": row(0.11, 0.9),
                      "export torch_save": row(0.2, 0.5), "export dcp": row(0.3, 0.33),
                      "write, fsynced": row(0.14, 0.71),
                      "read while writing, fsynced": row(0.17, 0.6),
                      "torch.save, tensors in memory": row(0.1, 1.0)}},
            {"storage": "s3", "bytes": 64 * MiB, "largest": 16 * MiB, "reps": 3,
             "rows": {"read": row(1.0, 1.0), "write": row(1.8, 0.55),
                      "export dcp": row(2.5, 0.4)}}],
        "memory": {"bytes": 256 * MiB, "largest": 64 * MiB, "bound_MiB": 192.0,
                   "rows": {"export dcp": {"growth_MiB": 64.0, "s": 1.0, "within": True}}}}
    page = report_md.render({"machine": {}, "formats": formats})
    assert "## Export and import (formats)" in page
    rows = {t[0]: t for t in report_md.targets({"formats": formats})}
    local = rows["formats: export hf ≥ 0.8× read, local (64 MiB)"]
    assert local[2] == "**no**" and "write itself 0.91× read" in local[1]
    assert rows["formats: import hf in place ≥ 0.8× read, local (64 MiB)"][2] == "yes"
    s3 = rows["formats: export dcp ≥ 0.8× read, s3 (64 MiB)"]
    assert s3[2] == "**no**" and "write itself 0.55× read" in s3[1]
    assert rows["formats: export dcp peak RSS ≤ 2 × largest + 64 MiB (256 MiB state)"][2] \
        == "yes"
    # A format's own writer from memory, measured in the same run, is named
    # beside its export, and is no target row of its own.
    torch_save = rows["formats: export torch_save ≥ 0.8× read, local (64 MiB)"]
    assert "torch.save itself from memory 1.00× read, the export at 0.50× its speed" \
        in torch_save[1]
    assert not any("tensors in memory" in name for name in rows)
    # A DCP export makes its files durable: the disk's fsynced write of the
    # same run is its floor, named beside it, and no target of its own.
    dcp = rows["formats: export dcp ≥ 0.8× read, local (64 MiB)"]
    assert "fsynced write itself 0.71× read, read and fsynced write at once 0.60×" in dcp[1]
    assert not any("fsynced" in name.split("≥")[0] for name in rows)
    limits = page.split("### What limits the targets not met")[1]
    assert "CPU-bound" in limits and "bounded by moto" in limits
    assert "`torch.save, tensors in memory` row" in limits


def test_codec_rows_measure_every_candidate_on_the_same_bytes_and_render() -> None:
    """bench_codec on a few synthetic pieces: every candidate gives the bytes
    back (measure asserts it), the rows reach the page with the targets and
    the reason beside a missed one."""
    import numpy as np

    from benchmarks import bench_codec

    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.02, 1 << 16).astype(np.float32)
    bf16 = (weights.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    groups = {"weights (bf16)": [bf16, bf16[:1000]],
              "exp_avg (fp32)": [(weights * 1e-3).tobytes()],
              "exp_avg_sq (fp32)": [(weights * weights * 1e-4).tobytes()]}
    res = bench_codec.measure(groups, 1, lambda m: None)
    rows = res["rows"]
    assert {"planes-zstd", "zstd, same parameters", "zstd level 3 (DCP's)", "raw",
            "planes-zstd, decode_many(workers=2)", "zstd, same parameters, 2 threads",
            "order-0 entropy of the byte planes"} <= set(rows)
    assert rows["planes-zstd"]["ratio"]["weights (bf16)"] > 1.3
    assert rows["raw"]["ratio"]["overall"] < 1.0
    res.update(reps=1, load_avg={"start": [1.0], "end": [1.0]}, cpu="test CPU",
               model={"parameters": 1e6, "steps": 1, "loss": 1.0,
                      "config": {"vocab_size": 4096}})
    page = report_md.render({"machine": {}, "codec": res})
    assert "## Lossless compression" in page and "| planes-zstd |" in page
    targets = {t[0]: t for t in report_md.targets({"codec": res})}
    assert targets["codec: bf16 weights ratio ≥ 1.35×"][2] == "yes"
    rows["planes-zstd"]["compress_GiB_s"] = 0.1
    page = report_md.render({"machine": {}, "codec": res})
    assert "**codec: compress**" in page.split("### What limits the targets not met")[1]
