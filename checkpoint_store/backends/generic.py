"""The generic fsspec backend: a scheme no backend is registered for.

:func:`checkpoint_store.registry.resolve` falls back here for a scheme that
fsspec knows and nobody registered (with a warning that it is untested), and
refuses, naming why, the fsspec protocols that cannot hold checkpoints.
Also the conservative capabilities of such a store, by protocol.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from typing import Any

from checkpoint_store.backends.base import (
    OBJECT_STORE_CAPABILITIES,
    Backend,
    Capabilities,
    redact_uri,
    scrub_secrets,
    typed_options,
)
from checkpoint_store.backends.engine_errors import as_os_error
from checkpoint_store.backends.handlers import wrap_filesystem
from checkpoint_store.errors import (
    BackendUnavailableError,
    CheckpointStoreError,
    InvalidConfigError,
    PermanentBackendError,
    TransientBackendError,
)

__all__ = ["UNUSABLE_FSSPEC_PROTOCOLS"]


#: fsspec protocols that cannot hold checkpoints, and why: read-only
#: (checkpoints are written), listing nothing a commit can trust, or a cache
#: in front of another store (what it writes may never reach that store).
#: Refused with the reason before any filesystem is built.
UNUSABLE_FSSPEC_PROTOCOLS: dict[str, str] = {
    **dict.fromkeys(("http", "https"), "web servers are read-only to fsspec and list only "
                    "the links a page happens to hold"),
    **dict.fromkeys(("zip", "tar", "libarchive"), "archives open read-only (a new zip "
                    "takes no delete or rename), so nothing can be committed or evicted"),
    **dict.fromkeys(("github", "git", "reference", "data"), "it is read-only"),
    **dict.fromkeys(("simplecache", "filecache", "blockcache", "cached"),
                    "it is a local cache in front of another store: name that store instead"),
}


def _refuse_unusable(scheme: str, uri: str) -> None:
    reason = UNUSABLE_FSSPEC_PROTOCOLS.get(scheme)
    if reason is not None:
        raise InvalidConfigError(
            f"{redact_uri(uri) or scheme + '://'!r}: fsspec's {scheme!r} filesystem cannot "
            f"hold checkpoints ({reason}); write them to a local path or a writable store "
            "(s3://, az://, gs://, file://) and copy them there"
        )


def _fsspec_fallback(scheme: str, uri: str, options: Mapping[str, Any]) -> Backend | None:
    import fsspec

    # Both fsspec's table of known implementations and its runtime registrations.
    if scheme not in fsspec.available_protocols() and scheme not in fsspec.registry:
        return None
    _refuse_unusable(scheme, uri)
    warnings.warn(
        f"no checkpoint-store backend is registered for {scheme!r}; using the generic "
        "fsspec backend, which is untested for this store",
        stacklevel=4,
    )
    try:
        cls = fsspec.get_filesystem_class(scheme)
        fs = cls(**_typed_by_signature(cls, options, scheme))
    except ImportError as exc:
        raise BackendUnavailableError(
            f"scheme {scheme!r} needs a package that is not installed: {exc}"
        ) from None
    except TypeError as exc:
        raise InvalidConfigError(
            f"fsspec's {scheme!r} filesystem rejected the storage options ({exc})"
        ) from None
    except Exception as exc:
        raise unbuildable(scheme, uri, exc, options) from exc
    return Backend(
        wrap_filesystem(fs),
        scheme=scheme,
        capabilities=_generic_capabilities(scheme),
        name=f"fsspec:{scheme}",
    )


#: What an engine says when a Java runtime or Hadoop's client library is
#: missing (pyarrow's HadoopFileSystem: "Unable to load libjvm").
_NO_JAVA_RE = re.compile(r"libjvm|libhdfs|JAVA_HOME|CLASSPATH")


def unbuildable(scheme: str, uri: str, exc: Exception,
                options: Mapping[str, Any] | None = None) -> CheckpointStoreError:
    """The typed error for a filesystem of ``scheme`` whose construction failed
    with ``exc`` (an engine's error, not ours). Its text is quoted with the
    credentials among the storage ``options`` hidden, and any it carries as
    ``name=value`` (gcsfs quotes its token-check URL, ``?access_token=...``).

    Returns:
        :class:`BackendUnavailableError` when the machine lacks what the
        engine loads (a Java runtime, libhdfs); :class:`TransientBackendError`
        when it could not reach its server; else :class:`PermanentBackendError`.
    """
    if isinstance(exc, CheckpointStoreError):
        return exc
    err = as_os_error(exc, f"build the {scheme}:// filesystem")
    first = scrub_secrets((str(exc).strip().splitlines() or [""])[0], options)
    shown = redact_uri(uri) or f"{scheme}://"
    if _NO_JAVA_RE.search(str(exc)):
        return BackendUnavailableError(
            f"{shown!r}: the {scheme}:// filesystem needs a Java runtime and Hadoop's libhdfs, "
            f"which this machine lacks ({type(exc).__name__}: {first}). Install a JDK and "
            "Hadoop and set JAVA_HOME, HADOOP_HOME and CLASSPATH (`hadoop classpath --glob`), "
            "or ARROW_LIBHDFS_DIR; or store checkpoints elsewhere (a local path, s3://, gs://)"
        )
    if isinstance(err, (ConnectionError, TimeoutError)):
        return TransientBackendError(
            f"{shown!r}: the {scheme}:// filesystem could not reach its server "
            f"({type(exc).__name__}: {first}); check the address and the network, then retry"
        )
    return PermanentBackendError(
        f"{shown!r}: the {scheme}:// filesystem could not be built ({type(exc).__name__}: "
        f"{first}); check the location, the storage options and the credentials",
        cause=exc,
    )


def _typed_by_signature(cls: Any, options: Mapping[str, Any], scheme: str) -> dict[str, Any]:
    """``options`` with strings converted by the types of the defaults of
    ``cls.__init__`` (``port=22`` for sftp, ``anon=False``): a generic fsspec
    store declares its options no other way, and the command line's ``-o``
    gives strings."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError, ImportError):  # a class without a signature
        return dict(options)
    types = {name: type(p.default) for name, p in params.items()
             if type(p.default) in (bool, int, float)}
    return typed_options(options, types, f"fsspec {scheme!r}")


# fsspec protocols of flat object stores: no real directories, so we never
# create any. Every other protocol (sftp, ftp, smb, hdfs, webdav ...) has real
# directories that must exist before a file is written into them.
_OBJECT_STORE_PROTOCOLS = frozenset({
    "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "oss", "r2",
    "oci", "ocilake", "tos", "cos", "cosn", "obs", "b2", "swift", "lakefs", "hf",
})


#: Stores whose every client copies an object inside the store
#: (``copy_file`` / fsspec's ``cp_file``: S3 CopyObject, or UploadPartCopy
#: through s3fs; Azure Copy Blob; GCS rewrite), by fsspec protocol and by
#: pyarrow's ``type_name``: a filesystem of these passed in keeps the
#: incremental uploads its store's plugin has by URI.
_SERVER_COPY_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


_SERVER_COPY_CAPABILITIES = dataclasses.replace(OBJECT_STORE_CAPABILITIES, server_side_copy=True)


def _generic_capabilities(protocol: str) -> Capabilities:
    """Conservative capabilities for a store nobody wrote a backend for
    (an fsspec filesystem, or a pyarrow one of ``type_name`` ``protocol``)."""
    if protocol in _SERVER_COPY_STORES:
        return _SERVER_COPY_CAPABILITIES
    if protocol in _OBJECT_STORE_PROTOCOLS:
        return OBJECT_STORE_CAPABILITIES
    return Capabilities(directories=True, chunk_size=8 * 1024 * 1024, concurrency=4)
