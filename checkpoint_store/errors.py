"""The error hierarchy: one root, one class per thing a caller can act on.

Every error raised on purpose by checkpoint-store derives from
:class:`CheckpointStoreError`. Where the natural Python error type also fits
(a bad argument is a ``ValueError``, a missing path a ``FileNotFoundError``),
the class derives from both so that existing ``except`` clauses keep working.
"""

from __future__ import annotations


class CheckpointStoreError(Exception):
    """Root of every error raised by checkpoint-store on purpose."""


class InvalidConfigError(CheckpointStoreError, ValueError):
    """An argument or configuration value is not valid. Nothing was written."""


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


class CheckpointConflictError(CheckpointStoreError):
    """Another writer holds, or already committed, what this call wanted to write."""


class TransientBackendError(CheckpointStoreError, OSError):
    """A backend error worth retrying (connection reset, timeout, 5xx, throttling)."""


class PermanentBackendError(CheckpointStoreError, OSError):
    """A storage error that retrying will not fix (access denied, missing bucket,
    expired credentials that could not be refreshed). Raised at once, never retried.

    Attributes:
        cause: the backend's original exception.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class CredentialsExpiredError(PermanentBackendError):
    """The storage credentials expired and rebuilding the filesystem from its
    backend factory (once) did not help. Refresh the credentials and retry."""
