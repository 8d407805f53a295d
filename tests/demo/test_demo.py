"""`checkpoint-store demo`: the end-to-end walking skeleton on real data."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("sklearn")

CLI = [sys.executable, "-m", "checkpoint_store"]


def _run(*args, **kw):
    return subprocess.run([*CLI, "demo", *args], capture_output=True, text=True, timeout=300, **kw)


def _trial(store):
    return store / "digits-demo" / "mlp"


def test_demo_keeps_best_three_and_loads_best(tmp_path):
    store = tmp_path / "store"
    out = _run("--storage", str(store), "--epochs", "8")
    assert out.returncode == 0, out.stderr
    acc = float(re.search(r"Test accuracy of the model loaded from it: ([0-9.]+)", out.stdout)[1])
    assert acc >= 0.90
    table = re.findall(r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+(file://\S+)$", out.stdout, re.M)
    assert 3 <= len(table) <= 4  # best 3, plus the latest when it is not among them
    trial = _trial(store)
    on_disk = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    assert on_disk == sorted(f"checkpoint_{int(idx):06d}" for idx, *_ in table)
    for name in on_disk:
        assert (trial / name / ".internal_metadata.json").is_file()
        assert (trial / name / ".user_metadata.json").is_file()
    assert (trial / "result.json").is_file()
    assert len((trial / "result.json").read_text().splitlines()) == 8


def test_demo_resumes_after_sigkill(tmp_path):
    store = tmp_path / "store"
    proc = subprocess.Popen([*CLI, "demo", "--storage", str(store), "--epochs", "12",
                             "--epoch-delay", "0.4"], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    seen = 0
    while time.time() < deadline and seen < 3:
        line = proc.stdout.readline()
        if line.startswith("epoch"):
            seen += 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert seen == 3
    out = _run("--storage", str(store), "--epochs", "12", "--resume")
    assert out.returncode == 0, out.stderr
    resumed = int(re.search(r"Resumed from epoch (\d+)", out.stdout)[1])
    assert resumed >= 3
    epochs = [int(m) for m in re.findall(r"^epoch\s+(\d+)", out.stdout, re.M)]
    assert epochs == list(range(resumed + 1, 13))
    acc = float(re.search(r"Test accuracy of the model loaded from it: ([0-9.]+)", out.stdout)[1])
    assert acc >= 0.90


@pytest.mark.parametrize("tune", [False, True], ids=["run", "tune"])
def test_a_rerun_without_resume_never_deletes_the_previous_run(tmp_path, tune):
    from checkpoint_store import Checkpoint, session
    from checkpoint_store.cli import EXIT_FAILURE
    from tests.cli.cli_helpers import invoke, write_tree

    storage = str(tmp_path / "demo")
    experiment = "digits-tune" if tune else "digits-demo"
    src = write_tree(str(tmp_path / "c"), {"model.bin": b"x"})
    with session.start(storage_path=storage, experiment_name=experiment, trial_name="mlp"):
        session.report({"val_accuracy": 0.5}, checkpoint=Checkpoint.from_directory(src))
    kept = tmp_path / "demo" / experiment / "mlp" / "checkpoint_000000" / "model.bin"
    res = invoke(["demo", "--storage", storage, "--epochs", "1", *(["--tune"] if tune else [])])
    assert res.exit_code == EXIT_FAILURE, res.output
    assert f"a previous {'study' if tune else 'demo run'} is at" in res.stderr
    assert "nothing was changed" in res.stderr and "--fresh" in res.stderr
    assert "Starting fresh" not in res.stdout
    assert kept.read_bytes() == b"x"
    # --resume and --fresh contradict each other: refused before anything is read.
    res = invoke(["demo", "--storage", storage, "--resume", "--fresh"])
    assert res.exit_code != 0 and "pass one of them" in res.output
    assert kept.read_bytes() == b"x"
