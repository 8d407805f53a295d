"""A preemption signal becomes a save request, then a clean stop.

Most restarts in the cloud begin with a signal and a grace period before the
SIGKILL: a spot or preemptible VM reclaimed (30 s on GKE, a two-minute
notice on AWS), a Kubernetes eviction (``terminationGracePeriodSeconds``),
SLURM's ``--signal=USR1@90`` before the time limit, a Ctrl-C. With
``session.start(preemption=PreemptionConfig(...))``:

1. the signal sets a flag (:attr:`Session.reached_preemption`, as Orbax's
   ``reached_preemption``) and nothing else: the step under way finishes;
2. the next ``report()`` commits its checkpoint on the storage_path even
   where the local tier's ``persist`` policy would keep it local, waits until
   every acknowledged save is durable, marks it a preemption checkpoint in
   its internal metadata (``"preemption"``), records the trial as
   ``preempted`` (``stopped.json``), releases the trial's lease, then raises
   :class:`~checkpoint_store.errors.Preempted` (a ``SystemExit`` whose code is
   the exit status the scheduler expects: ``128 + signal`` by default);
3. a loop that does not reach ``report()`` in time is stopped with the same
   exception ``stop_margin_s`` before the grace period ends (main thread
   only), and keeps the newest complete checkpoint as its resume point; a
   second signal stops it at once.

Without ``preemption=``, a session in the main thread still turns a SIGTERM
whose handler is the default one into ``SystemExit(143)`` (see
:func:`install_exit_on_sigterm`), so the session ends through its normal
path: acknowledged saves are committed, the lease is released and the
error is recorded, instead of the process vanishing mid-upload.

With several ranks the signal reaching one rank (or each at a different
step) becomes one index on every rank: over a torch.distributed process
group each report gathers the ranks' flags (:meth:`PreemptionWatch.shared`,
:meth:`PreemptionWatch.adopt`) and the next report is every rank's
preemption report; through storage alone the flag travels in the rank
markers of the next checkpoint report, which becomes every rank's
(docs/sessions.md, "A preemption signal with several ranks").

Signal handlers can only be installed by the main thread (Python's rule);
sessions of other threads (a :class:`TrialRunner`'s trials) are flagged
by the handler a main-thread call installed (:func:`install_handlers`).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store.errors import InvalidConfigError, Preempted

__all__ = [
    "PreemptionConfig",
    "PreemptionWatch",
    "check_installable",
    "check_preemption",
    "install_exit_on_sigterm",
    "install_handlers",
    "signal_name",
    "uninstall_exit_on_sigterm",
    "unwatch",
    "watch",
]

logger = logging.getLogger("checkpoint_store.session._session")


def _signal_number(value: Any) -> int:
    if isinstance(value, signal.Signals):
        return int(value)
    if isinstance(value, str):
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        found = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if found is None:
            raise InvalidConfigError(f"unknown signal {value!r}; use a name such as 'SIGTERM'")
        return int(found)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return int(signal.Signals(value))
        except ValueError:
            raise InvalidConfigError(f"unknown signal number {value!r}") from None
    raise InvalidConfigError(
        f"a signal must be a name ('SIGTERM') or a signal.Signals, got {type(value).__name__}")


_NOT_CATCHABLE = {int(signal.SIGKILL), int(signal.SIGSTOP)}


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15 (the name a signal is recorded under)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


@dataclass(frozen=True)
class PreemptionConfig:
    """How a session answers a preemption signal (``session.start(preemption=...)``).

    Attributes:
        signals: the signals that announce a preemption: names (``"SIGTERM"``,
            ``"SIGUSR1"`` for SLURM's ``--signal=USR1@90``, ``"SIGINT"`` for
            Ctrl-C) or ``signal.Signals``. Default: SIGTERM (Kubernetes, GKE
            and AWS spot, torchrun and SLURM at the time limit).
        grace_period_s: seconds between the signal and the SIGKILL that
            follows it (Kubernetes' ``terminationGracePeriodSeconds``, 30 by
            default; AWS spot gives 120). The session bounds its waits by it.
        stop_margin_s: a loop that has not reached ``report()`` this many
            seconds before the grace period ends is stopped where it is
            (:class:`~checkpoint_store.errors.Preempted` raised in the main
            thread), so the session still ends cleanly. Default: a fifth of
            ``grace_period_s``, at most 10 s.
        exit_code: the exit status of a process that lets
            :class:`~checkpoint_store.errors.Preempted` end it (it is a
            ``SystemExit``). Default: ``128 + the signal's number`` (143 for
            SIGTERM), what a shell reports for a process the signal ended;
            set what your scheduler's requeue rule matches (e.g. a
            Kubernetes ``podFailurePolicy`` on exit codes).

    Raises:
        InvalidConfigError: an unknown or uncatchable signal (SIGKILL,
            SIGSTOP), no signal, a grace period that is not a positive
            number of seconds, a margin outside ``[0, grace_period_s)``, an
            exit code outside 0–255.
    """

    signals: tuple[Any, ...] = ("SIGTERM",)
    grace_period_s: float = 30.0
    stop_margin_s: float | None = None
    exit_code: int | None = None
    _numbers: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        raw = self.signals
        if isinstance(raw, (str, int, signal.Signals)):
            raw = (raw,)
        try:
            items = tuple(raw)
        except TypeError:
            raise InvalidConfigError(
                f"signals must be a sequence of signal names, got {type(raw).__name__}") from None
        numbers = tuple(dict.fromkeys(_signal_number(s) for s in items))
        if not numbers:
            raise InvalidConfigError("signals must name at least one signal, e.g. ('SIGTERM',)")
        bad = [signal_name(n) for n in numbers if n in _NOT_CATCHABLE]
        if bad:
            raise InvalidConfigError(f"{', '.join(bad)} cannot be caught; use SIGTERM or SIGUSR1")
        grace = self.grace_period_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (
                0 < grace < float("inf")):
            raise InvalidConfigError(
                f"grace_period_s must be a positive number of seconds, got {grace!r}")
        margin = self.stop_margin_s
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not 0 <= margin < grace):
            raise InvalidConfigError(
                f"stop_margin_s must be a number of seconds in [0, grace_period_s={grace}), "
                f"got {margin!r}")
        code = self.exit_code
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)
                                 or not 0 <= code <= 255):
            raise InvalidConfigError(f"exit_code must be an int in 0..255, got {code!r}")
        object.__setattr__(self, "signals", tuple(signal_name(n) for n in numbers))
        object.__setattr__(self, "grace_period_s", float(grace))
        object.__setattr__(self, "_numbers", numbers)

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        return self._numbers

    @property
    def margin_s(self) -> float:
        """``stop_margin_s``, or its default."""
        if self.stop_margin_s is not None:
            return float(self.stop_margin_s)
        return min(10.0, self.grace_period_s / 5)

    def code_for(self, signum: int) -> int:
        return self.exit_code if self.exit_code is not None else 128 + signum


def check_preemption(value: Any) -> PreemptionConfig | None:
    """``session.start(preemption=...)``: None, True (the defaults) or a
    :class:`PreemptionConfig`.

    Raises:
        InvalidConfigError: anything else.
    """
    if value is None or value is False:
        return None
    if value is True:
        return PreemptionConfig()
    if isinstance(value, PreemptionConfig):
        return value
    raise InvalidConfigError(
        f"preemption must be a PreemptionConfig (or True for its defaults), "
        f"got {type(value).__name__}")


class PreemptionWatch:
    """One session's view of preemption signals.

    Args:
        config: the session's :class:`PreemptionConfig`.
        on_signal: called (once, on a helper thread, never in the signal
            handler) when the first signal arrives: the session hurries its
            pending durable copies.

    Thread-safety: the handler only sets fields and an event; the flag is
    read by the training loop's thread.
    """

    def __init__(self, config: PreemptionConfig, on_signal: Callable[[], None] | None = None):
        self.config = config
        self._on_signal = on_signal
        self._event = threading.Event()
        self.signum: int | None = None
        self.signalled_at: float | None = None  # time.time(), recorded in metadata
        self._signalled_mono: float | None = None
        self._main = threading.current_thread() is threading.main_thread()
        self._overdue = False
        self._stopping = False
        self.closed = False
        # Several ranks: every rank knows that some rank was signalled (the
        # flag was exchanged), and the deadline moved (woken watchdog).
        self.agreed = False
        self._moved = threading.Event()
        self._local = False  # this process received the signal itself

    @property
    def local(self) -> bool:
        """This process received the signal itself (not only another rank)."""
        return self._local

    @property
    def requested(self) -> bool:
        """A preemption signal arrived."""
        return self._event.is_set()

    def left_s(self) -> float | None:
        """Seconds left of the grace period (None before a signal)."""
        if self._signalled_mono is None:
            return None
        return max(0.0, self.config.grace_period_s
                   - (time.monotonic() - self._signalled_mono))

    def exception(self) -> Preempted:
        signum = self.signum if self.signum is not None else int(signal.SIGTERM)
        reason = f"{signal_name(signum)} received"
        if self.signalled_at is not None:
            reason += f" at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.signalled_at))}"
        return Preempted(reason, code=self.config.code_for(signum), signal=signal_name(signum))

    def metadata(self) -> dict[str, Any]:
        """What a preemption checkpoint records in its internal metadata."""
        signum = self.signum if self.signum is not None else int(signal.SIGTERM)
        return {"signal": signal_name(signum), "signalled_at": self.signalled_at,
                "grace_period_s": self.config.grace_period_s}

    def request(self, signum: int) -> None:
        """The signal ``signum`` arrived (the handler, or a test)."""
        if self.closed:
            return
        if self._event.is_set():
            if not self._local:  # flagged by another rank's signal: this is our first
                self._local = True
                return
            if self._main and not self._stopping:
                self._stopping = True
                raise self.exception()  # a second signal: stop now
            return
        self._local = True
        self._flag(signum, time.time(), time.monotonic())

    def _flag(self, signum: int, signalled_at: float, signalled_mono: float) -> None:
        self.signum = signum
        self.signalled_at = signalled_at
        self._signalled_mono = signalled_mono
        self._event.set()
        threading.Thread(target=self._watchdog, name="checkpoint-store-preemption",
                         daemon=True).start()

    # -- several ranks ------------------------------------------------------------------

    def shared(self) -> dict[str, Any] | None:
        """This rank's signal as the other ranks learn it (None before one):
        :meth:`metadata` plus ``left_s``, the grace this rank has left."""
        if not self.requested or self.closed:
            return None
        return {**self.metadata(), "left_s": self.left_s()}

    def adopt(self, signals: Iterable[Any]) -> bool:
        """What the ranks' :meth:`shared` said (None for a rank not signalled):
        if any rank was, this rank is flagged too (:attr:`agreed`), with the
        earliest signal and the shortest grace left of them all (its
        watchdog then stops a loop that does not reach ``report()`` in time).
        Returns whether some rank was signalled."""
        got = [s for s in signals if isinstance(s, dict)]
        if not got or self.closed:
            return False
        grace = self.config.grace_period_s
        # A rank that only read the signal from storage knows when it came.
        left = min(_seconds(s.get("left_s"), grace - (
            time.time() - _seconds(s.get("signalled_at"), time.time()))) for s in got)
        left = min(grace, max(0.0, left))
        mono = time.monotonic() - (self.config.grace_period_s - left)
        if not self.requested:
            first = min(got, key=lambda s: _seconds(s.get("signalled_at"), float("inf")))
            try:
                signum = _signal_number(first.get("signal"))
            except InvalidConfigError:
                signum = self.config.signal_numbers[0]
            at = first.get("signalled_at")
            self._flag(signum, float(at) if isinstance(at, (int, float)) else time.time(), mono)
        elif self._signalled_mono is not None and mono < self._signalled_mono:
            self._signalled_mono = mono  # another rank's grace ends first
            self._moved.set()
        self.agreed = True
        return True

    def overdue(self) -> None:
        """The main thread, called by the handler the watchdog triggered."""
        if self._main and not self._stopping and not self.closed:
            self._stopping = True
            raise self.exception()

    def stopping(self) -> None:
        """The session is ending because of the signal (no later raise)."""
        self._stopping = True

    def _watchdog(self) -> None:
        if self._on_signal is not None:
            try:
                self._on_signal()
            except Exception as exc:  # hurrying is best effort
                logger.warning("could not hurry the pending durable copies: %s", exc)
        while True:
            left = self.left_s()
            assert left is not None
            wait = left - self.config.margin_s
            if wait <= 0 or not self._moved.wait(wait):
                break
            self._moved.clear()  # another rank's deadline, earlier: sleep again
        if self.closed or self._stopping or not self._main:
            return
        logger.warning("preemption: report() was not reached within %.1f s of %s; stopping "
                       "the loop now (the newest committed checkpoint is the resume point)",
                       self.config.grace_period_s - self.config.margin_s,
                       signal_name(self.signum or 0))
        self._overdue = True
        _thread.interrupt_main(signal.Signals(self.signum or int(signal.SIGTERM)))

    def take_overdue(self) -> bool:
        overdue, self._overdue = self._overdue, False
        return overdue


def _seconds(value: Any, default: float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default


# -- the process's handlers -------------------------------------------------------------------

_lock = threading.Lock()
# Copied on write: the handler reads them without a lock (it may interrupt
# the main thread while it holds _lock).
_watches: tuple[PreemptionWatch, ...] = ()
_installed: dict[int, Any] = {}  # signum -> the handler it replaced
_exit_users = 0
_pinned: set[int] = set()  # installed by install_handlers(): kept for later sessions


def _handler(signum: int, frame: Any) -> None:
    mine = [w for w in _watches if signum in w.config.signal_numbers and not w.closed]
    if not mine:
        if signum == signal.SIGTERM and _exit_users:
            raise SystemExit(128 + signum)
        _chain(signum, frame)
        return
    for watch in mine:
        if watch.take_overdue():
            watch.overdue()
    for watch in mine:
        watch.request(signum)


def _chain(signum: int, frame: Any) -> None:
    """What the signal did before we handled it."""
    previous = _installed.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        raise SystemExit(128 + signum)


def _install(signum: int) -> None:
    main = threading.current_thread() is threading.main_thread()
    if signum in _installed:
        if main and signal.getsignal(signum) is not _handler:
            # Another library set its own handler over ours since (ray.init
            # installs one for SIGTERM): take the signal back, and do what
            # that handler does for the signals no session watches.
            _installed[signum] = signal.signal(signum, _handler)
        return
    if not main:
        raise InvalidConfigError(
            f"the preemption handler of {signal_name(signum)} must be installed by the main "
            "thread: start this session there, or call "
            "checkpoint_store.session.install_preemption_handlers() from it first")
    _installed[signum] = signal.signal(signum, _handler)


def check_installable(config: PreemptionConfig) -> None:
    """Raise before a session writes anything if :func:`watch` could not
    install a handler of ``config``'s signals (another thread than the main
    one, and no :func:`install_handlers` call before).

    Raises:
        InvalidConfigError: see above.
    """
    if threading.current_thread() is threading.main_thread():
        return
    missing = [n for n in config.signal_numbers if n not in _installed]
    if missing:
        raise InvalidConfigError(
            f"preemption on {', '.join(signal_name(n) for n in missing)} needs its handler, "
            "which only the main thread can install: start this session there, or call "
            "checkpoint_store.session.install_preemption_handlers("
            f"{[signal_name(n) for n in missing]!r}) from the main thread first")


def install_handlers(signals: Iterable[Any] = ("SIGTERM",)) -> None:
    """Install the preemption handler of ``signals`` from the main thread, for
    sessions that start in other threads (a TrialRunner's trials, a Ray
    Train worker's training thread). Idempotent; the handler flags the
    sessions watching a signal and does what the signal did before for
    everything else.

    Raises:
        InvalidConfigError: called from another thread; an unknown signal.
    """
    numbers = PreemptionConfig(signals=tuple(signals)).signal_numbers
    with _lock:
        for n in numbers:
            _install(n)
        _pinned.update(numbers)


def watch(w: PreemptionWatch) -> None:
    """Start flagging ``w`` on its signals."""
    global _watches
    with _lock:
        for n in w.config.signal_numbers:
            _install(n)
        _watches = (*_watches, w)


def unwatch(w: PreemptionWatch) -> None:
    global _watches
    w.closed = True
    with _lock:
        _watches = tuple(x for x in _watches if x is not w)
        _restore_unused()


def install_exit_on_sigterm() -> bool:
    """A session in the main thread: a SIGTERM whose handler is the default
    one raises ``SystemExit(143)`` instead of ending the process at once, so
    ``with session.start(...)`` (or the exit hook) commits what ``report()``
    acknowledged and releases the lease. A handler the program set is left
    alone. Returns whether this call counts as a user (pair it with
    :func:`uninstall_exit_on_sigterm`)."""
    global _exit_users
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if signal.SIGTERM not in _installed:
            if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
                return False
            _installed[int(signal.SIGTERM)] = signal.signal(signal.SIGTERM, _handler)
        _exit_users += 1
    return True


def uninstall_exit_on_sigterm() -> None:
    global _exit_users
    with _lock:
        _exit_users = max(0, _exit_users - 1)
        _restore_unused()


def _restore_unused() -> None:
    """Give back the handlers nobody uses (under ``_lock``, main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    used = {n for w in _watches for n in w.config.signal_numbers}
    if _exit_users:
        used.add(int(signal.SIGTERM))
    for n in [n for n in _installed if n not in used and n not in _pinned]:
        if signal.getsignal(n) is _handler:
            signal.signal(n, _installed[n])
        del _installed[n]
