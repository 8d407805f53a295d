"""Byte counting and progress bars for the command line's transfers (and ``verify``).

The transfer layer copies through ``pyarrow.fs`` streams. To show bytes/s and
an ETA without changing it, the CLI hands it a source filesystem wrapped in
:class:`_CountingHandler`: every read of a tracked file is counted, and when
the file's manifest entry is known, its CRC32C is checked at end of file, so
a corrupt source fails the copy *before* anything is committed at the
destination.

:func:`progress_bar` and :func:`counting_location` are what the commands
call; :class:`Progress` is looked up when a bar starts, so a test can
replace it.
"""

from __future__ import annotations

import dataclasses
import posixpath
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import google_crc32c
import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store._browse.locations import Location
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.cli.options import quiet
from checkpoint_store.errors import CheckpointCorruptError

__all__ = [
    "Expected",
    "Progress",
    "counting_filesystem",
    "counting_location",
    "expected_files",
    "mean_rate",
    "progress_bar",
]

#: ``{absolute path: (relative path, size, crc32c hex)}`` of a checkpoint's files.
Expected = Mapping[str, tuple[str, int, str]]


class _CountedFile:
    """What both counting readers share: the wrapped file, the byte callback,
    the manifest entry and the check against it."""

    def __init__(
        self,
        inner: Any,
        path: str,
        on_bytes: Callable[[int], None] | None,
        expected: tuple[str, int, str] | None,
    ):
        self._inner = inner
        self._path = path
        self._on_bytes = on_bytes
        self._expected = expected  # (relative path, size, crc32c hex)
        self._crc = 0
        self._seen = 0  # bytes that went into the running CRC32C
        self.closed = False

    def _count(self, data: bytes) -> None:
        if data and self._on_bytes is not None:
            self._on_bytes(len(data))

    def _check(self, got_size: int) -> None:
        """Raise unless ``got_size`` bytes with the running CRC32C match the entry."""
        assert self._expected is not None
        rel, size, crc = self._expected
        got = f"{self._crc:08x}"
        if got_size != size or got != crc:
            raise CheckpointCorruptError(
                f"file {rel!r} does not match the checkpoint's manifest (size "
                f"{got_size} vs {size}, crc32c {got} vs {crc})",
                path=self._path, file=rel,
            )

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._inner.close()


class _CountingReader(_CountedFile):
    """A file-like reader that reports bytes read and, given the manifest entry,
    checks size and CRC32C once the whole file has passed."""

    def read(self, n: int | None = -1) -> bytes:
        whole = n is None or n < 0
        data = self._inner.read() if whole else self._inner.read(n)
        if data:
            self._seen += len(data)
            if self._expected is not None:
                self._crc = google_crc32c.extend(self._crc, data)
            self._count(data)
        # Check as soon as the expected size is reached (callers that know the
        # size never ask for EOF), on a read-everything call, and at EOF.
        if self._expected is not None and (
            whole or not data or self._seen >= self._expected[1]
        ):
            self._check(self._seen)
        return data

    def seekable(self) -> bool:
        return False


class _CountingRandomReader(_CountedFile):
    """A seekable reader (for ``read_at``) that reports bytes read.

    When the reads of one open file cover it in order from offset 0 (a small
    file read whole), its size and CRC32C are checked against the manifest
    entry as soon as the last byte passed. Parts of a large file read by
    separate handles cannot be checked here; ``cp`` compares the committed
    manifest for those.
    """

    def __init__(self, inner: Any, path: str, on_bytes: Callable[[int], None] | None,
                 expected: tuple[str, int, str] | None):
        super().__init__(inner, path, on_bytes, expected)
        # Checked only while reads go on in order: the next one starts at _seen.
        self._in_order = expected is not None

    def read(self, n: int | None = -1) -> bytes:
        start = self._inner.tell()
        data = self._inner.read(n) if n is not None and n >= 0 else self._inner.read()
        self._count(data)
        if self._in_order and data:
            if start != self._seen:
                self._in_order = False
            else:
                self._crc = google_crc32c.extend(self._crc, data)
                self._seen += len(data)
                assert self._expected is not None
                if self._seen >= self._expected[1]:
                    self._check(self._seen)
                    self._in_order = False  # checked; later reads are just counted
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def size(self) -> int:
        return self._inner.size()

    def seekable(self) -> bool:
        return True


class _CountingHandler(ForwardingHandler):
    """Forwards everything to ``fs``; reads through :class:`_CountingReader`.

    Args:
        fs: the real filesystem.
        on_bytes: called with the byte count of every read of a tracked file.
        expected: ``{full path: (relative path, size, crc32c hex)}``; those files
            are tracked and checked at EOF. ``None`` tracks every file, unchecked.
    """

    def __init__(
        self,
        fs: pafs.FileSystem,
        on_bytes: Callable[[int], None] | None,
        expected: Expected | None = None,
        track: Callable[[str], bool] | None = None,
    ):
        super().__init__(fs)
        self.on_bytes = on_bytes
        self.expected = dict(expected) if expected is not None else None
        self.track = track

    def get_type_name(self) -> str:
        return f"counting+{self.inner.type_name}"

    def _counted(self, path: str) -> tuple[bool, Any]:
        """Whether reads of ``path`` are counted, and its expected manifest entry."""
        if self.expected is not None:
            exp = self.expected.get(path)
            return exp is not None, exp
        return (self.track(path) if self.track is not None else True), None

    def open_input_stream(self, path: str) -> pa.NativeFile:
        inner = self.inner.open_input_stream(path)
        counted, exp = self._counted(path)
        if not counted:
            return inner
        return pa.PythonFile(_CountingReader(inner, path, self.on_bytes, exp), mode="r")

    def open_input_file(self, path: str) -> pa.NativeFile:
        inner = self.inner.open_input_file(path)
        counted, exp = self._counted(path)
        if not counted:
            return inner
        return pa.PythonFile(_CountingRandomReader(inner, path, self.on_bytes, exp), mode="r")


def counting_filesystem(
    fs: pafs.FileSystem,
    on_bytes: Callable[[int], None] | None,
    expected: Expected | None = None,
    track: Callable[[str], bool] | None = None,
) -> pafs.FileSystem:
    """``fs`` with counted (and, for ``expected`` files, checksum-checked) reads."""
    return pafs.PyFileSystem(_CountingHandler(fs, on_bytes, expected, track))


def counting_location(loc: Location, on_bytes: Callable[[int], None],
                      expected: Expected | None = None,
                      track: Callable[[str], bool] | None = None) -> Location:
    """``loc`` on a backend whose reads are counted (:func:`counting_filesystem`):
    every file in ``expected`` (or accepted by ``track``) reports its bytes to
    ``on_bytes``; those in ``expected`` are checked against size and CRC32C."""
    fs = counting_filesystem(loc.fs, on_bytes, expected, track)
    return Location(dataclasses.replace(loc.backend, filesystem=fs), loc.path)


def expected_files(loc: Location, meta: Mapping[str, Any]) -> dict[str, tuple[str, int, str]]:
    """The manifest of internal metadata ``meta`` keyed by absolute path under ``loc``."""
    return {posixpath.join(loc.path, e["path"]): (e["path"], int(e["size"]), e["crc32c"])
            for e in meta.get("manifest", [])}


def progress_bar(description: str, total: int | None, *,
                 finishing: str | None = None) -> Progress:
    """A :class:`Progress` for the running command: none under ``--quiet``.
    ``finishing`` names the step after the last byte (``"committing"``)."""
    return Progress(description, total, enabled=not quiet(), finishing=finishing)


def _rate_column() -> Any:
    """A rich column showing bytes done over the time since the bar started:
    the true mean rate. rich's own speed column averages recent samples,
    which at the start are one burst over a few milliseconds (a rate many
    times the real one)."""
    from rich.filesize import decimal
    from rich.progress import ProgressColumn
    from rich.text import Text

    class _MeanRate(ProgressColumn):
        def render(self, task: Any) -> Text:
            rate = mean_rate(int(task.completed), task.elapsed or 0.0)
            return Text("?" if rate is None else f"{decimal(int(rate))}/s",
                        style="progress.data.speed")

    return _MeanRate()


def mean_rate(done: int, elapsed: float) -> float | None:
    """Bytes per second over ``elapsed`` seconds; None before 0.2 s, when one
    burst of reads would read as a rate many times the real one."""
    return None if elapsed < 0.2 else done / elapsed


def _stdout_is_terminal() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """A bytes progress bar (bytes/s, ETA) on stderr, or nothing.

    Shown only when ``enabled`` and stdout is a terminal, so pipes, CI logs
    and ``--quiet`` stay clean. ``advance`` is thread-safe (transfers run in
    a thread pool).
    """

    def __init__(self, description: str, total: int | None, *, enabled: bool,
                 finishing: str | None = None):
        self._enabled = enabled and _stdout_is_terminal()
        self._description = description
        self._finishing = finishing
        #: The step shown: ``"transfer"``, then ``finishing`` once every byte is done.
        self.phase = "transfer"
        self._total = total
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self.done = 0

    def __enter__(self) -> Progress:
        if self._enabled:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    DownloadColumn,
                    TextColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as _RichProgress
            except ImportError:  # rich is a dependency; a broken install just loses the bar
                self._enabled = False
                return self
            self._progress = _RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                _rate_column(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self._description, total=self._total)
        return self

    @property
    def enabled(self) -> bool:
        """True while a bar is drawn: only then are reads worth counting."""
        return self._progress is not None

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            finished = (self._finishing is not None and self.phase == "transfer"
                        and self._total is not None and self.done >= self._total)
            if finished:
                self.phase = self._finishing or "transfer"
        if self._progress is not None:
            self._progress.advance(self._task, n)
            if finished:
                # Every byte is there; what follows (the commit marker, a
                # rename) is its own step, not a bar stuck at 100 %.
                self._progress.update(self._task,
                                      description=f"{self._description}: {self.phase}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
