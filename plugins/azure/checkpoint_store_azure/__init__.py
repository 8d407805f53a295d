"""Azure Blob Storage and ADLS Gen2 for checkpoint-store.

Registered for ``az://``, ``abfs://`` and ``abfss://`` through the
``checkpoint_store.backends`` entry-point group. URIs name the container first:
``az://container/path``; the ADLS form ``abfss://container@account.dfs.core.windows.net/path``
also works and sets the account name.

Engines:

* ``adlfs`` (default): ``adlfs.AzureBlobFileSystem``, wrapped with
  ``pyarrow.fs.PyFileSystem(FSSpecHandler(...))``.
* ``pyarrow``: ``pyarrow.fs.AzureFileSystem`` (pyarrow >= 16) for reads,
  writes and listings, adlfs for deletes (pyarrow leaves directory markers);
  folder blobs are directories (:class:`FolderBlobsHandler`).
  Selected with ``storage_options={"engine": "pyarrow"}``; needs an account
  name plus key or SAS token, or a connection string. Measured against
  Azurite: faster for large files (128 MiB upload 1.7 s vs 4.1 s with adlfs),
  slower for many small ones (200 x 64 KiB upload 4.2 s vs 1.9 s).

Storage options (each falls back to the standard variable shown):

===================== ================================== ===================================
option                meaning                            environment
===================== ================================== ===================================
``connection_string`` full connection string             ``AZURE_STORAGE_CONNECTION_STRING``
``account_name``      storage account                    ``AZURE_STORAGE_ACCOUNT_NAME``,
                                                         ``AZURE_STORAGE_ACCOUNT``
``account_key``       shared key                         ``AZURE_STORAGE_ACCOUNT_KEY``,
                                                         ``AZURE_STORAGE_KEY``
``sas_token``         shared access signature            ``AZURE_STORAGE_SAS_TOKEN``
``anon``              anonymous (public containers)
``request_timeout``   seconds a request may wait for the
                      server's next byte (alias
                      ``read_timeout``; default
                      :data:`REQUEST_TIMEOUT_S`)
``connect_timeout``   seconds to open a connection (alias
                      ``connection_timeout``; default
                      :data:`CONNECT_TIMEOUT_S`)
===================== ================================== ===================================

Both timeouts must be numbers > 0 (else :class:`InvalidConfigError`). adlfs's
clients (the whole adlfs engine but its file transfers, and the pyarrow
engine's deletes) try a request :data:`ENGINE_ATTEMPTS` times with these
timeouts, 1 s and 3 s apart, where azure-storage-blob would try 4 times over
15 to 40 s waits with 300 s read timeouts: a store that stops answering fails
a storage call within about a minute, and checkpoint-store's own retry policy
then stops retrying (``RetryPolicy.max_elapsed``). ``pyarrow.fs.AzureFileSystem``
takes no timeout: what goes through it (the pyarrow engine's reads, writes and
listings, and the adlfs engine's file transfers when it has an account key or
SAS token) keeps the Azure C++ SDK's own limits, about 300 s per request
(measured against a silent relay). Giving either timeout to the adlfs engine
sends every byte through adlfs, bounded.

Anything else (``tenant_id``, ``client_id``, ``client_secret``, ``credential``,
``account_host`` ...) goes to ``adlfs.AzureBlobFileSystem`` unchanged. Without
key, SAS or connection string, adlfs uses Azure's default credential chain.
Credentials are never printed: ``repr(backend)`` names the engine only.
A string given for an option of :data:`OPTION_TYPES` (the command line's
``-o KEY=VALUE`` gives strings) is converted to that option's type.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import (
    Backend,
    Capabilities,
    bool_option,
    refuse_authority,
    timeout_option,
    typed_options,
)
from checkpoint_store.backends.handlers import (
    MarkerFreeDeletesHandler,
    folder_blobs_as_directories,
    wrap_fsspec,
)
from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError

__all__ = ["AZURE_CAPABILITIES", "CONNECT_TIMEOUT_S", "ENGINE_ATTEMPTS", "OPTION_TYPES",
           "REQUEST_TIMEOUT_S", "AzureBackend", "FolderBlobsHandler", "azure_backend",
           "engine_capabilities"]

#: Seconds a request may wait for the server's next byte (adlfs's clients).
#: azure-storage-blob waits 300 s; the S3 backend's 20 s, which outlasts a
#: slow commit of a large blob's block list, holds a silent store's call for
#: ENGINE_ATTEMPTS x 20 s.
REQUEST_TIMEOUT_S = 20.0
#: Seconds to open a connection (adlfs's clients).
CONNECT_TIMEOUT_S = 10.0
#: Tries per request inside azure-storage-blob (its default makes 4, 15 s+ apart),
#: before checkpoint-store's own retries.
ENGINE_ATTEMPTS = 3
# The engine's own names for the timeouts, taken as aliases of ours.
_TIMEOUT_ALIASES = {"read_timeout": "request_timeout", "connection_timeout": "connect_timeout"}
_TIMEOUT_DEFAULTS = {"request_timeout": REQUEST_TIMEOUT_S, "connect_timeout": CONNECT_TIMEOUT_S}

AZURE_CAPABILITIES = Capabilities(
    atomic_rename=False,  # flat namespace: no directory rename at all
    needs_fsync=False,
    server_side_copy=True,
    strong_listing=True,
    directories=False,
    chunk_size=32 * 1024 * 1024,
    concurrency=8,
)

# adlfs parses every path as a URL (fsspec's infer_storage_options): a '?' or
# '#' that ends a path starts an empty query or fragment and is dropped, so a
# file "d/a?" is written as the blob "d/a", and listing or deleting trial "t?"
# lists or deletes trial "t" (measured against Azurite, adlfs 2026.8). Inside
# a name both survive only by how adlfs re-appends a non-empty query: refused
# everywhere. The pyarrow engine writes and lists both, and deletes through
# adlfs: deleting a directory or file whose name ends in '#' fails there, so
# '#' is refused. A trial "t*1?" is deleted blob by blob and works; only a
# checkpoint file whose name ends in '?' fails to delete (loudly:
# PermanentBackendError, retried by retention), so '?' stays allowed.
_UNSUPPORTED_NAME_CHARACTERS = {"adlfs": "?#", "pyarrow": "#"}
_NAME_HINTS = {
    "adlfs": "for '?', storage_options={'engine': 'pyarrow'} stores it",
    "pyarrow": "adlfs, which this engine deletes with, reads it as a URL fragment",
}


def engine_capabilities(engine: str) -> Capabilities:
    """:data:`AZURE_CAPABILITIES` plus the name characters ``engine`` cannot store."""
    return dataclasses.replace(
        AZURE_CAPABILITIES,
        unsupported_name_characters=_UNSUPPORTED_NAME_CHARACTERS[engine],
        unsupported_name_hint=_NAME_HINTS[engine],
    )


_ENGINES = ("adlfs", "pyarrow")
#: Every storage option the Azure backend knows, with its type: ours (see the
#: module docstring), then those of adlfs and pyarrow a user sets most.
OPTION_TYPES: dict[str, type] = {
    "engine": str, "connection_string": str, "account_name": str, "account_key": str,
    "sas_token": str, "anon": bool,
    # adlfs.AzureBlobFileSystem
    "tenant_id": str, "client_id": str, "client_secret": str, "account_host": str,
    "blocksize": int, "max_concurrency": int, "version_aware": bool,
    "assume_container_exists": bool, "timeout": float, "connection_timeout": float,
    "read_timeout": float, "request_timeout": float, "connect_timeout": float,
    # pyarrow.fs.AzureFileSystem
    "blob_storage_authority": str, "dfs_storage_authority": str,
    "blob_storage_scheme": str, "dfs_storage_scheme": str,
}
_ENV = {
    "connection_string": ("AZURE_STORAGE_CONNECTION_STRING",),
    "account_name": ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT"),
    "account_key": ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY"),
    "sas_token": ("AZURE_STORAGE_SAS_TOKEN",),
}


@dataclass(frozen=True, repr=False)
class AzureBackend(Backend):
    """A Backend whose URIs may carry the account: ``abfss://c@acct.dfs.core.windows.net/p``.

    Args:
        account_host: the ``acct.dfs.core.windows.net`` part of such a URI, kept
            so that :meth:`uri_for` prints URIs a user can paste back in.
    """

    account_host: str = ""

    def path_from_uri(self, uri: str) -> str:
        rest = uri.split("://", 1)[1] if "://" in uri else uri
        container, sep, key = rest.partition("/")
        refuse_authority(uri, container, allow_user=True)
        if "@" in container:
            container = container.split("@", 1)[0]
        return f"{container}{sep}{key}".rstrip("/") or "/"

    def uri_for(self, path: str) -> str:
        if not self.account_host:
            return super().uri_for(path)
        container, sep, key = path.lstrip("/").partition("/")
        return f"{self.scheme}://{container}@{self.account_host}{sep}{key}"


def _account_host_from_uri(uri: str) -> str:
    rest = uri.split("://", 1)[1] if "://" in uri else ""
    container = rest.split("/", 1)[0]
    return container.split("@", 1)[1] if "@" in container else ""


def _parse_connection_string(conn: str) -> dict[str, str]:
    parts: dict[str, str] = {}
    for item in conn.split(";"):
        if "=" in item:
            k, v = item.split("=", 1)
            parts[k.strip()] = v.strip()
    return parts


def _account_from_uri(uri: str) -> str | None:
    rest = uri.split("://", 1)[1] if "://" in uri else ""
    container = rest.split("/", 1)[0]
    if "@" in container:
        host = container.split("@", 1)[1]
        return host.split(".", 1)[0] or None
    return None


def _options(uri: str, storage_options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    ours: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in typed_options(storage_options, OPTION_TYPES, "Azure").items():
        if k in ("engine", "connection_string", "account_name", "account_key", "sas_token",
                 "anon"):
            ours[k] = v
        elif k in _TIMEOUT_DEFAULTS or k in _TIMEOUT_ALIASES:
            name = _TIMEOUT_ALIASES.get(k, k)
            seconds = timeout_option("Azure", k, v, _TIMEOUT_DEFAULTS[name])
            if ours.get(name, seconds) != seconds:
                raise InvalidConfigError(
                    f"Azure storage option {name!r} was given twice (as {k!r} and an "
                    "alias); pass it once"
                )
            ours[name] = seconds
        else:
            extra[k] = v
    engine = ours.get("engine") or "adlfs"
    if engine not in _ENGINES:
        raise InvalidConfigError(
            f"unknown Azure engine {engine!r}: use one of {', '.join(_ENGINES)}"
        )
    ours["engine"] = engine
    if "anon" in ours:
        ours["anon"] = bool_option("anon", ours["anon"])
    account = _account_from_uri(uri)
    if account and not ours.get("account_name"):
        ours["account_name"] = account
    given = {k for k in ("connection_string", "account_name", "account_key", "sas_token")
             if ours.get(k)}
    # Variables fill in only what the options left open, and a connection string
    # in the options is never mixed with an account from the environment.
    if "connection_string" not in given and not ours.get("anon"):
        for key, names in _ENV.items():
            if ours.get(key):
                continue
            if key == "connection_string" and given:
                continue
            for name in names:
                if os.environ.get(name):
                    ours[key] = os.environ[name]
                    break
    if ours.get("sas_token"):
        ours["sas_token"] = ours["sas_token"].lstrip("?")
    return ours, extra


def _adlfs_instance(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
    try:
        import adlfs  # noqa: F401  (missing: say which package to install)
    except ImportError:
        raise BackendUnavailableError(
            "the adlfs engine needs adlfs: pip install checkpoint-store-azure"
        ) from None
    kwargs: dict[str, Any] = {
        # A listing must show what another process just wrote (retention, resume).
        "use_listings_cache": False,
        "skip_instance_cache": True,
        "blocksize": AZURE_CAPABILITIES.chunk_size,
        # adlfs hands these to its uploads and downloads only; _BoundedBlobFileSystem
        # makes every client it opens use them.
        "read_timeout": ours.get("request_timeout", REQUEST_TIMEOUT_S),
        "connection_timeout": ours.get("connect_timeout", CONNECT_TIMEOUT_S),
    }
    if ours.get("connection_string"):
        kwargs["connection_string"] = ours["connection_string"]
    else:
        for k in ("account_name", "account_key", "sas_token"):
            if ours.get(k):
                kwargs[k] = ours[k]
    if ours.get("anon"):
        kwargs["anon"] = True
    kwargs.update(extra)
    try:
        fs = _bounded_blob_fs_class()(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"adlfs.AzureBlobFileSystem rejected the storage options ({type(exc).__name__}); "
            "check the option names"
        ) from None
    except ValueError as exc:
        # adlfs/azure messages can quote the connection string: never repeat them.
        raise InvalidConfigError(
            f"Azure credentials were rejected ({type(exc).__name__}); check the connection "
            "string, account name and key, or SAS token"
        ) from None
    return fs


def _bound_client(client: Any, connect_s: float, read_s: float) -> Any:
    """``client`` (an azure-storage-blob aio service or container client) made to
    try each request :data:`ENGINE_ATTEMPTS` times with these timeouts. Its
    retry policy and transport are shared with the container and blob clients
    derived from it. Returns ``client``."""
    policy = client._config.retry_policy
    for attr in ("total_retries", "read_retries", "status_retries"):
        setattr(policy, attr, ENGINE_ATTEMPTS - 1)
    # A connection that cannot be opened is not retried here: checkpoint-store's
    # own policy decides (a refused one is a wrong address: StorageUnreachableError
    # after two quick tries, not four tries with waits each).
    policy.connect_retries = 0
    # Waits of 1 s then 3 s (initial_backoff + increment_base ** try), not 15 s then 18 s.
    policy.initial_backoff, policy.increment_base, policy.random_jitter_range = 1, 2, 1
    transport = client._pipeline._transport
    transport = getattr(transport, "_transport", transport)  # a derived client's wrapper
    transport.connection_config.timeout = connect_s
    transport.connection_config.read_timeout = read_s
    return client


@functools.cache
def _bounded_blob_fs_class() -> type:
    """``adlfs.AzureBlobFileSystem`` whose clients are bounded (:func:`_bound_client`):
    adlfs builds them itself and passes no retry or timeout settings to them."""
    import adlfs

    class _BoundedBlobFileSystem(adlfs.AzureBlobFileSystem):  # type: ignore[misc]
        def do_connect(self) -> None:
            super().do_connect()
            _bound_client(self.service_client, *self._bounds())

        def _open(self, *args: Any, **kwargs: Any) -> Any:
            f = super()._open(*args, **kwargs)
            _bound_client(f.container_client, *self._bounds())
            return f

        def _bounds(self) -> tuple[float, float]:
            t = self._timeout_kwargs
            return t["connection_timeout"], t["read_timeout"]

    _BoundedBlobFileSystem.__module__ = __name__
    _BoundedBlobFileSystem.__qualname__ = "_BoundedBlobFileSystem"
    return _BoundedBlobFileSystem


def __getattr__(name: str) -> Any:
    # Pickles name the class by module attribute (fsspec pickles a filesystem
    # as its class and options): made on first use, after adlfs is imported.
    if name == "_BoundedBlobFileSystem":
        return _bounded_blob_fs_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_adlfs(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> pafs.FileSystem:
    wrapped = wrap_fsspec(_adlfs_instance(ours, extra))
    native = _native_for_bytes(ours, extra)
    if native is not None:
        # Checkpoint transfers move file bytes through pyarrow's C++ client
        # (checkpoint_store._transfer.remote._native_of): adlfs runs every byte through
        # one event-loop thread, 1.4x slower on Azurite. Names, listings,
        # deletes and the commit marker stay with adlfs.
        wrapped.handler.native = native
    return wrapped


def _native_for_bytes(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> Any | None:
    """pyarrow's AzureFileSystem on the same account, for the adlfs engine's
    transfers; None unless the credentials are an account key or a SAS token
    given outright (others, e.g. Azure AD, are resolved by adlfs alone) and
    there are no adlfs-only options, nor a timeout (pyarrow's client takes none:
    a listing against a silent Azurite held 302 s)."""
    if extra or ours.get("anon") or _pyarrow_azure_class() is None:
        return None
    if any(name in ours for name in _TIMEOUT_DEFAULTS):
        return None
    conn = _parse_connection_string(ours.get("connection_string") or "")
    if not (conn.get("AccountKey") or conn.get("SharedAccessSignature")
            or ours.get("account_key") or ours.get("sas_token")):
        return None
    try:
        return _pyarrow_azure(ours, {})
    except (InvalidConfigError, BackendUnavailableError, OSError, ValueError):
        return None


def _pyarrow_azure_class() -> Any | None:
    try:
        return pafs.AzureFileSystem
    except (ImportError, AttributeError):
        return None


class FolderBlobsHandler(MarkerFreeDeletesHandler):
    """pyarrow's Azure client, with folder blobs read as the directories they mark.

    AzCopy, blobfuse, Azure Storage Explorer and Hadoop mark a directory on a
    flat-namespace account with a zero-byte blob of its name whose metadata
    says ``hdi_isfolder=true``. pyarrow lists such a blob as an empty file;
    each empty file listed or stat'ed here costs one metadata request more
    (:func:`~checkpoint_store.backends.handlers.folder_blobs_as_directories`):
    empty files are rare in checkpoints.
    """

    def __init__(self, native: pafs.FileSystem, deleter: Any):
        super().__init__(native, deleter, type_name="abfs")

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return folder_blobs_as_directories(self.native, self.native.get_file_info(paths))

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return folder_blobs_as_directories(self.native, super().get_file_info_selector(selector))


def _build_pyarrow(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> pafs.FileSystem:
    native = _pyarrow_azure(ours, extra)
    # pyarrow writes an empty directory marker after each delete; adlfs does not.
    return pafs.PyFileSystem(FolderBlobsHandler(native, _adlfs_instance(ours, {})))


def _pyarrow_azure(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> pafs.FileSystem:
    """``pyarrow.fs.AzureFileSystem`` from the options.

    Raises:
        BackendUnavailableError: this pyarrow has no AzureFileSystem.
        InvalidConfigError: no account name, or options pyarrow rejects.
    """
    cls = _pyarrow_azure_class()
    if cls is None:
        raise BackendUnavailableError(
            "this pyarrow has no AzureFileSystem (needs pyarrow >= 16 built with Azure); "
            "use the default adlfs engine"
        )
    kwargs: dict[str, Any] = {}
    account = ours.get("account_name")
    key = ours.get("account_key")
    if ours.get("connection_string"):
        parts = _parse_connection_string(ours["connection_string"])
        account = parts.get("AccountName", account)
        key = parts.get("AccountKey", key)
        endpoint = parts.get("BlobEndpoint")
        if endpoint:
            u = urllib.parse.urlsplit(endpoint)
            # Both authorities are needed, or pyarrow looks up the real Azure host.
            kwargs.update(
                blob_storage_authority=u.netloc, blob_storage_scheme=u.scheme,
                dfs_storage_authority=u.netloc, dfs_storage_scheme=u.scheme,
            )
        if parts.get("SharedAccessSignature"):
            kwargs["sas_token"] = parts["SharedAccessSignature"]
    if not account:
        raise InvalidConfigError(
            "the pyarrow Azure engine needs the storage account's name: pass account_name, "
            "an abfss://container@ACCOUNT.dfs.core.windows.net URI, or a connection string "
            "holding AccountName="
        )
    kwargs["account_name"] = account
    if key:
        kwargs["account_key"] = key
    if ours.get("sas_token"):
        kwargs["sas_token"] = ours["sas_token"]
    kwargs.update(extra)
    try:
        # No timeouts: pyarrow's AzureFileSystem takes none (module docstring).
        return cls(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"pyarrow.fs.AzureFileSystem rejected the storage options ({exc})"
        ) from None


def azure_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``az://``, ``abfs://`` and ``abfss://`` URIs.

    Args:
        uri: the URI being resolved (its scheme, and an ``@account`` host if any).
        storage_options: see the module docstring.

    Returns:
        An :class:`AzureBackend` with :data:`AZURE_CAPABILITIES` (marker-last
        commit: blob storage has no atomic directory rename) and the name
        characters its engine cannot store (:func:`engine_capabilities`:
        ``?`` and ``#`` with adlfs, ``#`` with pyarrow).

    Raises:
        InvalidConfigError: unknown engine or options the engine rejects.
        BackendUnavailableError: the engine's library is missing.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "az"
    options = dict(storage_options)
    ours, _ = _options(uri, options)
    return AzureBackend(
        _rebuild(uri, options),
        scheme=scheme,
        capabilities=engine_capabilities(ours["engine"]),
        name=f"Azure Blob ({ours['engine']})",
        # Rebuilding (expired SAS or token) reads the options and the
        # AZURE_STORAGE_* variables afresh. A partial, not a closure: Checkpoints pickle.
        rebuild=functools.partial(_rebuild, uri, options),
        account_host=_account_host_from_uri(uri),
    )


def _rebuild(uri: str, storage_options: Mapping[str, Any]) -> pafs.FileSystem:
    ours, extra = _options(uri, storage_options)
    if ours["engine"] == "pyarrow":
        return _build_pyarrow(ours, extra)
    return _build_adlfs(ours, extra)
