"""checkpoint_store.integrations.ray against a real Ray 2.60 cluster on loopback.

One Ray cluster serves the whole module (2 CPUs). Storage is real: moto S3
(with 20% injected transient faults through ``faulty+s3``), Azurite, local
disks. Ray workers get the servers' credentials through ``runtime_env``, never
through the pickled filesystem.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune")

from checkpoint_store import Checkpoint, CheckpointConfig, TrialRunner, registry, session  # noqa: E402
from checkpoint_store._util.inspect import read_internal_metadata  # noqa: E402
from checkpoint_store._util.retry import RetryPolicy  # noqa: E402
from checkpoint_store.errors import CheckpointStoreError  # noqa: E402
from checkpoint_store.integrations import ray as cs_ray  # noqa: E402
from checkpoint_store.testing.faults import read_call_log  # noqa: E402

pytestmark = pytest.mark.slow

FAULTY = "checkpoint_store.testing.faults:faulty_scheme_backend"
PATIENT = RetryPolicy(attempts=10, base_delay=0.005, max_delay=0.2)


_RAY_ENV = (
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_USAGE_STATS_ENABLED",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)


def _reset_ray_auth() -> None:
    # Ray caches the cluster's auth token per process; another cluster started in
    # this process earlier (the docs examples, with another $HOME) left its own.
    from ray._private.authentication_test_utils import reset_auth_token_state

    reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_cluster(s3_server, azure_server):
    """One loopback Ray cluster for the module, with token authentication and a
    token of its own; workers see the servers' credentials through runtime_env."""
    import secrets

    saved = {k: os.environ.get(k) for k in _RAY_ENV}
    os.environ.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _reset_ray_auth()
    # Reads through Checkpoint objects use the default policy: patient enough for
    # the 20% injected faults of the first test (the handler has its own, PATIENT).
    env = {
        **s3_server.env(),
        **azure_server.env(),
        "RAY_USAGE_STATS_ENABLED": "0",
        "CHECKPOINT_STORE_RETRY_ATTEMPTS": "10",
        "CHECKPOINT_STORE_RETRY_MAX_DELAY": "0.2",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    # Trainables of this module travel by value: workers cannot import a test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": env},
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _reset_ray_auth()


@pytest.fixture
def faulty_s3():
    registry.register_backend("faulty+s3", FAULTY, clobber=True)
    yield
    registry.unregister_backend("faulty+s3")


# -- a trainable written against checkpoint_store.session ------------------------------


def counting_trainable(config):
    """Three reports with a checkpoint each; resumes from session.get_checkpoint().

    With ``fail_once`` (a path), the first run commits its third checkpoint and dies
    before Tune records it: after a restore the trial must replace that directory.
    """
    start = session.get_checkpoint()
    done = 0
    if start is not None:
        with start.as_directory() as d:
            done = int(Path(d, "epoch.txt").read_text())
    flag = config.get("fail_once")
    for epoch in range(done + 1, 4):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "epoch.txt").write_text(str(epoch))
            Path(tmp, "weights.bin").write_bytes(os.urandom(2048))
            metrics = {"epoch": epoch, "score": epoch * config["x"], "resumed_from": done}
            ckpt = Checkpoint.from_directory(tmp)
            if flag and epoch == 3 and not os.path.exists(flag):
                Path(flag).write_text("failed")
                from ray.train._internal.session import get_session

                cs_ray._commit_for_tune(get_session(), ckpt, dict(metrics))
                raise RuntimeError("simulated death between our commit and Tune's record")
            session.report(metrics, checkpoint=ckpt)


def _tuner(fs, path, name, trainable, space, **run):
    from ray import tune

    return tune.Tuner(
        trainable,
        param_space=space,
        run_config=tune.RunConfig(
            name=name, storage_path=path, storage_filesystem=fs, verbose=0, **run
        ),
    )


def _assert_results_verify(results, epochs=3):
    assert not results.errors, results.errors
    for r in results:
        assert r.metrics["epoch"] == epochs
        ours = cs_ray.as_checkpoint(r.checkpoint)
        assert ours.is_committed
        ours.verify()  # every byte against the manifest's CRC32C
        assert ours.internal_metadata["metrics"]["epoch"] == epochs


def _restore_and_check(make_fs, fs_args, name, flag):
    """An errored trial resumes from its newest checkpoint after Tuner.restore."""
    from ray import tune

    fs, path = make_fs(*fs_args)
    results = _tuner(
        fs, path, name, counting_trainable, {"x": tune.grid_search([1, 2]), "fail_once": str(flag)}
    ).fit()
    assert len(results.errors) == 1
    fresh_fs, _ = make_fs(*fs_args)  # another instance, equal by value
    assert fresh_fs == fs
    exp = posixpath.join(path, name)
    assert tune.Tuner.can_restore(exp, storage_filesystem=fresh_fs)
    restored = tune.Tuner.restore(
        exp, counting_trainable, resume_errored=True, storage_filesystem=fresh_fs
    ).fit()
    _assert_results_verify(restored)
    resumed = [r.metrics["resumed_from"] for r in restored]
    assert 2 in resumed  # the failed trial went on from its epoch-2 checkpoint
    failed = next(r for r in restored if r.metrics["resumed_from"] == 2)
    assert posixpath.basename(failed.checkpoint.path) == "checkpoint_000002"
    # The directory the dead run committed (resumed_from 0) was replaced, not kept.
    assert cs_ray.as_checkpoint(failed.checkpoint).internal_metadata["metrics"]["resumed_from"] == 2


def test_tuner_over_faulty_s3_every_call_through_the_handler(
    ray_cluster, faulty_s3, s3_server, s3_bucket, tmp_path, monkeypatch
):
    from ray import tune

    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_ATTEMPTS", "10")
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_MAX_DELAY", "0.2")
    log = tmp_path / "calls"
    log.mkdir()
    options = {
        **s3_server.storage_options("pyarrow"),
        "fault_transient_rate": 0.2,
        "fault_seed": 11,
        "fault_call_log": str(log),
    }

    def make(uri):
        return cs_ray.ray_filesystem(uri, retry=PATIENT, **options)

    fs, path = make(f"faulty+s3://{s3_bucket}/runs")
    results = _tuner(
        fs,
        path,
        "sweep",
        counting_trainable,
        {"x": tune.grid_search([1, 2])},
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
    ).fit()
    _assert_results_verify(results)
    assert len(results) == 2

    # The spy: calls came from the driver and from the trial processes, faults were
    # injected, and every object in the bucket was written through our handler.
    calls = read_call_log(str(log))
    assert len(calls) >= 3, sorted(calls)
    written = {
        p
        for per_pid in calls.values()
        for m, p in per_pid
        if m in ("open_output_stream", "copy_file", "move")
    }
    raw = s3_server_fs(s3_server)
    objects = [
        i.path
        for i in raw.get_file_info(pafs.FileSelector(s3_bucket, recursive=True))
        if i.type == pafs.FileType.File
    ]
    assert objects and all(o in written for o in objects), set(objects) - written
    for r in results:  # Ray's num_to_keep=2 deleted the first checkpoint of each trial
        trial = posixpath.dirname(r.checkpoint.path)
        names = sorted(
            posixpath.basename(i.path)
            for i in raw.get_file_info(pafs.FileSelector(trial))
            if i.type == pafs.FileType.Directory
        )
        assert names == ["checkpoint_000001", "checkpoint_000002"]

    _restore_and_check(
        make, (f"faulty+s3://{s3_bucket}/restore",), "failing", tmp_path / "s3-failed-once"
    )


def s3_server_fs(s3_server):
    from checkpoint_store.registry import resolve

    backend, _ = resolve("s3://probe", storage_options=s3_server.storage_options("pyarrow"))
    return backend.filesystem


def test_tuner_restore_on_azure(ray_cluster, azure_server, azure_container, tmp_path):
    def make(uri):
        return cs_ray.ray_filesystem(uri, **azure_server.storage_options())

    _restore_and_check(
        make, (f"az://{azure_container}/runs",), "azure-sweep", tmp_path / "az-failed-once"
    )


# -- Ray Train: TorchTrainer, two CPU workers --------------------------------------------


def test_torch_trainer_commits_both_shards_failed_rank_never_committed(
    ray_cluster, faulty_s3, s3_server, s3_bucket, tmp_path
):
    """session.report() in a TorchTrainer of 2 CPU workers (upload_fn + CommitCallback
    underneath), Ray's num_to_keep=1; rank 1's upload of epoch 2 fails once and Ray
    restarts the workers (one run, since each worker group costs ~25 s here)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    flag = tmp_path / "failed-once"

    def train(config):
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        start = session.get_checkpoint()
        done = 0
        if start is not None:
            start.verify()
            done = int(start.internal_metadata["metrics"]["epoch"])
        for epoch in range(done + 1, 4):
            tmp = tempfile.mkdtemp()
            Path(tmp, f"shard_{rank}.bin").write_bytes(bytes([rank, epoch]) * 4096)
            if rank == 0:
                Path(tmp, "trainer.json").write_text(f'{{"epoch": {epoch}}}')
            ckpt = Checkpoint.from_directory(tmp)
            if rank == 1 and epoch == 2 and not flag.exists():
                flag.write_text("x")
                shutil.rmtree(tmp)  # this rank's upload now raises
            session.report({"epoch": epoch, "rank": rank, "resumed_from": done}, checkpoint=ckpt)
            shutil.rmtree(tmp, ignore_errors=True)

    log = tmp_path / "calls"
    log.mkdir()
    fs, path = cs_ray.ray_filesystem(
        f"faulty+s3://{s3_bucket}/train",
        fault_call_log=str(log),
        **s3_server.storage_options("pyarrow"),
    )
    result = TorchTrainer(
        train,
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name="shards",
            storage_path=path,
            storage_filesystem=fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            failure_config=ray.train.FailureConfig(max_failures=1),
            callbacks=[cs_ray.CommitCallback()],
        ),
    ).fit()
    assert result.error is None, result.error
    assert flag.exists()
    assert result.metrics["resumed_from"] == 1  # restarted from the epoch-1 checkpoint

    raw = s3_server_fs(s3_server)
    exp = posixpath.join(path, "shards")
    dirs = [
        i.path
        for i in raw.get_file_info(pafs.FileSelector(exp))
        if i.type == pafs.FileType.Directory
    ]
    assert dirs == [result.checkpoint.path]  # no partial, no orphan: only the newest
    files = sorted(
        posixpath.relpath(i.path, dirs[0])
        for i in raw.get_file_info(pafs.FileSelector(dirs[0], recursive=True))
    )
    assert files == [".internal_metadata.json", "shard_0.bin", "shard_1.bin", "trainer.json"]
    ours = cs_ray.as_checkpoint(result.checkpoint)
    ours.verify()
    meta = dict(ours.internal_metadata)
    assert meta["world_size"] == 2 and meta["index"] == 2  # epochs 1, 2 (redone), 3
    assert meta["ranks"] == {"0": ["shard_0.bin", "trainer.json"], "1": ["shard_1.bin"]}
    assert meta["metrics"]["rank"] == 0 and meta["metrics"]["epoch"] == 3

    # From the spy: of the four checkpoint directories written, exactly one never got
    # a commit marker (the epoch-2 upload rank 1 failed), and it is gone.
    writes = [
        p
        for calls in read_call_log(str(log)).values()
        for m, p in calls
        if m == "open_output_stream"
    ]
    written = {m.group(1) for p in writes if (m := re.match(r"(.*/checkpoint_[^/]+)/", p))}
    committed = {d for d in written if f"{d}/.internal_metadata.json" in writes}
    assert len(written) == 4 and len(written - committed) == 1, (written, committed)
    [failed] = written - committed
    assert raw.get_file_info(failed).type == pafs.FileType.NotFound

    # The command line sees the Ray-named committed checkpoint (the marker decides).
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    opts = [a for k, v in s3_server.storage_options("pyarrow").items() for a in ("-o", f"{k}={v}")]
    run_uri = f"s3://{posixpath.join(s3_bucket, 'train', 'shards')}"
    listed = CliRunner().invoke(main, ["ls", "--json", *opts, run_uri], catch_exceptions=False)
    assert listed.exit_code == 0, listed.output
    shown = [c["name"] for c in json.loads(listed.output)["checkpoints"]]
    assert shown == [posixpath.basename(result.checkpoint.path)]
    checked = CliRunner().invoke(main, ["verify", *opts, run_uri], catch_exceptions=False)
    assert checked.exit_code == 0, checked.output


def test_torch_trainer_restart_never_resumes_from_an_uncommitted_checkpoint(
    ray_cluster, tmp_path
):
    """Ray registers epoch 2's checkpoint as its latest, then the commit never
    happens (the controller 'dies' between the two: the callback skips it) and
    the worker fails. Ray restarts the worker with that uncommitted checkpoint;
    session.get_checkpoint() resumes from epoch 1's committed one instead."""
    import ray.train
    from ray.train.torch import TorchTrainer

    flag = tmp_path / "died-once"

    class DiesBeforeCommit(cs_ray.CommitCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metrics[0]["epoch"] == 2 and metrics[0]["attempt"] == 0:
                return  # registered by Ray, never committed
            super().after_report(run_context, metrics, checkpoint)

    def train(config):
        import time

        attempt = 1 if flag.exists() else 0
        start = session.get_checkpoint()
        done = 0
        if start is not None:
            start.verify()
            done = int(start.internal_metadata["metrics"]["epoch"])
        for epoch in range(done + 1, 4):
            tmp = tempfile.mkdtemp()
            Path(tmp, "weights.bin").write_bytes(bytes([epoch]) * 4096)
            metrics = {"epoch": epoch, "attempt": attempt, "resumed_from": done}
            session.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
            shutil.rmtree(tmp, ignore_errors=True)
            if epoch == 2 and attempt == 0:
                time.sleep(5)  # Ray registers the report meanwhile
                flag.write_text("x")
                raise RuntimeError("worker dies after Ray registered epoch 2")

    fs, path = cs_ray.ray_filesystem(f"file://{tmp_path / 'store'}")
    result = TorchTrainer(
        train,
        scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=ray.train.RunConfig(
            name="uncommitted",
            storage_path=path,
            storage_filesystem=fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            failure_config=ray.train.FailureConfig(max_failures=1),
            callbacks=[DiesBeforeCommit()],
        ),
    ).fit()
    assert result.error is None, result.error
    assert flag.exists()
    assert result.metrics["resumed_from"] == 1  # not 2: that one was never committed
    ours = cs_ray.as_checkpoint(result.checkpoint)
    ours.verify()
    assert ours.internal_metadata["metrics"]["epoch"] == 3


# -- the demo's function, unchanged, under TrialRunner and under a Ray Tuner ---------------


def test_demo_function_runs_unchanged_in_trial_runner_and_ray_tuner(ray_cluster, tmp_path):
    pytest.importorskip("sklearn")
    from ray import tune

    from checkpoint_store.demo import train_digits

    # In the driver, with Ray imported and running, the session does not delegate.
    assert session._ray_session() is None
    with pytest.raises(CheckpointStoreError, match="no active session"):
        session.report({"x": 1})
    cfg = {"epochs": 2, "hidden": 16}
    runner = TrialRunner(
        train_digits,
        cfg,
        storage_path=str(tmp_path / "local"),
        experiment_name="digits",
        trial_name="t0",
        checkpoint_config=CheckpointConfig(num_to_keep=5),
    )
    while runner.step() is not None:
        pass
    assert runner.error is None
    local_trial = tmp_path / "local" / "digits" / "t0"

    fs, path = cs_ray.ray_filesystem(f"file://{tmp_path}/ray")
    results = _tuner(
        fs, path, "digits", train_digits, {**cfg, "lr": tune.grid_search([0.05, 0.1])}
    ).fit()
    assert not results.errors and len(results) == 2

    def layout(trial: Path):
        ckpts = sorted(p for p in trial.iterdir() if p.name.startswith("checkpoint_"))
        metas = [read_internal_metadata(pafs.LocalFileSystem(), str(c)) for c in ckpts]
        assert all(m is not None for m in metas)
        return (
            [c.name for c in ckpts],
            [sorted(os.listdir(c)) for c in ckpts],
            sorted(metas[0]),
            sorted(metas[0]["metrics"]),
        )

    expected = layout(local_trial)
    assert expected[0] == ["checkpoint_000000", "checkpoint_000001"]
    for r in results:
        got = layout(Path(posixpath.dirname(r.checkpoint.path)))
        assert got == expected
        cs_ray.as_checkpoint(r.checkpoint).verify()


# -- report(state=...) under Ray: a Tune trial is one process ---------------------------


def state_trainable(config):
    """Three state reports; resumes from session.get_checkpoint().load_state().
    Written for the TrialRunner; must run unchanged under a Ray Tuner."""
    import numpy as np

    start = session.get_checkpoint()
    done, w = 0, np.zeros(4, dtype=np.float32)
    if start is not None:
        saved = start.load_state()
        done, w = saved["step"], saved["w"]
    for step in range(done + 1, 4):
        w = w + np.float32(config["x"])
        session.report({"step": step, "score": float(w.sum())},
                       state={"w": w, "step": step, "__metadata__": np.arange(2)})


def _state_layout(trial: Path) -> list[tuple[str, list[str], int, list[float]]]:
    out = []
    for c in sorted(p for p in trial.iterdir() if p.name.startswith("checkpoint_")):
        ckpt = Checkpoint.from_directory(c)
        assert ckpt.is_committed
        ckpt.verify()
        meta = dict(ckpt.internal_metadata)
        assert set(meta["tensors"]) == {"w", "__metadata__"}  # the index is in the marker
        state = ckpt.load_state()
        out.append((c.name, sorted(os.listdir(c)), state["step"], state["w"].tolist()))
    return out


def test_state_report_in_a_tune_function_trainable(ray_cluster, tmp_path):
    """Issue 37 item 7: report(state=...) in a Ray Tune function trainable was
    refused as "not supported inside Ray Train"; a Tune trial is one process,
    and the function runs unchanged under the TrialRunner and a Tuner."""
    from ray import tune

    runner = TrialRunner(state_trainable, {"x": 1.0}, storage_path=str(tmp_path / "local"),
                         experiment_name="st", trial_name="t0")
    while runner.step() is not None:
        pass
    assert runner.error is None
    expected = _state_layout(tmp_path / "local" / "st" / "t0")
    assert [e[2] for e in expected] == [1, 2, 3] and expected[-1][3] == [3.0] * 4

    fs, path = cs_ray.ray_filesystem(f"file://{tmp_path}/ray")
    results = _tuner(fs, path, "st", state_trainable, {"x": tune.grid_search([1.0, 2.0])}).fit()
    assert not results.errors and len(results) == 2
    for r in results:
        x = r.config["x"]
        ours = cs_ray.as_checkpoint(r.checkpoint)
        assert ours.internal_metadata["metrics"]["step"] == 3
        got = _state_layout(Path(posixpath.dirname(r.checkpoint.path)))
        assert [(n, files, step) for n, files, step, _ in got] == \
            [(n, files, step) for n, files, step, _ in expected]
        assert got[-1][3] == [3 * x] * 4


def test_state_report_in_ray_train_one_worker_and_refused_with_two(ray_cluster, tmp_path):
    """Found by ourselves: the other Ray entry point. A Ray Train run of one
    worker is one process too: its state report is committed (through
    upload_fn and CommitCallback). With two workers it is refused with an
    InvalidConfigError that says why, before anything is written."""
    import ray.train
    from ray.train.torch import TorchTrainer

    def train(config):
        import numpy as np
        import ray.train

        from checkpoint_store import InvalidConfigError

        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        try:
            session.report({"step": 1}, state={"w": np.full(3, rank, dtype=np.int64)})
        except InvalidConfigError as exc:  # Ray Train keeps no metrics without a checkpoint
            Path(config["out"], f"w{ctx.get_world_size()}-rank{rank}.txt").write_text(str(exc))
            session.report({"step": 1})

    results = {}
    for workers in (1, 2):
        fs, path = cs_ray.ray_filesystem(f"file://{tmp_path / 'store'}")
        results[workers] = TorchTrainer(
            train,
            train_loop_config={"out": str(tmp_path)},
            scaling_config=ray.train.ScalingConfig(num_workers=workers),
            run_config=ray.train.RunConfig(name=f"w{workers}", storage_path=path,
                                           storage_filesystem=fs,
                                           callbacks=[cs_ray.CommitCallback()]),
        ).fit()
    one, two = results[1], results[2]
    assert one.error is None and not (tmp_path / "w1-rank0.txt").exists()
    ours = cs_ray.as_checkpoint(one.checkpoint)
    assert ours.is_committed
    ours.verify()
    assert ours.load_state()["w"].tolist() == [0, 0, 0]
    assert two.error is None and two.checkpoint is None
    for rank in (0, 1):
        said = (tmp_path / f"w2-rank{rank}.txt").read_text()
        assert "Ray Train run of 2 workers" in said and "checkpoint=" in said
    assert not [p for p in (tmp_path / "store" / "w2").iterdir()
                if p.name.startswith("checkpoint_")]


def preemption_probe_trainable(config):
    """What docs/preemption.md says of Ray: the function runs outside the
    worker's main thread, whose SIGTERM handler is Ray's; our handler cannot
    be installed here, and is refused with a reason."""
    import signal
    import threading

    from checkpoint_store.errors import InvalidConfigError

    try:
        session.install_preemption_handlers(["SIGTERM"])
        refused = ""
    except InvalidConfigError as exc:
        refused = str(exc)
    handler = signal.getsignal(signal.SIGTERM)
    session.report({
        "refused": refused,
        "main_thread": threading.current_thread() is threading.main_thread(),
        "reached": session.reached_preemption(),
        "handler_module": str(getattr(handler, "__module__", handler)),
    })


def test_preemption_in_a_tune_trial_is_rays_and_refused_with_a_reason(ray_cluster, tmp_path):
    """Issue 39 item 4, the Ray session: a Tune function trainable runs in a
    thread of its worker, whose main thread (Ray's task loop) owns SIGTERM
    (ray._private.worker: exit 1). install_preemption_handlers() there raises
    InvalidConfigError naming the main thread, reached_preemption() is False,
    and Ray's handler stays in place (docs/preemption.md, "Ray Train and
    Ray Tune")."""
    fs, path = cs_ray.ray_filesystem(f"file://{tmp_path}/ray")
    results = _tuner(fs, path, "pre", preemption_probe_trainable, {}).fit()
    assert not results.errors, results.errors
    m = results[0].metrics
    assert m["main_thread"] is False
    assert "main thread" in m["refused"]
    assert m["reached"] is False
    assert m["handler_module"].startswith("ray"), m["handler_module"]
