"""Google Cloud Storage for checkpoint-store, through gcsfs.

Registered for ``gs://`` and ``gcs://`` through the ``checkpoint_store.backends``
entry-point group. The filesystem is ``gcsfs.GCSFileSystem`` wrapped with
``pyarrow.fs.PyFileSystem(FSSpecHandler(...))``.

Storage options:

================= ============================================= ===========================
option            meaning                                       environment
================= ============================================= ===========================
``endpoint_url``  ``http(s)://host:port`` of an emulator or     ``STORAGE_EMULATOR_HOST``
                  GCS-compatible store
``token``         ``"anon"``, ``"google_default"``, a service-  ``GOOGLE_APPLICATION_``
                  account JSON path, or its dict                ``CREDENTIALS``
``project``       project id (bucket creation, billing)         ``GOOGLE_CLOUD_PROJECT``
``request_timeout`` seconds a request may wait for the server's
                  next byte (default :data:`REQUEST_TIMEOUT_S`)
``connect_timeout`` seconds to open a connection (default
                  :data:`CONNECT_TIMEOUT_S`)
================= ============================================= ===========================

Both timeouts must be numbers > 0 (else :class:`InvalidConfigError`); they
become gcsfs's ``requests_timeout`` (an ``aiohttp.ClientTimeout`` with no
total limit, so a large transfer that keeps moving is not cut). gcsfs tries
each request :data:`ENGINE_ATTEMPTS` times, not its 6 over 31 s of waits: a
store that stops answering fails a storage call within about a minute, and
checkpoint-store's own retry policy then stops retrying
(``RetryPolicy.max_elapsed``). A ``requests_timeout`` given outright is
passed to gcsfs unchanged and replaces both. Buckets with gcsfs's zonal
(gRPC) variant keep that client's own deadlines.

Anything else goes to ``gcsfs.GCSFileSystem`` unchanged. With a custom
endpoint, gcsfs's core class is used even where ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
selected its hierarchical-namespace variant: emulators cannot answer that
variant's bucket probe, and each bucket call would wait 60 s.
Tokens are never printed: ``repr(backend)`` names the engine only.
A string given for an option of :data:`OPTION_TYPES` (the command line's
``-o KEY=VALUE`` gives strings) is converted to that option's type. With
``version_aware`` on, gcsfs reads ``#`` in a name as an object generation:
names holding ``#`` or ``?generation=`` are then refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import (
    Backend,
    Capabilities,
    bool_option,
    timeout_option,
    typed_options,
)
from checkpoint_store.backends.handlers import wrap_fsspec
from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError

__all__ = ["CONNECT_TIMEOUT_S", "ENGINE_ATTEMPTS", "GCS_CAPABILITIES", "OPTION_TYPES",
           "REQUEST_TIMEOUT_S", "gcs_backend"]

#: Seconds a request may wait for the server's next byte. gcsfs sets no limit
#: (aiohttp's 300 s total, which would also cut a large upload that is still
#: moving); 20 s as for S3 and Azure.
REQUEST_TIMEOUT_S = 20.0
#: Seconds to open a connection.
CONNECT_TIMEOUT_S = 10.0
#: Tries per request inside gcsfs (its own default is 6), before
#: checkpoint-store's own retries.
ENGINE_ATTEMPTS = 3
_TIMEOUT_DEFAULTS = {"request_timeout": REQUEST_TIMEOUT_S, "connect_timeout": CONNECT_TIMEOUT_S}
# gcsfs's methods that retry (gcsfs.retry.retry_request, 6 tries fixed when
# the class is defined): a subclass re-wraps them with ENGINE_ATTEMPTS.
_RETRIED_METHODS = ("_request", "_get_file_request", "_get_file_concurrent")

GCS_CAPABILITIES = Capabilities(
    atomic_rename=False,
    needs_fsync=False,
    server_side_copy=True,
    strong_listing=True,  # GCS lists strongly consistent after writes
    directories=False,
    chunk_size=32 * 1024 * 1024,
    concurrency=8,
)


#: Every storage option the GCS backend knows, with its type: ours (see the
#: module docstring), then those of ``gcsfs.GCSFileSystem`` a user sets most.
OPTION_TYPES: dict[str, type] = {
    "endpoint_url": str, "token": str, "project": str,
    "access": str, "consistency": str, "requester_pays": bool, "version_aware": bool,
    "block_size": int, "cache_timeout": float, "timeout": float, "check_connection": bool,
    "default_location": str, "request_timeout": float, "connect_timeout": float,
}


def _unreachable_at_once(func: Any) -> Any:
    """``func`` (a gcsfs request coroutine) raising a connection that could not be
    opened at all (refused, a host name that does not resolve) as a plain
    ``ConnectionRefusedError``/``OSError``, which gcsfs's retry loop does not
    retry: a wrong address is not fixed by waiting, and checkpoint-store's own
    policy gives up on it after two quick tries (``StorageUnreachableError``)."""
    import aiohttp

    @functools.wraps(func)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return await func(*args, **kwargs)
        except aiohttp.ClientConnectorError as exc:
            cause = getattr(exc, "os_error", None)
            if isinstance(cause, ConnectionRefusedError):
                raise ConnectionRefusedError(str(exc)) from exc
            if type(exc).__name__ == "ClientConnectorDNSError":
                raise OSError(str(exc)) from exc
            raise

    return call


@functools.cache
def _bounded_class(base: type) -> type:
    """``base`` (a gcsfs filesystem class) trying each request :data:`ENGINE_ATTEMPTS`
    times. Named ``_Bounded<base name>`` in this module, so that pickles find it."""
    from gcsfs.retry import retry_request

    bounded = retry_request(retries=ENGINE_ATTEMPTS)
    methods = {m: bounded(_unreachable_at_once(getattr(base, m).__wrapped__))
               for m in _RETRIED_METHODS
               if hasattr(getattr(base, m, None), "__wrapped__")}
    name = f"_Bounded{base.__name__}"
    return type(name, (base,), {**methods, "__module__": __name__, "__qualname__": name})


def __getattr__(name: str) -> Any:
    # A pickle made in another process names a class _bounded_class made there.
    if name.startswith("_Bounded"):
        import gcsfs
        from gcsfs.core import GCSFileSystem as CoreGCSFileSystem

        for base in (CoreGCSFileSystem, gcsfs.GCSFileSystem):
            if name == f"_Bounded{base.__name__}":
                return _bounded_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _requests_timeout(options: dict[str, Any]) -> Any:
    """gcsfs's ``requests_timeout`` from our two timeout options (popped)."""
    import aiohttp

    seconds = {k: timeout_option("GCS", k, options.pop(k, d), d)
               for k, d in _TIMEOUT_DEFAULTS.items()}
    # No total: a large transfer that keeps moving may take longer.
    return aiohttp.ClientTimeout(total=None, sock_connect=seconds["connect_timeout"],
                                 sock_read=seconds["request_timeout"])


def _build(options: Mapping[str, Any]) -> pafs.FileSystem:
    kwargs: dict[str, Any] = {
        # A listing must show what another process just wrote (retention, resume).
        "use_listings_cache": False,
        "skip_instance_cache": True,
        "block_size": GCS_CAPABILITIES.chunk_size,
    }
    kwargs.update(options)
    timeout = _requests_timeout(kwargs)
    kwargs.setdefault("requests_timeout", timeout)
    endpoint = kwargs.get("endpoint_url")
    if endpoint is None and os.environ.get("STORAGE_EMULATOR_HOST"):
        endpoint = os.environ["STORAGE_EMULATOR_HOST"]
        if "://" not in endpoint:
            endpoint = "http://" + endpoint
        kwargs["endpoint_url"] = endpoint
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise InvalidConfigError(f"GCS endpoint_url {endpoint!r} is not http(s)://host[:port]")
        kwargs.setdefault("token", "anon")
    if "project" not in kwargs and os.environ.get("GOOGLE_CLOUD_PROJECT"):
        kwargs["project"] = os.environ["GOOGLE_CLOUD_PROJECT"]
    try:
        import gcsfs
        from gcsfs.core import GCSFileSystem as CoreGCSFileSystem
    except ImportError:
        raise BackendUnavailableError(
            "gs:// needs gcsfs: pip install checkpoint-store-gcs"
        ) from None
    # gcsfs.GCSFileSystem may be the hierarchical-namespace variant (chosen when
    # gcsfs is imported); its bucket probe stalls 60 s on emulators, so a custom
    # endpoint always gets the core class.
    cls = _bounded_class(CoreGCSFileSystem if endpoint is not None else gcsfs.GCSFileSystem)
    try:
        fs = cls(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"gcsfs.GCSFileSystem rejected the storage options ({type(exc).__name__}); "
            "check the option names"
        ) from None
    except ValueError:
        raise InvalidConfigError(
            "GCS credentials were rejected; check the token option (\"anon\", "
            "\"google_default\", or a service-account JSON path)"
        ) from None
    return wrap_fsspec(fs)


def gcs_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``gs://bucket/key`` and ``gcs://bucket/key`` URIs.

    Args:
        uri: the URI being resolved; only its scheme is used here.
        storage_options: see the module docstring.

    Returns:
        A :class:`~checkpoint_store.backends.Backend` with
        :data:`GCS_CAPABILITIES` (marker-last commit).

    Raises:
        InvalidConfigError: malformed endpoint or options gcsfs rejects.
        BackendUnavailableError: gcsfs is not installed.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "gs"
    options = typed_options(storage_options, OPTION_TYPES, "GCS")
    _requests_timeout(dict(options))  # refused here, before any client is made
    caps = GCS_CAPABILITIES
    if bool_option("version_aware", options.get("version_aware", False)):
        # gcsfs then splits "#<generation>" and "?generation=" off every path.
        caps = dataclasses.replace(caps, unsupported_name_characters="#",
                                   unsupported_name_hint="gcsfs reads it as an object "
                                   "generation with version_aware on",
                                   unsupported_name_parts=("?generation=",))

    # A partial, not a closure: Checkpoints pickle with their backend.
    build = functools.partial(_build, options)
    return Backend(
        build(), scheme=scheme, capabilities=caps, name="GCS (gcsfs)", rebuild=build
    )
