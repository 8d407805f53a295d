"""A session (or a TrialRunner's trial) that ends with an exception leaves ``error.txt``.

Ray Tune's layout: ``Failure # N (occurred at YYYY-MM-DD_HH-MM-SS)`` then the
exception as Python prints it; failures of successive runs accumulate; a run
that ends cleanly removes the file. Only rank 0 writes it.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from checkpoint_store import StorageContext, session
from checkpoint_store.session import TrialRunner

HEADER = re.compile(r"^Failure # (\d+) \(occurred at \d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\)$", re.M)


def _location(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "store"), {}
    if kind == "memory":
        return f"memory://err-{uuid.uuid4().hex[:10]}/store", {}
    loc = request.getfixturevalue(f"{kind}_location")
    return loc.uri, dict(loc.storage_options)


@pytest.fixture(params=["local", "memory",
                        *(pytest.param(k, marks=pytest.mark.slow)
                          for k in ("s3", "s3fs", "azure", "gcs"))])
def where(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict]:
    return _location(request.param, tmp_path, request)


def _start(where: tuple[str, dict], **kw: Any) -> Any:
    uri, opts = where
    return session.start(storage_path=uri, storage_options=opts or None,
                         experiment_name="exp", trial_name="t", **kw)


def _error_text(where: tuple[str, dict]) -> str | None:
    uri, opts = where
    return StorageContext(uri, "exp", "t", storage_options=opts or None).read_error()


def _fail_inside(where: tuple[str, dict], exc: BaseException) -> None:
    with pytest.raises(type(exc)):
        with _start(where):
            session.report({"loss": 1.0})
            token = "local-value-0xdeadbeef"  # noqa: F841 (a frame's local: never written)
            raise exc


def test_a_raising_session_records_type_message_traceback(where) -> None:
    _fail_inside(where, ValueError("loss is nan at step 7"))
    text = _error_text(where)
    assert text is not None
    assert [int(n) for n in HEADER.findall(text)] == [1]
    assert "Traceback (most recent call last):" in text
    assert "in _fail_inside" in text  # the frame that raised
    assert text.rstrip().endswith("ValueError: loss is nan at step 7")
    assert "0xdeadbeef" not in text  # no frame locals


def test_failures_accumulate_until_a_clean_run_supersedes_them(where) -> None:
    _fail_inside(where, ValueError("first"))
    try:
        with _start(where):
            raise RuntimeError("second") from KeyError("cause")
    except RuntimeError:
        pass
    text = _error_text(where)
    assert [int(n) for n in HEADER.findall(text)] == [1, 2]
    assert "ValueError: first" in text and "RuntimeError: second" in text
    assert "KeyError: 'cause'" in text  # chained causes are part of the traceback
    with _start(where):
        session.report({"loss": 0.5})
    assert _error_text(where) is None


def test_a_clean_session_writes_no_error_file(where) -> None:
    with _start(where):
        session.report({"loss": 0.5})
    assert _error_text(where) is None


@pytest.mark.parametrize("exc, recorded", [
    (SystemExit(0), False), (SystemExit(None), False), (SystemExit(3), True),
    (KeyboardInterrupt(), True),
])
def test_exits_that_are_not_failures(tmp_path, exc, recorded) -> None:
    where = (str(tmp_path / "s"), {})
    with pytest.raises(type(exc)):
        with _start(where):
            raise exc
    assert (_error_text(where) is not None) == recorded


def _runner(where: tuple[str, dict], fn: Any, trial: str = "t") -> TrialRunner:
    uri, opts = where
    return TrialRunner(fn, {"lr": 0.1}, storage_path=uri, storage_options=opts or None,
                       experiment_name="exp", trial_name=trial)


def test_a_trial_runner_whose_function_raises_records_it(where) -> None:
    def train(config: dict) -> None:
        session.report({"loss": 1.0})
        raise ZeroDivisionError("lr schedule divided by zero")

    with _runner(where, train) as runner:
        assert runner.step()["loss"] == 1.0
        with pytest.raises(ZeroDivisionError):
            runner.step()
        assert runner.status == "errored"
    text = _error_text(where)
    assert text is not None and HEADER.search(text)
    assert "in train" in text
    assert text.rstrip().endswith("ZeroDivisionError: lr schedule divided by zero")


def test_a_stopped_or_paused_trial_is_not_errored(tmp_path) -> None:
    where = (str(tmp_path / "s"), {})

    def train(config: dict) -> None:
        for i in range(100):
            session.report({"i": i})

    _fail_inside(where, ValueError("earlier run"))
    runner = _runner(where, train)
    runner.step()
    runner.pause()
    assert _error_text(where) is None  # the resumed run went on: superseded
    runner.step()
    runner.stop()
    assert runner.status == "stopped" and _error_text(where) is None


def test_only_rank_0_writes_it(ranks, tmp_path) -> None:
    where = (str(tmp_path / "s"), {})

    def run(rank: int) -> None:
        with _start(where, world_rank=rank, world_size=2, attempt_id="a1",
                    sync_timeout_s=20):
            session.report({"rank": rank})
            if rank == 1:
                raise ValueError("rank 1 failed")

    out = ranks(2, run)
    assert isinstance(out[1], ValueError) and out[0] is None
    assert _error_text(where) is None

    def run0(rank: int) -> None:
        with _start(where, world_rank=rank, world_size=2, attempt_id="a2",
                    sync_timeout_s=20):
            session.report({"rank": rank})
            if rank == 0:
                raise ValueError("rank 0 failed")

    out = ranks(2, run0)
    assert isinstance(out[0], ValueError)
    assert _error_text(where).rstrip().endswith("ValueError: rank 0 failed")
