"""The command line on a Ray Train run committed by ``CommitCallback``.

Ray names the checkpoint directories (``checkpoint_<time>``); the commit
marker, not the name, makes them checkpoints, so ``ls``, ``verify`` and
``cp`` see them. The run is written by our own upload and commit code (what
``upload_fn`` and ``CommitCallback.after_report`` run inside Ray), without a
Ray cluster; ``test_ray.py`` has the slow real-Ray runs.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest

pytest.importorskip("ray")

from checkpoint_store._util.inspect import inspect_checkpoint  # noqa: E402
from checkpoint_store.integrations.ray import (  # noqa: E402
    CommitCallback,
    _upload_rank,
    ray_filesystem,
)
from tests.cli.cli_helpers import invoke  # noqa: E402

RAY_NAMES = ["checkpoint_2026-11-30_17-00-00.000001", "checkpoint_2026-11-30_17-00-05.000002"]
UNFINISHED = "checkpoint_2026-11-30_17-00-09.000003"


def write_ray_run(tmp_path) -> tuple[str, str]:
    """``<storage>/my_run/`` as a 2-worker TorchTrainer run leaves it: two
    committed checkpoints under Ray's names, one whose rank 1 never uploaded,
    and Ray's own files. Returns (storage path, run path)."""
    storage = tmp_path / "ray_results"
    fs, root = ray_filesystem(storage.as_uri())
    run = f"{root}/my_run"
    callback = CommitCallback()
    local = pafs.LocalFileSystem()
    for step, name in enumerate([*RAY_NAMES, UNFINISHED]):
        ranks = (0,) if name == UNFINISHED else (0, 1)
        for rank in ranks:
            shard = tmp_path / f"local-{step}-{rank}"
            shard.mkdir()
            (shard / f"shard-{rank}.pt").write_bytes(os.urandom(1000 + rank))
            _upload_rank(local, str(shard), fs, f"{run}/{name}", rank)
        if name != UNFINISHED:
            callback.after_report(
                SimpleNamespace(run_config=SimpleNamespace(name="my_run")),
                [{"loss": 1.0 / (step + 1), "step": step}, {"loss": 9.0}],
                SimpleNamespace(filesystem=fs, path=f"{run}/{name}"),
            )
    (storage / "my_run" / "checkpoint_manager_snapshot.json").write_text("{}")
    return str(storage), f"{storage}/my_run"


def test_ls_verify_cp_see_ray_named_checkpoints(tmp_path) -> None:
    storage, run = write_ray_run(tmp_path)
    for name in RAY_NAMES:
        assert inspect_checkpoint(pafs.LocalFileSystem(), f"{run}/{name}").state == "committed"

    listed = invoke(["ls", "--json", storage])  # the experiment: one trial, two checkpoints
    assert listed.exit_code == 0, listed.output
    [trial] = json.loads(listed.output)["trials"]
    assert (trial["uri"].rsplit("/", 1)[-1], trial["checkpoints"]) == ("my_run", 2)
    listed = invoke(["ls", "--json", "--long", run])
    assert listed.exit_code == 0, listed.output
    shown = json.loads(listed.output)
    assert shown["kind"] == "trial"
    assert [(c["index"], c["name"], c["files"]) for c in shown["checkpoints"]] == [
        (0, RAY_NAMES[0], 2),
        (1, RAY_NAMES[1], 2),
    ]

    checked = invoke(["verify", storage])
    assert checked.exit_code == 0, checked.output
    for name in RAY_NAMES:
        assert name in checked.output

    dest = tmp_path / "copy" / "my_run"
    copied = invoke(["cp", "-q", run, str(dest)])
    assert copied.exit_code == 0, copied.output
    local = pafs.LocalFileSystem()
    for name in RAY_NAMES:
        found = inspect_checkpoint(local, str(dest / name))
        assert found.state == "committed"
        assert sorted(e["path"] for e in found.meta["manifest"]) == ["shard-0.pt", "shard-1.pt"]
    assert not (dest / UNFINISHED).exists()  # never committed, never copied


def test_a_single_ray_named_checkpoint_verifies_and_copies(tmp_path) -> None:
    storage, run = write_ray_run(tmp_path)
    one = f"{run}/{RAY_NAMES[1]}"
    checked = invoke(["verify", one])
    assert checked.exit_code == 0, checked.output
    unfinished = invoke(["verify", f"{run}/{UNFINISHED}"])
    assert unfinished.exit_code != 0
    copied = invoke(["cp", "-q", one, str(tmp_path / "restore" / "my_run")])
    assert copied.exit_code == 0, copied.output
    found = inspect_checkpoint(
        pafs.LocalFileSystem(), str(tmp_path / "restore" / "my_run" / RAY_NAMES[1])
    )
    assert found.state == "committed" and found.meta["metrics"]["loss"] == 0.5


def test_the_web_page_shows_and_verifies_ray_named_checkpoints(tmp_path) -> None:
    from checkpoint_store.ui._model import StoreView

    storage, run = write_ray_run(tmp_path)
    view = StoreView(storage)  # the storage_path is an experiment of runs
    assert view.experiments() == {"ray_results": ["my_run"]}
    rows = view.trial("ray_results", "my_run")["checkpoints"]
    assert [(r["name"], r["index"]) for r in rows] == [(RAY_NAMES[0], 0), (RAY_NAMES[1], 1)]
    assert view.verify("ray_results", "my_run", RAY_NAMES[1])["ok"] is True
    assert view.checkpoint("ray_results", "my_run", RAY_NAMES[0])["name"] == RAY_NAMES[0]
