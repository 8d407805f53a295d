"""The tuning side of the session: run one trial's function in a thread, result by result.

A scheduler (Optuna, a successive-halving loop, a hand-written sweep) drives
a :class:`TrialRunner` with ``step()`` and decides after each result whether
to go on, ``pause()`` or ``stop()``. Same semantics as a Ray Tune function
trainable run by its trial runner; the session inside is the one
:func:`checkpoint_store.session.report` uses everywhere.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import check_run_name
from checkpoint_store._util.locks import condition
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointStoreError,
    InvalidConfigError,
    Preempted,
    TrialStopped,
)
from checkpoint_store.retention import CheckpointConfig
from checkpoint_store.session._checks import (
    check_checkpoint_config,
    check_timeout,
    check_upload_config,
)
from checkpoint_store.session._preemption import (
    PreemptionConfig,
    check_installable,
    check_preemption,
    install_handlers,
)
from checkpoint_store.session._uploads import UploadConfig
from checkpoint_store.tiers import LocalTier, check_local_tier

if TYPE_CHECKING:
    from checkpoint_store.session._session import Session

_IDLE, _RUNNING, _FINISHED, _STOPPED, _PAUSED = "idle", "running", "finished", "stopped", "paused"
_ERRORED, _PREEMPTED = "errored", "preempted"
#: How often a driver waiting in ``step()`` wakes to run pending signal handlers.
_SIGNAL_POLL_S = 0.05


class TrialRunner:
    """Runs ``train_fn(config)`` in a thread with its own session, one result per ``step()``.

    Args:
        train_fn: the function trainable. Called as ``train_fn(config)`` (or
            ``train_fn()`` when it takes no argument) in a new thread, where
            :func:`checkpoint_store.session.report` and ``get_checkpoint()``
            reach this trial's session. If it returns a dict, or is a
            generator yielding dicts, those are reported too.
        config: the trial's hyperparameters (a JSON object), written to
            ``params.json``.
        storage_path, experiment_name, trial_name, storage_filesystem: where
            the trial lives, as for :func:`checkpoint_store.session.start`.
        checkpoint_config: retention rules for this trial's checkpoints (each
            trial keeps its own top K under its own directory).
        upload_config: how this trial's ``report()`` uploads
            (:class:`~checkpoint_store.UploadConfig`; default synchronously).
        synchronous_result_reporting: True (default): ``report()`` inside
            ``train_fn`` blocks until the *next* ``step()``, so the function
            never runs ahead of the scheduler and can be stopped or paused
            between two reports. False: ``report()`` returns as soon as
            ``step()`` has taken its result.
        storage_options: backend options for a URI ``storage_path``.
        stop_timeout_s: how long ``stop()``/``pause()``/``reset()`` wait for
            the thread to end, in seconds.
        resume_from: another run's committed checkpoint to start from, as for
            :func:`checkpoint_store.session.start` (checked when the thread
            starts, before anything is written, unless the trial has
            checkpoints of its own: then it is not read at all).
        local_tier: a fast local tier in front of ``storage_path``, as for
            :func:`checkpoint_store.session.start` (docs/tiers.md).
        preemption: a :class:`~checkpoint_store.PreemptionConfig` (or True
            for its defaults) for the trial's session (docs/preemption.md).
            The signal handler is installed here when the runner is built in
            the main thread; built in another thread (Optuna's ``n_jobs``),
            call :func:`checkpoint_store.session.install_preemption_handlers`
            from the main thread first. On the signal the trial's next
            ``report()`` commits a preemption checkpoint, the trial ends as
            ``preempted`` (its ``stopped.json``) and :meth:`step` raises
            :class:`~checkpoint_store.errors.Preempted` in the driver's
            thread; the trial is resumable: the next ``step()`` (or a new
            runner of the same trial after a restart) continues from that
            checkpoint through ``get_checkpoint()``.

    Raises:
        InvalidConfigError: ``train_fn`` is not callable, ``config`` is not a
            JSON object, a name is not one path component or is reserved
            (``checkpoint_NNNNNN``, ``result.json`` ...), ``checkpoint_config``
            is not a CheckpointConfig, ``upload_config`` is not an UploadConfig
            (or repeats upload settings the checkpoint config gives),
            ``storage_options`` is not a dict, ``stop_timeout_s`` is not a
            number > 0, or ``preemption`` is no PreemptionConfig or is built
            outside the main thread before its handlers were installed.
            Checked here, before any storage call; the thread starts at the
            first ``step()``.

    Example::

        runner = TrialRunner(train, {"lr": 0.1}, storage_path="s3://b/runs",
                             experiment_name="sweep", trial_name="trial_0")
        while (result := runner.step()) is not None:
            if result["loss"] > 10:
                runner.stop()
    """

    def __init__(
        self,
        train_fn: Callable[..., Any],
        config: Mapping[str, Any] | None = None,
        *,
        storage_path: str | os.PathLike[str],
        experiment_name: str,
        trial_name: str,
        checkpoint_config: CheckpointConfig | None = None,
        upload_config: UploadConfig | None = None,
        storage_filesystem: Any = None,
        synchronous_result_reporting: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        stop_timeout_s: float = 30.0,
        resume_from: Checkpoint | str | os.PathLike[str] | None = None,
        local_tier: LocalTier | None = None,
        preemption: PreemptionConfig | bool | None = None,
    ):
        if not callable(train_fn):
            raise InvalidConfigError(
                f"train_fn must be callable, got {type(train_fn).__name__}"
            )
        self._train_fn = train_fn
        self._config = _json.to_json_object(config or {}, "config")
        check_run_name(experiment_name, "experiment_name")
        check_run_name(trial_name, "trial_name")
        check_upload_config(upload_config, check_checkpoint_config(checkpoint_config))
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise InvalidConfigError(
                f"storage_options must be a dict or None, got {type(storage_options).__name__}"
            )
        if not isinstance(synchronous_result_reporting, bool):
            raise InvalidConfigError("synchronous_result_reporting must be True or False, got "
                                     f"{synchronous_result_reporting!r}")
        self._storage_args = {
            "storage_path": storage_path,
            "experiment_name": experiment_name,
            "trial_name": trial_name,
            "checkpoint_config": checkpoint_config,
            "upload_config": upload_config,
            "storage_filesystem": storage_filesystem,
            "storage_options": storage_options,
            "resume_from": resume_from,
            "local_tier": check_local_tier(local_tier),
        }
        preemption_config = check_preemption(preemption)
        if preemption_config is not None:
            # The trials' sessions start in their own threads, where no
            # signal handler can be installed: the driver's thread does it.
            if threading.current_thread() is threading.main_thread():
                install_handlers(preemption_config.signals)
            check_installable(preemption_config)
            self._storage_args["preemption"] = preemption_config
        self._sync = synchronous_result_reporting
        self._stop_timeout_s = check_timeout(stop_timeout_s, "stop_timeout_s")
        self._mutex, self._cv = condition()  # enter _mutex, not the condition
        self._thread: threading.Thread | None = None
        self._session: Session | None = None
        self._status = _IDLE
        #: The exception ``train_fn`` raised (also raised once by :meth:`step`), or None.
        self.error: BaseException | None = None
        self._generation = 0
        self._new_attempt()

    def _new_attempt(self) -> None:
        # Per-thread state; a generation number keeps a thread that outlived
        # stop() from touching the state of the next one.
        self._slot: dict[str, Any] | None = None
        self._put = 0
        self._taken = 0
        self._released = 0
        self._stop_requested = False
        self._stop_reason: tuple[str, str] | None = None  # (status, reason) of stop()
        self._error: BaseException | None = None
        self._preempted: Preempted | None = None
        self._thread_done = False

    # -- introspection --------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        """The current config (a copy)."""
        return dict(self._config)

    @property
    def trial_name(self) -> str:
        return str(self._storage_args["trial_name"])

    @property
    def status(self) -> str:
        """``"idle"`` (no step yet), ``"running"``, ``"finished"`` (returned),
        ``"errored"`` (raised; the exception is kept in :attr:`error`),
        ``"stopped"``, ``"paused"`` or ``"preempted"`` (a preemption signal
        ended it after its preemption checkpoint; resumable like a paused
        trial). Same roles as Ray Tune's trial statuses."""
        return self._status

    @property
    def session(self) -> Session | None:
        """The :class:`~checkpoint_store.session.Session` of the latest thread,
        or None before the first ``step()``. Its ``manager`` holds the trial's
        kept checkpoints; it stays readable after the thread ended."""
        return self._session

    @property
    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """This trial's kept checkpoints with their metrics, best first ([] before any)."""
        return self._session.manager.best_checkpoints if self._session is not None else []

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint of this trial, or None."""
        return self._session.get_checkpoint() if self._session is not None else None

    # -- the thread -------------------------------------------------------------------

    def _start_thread(self) -> None:
        # Started under the mutex, which the new thread takes before it does
        # anything: a signal's exception anywhere in here (Ctrl-C, inside
        # Thread.start too) takes the attempt back, and a thread that started
        # all the same finds its generation gone and ends. Either the thread
        # runs, or the status says it does not and the next step() starts it.
        with self._mutex:
            self._start_locked(self._status)

    def _start_locked(self, status: str) -> None:
        try:
            self._new_attempt()
            self._generation += 1
            self._status = _RUNNING
            self._stop_reason = None
            self._thread = threading.Thread(
                target=self._run, args=(self._generation,),
                name=f"cs-trial-{self.trial_name}", daemon=True,
            )
            self._thread.start()
        except BaseException:
            self._generation += 1
            self._status, self._thread = status, None
            raise

    def _run(self, generation: int) -> None:
        from checkpoint_store.session import _api as _session_mod

        with self._mutex:
            if generation != self._generation:
                return  # its start was taken back (or the runner reset)
        try:
            active = _session_mod.start(
                config=self._config, _thread_only=True, **self._storage_args
            )
            with active as sess:
                self._session = sess
                sess.add_report_hook(_Hook(self, generation))
                self._call_train_fn(_session_mod)
        except Preempted as exc:  # the session is closed as "preempted"
            with self._mutex:
                if generation == self._generation:
                    self._preempted = exc
        except TrialStopped:
            pass
        except BaseException as exc:  # re-raised by step() in the driver's thread
            with self._mutex:
                if generation == self._generation:
                    self._error = exc
        finally:
            with self._mutex:
                if generation == self._generation:
                    self._thread_done = True
                    self._cv.notify_all()

    def _call_train_fn(self, session_mod: Any) -> None:
        fn = self._train_fn
        try:
            takes_config = bool(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            takes_config = True
        out = fn(dict(self._config)) if takes_config else fn()
        if inspect.isgenerator(out):
            try:
                for item in out:
                    if item is not None:
                        session_mod.report(_as_metrics(item, "yielded"))
            finally:
                out.close()  # a stopped generator's finally blocks run now
        elif out is not None:
            session_mod.report(_as_metrics(out, "returned"))

    # -- the handoff (called from the trial thread through _Hook) ------------------------

    def _stopped(self) -> TrialStopped:
        if self._status == _STOPPED and self._stop_reason is not None:
            status, reason = self._stop_reason
            return TrialStopped(reason, status)
        return TrialStopped()

    def _before_report(self, generation: int) -> None:
        with self._mutex:
            if self._stop_requested or generation != self._generation:
                raise self._stopped()

    def _after_report(self, generation: int, row: dict[str, Any], ckpt: Checkpoint | None) -> None:
        result = dict(row)
        result["checkpoint"] = ckpt
        with self._mutex:
            if self._stop_requested or generation != self._generation:
                raise self._stopped()
            self._slot = result
            self._put += 1
            n = self._put
            self._cv.notify_all()
            while True:
                if generation != self._generation:
                    raise self._stopped()
                if (self._released if self._sync else self._taken) >= n:
                    return
                if self._stop_requested:
                    raise self._stopped()
                self._cv.wait()

    # -- the driver's API --------------------------------------------------------------

    def step(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Run ``train_fn`` until its next ``report()`` and return that result.

        The first call starts the thread (after a :meth:`pause`, a new thread
        resumes from the latest checkpoint through ``get_checkpoint()``).

        Args:
            timeout: seconds to wait for the result; None waits forever.

        Returns:
            A flat dict: the reported metrics and the auto-filled keys
            (``training_iteration``, ``timestamp``, ``time_total_s``,
            ``time_this_iter_s``, ``trial_id``, ``checkpoint_dir_name``) at the
            top level, plus ``checkpoint``: the committed
            :class:`~checkpoint_store.Checkpoint` on storage, or None. None once
            ``train_fn`` has returned or the trial was stopped, and on every
            later call.

        Raises:
            BaseException: whatever ``train_fn`` raised, with its original type
                and traceback (once; later calls return None).
            Preempted: a preemption signal ended the trial after its
                preemption checkpoint (``preemption=``); raised once, the
                status is then ``"preempted"`` and the next ``step()``
                resumes the trial from that checkpoint.
            TimeoutError: no result within ``timeout`` (the trial goes on).
        """
        with self._mutex:
            if self._status in (_IDLE, _PAUSED, _PREEMPTED):
                starting = True
            elif self._status in (_FINISHED, _ERRORED, _STOPPED):
                return None
            else:
                starting = False
        if starting:
            self._start_thread()
        with self._mutex:
            if self._sync and self._taken > self._released:
                self._released = self._taken  # let the blocked report() return
                self._cv.notify_all()
            ok = self._wait_for_result(timeout)
            if not ok:
                raise TimeoutError(
                    f"trial {self.trial_name!r} reported nothing within {timeout}s"
                )
            if self._slot is not None and not self._stop_requested:
                result, self._slot = self._slot, None
                self._taken += 1
                self._cv.notify_all()
                return result
            if self._stop_requested:
                return None
            error, self._error = self._error, None
            preempted, self._preempted = self._preempted, None
            if preempted is not None and error is None:
                self._status = _PREEMPTED
                error = preempted
            else:
                self._status = _FINISHED if error is None else _ERRORED
                if error is not None:
                    self.error = error
        if self._thread is not None:
            self._thread.join(self._stop_timeout_s)
        if error is not None:
            raise error.with_traceback(error.__traceback__)
        return None

    def _wait_for_result(self, timeout: float | None) -> bool:
        """Wait (under ``_cv``) for a result, the thread's end or a stop.

        With ``preemption=`` the wait wakes every :data:`_SIGNAL_POLL_S`: a
        signal that the kernel hands to another thread than this (the main)
        one only trips Python's flag, and its handler, which flags the
        trial's session, runs when the main thread next runs Python code. A
        wait that never wakes would hold the flag back until the trial's
        next report, one step late."""
        def ready() -> bool:
            return self._slot is not None or self._thread_done or self._stop_requested

        if "preemption" not in self._storage_args:
            return self._cv.wait_for(ready, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            left = _SIGNAL_POLL_S if deadline is None else min(
                _SIGNAL_POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            self._cv.wait(left)
        return True

    def _end_thread(self, status: str, timeout: float | None) -> bool:
        with self._mutex:
            if self._status != _RUNNING:
                # Nothing runs. Before the first step (or while paused) the
                # request decides what step() does; a finished or stopped
                # trial stays so.
                if self._status in (_IDLE, _PAUSED):
                    self._status = status
                return True
            self._stop_requested = True
            self._status = status
            self._cv.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(self._stop_timeout_s if timeout is None else timeout)
        return not thread.is_alive()

    def stop(self, timeout: float | None = None, *, reason: str | None = None,
             status: str = "stopped") -> bool:
        """End the trial: the blocked (or next) ``report()`` raises
        :class:`~checkpoint_store.session.TrialStopped` inside ``train_fn``, so
        it unwinds and its ``finally`` blocks run; the thread is joined.

        Idempotent; allowed before the first ``step()`` and after the end.
        Nothing is deleted. ``step()`` returns None afterwards.

        Args:
            timeout: seconds to wait for the thread (default ``stop_timeout_s``).
            reason: why, in one line (``"pruned at training_iteration 3"``): the
                session records it in the trial's ``stopped.json`` with
                ``status``, so ``ui`` shows the trial as pruned or stopped, not
                finished (as Ray Tune tells an early-stopped trial from a
                finished one). Without a reason nothing is recorded.
            status: ``"stopped"`` or ``"pruned"`` (a pruner's verdict).

        Raises:
            InvalidConfigError: another ``status``.

        Returns:
            True when the thread has ended (or never ran); False if it is still
            running after ``timeout`` (it is a daemon thread and stops at its
            next report()).
        """
        if status not in ("stopped", "pruned"):
            raise InvalidConfigError(f"status must be 'stopped' or 'pruned', got {status!r}")
        with self._mutex:
            if reason is not None and self._status in (_RUNNING, _IDLE, _PAUSED):
                self._stop_reason = (status, str(reason))
        return self._end_thread(_STOPPED, timeout)

    def pause(self, timeout: float | None = None) -> bool:
        """End the thread like :meth:`stop`, keeping every checkpoint.

        The next ``step()`` on this runner, or a new runner for the same
        trial, starts ``train_fn`` again and it resumes from the latest
        checkpoint through ``get_checkpoint()``. Idempotent.

        Returns:
            As :meth:`stop`.
        """
        return self._end_thread(_PAUSED, timeout)

    def reset(
        self, new_config: Mapping[str, Any] | None, *, trial_name: str | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Reuse this runner for a new config (Ray's ``reset_config``).

        The current thread is stopped; the next ``step()`` runs ``train_fn``
        with ``new_config``. With ``trial_name`` the runner moves to that
        trial's directory; without, it continues in the same trial (and
        ``get_checkpoint()`` there returns that trial's latest checkpoint).

        Returns:
            True when reset; False if the old thread did not stop within the
            timeout (nothing changed apart from the stop request).

        Raises:
            InvalidConfigError: ``new_config`` is not a JSON object, or
                ``trial_name`` is not one path component or is reserved (the
                thread goes on).
        """
        clean = _json.to_json_object(new_config or {}, "config")
        if trial_name is not None:
            check_run_name(trial_name, "trial_name")
        if not self._end_thread(_STOPPED, timeout):
            return False
        with self._mutex:
            self._config = clean
            if trial_name is not None:
                self._storage_args["trial_name"] = trial_name
            self._status = _IDLE
            self.error = None
            self._generation += 1
            self._new_attempt()
            self._session = None
        return True

    def __enter__(self) -> TrialRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"TrialRunner(trial_name={self.trial_name!r}, status={self._status!r})"


class _Hook:
    """What a Session calls around each report() of a runner's thread."""

    def __init__(self, runner: TrialRunner, generation: int):
        self._runner = runner
        self._generation = generation

    def before_report(self) -> None:
        self._runner._before_report(self._generation)

    def after_report(self, row: dict[str, Any], checkpoint: Checkpoint | None) -> None:
        self._runner._after_report(self._generation, row, checkpoint)


def _as_metrics(value: Any, how: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CheckpointStoreError(
            f"train_fn {how} a {type(value).__name__}; return or yield a dict of metrics "
            "(or None), or call checkpoint_store.session.report() yourself"
        )
    return value
