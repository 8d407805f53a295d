"""Level 1 of :mod:`checkpoint_store.integrations.ray`: our backends as Ray's filesystem.

Owns :class:`CheckpointStoreHandler` (a ``pyarrow.fs.FileSystemHandler`` over a
checkpoint-store backend), its pickling (configuration only, never a
credential: :func:`_split_secrets`, :func:`_restore_handler`),
:func:`ray_filesystem`, :func:`backend_of` and :func:`as_checkpoint`.
Imports pyarrow only, never Ray. Import the public names from
:mod:`checkpoint_store.integrations.ray`.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store import registry
from checkpoint_store._commit.commit import delete_checkpoint_dir
from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import CheckpointNotFoundError, InvalidConfigError

__all__ = [
    "CheckpointStoreHandler",
    "as_checkpoint",
    "backend_of",
    "committed_checkpoint",
    "ray_filesystem",
]


# Option names that carry a credential (any backend's spelling): never pickled.
_SECRET_RE = re.compile(
    r"(secret|key|token|passw|credential|connection_string|(^|_)sas|signature|authorization)",
    re.IGNORECASE,
)
# Values that name how to authenticate rather than carry a credential: gcsfs's
# ``token="anon"`` (no credentials: public buckets, the emulator) and its
# other lookup methods. Under a credential-looking name they still travel, or
# workers would fall back to default credentials. Any other value (a key
# file's path included: it is this machine's, and a str under such a name may
# as well be the token itself) is kept back.
_AUTH_METHODS = frozenset({"anon", "google_default", "cloud", "cache", "browser"})
# Credentials given in this process, by handler token, so that a handler
# unpickled in the same process (Ray copies its filesystem around) keeps them.
# Other processes read the backend's usual environment variables instead.
_SECRETS: dict[str, dict[str, Any]] = {}
_SECRETS_LOCK = threading.Lock()


def _split_secrets(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    public: dict[str, Any] = {}
    secret: dict[str, Any] = {}
    for k, v in options.items():
        if not isinstance(k, str):
            raise InvalidConfigError(f"storage option names must be strings, got {k!r}")
        (secret if _is_secret(k, v) else public)[k] = v
    return public, secret


def _is_secret(key: str, value: Any) -> bool:
    """Whether option ``key=value`` holds a credential (kept out of pickles)."""
    if not _SECRET_RE.search(key):
        return False
    return not (
        value is None
        or isinstance(value, bool)
        or (isinstance(value, str) and value in _AUTH_METHODS)
    )


def _picklable_option(key: str, value: Any) -> None:
    if value is None or isinstance(value, (str, int, float, bool)):
        return
    if isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (str, int, float, bool)) for v in value
    ):
        return
    raise InvalidConfigError(
        f"storage option {key!r} must be a str, number, bool or a list of them to travel to "
        f"Ray workers, got {type(value).__name__}"
    )


class CheckpointStoreHandler(pafs.FileSystemHandler):
    """A ``pyarrow.fs.FileSystemHandler`` over a checkpoint-store backend.

    Build it with :func:`ray_filesystem`. Every method forwards to the
    backend's filesystem through :func:`checkpoint_store._util.retry.call_fs`:
    transient errors are retried per ``retry``, expired credentials rebuild
    the filesystem once. A stream is retried when it is opened; bytes
    already streamed are not replayed (Ray's own upload retry covers that).

    Differences from a plain pyarrow filesystem, on purpose:

    * ``create_dir`` is a no-op on object stores (no zero-byte directory
      markers; Ray writes the files into place anyway).
    * A non-recursive listing returns one level, whatever the backend does
      (adlfs walking the whole tree broke ``Tuner.restore``: Ray #41125,
      #40484).
    * ``delete_dir`` of a committed checkpoint is the commit in reverse
      (docs/format.md): the marker goes first, so a delete cut short never
      leaves a directory that still lists as committed.

    Pickling keeps the configuration only: the URI, the storage options
    whose names do not look like credentials (no ``key``, ``secret``,
    ``token``, ``password``, ``credential``, ``connection_string``, ``sas``
    ...) unless their value is None, a bool or one of gcsfs's authentication
    methods (``token="anon"``, ``"google_default"``, ``"cloud"``, ``"cache"``,
    ``"browser"``: configuration, not a secret), the retry policy and, for a
    scheme registered in code by dotted path, that path. No client and no
    credential is in the bytes. In the process that built it, an unpickled
    copy reuses the credentials given;
    elsewhere (Ray workers) the backend reads its usual environment
    variables (``AWS_*``, ``AZURE_STORAGE_*`` ...; pass them with
    ``runtime_env={"env_vars": ...}`` or use instance credentials). Two
    handlers are equal when their configuration is, which is what Ray checks
    between a returned checkpoint's filesystem and its own.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        _token: str | None = None,
        _factory: str | None = None,
    ):
        # Absolute before it is pickled: a worker resolves it in its own directory.
        uri = registry.local_location(uri)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidConfigError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        public, secret = _split_secrets(dict(storage_options or {}))
        for k, v in public.items():
            _picklable_option(k, v)
        self.uri = uri
        self.scheme = registry.split_scheme(uri) or "file"
        self._public = public
        self._retry = retry or RetryPolicy.from_env()
        self._token = _token or uuid.uuid4().hex
        if _factory is None:
            entry = registry._code_registered.get(self.scheme)
            _factory = entry if isinstance(entry, str) else None
        self._factory = _factory
        if secret:
            with _SECRETS_LOCK:
                _SECRETS[self._token] = secret
        self._backend: Backend | None = None
        self._path: str | None = None
        self._lock = threading.Lock()

    # -- configuration, pickling, equality ------------------------------------------

    @property
    def _identity(self) -> tuple[Any, ...]:
        return (
            self.uri,
            tuple(sorted((k, repr(v)) for k, v in self._public.items())),
            self._factory,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        r = self._retry
        return (
            _restore_handler,
            (
                self.uri,
                dict(self._public),
                (r.attempts, r.base_delay, r.max_delay),
                self._token,
                self._factory,
            ),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointStoreHandler):
            return NotImplemented
        return self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __repr__(self) -> str:
        return f"CheckpointStoreHandler({self.uri!r}, options={sorted(self._public)})"

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    @property
    def backend(self) -> Backend:
        """The checkpoint-store backend, built on first use in each process.

        Raises:
            UnknownSchemeError, BackendUnavailableError, InvalidConfigError:
                as :func:`checkpoint_store.registry.resolve`.
        """
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._build()
        assert self._backend is not None
        return self._backend

    @property
    def checkpoint_store_backend(self) -> Backend:
        """The same as :attr:`backend`: lets ``session.start(storage_filesystem=fs)``
        and every other caller of :func:`checkpoint_store.registry.backend_for_filesystem`
        use this backend's real capabilities."""
        return self.backend

    @property
    def root(self) -> str:
        """The path of ``uri`` inside the backend's filesystem."""
        self.backend  # noqa: B018 - builds it
        assert self._path is not None
        return self._path

    def _build(self) -> None:
        if self._factory is not None and self.scheme not in registry.available_backends():
            registry.register_backend(self.scheme, self._factory)
        with _SECRETS_LOCK:
            secret = dict(_SECRETS.get(self._token, {}))
        self._backend, self._path = registry.resolve(
            self.uri, storage_options={**self._public, **secret} or None
        )

    def _call(self, fn: Callable[[pafs.FileSystem], Any], what: str) -> Any:
        return _retry.call_fs(self.backend, fn, policy=self._retry, what=what)

    # -- FileSystemHandler ----------------------------------------------------------

    def get_type_name(self) -> str:
        return f"checkpoint_store+{self.scheme}"

    def normalize_path(self, path: str) -> str:
        return self.backend.filesystem.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self._call(lambda fs: fs.get_file_info(paths), f"stat {paths[:1]}")

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        infos = self._call(lambda fs: fs.get_file_info(selector), f"list {selector.base_dir}")
        if selector.recursive:
            return infos
        base = selector.base_dir.rstrip("/")
        # One level, even where a backend returned the whole subtree.
        return [fi for fi in infos if "/" not in _fsutil.relative(base, fi.path.rstrip("/"))]

    def create_dir(self, path: str, recursive: bool) -> None:
        if self.backend.capabilities.directories:
            self._call(lambda fs: fs.create_dir(path, recursive=recursive), f"mkdir {path}")

    def delete_dir(self, path: str) -> None:
        backend = self.backend
        path = path.rstrip("/")
        # Every committed checkpoint at or under ``path`` is uncommitted first
        # (one recursive listing finds their markers), so a delete cut short
        # never leaves a directory that still lists as committed.
        checkpoints = sorted(
            posixpath.dirname(fi.path)
            for fi in _fsutil.list_tree(backend.filesystem, path, retry=self._retry)
            if posixpath.basename(fi.path) == INTERNAL_METADATA and fi.type == pafs.FileType.File
        )
        for ckpt in checkpoints:
            _retry.with_rebuild(
                backend,
                functools.partial(
                    delete_checkpoint_dir,
                    backend,
                    ckpt,
                    writer_id=new_writer_id(),
                    retry=self._retry,
                ),
                what=f"delete {ckpt}",
            )
        if path not in checkpoints:
            self._call(lambda fs: fs.delete_dir(path), f"delete {path}")

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        sel = pafs.FileSelector(path, allow_not_found=missing_dir_ok, recursive=False)
        for fi in self.get_file_info_selector(sel):
            if fi.type == pafs.FileType.Directory:
                self.delete_dir(fi.path)
            else:
                self.delete_file(fi.path)

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to delete every bucket or container of an account")

    def delete_file(self, path: str) -> None:
        self._call(lambda fs: fs.delete_file(path), f"delete {path}")

    def move(self, src: str, dest: str) -> None:
        self._call(lambda fs: fs.move(src, dest), f"rename {src} to {dest}")

    def copy_file(self, src: str, dest: str) -> None:
        self._call(lambda fs: fs.copy_file(src, dest), f"copy {src} to {dest}")

    def open_input_stream(self, path: str) -> Any:
        return self._call(lambda fs: fs.open_input_stream(path), f"read {path}")

    def open_input_file(self, path: str) -> Any:
        return self._call(lambda fs: fs.open_input_file(path), f"read {path}")

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self._call(
            lambda fs: fs.open_output_stream(path, metadata=metadata), f"write {path}"
        )

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self._call(
            lambda fs: fs.open_append_stream(path, metadata=metadata), f"append {path}"
        )


def _restore_handler(
    uri: str,
    public: dict[str, Any],
    retry: tuple[int, float, float],
    token: str,
    factory: str | None,
) -> CheckpointStoreHandler:
    attempts, base_delay, max_delay = retry
    return CheckpointStoreHandler(
        uri,
        public,
        retry=RetryPolicy(attempts, base_delay, max_delay),
        _token=token,
        _factory=factory,
    )


def ray_filesystem(
    uri: str | os.PathLike[str], *, retry: RetryPolicy | None = None, **storage_options: Any
) -> tuple[pafs.PyFileSystem, str]:
    """Our backend for ``uri`` as a filesystem Ray can use.

    Args:
        uri: a storage URI (``s3://bucket/prefix``, ``az://container/prefix``,
            ``gs://...``, ``file:///abs/path``, or a plugin's scheme) or a
            local path (str or PathLike; ``~`` expanded, a relative path made
            absolute here, as Ray's own ``storage_path`` takes it).
        retry: retry policy for every storage call (default
            :meth:`RetryPolicy.from_env`).
        **storage_options: the backend's options (endpoint, engine,
            credentials ...). Credentials are never pickled: Ray workers in
            other processes read them from their environment (see
            :class:`CheckpointStoreHandler`).

    Returns:
        ``(filesystem, path)``: pass them as
        ``RunConfig(storage_path=path, storage_filesystem=filesystem)`` or
        ``Tuner.restore(path, ..., storage_filesystem=filesystem)``.

    Raises:
        InvalidConfigError: an empty location or a malformed URI
            (``s3:/bucket``), or an option that cannot travel to workers
            (not a str, number, bool or list of them).
        UnknownSchemeError, BackendUnavailableError: as for any URI.
    """
    handler = CheckpointStoreHandler(uri, storage_options, retry=retry)
    return pafs.PyFileSystem(handler), handler.root


def backend_of(filesystem: pafs.FileSystem) -> tuple[Backend, RetryPolicy | None]:
    """The backend behind a filesystem Ray hands over, and its retry policy.

    Our handler gives its own backend (real capabilities, retries); any
    other filesystem is described as :func:`checkpoint_store.registry.backend_for_filesystem`
    does.
    """
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(
        filesystem.handler, CheckpointStoreHandler
    ):
        return filesystem.handler.backend, filesystem.handler.retry
    return registry.backend_for_filesystem(filesystem), None


def as_checkpoint(ray_checkpoint: Any) -> Checkpoint:
    """A Ray checkpoint (``ray.train.Checkpoint``, ``ray.tune.Checkpoint``,
    ``Result.checkpoint``) as ours: the same directory, read through our
    backend (``verify()``, ``internal_metadata``, verified downloads)."""
    backend, _ = backend_of(ray_checkpoint.filesystem)
    return Checkpoint._from_backend(backend, ray_checkpoint.path)


def committed_checkpoint(ray_checkpoint: Any) -> Checkpoint:
    """The checkpoint to resume from when Ray hands ``ray_checkpoint`` back
    (``ray.train.get_checkpoint()``, ``ray.tune.get_checkpoint()``,
    ``Result.checkpoint``): it as ours when it is committed, else the newest
    committed checkpoint (highest index, then latest commit) beside it, with
    a ``RuntimeWarning`` naming both.

    Ray Train registers a reported checkpoint (its latest, written to the
    run's ``checkpoint_manager_snapshot.json``, and older ones beyond
    ``num_to_keep`` deleted) before ``CommitCallback`` writes its commit
    marker. A controller that dies in between, or a commit that was refused
    (a rank's upload failed, two ranks wrote one file), leaves Ray's latest
    checkpoint uncommitted: possibly incomplete, never to be loaded.

    Raises:
        CheckpointNotFoundError: ``ray_checkpoint`` is not committed and no
            committed checkpoint is beside it (with ``num_to_keep=1`` Ray
            deleted the previous one when it registered this one).
    """
    ours = as_checkpoint(ray_checkpoint)
    if ours.is_committed:
        return ours
    backend, retry = backend_of(ray_checkpoint.filesystem)
    path = ray_checkpoint.path.rstrip("/")
    parent = posixpath.dirname(path)
    best: tuple[int, float, str] | None = None
    for fi in _fsutil.list_dir(backend.filesystem, parent, retry=retry):
        if fi.type != pafs.FileType.Directory or fi.path.rstrip("/") == path:
            continue
        meta = read_internal_metadata(backend.filesystem, fi.path, retry=retry)
        if meta is not None:
            key = (int(meta["index"]), float(meta.get("created_at", 0.0)), fi.path)
            best = key if best is None or key > best else best
    if best is None:
        raise CheckpointNotFoundError(
            f"Ray restored {ours.uri}, which is not a committed checkpoint (no commit "
            "marker: Ray registered it before CommitCallback committed it, and the commit "
            "never happened or was refused; or the RunConfig has no CommitCallback), and "
            f"{backend.uri_for(parent)} holds no "
            "committed checkpoint to resume from instead. Start the run afresh (a new "
            "RunConfig(name)), or keep more than one checkpoint (CheckpointConfig(num_to_keep=2))"
        )
    chosen = Checkpoint._from_backend(backend, best[2])
    warnings.warn(
        f"Ray restored {ours.uri}, which is not a committed checkpoint (Ray registered it "
        "before CommitCallback committed it, and the commit never happened or was "
        f"refused); resuming from {chosen.uri}, the newest committed one beside it, instead",
        RuntimeWarning,
        stacklevel=2,
    )
    return chosen
