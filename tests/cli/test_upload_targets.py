"""`upload` never hides trials: targets that hold trials, or sit inside one, are refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from checkpoint_store import StorageContext
from checkpoint_store.cli import main


@pytest.fixture
def tree(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"weights")
    results = tmp_path / "results"
    for _ in range(2):
        out = CliRunner().invoke(main, ["upload", str(model), str(results / "exp" / "t1")])
        assert out.exit_code == 0, out.output
    return model, results


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("exp", "an experiment"),
        ("", "holds other data"),
        ("exp/t1/mycheckpoint", "a trial inside it would be hidden"),
    ],
)
def test_upload_refuses_targets_that_would_hide_trials(tree, target, says):
    model, results = tree
    before = sorted(p.relative_to(results) for p in results.rglob("*"))
    out = CliRunner().invoke(main, ["upload", str(model), str(results / target)])
    assert out.exit_code == 2
    assert says in out.output
    assert sorted(p.relative_to(results) for p in results.rglob("*")) == before


def test_upload_into_a_new_trial_beside_others_works(tree):
    model, results = tree
    out = CliRunner().invoke(main, ["upload", str(model), str(results / "exp" / "t2")])
    assert out.exit_code == 0, out.output
    ctx = StorageContext(str(results), "exp", "t2")
    assert [c.path.rsplit("/", 1)[1] for c, _ in ctx.committed_checkpoints()] == [
        "checkpoint_000000"]
    assert len(StorageContext(str(results), "exp", "t1").committed_checkpoints()) == 2


def test_client_log_records_print_one_line_and_tracebacks_only_with_debug(tmp_path, monkeypatch):
    import logging

    import checkpoint_store.cli as cli

    def noisy_backends():
        try:
            raise ConnectionError("simulated client failure\nwith a second line")
        except ConnectionError:
            logging.getLogger("gcsfs").error("_request out of retries", exc_info=True)
        return {"file": "checkpoint-store"}

    monkeypatch.setattr("checkpoint_store.registry.available_backends", noisy_backends)
    runner = CliRunner()
    out = runner.invoke(cli.main, ["backends"])
    assert "error: _request out of retries" in out.stderr
    assert "Traceback" not in out.stderr
    out = runner.invoke(cli.main, ["backends", "--debug"])
    assert "Traceback" in out.stderr and "simulated client failure" in out.stderr
