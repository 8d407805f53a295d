"""The error hierarchy: one root, one class per thing a caller can act on.

Every error raised on purpose by checkpoint-store derives from
:class:`CheckpointStoreError`. Where the natural Python error type also fits
(a bad argument is a ``ValueError``, a missing path a ``FileNotFoundError``),
the class derives from both so that existing ``except`` clauses keep working.
The one exception that is not an error, :class:`TrialStopped`, lives here too
so that every exception checkpoint-store raises has one home; it derives from
``BaseException`` on purpose (see its docstring).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AmbiguousCommitError",
    "AmbiguousMetricError",
    "BackendUnavailableError",
    "CheckpointAbortedError",
    "CheckpointConflictError",
    "TrialInUseError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "CheckpointStoreError",
    "CredentialsExpiredError",
    "FormatConversionError",
    "InvalidConfigError",
    "MetadataError",
    "NestedCheckpointError",
    "PermanentBackendError",
    "PersistProcessError",
    "Preempted",
    "RankTimeoutError",
    "StateKeyError",
    "StateMismatchError",
    "SourceChangedError",
    "SourceDeletedError",
    "StorageFullError",
    "TensorCorruptError",
    "TransientBackendError",
    "TrialStopped",
    "UnknownSchemeError",
    "UnreadableSourceError",
    "UnsafePathError",
    "UnsupportedStateError",
]


class CheckpointStoreError(Exception):
    """Root of every error raised by checkpoint-store on purpose."""


class InvalidConfigError(CheckpointStoreError, ValueError):
    """An argument or configuration value is not valid. Nothing was written."""


class AmbiguousMetricError(InvalidConfigError, LookupError):
    """Two different values are reachable under one metric name once the metrics are
    flattened with ``/`` (``"a/b/c"`` in ``{"a": {"b/c": 1}, "a/b": {"c": 2}}``).
    Rename one of them."""


class MetricMismatchError(InvalidConfigError):
    """Trials (or a trial and a caller) name different metrics or orders to rank
    by, so "the best" has no single meaning: pass ``metric=`` and ``mode=``
    (``--metric`` and ``--mode`` on the command line) to choose one."""


class MetadataError(InvalidConfigError, TypeError):
    """Metadata or metrics are not a JSON object of serialisable values.

    The message names the offending key. Nothing was written.
    """


class UnknownSchemeError(InvalidConfigError):
    """A URI names a scheme that no backend, plugin or fsspec knows.

    The message lists the registered schemes.
    """


class BackendUnavailableError(CheckpointStoreError, ImportError):
    """A known scheme whose plugin distribution is not installed.

    The message names the distribution to ``pip install``.
    """


class CheckpointNotFoundError(CheckpointStoreError, FileNotFoundError):
    """The path does not exist, or is not a committed checkpoint."""


class CheckpointCorruptError(CheckpointStoreError):
    """A committed checkpoint's data does not match its manifest.

    Attributes:
        path: the checkpoint path (within its filesystem).
        file: the relative path of the first file that failed, or None.
    """

    def __init__(self, message: str, *, path: str | None = None, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class UnsafePathError(CheckpointCorruptError, InvalidConfigError):
    """A file in a source or target tree cannot be copied to its place: its
    name holds ``..``, is absolute, holds a backslash or NUL, is not UTF-8 or
    too long; or a symlink leads out of the checkpoint or loops back into
    itself; or the target lies inside the checkpoint being read.

    Raised before the first byte is written; the source is unchanged.
    ``.file`` names the entry at fault (relative to ``.path``).
    """


class UnreadableSourceError(CheckpointStoreError, OSError):
    """A directory of a source tree cannot be listed (permission denied, or
    another error of the local disk): the checkpoint would silently miss its
    files. Make it readable, or move it out of the source, and try again.

    Raised while the source is walked, before the first byte is written.

    Attributes:
        path: the source directory handed in.
        file: the entry at fault, relative to ``path`` (``""``: ``path`` itself).
    """

    def __init__(self, message: str, *, path: str | None = None, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class SourceChangedError(CheckpointStoreError, OSError):
    """A file of a source tree changed while it was copied: deleted, grown,
    shrunk or rewritten after the listing; or it reads other bytes than its
    size says (a link to a pseudo file: ``/proc/self/status`` stats 0 bytes
    and reads a page, a ``/sys`` file stats 4096 and reads a line). Its
    copy would not be the file it names: nothing of the checkpoint is
    committed.

    Write the checkpoint completely before reporting it (wait for the
    writer, ``dcp.save`` or a background thread, to finish); copy a pseudo
    file's contents into a regular file first.

    Attributes:
        path: the source directory handed in.
        file: the file at fault, relative to ``path``.
    """

    def __init__(self, message: str, *, path: str | None = None, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class SourceDeletedError(SourceChangedError, FileNotFoundError):
    """A file of a source tree was deleted while it was copied: a
    :class:`SourceChangedError` that is also a ``FileNotFoundError``, as the
    OS's error it replaces was. Keep the directory until the report (or
    copy) returns; nothing of the checkpoint is committed."""


class NestedCheckpointError(UnsafePathError):
    """A write destination (a ``storage_path``'s trial directory, a Lightning
    ``.ckpt``, an upload or copy target, a DCP checkpoint directory) lies
    inside a committed checkpoint: files written there would corrupt it (its
    manifest does not list them). Choose a destination outside every
    committed checkpoint.

    Raised before the first byte is written. ``.path`` is the committed
    checkpoint, ``.file`` the destination relative to it.
    """


class CheckpointConflictError(CheckpointStoreError):
    """Another writer holds, or already committed, what this call wanted to write."""


class TrialInUseError(CheckpointConflictError):
    """A live checkpoint manager (a running job) manages the trial: wait for it
    to end or stop it. Raised by the lease (docs/retention.md) and by the
    CLI's deleting commands, before anything is written or deleted."""


class TransientBackendError(CheckpointStoreError, OSError):
    """A backend error worth retrying (connection reset, timeout, 5xx, throttling)."""


class StorageUnreachableError(TransientBackendError):
    """No connection to the storage's endpoint could be opened: the connection
    was refused, or the host name does not resolve. The usual cause is a wrong
    address (a typo in ``endpoint_url``, a port, a connection string) or a
    server that is not running; it is not throttling, so it is raised after
    at most two quick tries, and later calls to the same store fail at once
    for a while (see ``checkpoint_store._util.retry``).

    Attributes:
        endpoint: the address that refused, as the client named it (None
            when the client did not say).
    """

    def __init__(self, message: str, *, endpoint: str | None = None):
        super().__init__(message)
        self.endpoint = endpoint


class AmbiguousCommitError(TransientBackendError):
    """Storage failed at the commit itself (the marker's write, or reading it
    back to settle whether that write landed), so the checkpoint may be
    committed.

    A session never reuses that index: its next report takes the next free
    one and first settles this one (registered with retention if our marker
    is there, left for cleanup otherwise). Any other error of a report means
    nothing was committed.

    Attributes:
        path: the checkpoint directory's URI.
    """

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


class PermanentBackendError(CheckpointStoreError, OSError):
    """A storage error that retrying will not fix (access denied, missing bucket,
    expired credentials that could not be refreshed). Raised at once, never retried.

    Attributes:
        cause: the backend's original exception.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class StorageFullError(PermanentBackendError):
    """The destination's disk is full, or its quota used up (``ENOSPC``,
    ``EDQUOT``). Free space there (or raise the quota) and try again; what was
    written of the failed checkpoint is never committed."""


class CredentialsExpiredError(PermanentBackendError):
    """The storage credentials expired and rebuilding the filesystem from its
    backend factory (once) did not help. Refresh the credentials and retry."""


class RankTimeoutError(CheckpointStoreError, TimeoutError):
    """A multi-rank wait ran out of time: some ranks never wrote their part.

    Raise ``sync_timeout_s`` in :func:`checkpoint_store.session.start` if the
    ranks are only slow; otherwise look at the missing ranks' logs.

    Attributes:
        missing_ranks: the ranks that had not finished, sorted.
        index: the checkpoint index waited for, or None for the run start.
    """

    def __init__(self, message: str, *, missing_ranks: list[int], index: int | None = None):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)
        self.index = index


class CheckpointAbortedError(CheckpointStoreError):
    """A multi-rank checkpoint was not committed because some rank failed.

    Raised on the ranks that did not fail themselves (a failing rank raises
    its own error). Nothing of that index is committed; the next report with
    a checkpoint uses the next index.

    Attributes:
        index: the checkpoint index that was abandoned.
        failed_ranks: the ranks that reported a failure, sorted.
    """

    def __init__(self, message: str, *, index: int, failed_ranks: list[int]):
        super().__init__(message)
        self.index = index
        self.failed_ranks = list(failed_ranks)


class UnsupportedStateError(InvalidConfigError, TypeError):
    """A state tree (``Checkpoint.from_state``, ``session.report(state=...)``)
    holds something the state format cannot store: a dict key that is
    neither a string nor an int, two keys of one dict that flatten alike, a
    leaf that is neither a tensor nor a JSON value (a set, bytes, an object),
    a dtype safetensors has no name for, a cycle, or two tensors that share
    an element of memory without being the same view (docs/state.md; views
    of one storage that share no element are stored each). Raised before
    the first byte is written.

    Attributes:
        key: the flattened key of the entry at fault (``"model/layers/0"``;
            ``""``: the root).
    """

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


class FormatConversionError(InvalidConfigError):
    """A checkpoint cannot be written in the asked format as it is
    (:mod:`checkpoint_store.formats`): two tensors' names collide once mapped,
    two tensors share storage and the format would not keep that, a value
    the format cannot hold, or no tensor under the chosen prefix. Checked
    before the first write: nothing was written.

    Attributes:
        key: the state key (or the format's name) that failed, or None.
    """

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


class StateKeyError(InvalidConfigError, KeyError):
    """``Checkpoint.load_state(keys=..., into=...)`` names a key the saved
    state does not hold: a name or glob of ``keys`` that matches nothing, or
    an entry of ``into`` with no saved counterpart. Nothing was read.

    Attributes:
        key: the name, glob or flattened key at fault.
    """

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class StateMismatchError(InvalidConfigError, TypeError):
    """A tensor of ``into`` (``Checkpoint.load_state(into=...)``) cannot take
    the saved one in place: another dtype or shape, the saved entry is not
    a tensor, or the target cannot be written (a read-only numpy array, a
    tensor whose elements share memory, as ``expand`` makes); or two
    targets share memory without being the same view (``t[0:2]`` and
    ``t[1:3]``), or are one tensor under keys of different saved values.
    Raised before any tensor of ``into`` is changed.

    Attributes:
        key: the flattened key at fault.
        expected: what the saved state holds there (``"F32 [4, 3]"``).
        found: what ``into`` holds there.
    """

    def __init__(self, message: str, *, key: str, expected: str, found: str):
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.found = found


class TensorCorruptError(CheckpointCorruptError):
    """One tensor's bytes do not match the CRC32C its checkpoint's tensor index
    records: the file is damaged there. Resume from an earlier checkpoint.

    Attributes:
        path: the checkpoint path; file: the safetensors file (relative to it).
        tensor: the flattened key of the tensor whose checksum failed.
    """

    def __init__(self, message: str, *, path: str | None = None, file: str | None = None,
                 tensor: str | None = None):
        super().__init__(message, path=path, file=file)
        self.tensor = tensor


class PersistProcessError(CheckpointStoreError):
    """The process that writes staged state (``report(state=...)``) died or
    failed: the checkpoint it was writing was not committed. Raised by the
    next ``report()``, ``wait()`` or the end of the session; the next state
    report starts a new persist process."""


class TrialStopped(BaseException):
    """Raised inside ``train_fn`` by ``report()`` when its trial was stopped or paused.

    It derives from ``BaseException`` (like ``KeyboardInterrupt``) so that an
    ``except Exception:`` in user code does not swallow it: the function
    unwinds, its ``finally`` blocks run, and the trial runner ends the thread
    quietly. Do not catch it.

    Attributes:
        status: ``"pruned"`` or ``"stopped"`` when the driver gave a reason
            (:meth:`TrialRunner.stop`), recorded in the trial's ``stopped.json``
            so pages and listings tell an early stop from a finished run; None
            for a pause or a stop without a reason.
        reason: the driver's one line, or None.
    """

    def __init__(self, reason: str | None = None, status: str | None = None) -> None:
        super().__init__(*(() if reason is None else (reason,)))
        self.reason = reason
        self.status = status if reason is not None else None


class Preempted(TrialStopped, SystemExit):
    """Raised by ``report()`` after a preemption signal, once the preemption
    checkpoint is committed and the session has ended (see
    ``session.start(preemption=PreemptionConfig(...))`` and docs/preemption.md).

    A :class:`TrialStopped` (a trial runner ends the trial as ``preempted``,
    resumable) and a ``SystemExit``: a script that lets it propagate exits
    quietly with :attr:`code`, the status the scheduler expects (``128 +
    signal`` by default, 143 for SIGTERM). ``except Exception`` does not
    catch it.

    Attributes:
        code: the exit status (``PreemptionConfig.exit_code``).
        signal: the signal's name, e.g. ``"SIGTERM"``.
        status: ``"preempted"`` (recorded in the trial's ``stopped.json``).
        reason: one line, e.g. ``"SIGTERM received at 2026-12-05T06:30:00Z"``.
    """

    def __init__(self, reason: str = "preempted", *, code: int = 143,
                 signal: str = "SIGTERM") -> None:
        TrialStopped.__init__(self, reason, "preempted")
        self.code = code
        self.signal = signal

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_preempted, (self.reason, self.code, self.signal))


def _rebuild_preempted(reason: str, code: int, signal: str) -> Preempted:
    return Preempted(reason, code=code, signal=signal)
