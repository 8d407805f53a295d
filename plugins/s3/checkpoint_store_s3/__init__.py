"""Amazon S3 and S3-compatible stores (MinIO, Ceph, R2, moto) for checkpoint-store.

Registered for ``s3://`` and ``s3a://`` through the ``checkpoint_store.backends``
entry-point group. Two engines:

* ``pyarrow`` (default): ``pyarrow.fs.S3FileSystem``, C++ and multi-threaded,
  for reads, writes and listings. Deletes go through s3fs, because pyarrow
  writes an empty directory-marker object after every delete
  (:class:`MarkerFreeS3Handler`).
* ``s3fs``: ``s3fs.S3FileSystem`` for everything, wrapped with
  ``pyarrow.fs.PyFileSystem(FSSpecHandler(...))``. Chosen by
  ``storage_options={"engine": "s3fs"}``, and automatically (with a warning)
  when the installed pyarrow was built without S3 support.

Neither engine writes directory markers or any other zero-byte object.

Storage options (each falls back to the standard AWS variable shown):

===================== =========================================== ===========================
option                meaning                                     environment
===================== =========================================== ===========================
``engine``            ``"pyarrow"`` or ``"s3fs"``
``endpoint_url``      ``http(s)://host:port`` of an S3-compatible  ``AWS_ENDPOINT_URL_S3``,
                      store                                        ``AWS_ENDPOINT_URL``
``region``            e.g. ``"eu-west-1"``                        ``AWS_REGION``,
                                                                   ``AWS_DEFAULT_REGION``
``access_key_id``     (alias ``key``)                             ``AWS_ACCESS_KEY_ID``
``secret_access_key`` (alias ``secret``)                          ``AWS_SECRET_ACCESS_KEY``
``session_token``     (alias ``token``)                           ``AWS_SESSION_TOKEN``
``anonymous``         no credentials (public buckets)
``request_timeout``   seconds a request may wait for the server's
                      next byte (default :data:`REQUEST_TIMEOUT_S`)
``connect_timeout``   seconds to open a connection (default
                      :data:`CONNECT_TIMEOUT_S`)
===================== =========================================== ===========================

Both timeouts must be numbers > 0 (else :class:`InvalidConfigError`). Each
engine tries a request :data:`ENGINE_ATTEMPTS` times, so a store that stops
answering fails a storage call after about a minute; checkpoint-store's own
retry policy then stops retrying (``RetryPolicy.max_elapsed``).

Any other option is passed to the engine's constructor unchanged
(``pyarrow.fs.S3FileSystem`` or ``s3fs.S3FileSystem``). A string given for
an option of :data:`OPTION_TYPES` (the command line's ``-o KEY=VALUE`` gives
strings) is converted to that option's type: ``-o request_timeout=3`` is 3.0.
Names holding ``?versionId=`` are refused: s3fs, which both engines delete
with, reads it as an object version wherever it appears in a key. Credentials not given
come from the engine's default AWS chain (variables, ``~/.aws``, instance
role). They are never printed: ``repr(backend)`` names the engine only.
"""

from __future__ import annotations

import functools
import os
import urllib.parse
import warnings
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import (
    Backend,
    Capabilities,
    bool_option,
    refuse_endpoint_credentials,
    timeout_option,
    typed_options,
)
from checkpoint_store.backends.handlers import MarkerFreeDeletesHandler, wrap_fsspec
from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError

__all__ = [
    "CONNECT_TIMEOUT_S",
    "ENGINE_ATTEMPTS",
    "OPTION_TYPES",
    "REQUEST_TIMEOUT_S",
    "S3_CAPABILITIES",
    "MarkerFreeS3Handler",
    "s3_backend",
]

#: Seconds a request may wait for the server's next byte before the client
#: gives up and sends it again. The engines' defaults are shorter than a
#: store may take to answer CompleteMultipartUpload, which sends nothing
#: until the object is assembled: pyarrow's AWS SDK gives up after 3 s
#: without a byte (curl's low-speed limit, Linux included), s3fs after 15 s.
#: The request sent again then races the first one still running: moto 5.2
#: answers 500 (INTERNAL_FAILURE: the first one closed the parts the second
#: is reading), or NoSuchUpload once the first has finished; either way the
#: upload fails. Real S3 keeps a slow CompleteMultipartUpload alive with
#: whitespace. Longer (botocore's 60 s) would let a store that stopped
#: answering hold each storage call for ENGINE_ATTEMPTS minutes.
REQUEST_TIMEOUT_S = 20.0
#: Seconds to open a connection (both engines).
CONNECT_TIMEOUT_S = 10.0
#: Tries per request inside the engine (pyarrow's AWS SDK, botocore), before
#: checkpoint-store's own retries (botocore's legacy mode would make 5).
ENGINE_ATTEMPTS = 3
_TIMEOUTS = ("request_timeout", "connect_timeout")

# Each ranged GET is a full request (and against some servers a re-read of the
# object), so large chunks: 64 MiB reads were 30x faster than pyarrow's 1 MiB
# default against moto. Eight files in flight keep at most 512 MiB buffered.
S3_CAPABILITIES = Capabilities(
    atomic_rename=False,
    needs_fsync=False,
    server_side_copy=True,
    strong_listing=True,  # S3 is strongly consistent for list-after-write since 2020
    directories=False,
    chunk_size=64 * 1024 * 1024,
    concurrency=8,
    unsupported_name_parts=("?versionId=",),
)

_ALIASES = {
    "key": "access_key_id",
    "access_key": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "secret_key": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "token": "session_token",
    "aws_session_token": "session_token",
    "endpoint": "endpoint_url",
    "endpoint_override": "endpoint_url",
    "region_name": "region",
    "anon": "anonymous",
}
#: Every storage option the S3 backend knows, with its type: ours (see the
#: module docstring), then those of the engines' constructors that a user
#: sets most (``pyarrow.fs.S3FileSystem``, ``s3fs.S3FileSystem``). Aliases
#: take the type of the option they name.
OPTION_TYPES: dict[str, type] = {
    "engine": str, "endpoint_url": str, "region": str, "access_key_id": str,
    "secret_access_key": str, "session_token": str, "anonymous": bool,
    "request_timeout": float,
    # pyarrow.fs.S3FileSystem
    "connect_timeout": float, "role_arn": str, "session_name": str, "external_id": str,
    "load_frequency": int, "scheme": str, "tls_ca_file_path": str,
    "force_virtual_addressing": bool, "background_writes": bool,
    "allow_bucket_creation": bool, "allow_bucket_deletion": bool,
    "check_directory_existence_before_creation": bool, "allow_delayed_open": bool,
    # s3fs.S3FileSystem
    "use_ssl": bool, "requester_pays": bool, "version_aware": bool, "cache_regions": bool,
    "max_concurrency": int, "default_block_size": int, "fixed_upload_size": bool,
}
# pyarrow options that change how requests are authenticated or routed, which
# an s3fs client could not mirror: with any of them, pyarrow also deletes.
_PYARROW_ONLY_ACCESS = frozenset({
    "role_arn", "session_name", "external_id", "load_frequency", "proxy_options",
    "tls_ca_file_path", "scheme", "force_virtual_addressing",
})
#: pyarrow-only options that shape what is written (an ACL or content type on
#: every object): every byte then goes through pyarrow, since objects the
#: s3fs client wrote (a large file's parallel parts) would lack them.
_PYARROW_ONLY_WRITES = frozenset({"default_metadata"})
#: pyarrow's timeouts, which s3fs takes as botocore's (config_kwargs
#: read_timeout and connect_timeout): both engines honour both.
_TIMEOUTS = ("request_timeout", "connect_timeout")
_TYPES_WITH_ALIASES = {**{a: OPTION_TYPES[c] for a, c in _ALIASES.items()}, **OPTION_TYPES}
_ENGINES = ("pyarrow", "s3fs")


def _normalise(storage_options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split into (our options under canonical names, engine pass-through options),
    strings of typed options converted (:data:`OPTION_TYPES`)."""
    ours: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    typed = typed_options(storage_options, _TYPES_WITH_ALIASES, "S3")
    for key, value in typed.items():
        canonical = _ALIASES.get(key, key)
        if canonical in (
            "engine", "endpoint_url", "region", "access_key_id", "secret_access_key",
            "session_token", "anonymous",
        ):
            if canonical in ours and ours[canonical] != value:
                raise InvalidConfigError(
                    f"S3 storage option {canonical!r} was given twice (as {key!r} and an "
                    "alias); pass it once"
                )
            ours[canonical] = value
        else:
            extra[key] = value
    if "anonymous" in ours:
        ours["anonymous"] = bool_option("anonymous", ours["anonymous"])
    for name in _TIMEOUTS:
        if name in extra:
            extra[name] = _check_timeout(name, extra[name])
    env = os.environ
    ours.setdefault("endpoint_url", env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
    refuse_endpoint_credentials("endpoint_url", ours["endpoint_url"])
    ours.setdefault("region", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
    engine = ours.get("engine") or "pyarrow"
    if engine not in _ENGINES:
        raise InvalidConfigError(
            f"unknown S3 engine {engine!r}: use one of {', '.join(_ENGINES)}"
        )
    if bool(ours.get("access_key_id")) != bool(ours.get("secret_access_key")):
        raise InvalidConfigError(
            "S3 credentials need both access_key_id and secret_access_key (or neither, "
            "to use the AWS default chain: AWS_* variables, ~/.aws, instance role)"
        )
    return ours, extra


def _check_timeout(name: str, value: Any) -> float:
    default = REQUEST_TIMEOUT_S if name == "request_timeout" else CONNECT_TIMEOUT_S
    return timeout_option("S3", name, value, default)


def _split_endpoint(endpoint_url: str) -> tuple[str, str]:
    """``http://h:p`` -> ``("http", "h:p")``.

    Raises:
        InvalidConfigError: no ``http://`` or ``https://`` in front. Guessing
            one would try TLS (three times, with retries) against a local
            plain-HTTP server and fail late with a network error.
    """
    if "://" not in endpoint_url:
        raise InvalidConfigError(
            f"S3 endpoint_url {endpoint_url!r} has no scheme: add http:// (a local or "
            "plain-HTTP server) or https:// in front"
        )
    parsed = urllib.parse.urlsplit(endpoint_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidConfigError(
            f"S3 endpoint_url {endpoint_url!r} is not http(s)://host[:port]"
        )
    return parsed.scheme, parsed.netloc


def _pyarrow_s3_class() -> Any | None:
    """``pyarrow.fs.S3FileSystem``, or None when this pyarrow was built without S3."""
    try:
        cls = pafs.S3FileSystem
    except (ImportError, AttributeError):
        return None
    return cls


class MarkerFreeS3Handler(MarkerFreeDeletesHandler):
    """pyarrow's S3 client for reads, writes and listings; s3fs for deletes.

    After every delete, ``pyarrow.fs.S3FileSystem`` writes an empty ``parent/``
    directory-marker object so that the parent keeps "existing" (Arrow's
    ``EnsureParentExists``). That costs a request per delete, litters the
    bucket with zero-byte objects, and fails outright on S3-compatible stores
    that reject zero-byte objects. s3fs deletes just the keys.
    """

    def __init__(self, native: pafs.FileSystem, deleter: Any):
        super().__init__(native, deleter, type_name="s3")


def _build_pyarrow(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> pafs.FileSystem:
    cls = _pyarrow_s3_class()
    if cls is None:
        raise BackendUnavailableError(
            "this pyarrow was built without S3 support: install a pyarrow wheel from "
            "PyPI, or use the s3fs engine: storage_options={'engine': 's3fs'}"
        )
    kwargs: dict[str, Any] = {}
    if ours.get("endpoint_url"):
        scheme, netloc = _split_endpoint(ours["endpoint_url"])
        kwargs["endpoint_override"] = netloc
        kwargs["scheme"] = scheme
    if ours.get("region"):
        kwargs["region"] = ours["region"]
    elif ours.get("endpoint_url"):
        # A custom endpoint has no region lookup; the SDK's fallback probes hosts.
        kwargs["region"] = "us-east-1"
    if ours.get("access_key_id"):
        kwargs["access_key"] = ours["access_key_id"]
        kwargs["secret_key"] = ours["secret_access_key"]
        if ours.get("session_token"):
            kwargs["session_token"] = ours["session_token"]
    if ours.get("anonymous"):
        kwargs["anonymous"] = True
    # A small file then costs one PUT instead of three multipart requests
    # (2.4x faster for 100-byte files against moto); errors surface at close.
    kwargs["allow_delayed_open"] = True
    kwargs["request_timeout"] = REQUEST_TIMEOUT_S
    kwargs["connect_timeout"] = CONNECT_TIMEOUT_S
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=ENGINE_ATTEMPTS)
    kwargs.update(extra)
    try:
        native = cls(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"pyarrow.fs.S3FileSystem rejected the storage options ({exc}); "
            f"known options: {', '.join(sorted(OPTION_TYPES))}"
        ) from None
    except ImportError as exc:  # a pyarrow whose S3 support fails only when used
        raise BackendUnavailableError(
            f"pyarrow's S3 support cannot be used ({exc}); use the s3fs engine: "
            "storage_options={'engine': 's3fs'}"
        ) from None
    if (_PYARROW_ONLY_ACCESS | _PYARROW_ONLY_WRITES) & set(extra):
        # s3fs could not reach the store the same way, or would write objects
        # without the metadata asked for: pyarrow deletes and writes everything
        # (and leaves its directory markers).
        return native
    try:
        # The same patience as the reads and writes (see REQUEST_TIMEOUT_S).
        deleter = _s3fs_instance(ours, {k: v for k, v in extra.items() if k in _TIMEOUTS})
    except BackendUnavailableError:
        return native
    return pafs.PyFileSystem(MarkerFreeS3Handler(native, deleter))


def _s3fs_instance(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
    try:
        import s3fs
    except ImportError:
        raise BackendUnavailableError(
            "the s3fs engine needs s3fs: pip install checkpoint-store-s3"
        ) from None
    kwargs: dict[str, Any] = {
        # A listing must show what another process just wrote (retention, resume).
        "use_listings_cache": False,
        "skip_instance_cache": True,
        # One ranged GET per transfer chunk, not many small ones.
        "default_block_size": S3_CAPABILITIES.chunk_size,
    }
    if ours.get("endpoint_url"):
        _split_endpoint(ours["endpoint_url"])
        kwargs["endpoint_url"] = ours["endpoint_url"]
    client_kwargs = dict(extra.get("client_kwargs") or {})
    config_kwargs = dict(extra.get("config_kwargs") or {})
    config_kwargs.setdefault("read_timeout", extra.get("request_timeout", REQUEST_TIMEOUT_S))
    config_kwargs.setdefault("connect_timeout", extra.get("connect_timeout", CONNECT_TIMEOUT_S))
    config_kwargs.setdefault("retries", {"max_attempts": ENGINE_ATTEMPTS, "mode": "standard"})
    kwargs["config_kwargs"] = config_kwargs
    if ours.get("region"):
        client_kwargs.setdefault("region_name", ours["region"])
    if client_kwargs:
        kwargs["client_kwargs"] = client_kwargs
    if ours.get("access_key_id"):
        kwargs["key"] = ours["access_key_id"]
        kwargs["secret"] = ours["secret_access_key"]
        if ours.get("session_token"):
            kwargs["token"] = ours["session_token"]
    if ours.get("anonymous"):
        kwargs["anon"] = True
    kwargs.update({k: v for k, v in extra.items()
                   if k not in ("client_kwargs", "config_kwargs", *_TIMEOUTS)})
    try:
        fs = s3fs.S3FileSystem(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"s3fs.S3FileSystem rejected the storage options ({exc})"
        ) from None
    # botocore already tries each request ENGINE_ATTEMPTS times; s3fs's own
    # five tries around it (a class attribute) would make a store that stopped
    # answering hold one call for 5 x 3 x request_timeout.
    fs.retries = 1
    return fs


def _build_s3fs(ours: Mapping[str, Any], extra: Mapping[str, Any]) -> pafs.FileSystem:
    return wrap_fsspec(_s3fs_instance(ours, extra))


def s3_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``s3://bucket/key`` and ``s3a://bucket/key`` URIs.

    Args:
        uri: the URI being resolved; only its scheme is used here.
        storage_options: see the module docstring.

    Returns:
        A :class:`~checkpoint_store.backends.Backend` with
        :data:`S3_CAPABILITIES` (marker-last commit, no directory markers).

    Raises:
        InvalidConfigError: unknown engine, malformed endpoint, half credentials,
            or options the engine rejects.
        BackendUnavailableError: the engine's library is missing.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "s3"
    options = dict(storage_options)
    filesystem, engine = _build(options, warn=True)
    return Backend(
        filesystem,
        scheme=scheme,
        capabilities=S3_CAPABILITIES,
        name=f"S3 ({engine})",
        # Rebuilding (expired credentials) reads the options and the AWS_*
        # variables afresh. A partial, not a closure: Checkpoints pickle.
        rebuild=functools.partial(_rebuild, options),
    )


def _build(storage_options: Mapping[str, Any], *, warn: bool = False
           ) -> tuple[pafs.FileSystem, str]:
    ours, extra = _normalise(storage_options)
    engine = ours.get("engine") or "pyarrow"
    if engine == "pyarrow" and _pyarrow_s3_class() is None and "engine" not in storage_options:
        try:
            import s3fs  # noqa: F401
        except ImportError:
            pass
        else:
            if warn:
                warnings.warn(
                    "this pyarrow was built without S3 support; using the s3fs engine",
                    stacklevel=4,
                )
            engine = "s3fs"
    if engine == "s3fs":
        return _build_s3fs(ours, extra), engine
    return _build_pyarrow(ours, extra), engine


def _rebuild(storage_options: Mapping[str, Any]) -> pafs.FileSystem:
    return _build(storage_options)[0]
