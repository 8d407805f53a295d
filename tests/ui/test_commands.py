"""``checkpoint-store plot``, the score sparkline of ``show``, and ``checkpoint-store ui``
as a user starts it (a real process on a free port)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from click.testing import CliRunner
from ui_helpers import LAYOUT, Store, report_trial

from checkpoint_store._browse.spark import ASCII_BARS, BARS, sparkline
from checkpoint_store.cli import main


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _pixels_near(image: Any, rgb: tuple[int, int, int], tol: int = 40) -> int:
    import numpy as np

    diff = np.abs(image[:, :, :3].astype(int) - np.array(rgb)).sum(axis=2)
    return int((diff < tol).sum())


def test_plot_png_draws_the_curve_and_markers(local_store: Store, tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    out = tmp_path / "curve.png"
    trial = os.path.join(local_store.uri, "sweep", "lr-0.1")
    result = invoke(["plot", trial, "--metric", "val/accuracy", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 15_000
    import numpy as np

    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape == (480, 900, 3)
    assert _pixels_near(image, (0x1F, 0x77, 0xB4)) > 500  # the curve (matplotlib's C0)
    assert _pixels_near(image, (0x1A, 0x98, 0x50)) > 60  # the best-K stars
    assert _pixels_near(image, (0x21, 0x66, 0xAC)) > 30  # the latest's triangle
    assert _pixels_near(image, (0x88, 0x88, 0x88), tol=10) > 30  # the evicted crosses
    # The curve spans the plot: C0 pixels in the left and the right third.
    cols = np.nonzero(np.abs(image.astype(int) - (0x1F, 0x77, 0xB4)).sum(axis=2) < 40)[1]
    assert cols.min() < 300 and cols.max() > 600


def test_plot_svg_of_several_trials(local_store: Store, tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.svg"
    trials = [os.path.join(local_store.uri, "sweep", t) for t in LAYOUT["sweep"]]
    result = invoke(["plot", *trials, "-o", str(out)])  # metric: the recorded score attribute
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("<?xml") and "<svg" in text
    assert all(t in text for t in LAYOUT["sweep"])  # one legend entry per trial


def test_plot_legend_holds_every_one_of_50_trials() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from checkpoint_store.ui._plot import figure

    # StoreView.trial answers in miniature: 3 reports each, the last one kept as best.
    trials = [{"experiment": "sweep", "trial": f"trial-{i:02d}-lr-{0.0001 * (i + 1):.4f}",
               "metric": "acc", "metrics": ["acc"],
               "rows": [{"training_iteration": j, "acc": 0.1 * j + 0.001 * i,
                         "checkpoint_dir_name": f"checkpoint_{j:06d}"} for j in (1, 2, 3)],
               "checkpoints": [{"name": "checkpoint_000003", "kind": "best"}]}
              for i in range(50)]
    fig, drawn = figure(trials)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = fig.axes[0].get_legend().get_texts()
    inside = [t.get_text() for t in texts
              if (e := t.get_window_extent(renderer)).x0 >= box.x0 and e.x1 <= box.x1
              and e.y0 >= box.y0 and e.y1 <= box.y1]
    # Before: 48 of 50 inside the figure (the last entries of a column cut off).
    assert drawn == 50 and inside == [t["trial"] for t in trials]


def test_plot_refuses_bad_requests(local_store: Store, tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    trial = os.path.join(local_store.uri, "sweep", "lr-0.1")
    result = invoke(["plot", trial, "--metric", "nope", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "val/accuracy" in result.output
    result = invoke(["plot", trial, "-o", str(tmp_path / "x.gif")])
    assert result.exit_code == 2 and ".png" in result.output
    result = invoke(["plot", os.path.join(local_store.uri, "sweep"), "-o",
                     str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "not a trial" in result.output
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.gif").exists()


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0.0, 0.5, 1.0]) == BARS[0] + BARS[4] + BARS[7]
    assert sparkline([2.0, 2.0]) == BARS[3] * 2
    assert sparkline([1.0, None, float("nan"), 3.0]) == BARS[0] + "  " + BARS[7]
    assert len(sparkline(list(range(1000)), width=40)) <= 40
    assert sparkline([0, 1], bars=ASCII_BARS) == "_@"


def test_show_prints_the_score_sparkline(local_store: Store) -> None:
    ckpt = os.path.join(local_store.uri, "sweep", "lr-0.1", "checkpoint_000004")
    result = invoke(["show", ckpt])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("score "))
    scores = LAYOUT["sweep"]["lr-0.1"][0]
    spark = sparkline(scores)
    assert line.startswith(f"score val/accuracy  {spark}  0.5 -> 0.6 over 6 reports")
    assert line.endswith("this checkpoint 0.74 at report 5")
    assert spark.index(BARS[7]) == 4  # the peak is report 5


def test_no_ui_dependency_on_import() -> None:
    code = ("import sys, checkpoint_store, checkpoint_store.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('flask', 'werkzeug', 'matplotlib', 'selenium')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _start_ui(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint_store", "ui", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline() if proc.stdout else ""
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"no URL printed: {line!r} {proc.communicate()}")
    return proc, line.split(" at ", 1)[1].split()[0]


@pytest.mark.slow
def test_ui_command_serves_and_warns(local_store: Store, tmp_path: Any, s3_server: Any) -> None:
    """A real `checkpoint-store ui` process, on loopback and (with a warning) on all
    addresses; the secret given with -o never appears in its output."""
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
    bucket = s3_server.create_bucket()
    try:
        store = Store(f"s3://{bucket}/runs", s3_server.storage_options("pyarrow"))
        report_trial(store, "exp", "t", [0.1, 0.2], [True, True], {"lr": 0.1})
        opts = [a for k, v in store.options.items() for a in ("-o", f"{k}={v}")]
        proc, url = _start_ui([store.uri, *opts, "--debug"], env)
        try:
            assert url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "api/overview") as resp:
                assert b'"committed": 2' in resp.read()
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=10)
        assert "GET /api/overview" in err  # --debug logs requests ...
        assert s3_server.secret_access_key not in out + err  # ... and never the secret
        proc, url = _start_ui([local_store.uri, "--host", "0.0.0.0"], env)
        try:
            with urllib.request.urlopen(url + "api/config") as resp:
                assert resp.status == 200
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=10)
        assert "warning: serving on 0.0.0.0" in err and "no authentication" in err
    finally:
        s3_server.delete_bucket(bucket)
