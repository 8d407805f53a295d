"""Shared fixtures for checkpoint-store's own tests.

Server fixtures (S3, Azure, GCS) come from the shipped pytest plugin,
``checkpoint_store.testing.plugin``.
"""

from __future__ import annotations

import os

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
# Background copies yield the CPU to the training loop (nice 10: see
# checkpoint_store/_util/background.py). Here the other test workers stand
# where a loop would, and a copy at a tenth of their share would stretch the
# tests' deadlines (grace periods, rank timeouts); the suite keeps them at
# its own priority. tests/session/test_uploader.py checks the default.
os.environ.setdefault("CHECKPOINT_STORE_UPLOAD_NICE", "0")

import fcntl  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The kill harnesses (tests/crash) run alone: they hold real deadlines
    (grace periods, lease expiry, kill moments) against the wall clock, which
    other workers' tests on the same cores would stretch. A test there marked
    ``no_deadline`` (a kill at a fixed line, a sweep of injected faults) holds
    none and runs beside the others. So do the tests on a full disk
    (``small_disk``) run alone: under load, a background commit of the failed
    report was seen to run after the next one began."""
    for item in items:
        in_crash = item.path.parent.name == "crash" and item.path.parent.parent.name == "tests"
        if (in_crash and item.get_closest_marker("no_deadline") is None) \
                or "small_disk" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.exclusive)


class _ExclusiveLock:
    """Under pytest-xdist, a test marked ``exclusive`` runs while no other test
    runs in any worker; the others run side by side. A readers-writer lock of
    two ``flock``s in a directory of the run's own (``PYTEST_XDIST_TESTRUNUID``
    names it): everyone passes a turnstile to take the lock, so a waiting
    exclusive test holds back new shared ones instead of waiting for a moment
    when none runs.

    A worker keeps the lock exclusive from one exclusive test to the next one
    it runs: taking it again for each would first wait for the other
    workers' running tests to end (each of up to two minutes) while two cores
    stood mostly idle. A shared test gives its hold back when it ends, so an
    exclusive test waits for one test per worker at most."""

    def __init__(self, run_id: str) -> None:
        import tempfile

        shared_dir = os.path.join(tempfile.gettempdir(), f"cs-exclusive-{run_id}")
        os.makedirs(shared_dir, exist_ok=True)
        self._turnstile = open(os.path.join(shared_dir, "turnstile"), "a")
        self._lock = open(os.path.join(shared_dir, "lock"), "a")
        self.held: int | None = None  # fcntl.LOCK_EX or LOCK_SH while held

    def take(self, mode: int) -> None:
        if self.held == mode:
            return
        self.give_back()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, mode)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.held = mode

    def give_back(self) -> None:
        if self.held is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self.held = None


_EXCLUSIVE: _ExclusiveLock | None = None


def _is_exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each test's setup, call and teardown (see :class:`_ExclusiveLock`)."""
    global _EXCLUSIVE
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if os.environ.get("PYTEST_XDIST_WORKER") is None or run_id is None:
        yield
        return
    if _EXCLUSIVE is None:
        _EXCLUSIVE = _ExclusiveLock(run_id)
    exclusive = _is_exclusive(item)
    _EXCLUSIVE.take(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if not (exclusive and _is_exclusive(nextitem)):
            _EXCLUSIVE.give_back()


@pytest.fixture
def ranks():
    """``run_ranks(n, fn)`` (tests/ranks.py): ``fn(rank)`` on n threads, each
    rank's result or exception in rank order."""
    from tests.ranks import run_ranks

    return run_ranks


@pytest.fixture
def fresh_signal_handlers():
    """The test starts from the signal handlers and preemption state of a fresh
    process, and what was there is put back afterwards. Earlier tests of the
    suite leave handlers installed (``ray.init``, Tune's signal catching) and
    a session never ended keeps watching; tests that send themselves signals
    and check what our handlers do, and give back, must not see either."""
    import signal

    from checkpoint_store.session import _preemption

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    saved = {s: signal.getsignal(s) for s in signals}
    with _preemption._lock:
        state = (_preemption._watches, dict(_preemption._installed), set(_preemption._pinned),
                 _preemption._exit_users)
        _preemption._watches = ()
        _preemption._installed.clear()
        _preemption._pinned.clear()
        _preemption._exit_users = 0
    for s in signals:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    yield
    with _preemption._lock:
        (_preemption._watches, installed, pinned, _preemption._exit_users) = state
        _preemption._installed.clear()
        _preemption._installed.update(installed)
        _preemption._pinned.clear()
        _preemption._pinned.update(pinned)
    for s, handler in saved.items():
        signal.signal(s, handler)


def _tmpfs(mnt, options: str):
    """Mount a tmpfs with ``options`` on the directory ``mnt`` until the
    generator is closed (root and mount needed: the test is skipped elsewhere)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr!r}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs, a real full disk (needs root and mount; skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    yield from _tmpfs(mnt, "size=256k")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no write reaches: a read-only tmpfs for root (whom no
    permission bit stops), a directory of mode 0o555 for anyone else."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    for _ in _tmpfs(ro, "ro,size=64k"):
        yield ro
