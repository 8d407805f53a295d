"""Smoke test of the cost-against-history benchmark (benchmarks/bench_scale.py):
its request counting, one tiny run through its main, and the page section with
issue 19's targets. The benchmark itself is not part of the test suite."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from benchmarks import bench_scale, report_md


def test_counting_handler_counts_calls_by_kind_and_bytes_by_path(tmp_path) -> None:
    fs = pafs.PyFileSystem(bench_scale.CountingHandler(pafs.LocalFileSystem()))
    bench_scale.TALLY.reset()
    base = str(tmp_path)
    fs.create_dir(f"{base}/t/checkpoint_000001")
    with fs.open_output_stream(f"{base}/t/checkpoint_000001/w.bin") as f:
        f.write(b"x" * 100)
    with fs.open_output_stream(f"{base}/t/state.json") as f:
        f.write(b"y" * 7)
    fs.get_file_info([f"{base}/t/state.json", f"{base}/t/nope"])
    fs.get_file_info(pafs.FileSelector(f"{base}/t"))
    with fs.open_input_stream(f"{base}/t/state.json") as f:
        assert f.read() == b"y" * 7
    fs.move(f"{base}/t/state.json", f"{base}/t/state2.json")
    fs.delete_file(f"{base}/t/state2.json")
    snap = bench_scale.TALLY.snapshot()
    assert snap["requests"] == {"stat": 2, "list": 1, "get": 1, "put": 2, "delete": 1,
                                "move_copy": 1, "mkdir": 1}
    assert snap["requests_total"] == 9
    assert snap["bytes_written"] == 107
    assert snap["bytes_written_outside_checkpoints"] == 7


def test_local_bytes_count_appends_by_growth_and_replacements_whole(tmp_path) -> None:
    (tmp_path / "result.json").write_bytes(b"a" * 10)
    (tmp_path / "state.json").write_bytes(b"s" * 50)
    (tmp_path / "checkpoint_000000").mkdir()
    before = bench_scale._local_files(str(tmp_path))
    with open(tmp_path / "result.json", "ab") as f:
        f.write(b"b" * 5)
    (tmp_path / "state.tmp").write_bytes(b"t" * 60)
    (tmp_path / "state.tmp").replace(tmp_path / "state.json")
    (tmp_path / "checkpoint_000000" / "w.bin").write_bytes(b"w" * 1000)
    after = bench_scale._local_files(str(tmp_path))
    assert bench_scale._local_written(before, after) == 5 + 60


def _run(n: int, start_s: float, start_req: int, ckpt_b: int, rows_b: float) -> dict:
    row = {"n": n, "grow": {"bulk": 0},
           "start": {"wall_s": start_s, "requests_total": start_req, "rss_growth_mib": 5.0},
           "ckpt_report": {"bytes_outside_checkpoint": ckpt_b,
                           "bytes_outside_checkpoint_max": ckpt_b},
           "metrics_report": {"bytes_amortised": rows_b},
           "cli_best": {"requests_total": start_req}, "cli_show": {"requests_total": 7}}
    return {"args": {"max_n": n, "max_n_s3": n, "max_rows": 0}, "commit": "abc",
            "started_utc": f"2026-11-30 {20 if start_s < 60 else 19}:00 UTC",
            "backends": {"s3": {"n": [row]}}}


def test_scale_section_states_each_target_for_each_run() -> None:
    # Keyed as the JSON keeps them (sorted): the page orders runs by start time.
    runs = {"after": _run(10_000, 1.5, 40, 2_000, 300.0),
            "before": _run(10_000, 90.0, 90_000, 3_000_000, 1_200_000.0)}
    targets = {t[0]: t for t in report_md.scale_targets(runs)}
    start_req = targets["moto S3, keep-all: session.start at N = 10,000 ≤ 60 requests"]
    assert start_req[1:] == (["90,000", "40"], "yes")
    ckpt = targets["moto S3: a checkpoint report writes ≤ 16 KB besides the checkpoint's "
                   "files, any N"]
    assert ckpt[1:] == (["2.9 MiB", "2.0 KiB"], "yes")
    local = targets["local: session.start at N = 100,000 ≤ 0.5 s"]
    assert local[1:] == (["not measured", "not measured"], "n/a")
    md = report_md.scale_section(runs)
    assert "90.00 s · 90,000 req → 1.50 s · 40 req" in md
    assert "Every cell reads before → after." in md
    runs["after"]["backends"]["s3"]["n"][0]["start"]["requests_total"] = 61
    assert report_md.scale_targets(runs)[0][2] == "**no**"
    # A run that did not reach the target's N says what it measured at its largest.
    runs["after"]["backends"]["s3"]["n"][0]["n"] = 1000
    start_req = report_md.scale_targets(runs)[0]
    # Met or not is then judged by the newest run that measured it, named.
    assert start_req[1:] == (["90,000", "not measured; 61 at N = 1,000"], "**no** (before)")


@pytest.mark.slow
def test_tiny_local_run_measures_every_row_and_plots(tmp_path) -> None:
    res = bench_scale.main(["--min-n", "10", "--max-n", "10", "--max-rows", "10",
                            "--backends", "local", "--label", "smoke"], log=lambda m: None)
    (row,) = res["backends"]["local"]["n"]
    assert row["n"] == 10 and row["grow"]["by_report"] == 10
    assert row["start"]["latest"] == "checkpoint_000009"
    assert row["manager"]["latest"] == "checkpoint_000009"
    for op in ("cli_best", "cli_show", "cli_ls"):
        assert row[op]["exit"] in (0, None), row[op]
    assert row["cli_show"]["first_line"].endswith("checkpoint_000009")
    # Every checkpoint report appends its result row at least.
    assert row["ckpt_report"]["bytes_outside_checkpoint"] > 0
    assert row["metrics_report"]["bytes_amortised"] > 0
    assert [r["m"] for r in res["backends"]["local"]["m"]] == [0, 10]
    pytest.importorskip("matplotlib")
    png = bench_scale.plot({"smoke": res}, str(tmp_path / "scale.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "### Local disk: cost against N checkpoints" in report_md.scale_section(
        {"smoke": res})
