"""Ray Train and Ray Tune keep their checkpoints through checkpoint-store.

Three levels, each usable alone (docs/integrations/ray.md):

1. **Our backends as Ray's filesystem.** :func:`ray_filesystem` returns
   ``(pyarrow.fs.PyFileSystem(handler), path)`` for
   ``RunConfig(storage_path=path, storage_filesystem=fs)`` and
   ``Tuner.restore(..., storage_filesystem=fs)``. Every storage call Ray
   makes goes through :class:`CheckpointStoreHandler`: our backend (Azure
   without hand wrapping, any plugin), its retries and credential rebuilds,
   one-level listings, and marker-first deletes of committed checkpoints.
2. **Committed checkpoints from Ray Train.** :func:`upload_fn` for
   ``ray.train.report(..., checkpoint_upload_fn=upload_fn())``: each worker
   uploads its files with our transfer (parallel, CRC32C on the fly) into
   the directory Ray names and writes its rank marker.
   :class:`CommitCallback` (``RunConfig(callbacks=[CommitCallback()])``)
   writes ``.internal_metadata.json`` last once Ray has every rank's report.
3. **Our session under Ray.** Inside a Ray Train worker or a Ray Tune
   function trainable, with no checkpoint-store session started there,
   ``checkpoint_store.session.report()`` and ``get_checkpoint()`` forward to
   Ray (:func:`active_session`), so a function written for
   :class:`~checkpoint_store.TrialRunner` runs unchanged in a ``Tuner`` or a
   ``TorchTrainer``.

Retention belongs to Ray here (``CheckpointConfig(num_to_keep=...)`` of
Ray's ``RunConfig``): we commit, index and verify, never evict. Ray's
deletes reach storage through the handler, which removes the commit marker
first. Requires ``pip install 'checkpoint-store[ray]'`` (Ray 2.60); importing
this module does not import Ray, only the Ray-facing calls do.
"""

from __future__ import annotations

import functools
import logging
import posixpath
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store import _fsutil, _json, _retry, registry
from checkpoint_store._commit import delete_checkpoint_dir, protocol_for
from checkpoint_store._layout import (
    INTERNAL_METADATA,
    USER_METADATA,
    checkpoint_dir_name,
    is_internal_file,
    parse_rank_marker_name,
    rank_marker_name,
)
from checkpoint_store._manifest import read_internal_metadata
from checkpoint_store._retry import RetryPolicy
from checkpoint_store._runs import new_writer_id
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError
from checkpoint_store.transfer import copy_tree

__all__ = [
    "CheckpointStoreHandler",
    "CommitCallback",  # noqa: F822 - built on first use, see __getattr__
    "active_session",
    "as_checkpoint",
    "backend_of",
    "ray_filesystem",
    "upload_fn",
]

logger = logging.getLogger(__name__)

# -- level 1: the filesystem -------------------------------------------------------

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
    backend's filesystem through :func:`checkpoint_store._retry.call_fs`:
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
        uri: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        _token: str | None = None,
        _factory: str | None = None,
    ):
        if not isinstance(uri, str) or registry.split_scheme(uri) is None:
            raise InvalidConfigError(
                f"ray_filesystem needs a URI with a scheme (s3://, az://, gs://, file:// ...), "
                f"got {uri!r}"
            )
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
                    delete_checkpoint_dir, backend, ckpt, writer_id=new_writer_id(),
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
    uri: str, *, retry: RetryPolicy | None = None, **storage_options: Any
) -> tuple[pafs.PyFileSystem, str]:
    """Our backend for ``uri`` as a filesystem Ray can use.

    Args:
        uri: a storage URI with a scheme (``s3://bucket/prefix``,
            ``az://container/prefix``, ``gs://...``, ``file:///abs/path``,
            or a plugin's scheme).
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
        InvalidConfigError: no scheme, or an option that cannot travel to
            workers (not a str, number, bool or list of them).
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


# -- level 2: committed checkpoints from Ray Train --------------------------------

def upload_fn() -> Callable[[Any, str], Any]:
    """The ``checkpoint_upload_fn`` for ``ray.train.report`` (Ray Train workers).

    Each worker copies its checkpoint's files with our transfer (parallel,
    CRC32C computed on the bytes in flight, retried per file) into the
    directory Ray names, on Ray's storage filesystem, then writes its rank
    marker ``.cs_rank-<rank>.json`` listing them. Rank 0 alone contributes
    ``.user_metadata.json``. :class:`CommitCallback` commits the directory
    once Ray has every rank's report; without it nothing is committed.

    Returns:
        ``fn(checkpoint, checkpoint_dir_name) -> ray.train.Checkpoint`` on
        Ray's filesystem object (Ray compares it with its own).

    Raises (from the returned function):
        CheckpointNotFoundError: the local checkpoint directory is gone.
        TransientBackendError, PermanentBackendError: storage failed; the
            rank's marker then records the failure, and the checkpoint is
            never committed (Ray fails the worker and, with
            ``FailureConfig(max_failures=...)``, resumes from the previous one).
    """

    def _upload(checkpoint: Any, checkpoint_dir_name: str) -> Any:
        import ray.train

        ctx = ray.train.get_context()
        storage = ctx.get_storage()
        fs = storage.storage_filesystem
        dest = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
        _upload_rank(checkpoint.filesystem, checkpoint.path, fs, dest, ctx.get_world_rank())
        return ray.train.Checkpoint(path=dest, filesystem=fs)

    return _upload


def _upload_rank(
    src_fs: pafs.FileSystem, src: str, fs: pafs.FileSystem, dest: str, rank: int
) -> list[dict[str, Any]]:
    """One rank's share: files, then its marker (also when the copy failed)."""
    backend, retry = backend_of(fs)

    def include(rel: str) -> bool:
        return not is_internal_file(rel) and (rank == 0 or rel != USER_METADATA)

    files: list[dict[str, Any]] = []
    error: BaseException | None = None
    try:
        entries = copy_tree(
            src_fs,
            src,
            backend.filesystem,
            dest,
            backend.capabilities,
            include=include,
            retry=retry,
        )
        files = [e.to_json() for e in entries]
    except Exception as exc:
        error = exc
    marker = {
        "rank": rank,
        "ok": error is None,
        "files": files,
        "time": time.time(),
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    _fsutil.write_bytes(
        backend.filesystem,
        posixpath.join(dest, rank_marker_name(rank)),
        _json.dumps(marker),
        backend.capabilities,
        retry=retry,
    )
    if error is not None:
        raise error
    return files


def _commit_from_markers(
    backend: Backend,
    path: str,
    internal: dict[str, Any],
    world_size: int,
    retry: RetryPolicy | None,
) -> dict[str, Any] | None:
    """Commit ``path`` from its rank markers; None (and a warning) when a rank failed.

    Every marker present must report success and no path may come from two
    ranks. The markers are deleted after the commit marker is written.
    """
    from checkpoint_store.session._multirank import merge_rank_files

    fs = backend.filesystem
    markers: dict[int, dict[str, Any]] = {}
    for fi in _fsutil.list_dir(fs, path, retry=retry):
        rank = parse_rank_marker_name(posixpath.basename(fi.path))
        if rank is not None and fi.type == pafs.FileType.File:
            body = _json.loads(_fsutil.read_bytes(fs, fi.path, retry=retry))
            markers[rank] = body if isinstance(body, dict) else {"ok": False}
    where = backend.uri_for(path)
    failed = {r: b.get("error") for r, b in markers.items() if not b.get("ok")}
    if not markers or failed:
        logger.warning(
            "%s is not committed: %s",
            where,
            f"ranks failed: {failed}" if failed else "no rank uploaded with upload_fn()",
        )
        return None
    merged = merge_rank_files(markers)
    if merged.clash is not None:
        logger.warning("%s is not committed: ranks %d and %d both wrote %r", where, *merged.clash)
        return None
    meta = dict(internal)
    meta["world_size"] = world_size
    meta["ranks"] = merged.ranks
    protocol = protocol_for(backend, retry=retry)
    written = _retry.with_rebuild(
        backend, lambda: protocol.finalize(path, path, meta, merged.manifest),
        what=f"commit {where}",
    )
    for r in markers:
        try:
            _fsutil.delete_file(fs, posixpath.join(path, rank_marker_name(r)), retry=retry)
        except OSError:
            pass  # an internal file: a leftover changes nothing
    return written


def _remove_failed(
    backend: Backend, parent: str, before: float, retry: RetryPolicy | None
) -> list[str]:
    """Delete the uncommitted directories under ``parent`` where a rank recorded a
    failed upload before ``before`` (the time Ray saw a worker fail, after which
    it replaced every worker, so nobody writes there any more). Returns their paths."""
    fs = backend.filesystem
    removed = []
    for fi in _fsutil.list_dir(fs, parent, retry=retry):
        if fi.type != pafs.FileType.Directory:
            continue
        names = {
            posixpath.basename(e.path): e.path for e in _fsutil.list_tree(fs, fi.path, retry=retry)
        }
        if INTERNAL_METADATA in names:
            continue
        for name, full in names.items():
            if parse_rank_marker_name(name) is None:
                continue
            body = _json.loads(_fsutil.read_bytes(fs, full, retry=retry))
            if isinstance(body, dict) and not body.get("ok") and body.get("time", 0) < before:
                delete_checkpoint_dir(backend, fi.path, retry=retry)
                removed.append(fi.path)
                break
    return removed


def _next_index(backend: Backend, parent: str, retry: RetryPolicy | None) -> int:
    """One past the highest index committed under ``parent`` (one listing and
    one read per directory, once per run)."""
    best = -1
    for fi in _fsutil.list_dir(backend.filesystem, parent, retry=retry):
        if fi.type != pafs.FileType.Directory:
            continue
        meta = read_internal_metadata(backend.filesystem, fi.path, retry=retry)
        if meta is not None:
            best = max(best, int(meta["index"]))
    return best + 1


def _commit_callback_class() -> type:
    import ray.train

    class CommitCallback(ray.train.UserCallback):
        """Commits each Ray Train checkpoint uploaded with :func:`upload_fn`.

        Runs in Ray Train's controller (``after_report``), which Ray calls
        once every rank's ``ray.train.report`` has returned. Writes
        ``.internal_metadata.json`` last: the manifest is the union of the
        ranks' markers, the metrics are rank 0's, the index counts on past
        the highest committed one in the run directory. A checkpoint with a
        failed or conflicting rank is left uncommitted (a warning names it);
        after Ray has replaced the failed workers, the next commit removes
        the directories where a rank recorded a failed upload.

        Ray's ``CheckpointConfig`` keeps the top K and deletes the rest,
        through the storage filesystem; with :func:`ray_filesystem` those
        deletes remove the marker first. Ray registers (and may delete older
        checkpoints) before this callback commits the new one, so for that
        moment the newest committed checkpoint is the one before.
        """

        def __init__(self) -> None:
            self._index: int | None = None
            self._failed_at: float | None = None

        def after_exception(self, run_context: Any, worker_exceptions: dict) -> None:
            # Cleaned at the next commit, when Ray has replaced the failed workers.
            self._failed_at = time.time()

        def after_report(
            self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
        ) -> None:
            if checkpoint is None:
                return
            backend, retry = backend_of(checkpoint.filesystem)
            path = checkpoint.path.rstrip("/")
            parent = posixpath.dirname(path)
            if self._index is None:
                self._index = _next_index(backend, parent, retry)
            if self._failed_at is not None:
                for gone in _remove_failed(backend, parent, self._failed_at, retry):
                    logger.info("removed %s: a rank failed to upload it", backend.uri_for(gone))
                self._failed_at = None
            name = run_context.run_config.name or posixpath.basename(posixpath.dirname(path))
            row = _json_safe(metrics[0] if metrics else {})
            row["checkpoint_dir_name"] = posixpath.basename(path)
            internal = {
                "index": self._index,
                "metrics": row,
                "experiment_name": name,
                "trial_name": name,
                "created_at": time.time(),
            }
            if _commit_from_markers(backend, path, internal, len(metrics), retry) is not None:
                self._index += 1

    CommitCallback.__module__ = __name__
    CommitCallback.__qualname__ = "CommitCallback"
    return CommitCallback


def _json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's metrics as a JSON object; values JSON cannot hold are dropped
    (Ray accepts any picklable metric)."""
    out: dict[str, Any] = {}
    for k, v in dict(metrics).items():
        try:
            out.update(_json.to_json_object({k: v}, "metrics"))
        except CheckpointStoreError:
            logger.debug("metric %r is not JSON; left out of the internal metadata", k)
    return out


def __getattr__(name: str) -> Any:
    # CommitCallback subclasses ray.train.UserCallback: built on first use so
    # that importing this module (e.g. to unpickle the handler) needs no Ray.
    if name == "CommitCallback":
        cls = _commit_callback_class()
        globals()["CommitCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- level 3: checkpoint_store.session under Ray -----------------------------------


class RaySession:
    """What ``checkpoint_store.session.report()``/``get_checkpoint()`` do under Ray.

    Obtained from :func:`active_session`; ``kind`` is ``"train"`` (a Ray
    Train worker) or ``"tune"`` (a Ray Tune function trainable).
    """

    def __init__(self, kind: str):
        self.kind = kind

    def report(
        self, metrics: Mapping[str, Any], *, checkpoint: Checkpoint | None = None
    ) -> dict[str, Any]:
        """Forward to ``ray.train.report`` (with :func:`upload_fn`) or ``ray.tune.report``.

        Under Tune the checkpoint is committed first, by our protocol, as
        ``<trial dir>/checkpoint_NNNNNN`` (the directory Tune then records
        for that report, Tune's numbering), and Tune is handed an empty
        directory to copy there.

        Returns:
            The metrics as reported (a copy); under Tune with the auto-filled
            keys of :data:`checkpoint_store.session.AUTO_FILLED`.

        Raises:
            MetadataError: ``metrics`` is not a JSON object.
            InvalidConfigError: ``checkpoint`` is not a Checkpoint.
        """
        clean = _json.to_json_object(metrics, "metrics")
        if checkpoint is not None:
            _require_checkpoint(checkpoint)
        if self.kind == "train":
            return self._report_train(clean, checkpoint)
        return self._report_tune(clean, checkpoint)

    def _report_train(self, clean: dict[str, Any], checkpoint: Checkpoint | None) -> dict:
        import ray.train

        ray_ckpt = None
        if checkpoint is not None:
            ray_ckpt = ray.train.Checkpoint(path=checkpoint.path, filesystem=checkpoint.filesystem)
        ray.train.report(clean, checkpoint=ray_ckpt, checkpoint_upload_fn=upload_fn())
        return clean

    def _report_tune(self, clean: dict[str, Any], checkpoint: Checkpoint | None) -> dict:
        import ray.tune
        from ray.train._internal.session import get_session

        sess = get_session()
        row = self._tune_row(clean, sess)
        if checkpoint is None:
            ray.tune.report(clean)
            return row
        _commit_for_tune(sess, checkpoint, row)
        with tempfile.TemporaryDirectory(prefix="cs-ray-") as empty:
            # Tune records the directory we committed; there is nothing left to copy.
            ray.tune.report(clean, checkpoint=ray.tune.Checkpoint.from_directory(empty))
        return row

    @staticmethod
    def _tune_row(clean: dict[str, Any], sess: Any) -> dict[str, Any]:
        """Our auto-filled keys (docs/format.md), counted from Tune's session; after
        a restore ``training_iteration`` continues from the restored checkpoint."""
        state = sess.__dict__.setdefault("_checkpoint_store", {})
        if "offset" not in state:
            state["offset"] = 0
            if sess.loaded_checkpoint is not None:
                meta = as_checkpoint(sess.loaded_checkpoint).internal_metadata
                state["offset"] = int(dict(meta).get("metrics", {}).get("training_iteration", 0))
        now = time.time()
        row = dict(clean)
        row.update(
            training_iteration=state["offset"] + int(sess.iteration) + 1,
            timestamp=now,
            time_total_s=sess.time_total + (now - sess.last_report_time),
            time_this_iter_s=now - sess.last_report_time,
            trial_id=f"{sess.experiment_name}/{sess.trial_name}",
            checkpoint_dir_name=None,
        )
        return row

    def get_checkpoint(self) -> Checkpoint | None:
        """Ray's restored checkpoint as ours (None when Ray has none)."""
        if self.kind == "train":
            import ray.train

            ray_ckpt = ray.train.get_checkpoint()
        else:
            import ray.tune

            ray_ckpt = ray.tune.get_checkpoint()
        return None if ray_ckpt is None else as_checkpoint(ray_ckpt)


def _commit_for_tune(sess: Any, checkpoint: Checkpoint, row: dict[str, Any]) -> Checkpoint:
    """Commit ``checkpoint`` where Tune will record this report's checkpoint:
    ``<trial dir>/checkpoint_<Tune's index + 1>``. Sets ``row["checkpoint_dir_name"]``.

    A directory already there is one Tune never recorded (a trial that died
    between our commit and Tune's record reuses the index after a restore):
    it is deleted, marker first, and committed again.

    Raises:
        CheckpointStoreError: this Ray version numbers Tune checkpoints differently.
    """
    from ray.train._internal.storage import StorageContext as TuneStorage

    from checkpoint_store.storage import StorageContext

    tstore = sess.storage
    if type(tstore)._update_checkpoint_index is not TuneStorage._update_checkpoint_index:
        raise CheckpointStoreError(
            f"{type(tstore).__name__} numbers Tune checkpoints its own way; "
            "checkpoint_store.session.report() cannot commit them under Ray Tune here"
        )
    index = tstore.current_checkpoint_index + 1
    name = checkpoint_dir_name(index)
    row["checkpoint_dir_name"] = name
    backend, retry = backend_of(tstore.storage_filesystem)
    ours = StorageContext.from_backend(
        backend,
        tstore.storage_fs_path,
        tstore.experiment_dir_name,
        tstore.trial_dir_name,
        retry=retry,
        run_id=f"ray_{sess.trial_id}",
    )
    if _fsutil.exists(backend.filesystem, ours.checkpoint_path(index), retry=retry):
        logger.warning(
            "%s was never recorded by Tune; replacing it", ours.uri(ours.checkpoint_path(index))
        )
        ours.delete_checkpoint(name)
    return ours.persist_checkpoint(
        checkpoint, index, {"metrics": row, "world_size": 1, "run_id": ours.run_id}
    )


def active_session() -> RaySession | None:
    """A :class:`RaySession` when this code runs in a Ray Train worker or a
    Ray Tune function trainable, else None. Never imports Ray itself."""
    import sys

    if "ray" not in sys.modules:
        return None
    try:
        from ray.train.v2._internal.util import _in_ray_train_worker
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session
    except ImportError:  # pragma: no cover - another Ray version
        return None
    if _in_tune_session():
        return RaySession("tune")
    if _in_ray_train_worker():
        return RaySession("train")
    return None
