"""Which client really moves a backend's bytes: the look-through to it.

A backend's filesystem may be a thin Python handler in front of a C++
filesystem (the object-store plugins' marker-free handler keeps it as
``handler.native``) or in front of an fsspec client
(``PyFileSystem(LiteralFSSpecHandler(fs))``). :func:`_native_of`,
:func:`_fsspec_of` and :func:`_client_of` look through the handler;
:func:`writer_of` is the twin filesystem that writes with the handler's own
options. Used by the storage calls (:mod:`checkpoint_store._util.fs`), the
transfer (:mod:`checkpoint_store._transfer`) and the removal of trees.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow.fs as pafs

__all__ = ["_client_of", "_fsspec_of", "_is_async", "_native_of", "keeps_names", "writer_of"]



def _native_of(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The C++ filesystem behind a thin Python handler that keeps it as
    ``handler.native`` (the S3 plugin's marker-free handler), else ``fs``:
    data then moves without a Python call per read or write."""
    if isinstance(fs, pafs.PyFileSystem):
        native = getattr(fs.handler, "native", None)
        if isinstance(native, pafs.FileSystem):
            return native
    return fs


#: ``(what, id(user's pyarrow filesystem)) -> (weak reference to it, what was
#: made of it or None)``: the twins of :func:`writer_of`, :func:`_s3fs_twin_of`
#: and :func:`_adlfs_twin_of`, kept as long as the user's filesystem lives.
_TWINS: dict[tuple[str, int], tuple[weakref.ref[Any], Any]] = {}
#: Reentrant: the cycle collector may run on any allocation, also inside a
#: section holding this lock, and collect a user's filesystem there; its
#: weakref callback (:func:`_forget_twin`) then takes the lock on the same
#: thread. A plain lock would wait for itself forever.
_TWINS_LOCK = threading.RLock()


def _twin(what: str, fs: pafs.FileSystem, make: Callable[[dict[str, Any]], Any],
          kind: str = "S3FileSystem") -> Any:
    """``make(options)`` for a pyarrow filesystem ``fs`` of class ``kind``
    (``S3FileSystem``, ``AzureFileSystem``) from its pickled options (what
    pyarrow, and a Ray worker, rebuilds it from), made once per filesystem
    and kept while ``fs`` lives; None for any other filesystem, for a state
    this pyarrow does not pickle so, or where ``make`` returns None."""
    try:
        cls = getattr(pafs, kind)
    except (AttributeError, ImportError):  # a pyarrow built without it: nothing to twin
        return None
    if type(fs) is not cls:
        return None
    key = (what, id(fs))
    with _TWINS_LOCK:
        held = _TWINS.get(key)
        if held is not None and held[0]() is fs:
            return held[1]
    try:
        options = dict(fs.__reduce__()[1][0])
    except (AttributeError, IndexError, KeyError, TypeError):  # another pyarrow's state
        made = None
    else:
        made = make(options)
    with _TWINS_LOCK:
        _TWINS[key] = (weakref.ref(fs, lambda _ref: _forget_twin(key, _ref)), made)
    return made


def _forget_twin(key: tuple[str, int], ref: weakref.ref[Any]) -> None:
    with _TWINS_LOCK:
        held = _TWINS.get(key)
        if held is not None and held[0] is ref:
            del _TWINS[key]


def writer_of(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The filesystem a transfer writes files through: ``fs`` itself, except
    for a pyarrow ``S3FileSystem`` made without ``allow_delayed_open``.

    Such a filesystem starts a multipart upload when an output stream opens,
    so every small file costs three requests (CreateMultipartUpload,
    UploadPart, CompleteMultipartUpload) instead of one PutObject; a Ray
    user's ``storage_filesystem`` usually is one. The transfer then writes
    through a twin made from the same options (credentials, endpoint,
    timeouts, metadata ...: pyarrow's own pickling state, which is also what
    a Ray worker receives of a pickled filesystem) with only
    ``allow_delayed_open=True``, kept as long as ``fs`` lives. That state
    leaves out a custom ``retry_strategy``: the twin has pyarrow's default
    (3 attempts), and every transfer task is retried by our own policy on
    top (:mod:`checkpoint_store._util.retry`). A write still fails as it would,
    only at its first part or its close rather than at its open. 2000 x 64
    KiB to moto, 3 alternating runs: 21.5 s -> 7.8 s.
    """
    twin = _twin("writer", fs, _make_writer_twin)
    return fs if twin is None else twin


def _make_writer_twin(options: dict[str, Any]) -> pafs.FileSystem | None:
    if options.get("allow_delayed_open", True):
        return None
    try:
        return pafs.S3FileSystem(**{**options, "allow_delayed_open": True})
    except (TypeError, ValueError):
        return None


#: Options of pyarrow's S3FileSystem (its pickled state) an s3fs client is
#: given the same way: what they must hold for one to be made. Any other
#: option set to anything but these values (a role to assume, a proxy, a CA
#: file, virtual addressing, or an option a later pyarrow adds; also metadata
#: on every object) keeps the user's filesystem for every byte.
_S3FS_EQUIVALENT_DEFAULTS: dict[str, Any] = {
    "role_arn": "", "external_id": "", "session_name": "", "tls_ca_file_path": "",
    "force_virtual_addressing": False,
    "proxy_options": {"host": "", "password": "", "port": -1, "scheme": "", "username": ""},
}
#: Options that do not change where or as whom a part is written.
_S3FS_IRRELEVANT = frozenset({
    "allow_delayed_open", "allow_bucket_creation", "allow_bucket_deletion",
    "background_writes", "check_directory_existence_before_creation", "load_frequency",
})


def _s3fs_twin_of(fs: pafs.FileSystem) -> Any | None:
    """An s3fs client on the store and credentials of a pyarrow
    ``S3FileSystem`` the user passed in, made once per filesystem, else None.

    pyarrow's Python API cannot send the parts of one object from several
    threads; through this client a large file goes up in parallel parts
    (:class:`S3Multipart`) as it does with the pyarrow engine by URI (4 x
    256 MiB to moto: about 1.5x faster than pyarrow's stream). Made only
    from explicit keys (or ``anonymous``), endpoint, scheme, region and
    timeouts: with the default credential chain, or any option s3fs would
    not honour the same way (:data:`_S3FS_EQUIVALENT_DEFAULTS`), or without
    the S3 plugin's s3fs engine (the client is the one that engine builds,
    through the registry: the same timeouts and caching as by URI), large
    files keep pyarrow's stream.
    """
    return _twin("s3fs", fs, _make_s3fs_twin)


def _make_s3fs_twin(options: dict[str, Any]) -> Any | None:
    known = {"access_key", "secret_key", "session_token", "anonymous", "endpoint_override",
             "scheme", "region", "request_timeout", "connect_timeout", "default_metadata",
             *_S3FS_EQUIVALENT_DEFAULTS, *_S3FS_IRRELEVANT}
    if set(options) - known or any(options.get(k, v) != v
                                   for k, v in _S3FS_EQUIVALENT_DEFAULTS.items()):
        return None
    if options.get("default_metadata") is not None and len(options["default_metadata"]):
        return None  # metadata on every object: parts through s3fs would lack it
    # The S3 plugin's s3fs engine, given the same store and credentials. Every
    # option is given, None included, so that no AWS_* variable fills one in
    # that the user's filesystem did not have.
    scheme = options.get("scheme") or "https"
    override = options.get("endpoint_override")
    if not override and scheme != "https":
        return None
    storage_options: dict[str, Any] = {
        "engine": "s3fs",
        # pyarrow takes the override with or without its scheme ("http://h:p").
        "endpoint_url": (override if override and "://" in override
                         else f"{scheme}://{override}" if override else None),
        "region": options.get("region") or None,
    }
    if options.get("anonymous"):
        storage_options["anonymous"] = True
    elif options.get("access_key") and options.get("secret_key"):
        storage_options["access_key_id"] = options["access_key"]
        storage_options["secret_access_key"] = options["secret_key"]
        if options.get("session_token"):
            storage_options["session_token"] = options["session_token"]
    else:  # the default chain: pyarrow's (the AWS C++ SDK's) may find other keys
        return None
    timeout = options.get("request_timeout")
    if isinstance(timeout, (int, float)) and timeout > 0:  # else the plugin's 20 s
        storage_options["request_timeout"] = timeout
    connect = options.get("connect_timeout")
    if isinstance(connect, (int, float)) and connect > 0:
        storage_options["config_kwargs"] = {"connect_timeout": connect}
    from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError
    from checkpoint_store.registry import backend_for_scheme

    try:
        backend = backend_for_scheme("s3", "s3://", storage_options)
    except (BackendUnavailableError, InvalidConfigError):  # no S3 plugin, or no s3fs
        return None
    return _fsspec_of(backend.filesystem)


def _adlfs_twin_of(fs: pafs.FileSystem) -> Any | None:
    """An adlfs client on the account and key (or SAS token) of a pyarrow
    ``AzureFileSystem`` the user passed in, made once per filesystem, else
    None: the client the Azure plugin's adlfs engine builds from a
    connection string naming the same blob endpoint. Through it large files
    go up in staged blocks and small files in batches, as with the pyarrow
    engine by URI. Not made for a service principal or the default
    credential chain (``client_id``, ``tenant_id``, no key): pyarrow's
    client then moves every byte."""
    return _twin("adlfs", fs, _make_adlfs_twin, kind="AzureFileSystem")


def _make_adlfs_twin(options: dict[str, Any]) -> Any | None:
    account = options.get("account_name")
    key, sas = options.get("account_key"), options.get("sas_token")
    if (not account or not (key or sas)
            or any(options.get(k) for k in ("client_id", "client_secret", "tenant_id"))):
        return None
    scheme = options.get("blob_storage_scheme") or "https"
    authority = options.get("blob_storage_authority") or ".blob.core.windows.net"
    # As pyarrow addresses the account: a host suffix after the account's
    # name, or a host (an emulator's) with the account as the first path part.
    endpoint = (f"{scheme}://{account}{authority}" if authority.startswith(".")
                else f"{scheme}://{authority}/{account}")
    secret = f"AccountKey={key}" if key else f"SharedAccessSignature={sas}"
    conn = (f"DefaultEndpointsProtocol={scheme};AccountName={account};{secret};"
            f"BlobEndpoint={endpoint};")
    from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError
    from checkpoint_store.registry import backend_for_scheme

    try:
        backend = backend_for_scheme("az", "az://", {"engine": "adlfs", "connection_string": conn})
    except (BackendUnavailableError, InvalidConfigError):  # no Azure plugin, or no adlfs
        return None
    return _fsspec_of(backend.filesystem)


def _fsspec_of(fs: pafs.FileSystem) -> Any | None:
    """The fsspec filesystem behind ``PyFileSystem(FSSpecHandler(...))`` (or the
    s3fs client a plugin's handler keeps as ``deleter``), else None."""
    if isinstance(fs, pafs.PyFileSystem):
        handler = fs.handler
        for attr in ("fs", "deleter"):
            inner = getattr(handler, attr, None)
            if inner is not None and hasattr(inner, "cat_file") and hasattr(inner, "pipe"):
                return inner
    return None


def _client_of(fs: pafs.FileSystem) -> Any | None:
    """The fsspec client a transfer moves bytes through beside ``fs``: the
    one behind its handler (:func:`_fsspec_of`), else the twin of a pyarrow
    ``S3FileSystem`` (:func:`_s3fs_twin_of`) or ``AzureFileSystem``
    (:func:`_adlfs_twin_of`) the user passed in, else None.

    Through it every transfer feature works for such a filesystem as for
    the plugin's pyarrow engine by URI (which keeps an fsspec client to
    delete with): small files in one concurrent batch, large uploads in
    parallel parts, and on S3 downloads in streamed ranged GETs and copies
    of objects over 5 GiB inside the store (UploadPartCopy; pyarrow's
    CopyObject stops at 5 GiB). Where no twin can be made (credentials from
    a default chain, options the fsspec client would not honour alike),
    pyarrow's own client does it all: one request per small file, one
    stream per large upload, ranged reads of at most 16 MiB.
    """
    fss = _fsspec_of(fs)
    if fss is None:
        fss = _s3fs_twin_of(fs)
    return fss if fss is not None else _adlfs_twin_of(fs)


def keeps_names(fss: Any, paths: Iterable[str]) -> bool:
    """Whether the fsspec client ``fss`` reads and writes each of ``paths``
    under that very name. Not adlfs for a path holding ``?`` or ``#``: it
    parses paths as URLs and drops such a character ending a name (``opt?``
    is written as ``opt``, and ``opt`` read for it). The Azure plugin's
    pyarrow engine stores ``?``; its files then go through pyarrow's client."""
    return not _is_adlfs(fss) or not any("?" in p or "#" in p for p in paths)


def _is_async(fsspec_fs: Any) -> bool:
    """Whether an fsspec client runs its calls on an event loop (s3fs, adlfs,
    gcsfs): a batch of files is then one call that fsspec runs concurrently."""
    return bool(getattr(fsspec_fs, "async_impl", False))


def _is_adlfs(fss: Any | None) -> bool:
    """Whether ``fss`` is adlfs's ``AzureBlobFileSystem`` (or a subclass);
    adlfs is not imported for it (an instance exists only once it is)."""
    adlfs = sys.modules.get("adlfs")
    return fss is not None and adlfs is not None and isinstance(fss, adlfs.AzureBlobFileSystem)
