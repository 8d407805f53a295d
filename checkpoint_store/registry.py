"""Which backend serves which URI scheme.

Two ways to add a backend. In code::

    from checkpoint_store import register_backend
    register_backend("myfs", "my_pkg.backend:make_backend")   # dotted path, imported lazily
    register_backend("myfs", make_backend, clobber=True)      # or the callable itself

Through packaging, in the plugin distribution's ``pyproject.toml``::

    [project.entry-points."checkpoint_store.backends"]
    myfs = "my_pkg.backend:make_backend"

A factory is called as ``factory(uri, storage_options)`` and returns a
:class:`~checkpoint_store.backends.Backend`.

Precedence, highest first: :func:`register_backend` calls in this process,
then entry points of other distributions, then the built-ins shipped in
checkpoint-store itself (which are entry points too). Registering a scheme
that is already known, by any of the three, needs ``clobber=True``; two other
distributions claiming one scheme is a warning (the first by name wins).
Nothing is imported
until a scheme is first used, so ``import checkpoint_store`` stays cheap and
imports no cloud SDK.

A scheme nobody registered but fsspec knows falls back to a generic fsspec
backend, with a warning that it is untested. A known cloud scheme whose
plugin is not installed raises :class:`BackendUnavailableError` naming the
distribution to install. Anything else raises :class:`UnknownSchemeError`
listing the registered schemes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import (
    LOCAL_CAPABILITIES,
    MEMORY_CAPABILITIES,
    OBJECT_STORE_CAPABILITIES,
    Backend,
    Capabilities,
    canonical_path,
    check_location_text,
    redact_uri,
)
from checkpoint_store.backends.engine_errors import as_os_error
from checkpoint_store.backends.generic import (
    _SERVER_COPY_STORES,
    _fsspec_fallback,
    _generic_capabilities,
    _refuse_unusable,
    unbuildable,
)
from checkpoint_store.backends.generic import UNUSABLE_FSSPEC_PROTOCOLS as UNUSABLE_FSSPEC_PROTOCOLS
from checkpoint_store.backends.generic import _typed_by_signature as _typed_by_signature
from checkpoint_store.backends.handlers import check_filesystem, wrap_filesystem
from checkpoint_store.errors import (
    BackendUnavailableError,
    CheckpointStoreError,
    InvalidConfigError,
    UnknownSchemeError,
)

ENTRY_POINT_GROUP = "checkpoint_store.backends"
_OWN_DISTRIBUTION = "checkpoint-store"

# Used when checkpoint-store runs from a source tree that was never installed
# (no entry-point metadata); an installed checkpoint-store declares the same.
_BUILTINS: dict[str, str] = {
    "file": "checkpoint_store.backends.local:local_backend",
    "local": "checkpoint_store.backends.local:local_backend",
    "memory": "checkpoint_store.backends.memory:memory_backend",
}

# Schemes with a plugin distribution of ours: what to install when missing.
KNOWN_PLUGINS: dict[str, str] = {
    "s3": "checkpoint-store-s3",
    "s3a": "checkpoint-store-s3",
    "az": "checkpoint-store-azure",
    "abfs": "checkpoint-store-azure",
    "abfss": "checkpoint-store-azure",
    "gs": "checkpoint-store-gcs",
    "gcs": "checkpoint-store-gcs",
}

_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.\-]*$")
_URI_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_WINDOWS_DRIVE_RE = re.compile(r"^[A-Za-z]:[\\/]")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

Factory = Callable[[str, Mapping[str, Any]], Backend]

_lock = threading.Lock()
_code_registered: dict[str, Factory | str] = {}
_entry_points: dict[str, tuple[str, str]] | None = None  # scheme -> (value, distribution)


def _validate_scheme(scheme: str) -> str:
    if not isinstance(scheme, str) or not _SCHEME_RE.match(scheme):
        raise InvalidConfigError(
            f"invalid scheme {scheme!r}: use lowercase letters, digits, '+', '-' or '.', "
            "starting with a letter (like 's3' or 'myfs')"
        )
    return scheme


def register_backend(scheme: str, factory: Factory | str, *, clobber: bool = False) -> None:
    """Register ``factory`` for URIs starting with ``scheme://``.

    Args:
        scheme: lowercase URI scheme, e.g. ``"myfs"``.
        factory: a callable ``(uri, storage_options) -> Backend`` or a dotted
            path ``"package.module:function"`` imported on first use.
        clobber: replace a scheme that is already registered, in code, by a
            plugin's entry point or built in. Without it, registering a known
            scheme is an error. A code registration then takes precedence
            over entry points and built-ins for the rest of the process.

    Raises:
        InvalidConfigError: the scheme or dotted path is malformed, or the
            scheme is already registered and ``clobber`` is False.
        TypeError: ``factory`` is neither callable nor a string.
    """
    _validate_scheme(scheme)
    if isinstance(factory, str):
        if not re.match(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$", factory):
            raise InvalidConfigError(
                f"dotted path {factory!r} is not 'package.module:function'"
            )
    elif not callable(factory):
        raise TypeError(f"factory must be callable or a dotted path, got {type(factory).__name__}")
    with _lock:
        existing = available_backends().get(scheme)
        if existing is not None and not clobber:
            where = "in code" if existing == "code" else f"by {existing}"
            raise InvalidConfigError(
                f"scheme {scheme!r} is already registered {where}; pass clobber=True to "
                "replace it"
            )
        _code_registered[scheme] = factory


def unregister_backend(scheme: str) -> None:
    """Remove a code registration (entry points and built-ins stay)."""
    with _lock:
        _code_registered.pop(scheme, None)


def _load_entry_points() -> dict[str, tuple[str, str]]:
    """``{scheme: (dotted value, distribution)}`` from installed metadata (nothing imported).

    Other distributions win over checkpoint-store's own built-ins. Two other
    distributions claiming one scheme: the first by distribution name wins,
    with a warning naming both.
    """
    global _entry_points
    if _entry_points is None:
        found: dict[str, tuple[str, str]] = {}
        eps = sorted(
            entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (ep.dist is not None and ep.dist.name != _OWN_DISTRIBUTION,
                            ep.dist.name if ep.dist is not None else ""),
            reverse=False,
        )
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "?"
            if ep.name in found:
                prev_dist = found[ep.name][1]
                if prev_dist == dist:
                    continue
                if prev_dist != _OWN_DISTRIBUTION:
                    warnings.warn(
                        f"both {prev_dist} and {dist} register the {ep.name!r} storage "
                        f"scheme; using {prev_dist}. Uninstall one, or call "
                        "checkpoint_store.register_backend(..., clobber=True)",
                        stacklevel=3,
                    )
                    continue
            found[ep.name] = (ep.value, dist)
        _entry_points = found
    return _entry_points


def available_backends() -> dict[str, str]:
    """Registered schemes and where each comes from.

    Returns:
        ``{scheme: source}``, source being ``"code"`` for
        :func:`register_backend`, else the distribution name that provides it.
    """
    result: dict[str, str] = {s: _OWN_DISTRIBUTION for s in _BUILTINS}
    for scheme, (_, dist) in _load_entry_points().items():
        result[scheme] = dist
    for scheme in _code_registered:
        result[scheme] = "code"
    return dict(sorted(result.items()))


def _import_dotted(value: str) -> Any:
    module, _, attr = value.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def _factory_for(scheme: str) -> tuple[Factory, str]:
    """The factory for ``scheme`` and a label naming where it came from."""
    if scheme in _code_registered:
        entry = _code_registered[scheme]
        label = f"code-registered backend {scheme!r}"
        if isinstance(entry, str):
            return _import_dotted(entry), f"{label} ({entry})"
        return entry, label
    eps = _load_entry_points()
    if scheme in eps:
        value, dist = eps[scheme]
        label = f"plugin {value!r} from distribution {dist!r}"
        try:
            return _import_dotted(value), label
        except (ImportError, AttributeError) as exc:
            raise BackendUnavailableError(
                f"the {label} for {scheme}:// failed to import ({type(exc).__name__}: {exc}); "
                f"reinstall it: pip install --force-reinstall {dist}"
            ) from None
    if scheme in _BUILTINS:
        return _import_dotted(_BUILTINS[scheme]), f"built-in backend {scheme!r}"
    raise KeyError(scheme)


def _call_factory(factory: Factory, label: str, uri: str, options: Mapping[str, Any]) -> Backend:
    try:
        backend = factory(uri, options)
    except Exception as exc:
        # An engine that failed while being built (a client that loads a
        # library, or connects, at construction): typed, never raw.
        if isinstance(exc, CheckpointStoreError) or not isinstance(
                as_os_error(exc, label), OSError):
            raise
        raise unbuildable(uri.partition("://")[0].lower(), uri, exc, options) from exc
    if not isinstance(backend, Backend):
        raise TypeError(
            f"{label} returned {type(backend).__name__}, not a checkpoint_store Backend"
        )
    return backend












#: Name characters an fsspec client passed in as a filesystem object cannot
#: keep, by the client's top-level module: (characters, what to do instead).
#: adlfs parses every path as a URL, so a '?' or '#' ending a name starts an
#: empty query or fragment and is dropped ("d/a?" is written as "d/a"): the
#: same limit as the Azure plugin's adlfs engine, which documents the details.
_FSSPEC_NAME_LIMITS: dict[str, tuple[str, str]] = {
    "adlfs": ("?#", "for '?', give the location as az://container/path with "
                    "storage_options={'engine': 'pyarrow'}, which stores it"),
}



#: Strings an fsspec client passed in as a filesystem object reads out of a
#: name wherever they appear (:attr:`Capabilities.unsupported_name_parts`):
#: s3fs takes "?versionId=" as an object version, as in the S3 plugin.
_FSSPEC_NAME_PARTS: dict[str, tuple[str, ...]] = {"s3fs": ("?versionId=",)}




def split_scheme(location: str) -> str | None:
    """The lowercase scheme of ``location``, or None for a plain local path.

    Raises:
        InvalidConfigError: it has a scheme but not ``scheme://`` (``s3:/bucket``).
    """
    if _WINDOWS_DRIVE_RE.match(location) and os.name == "nt":
        return None
    m = _URI_SCHEME_RE.match(location)
    if not m:
        return None
    if not location[m.end() :].startswith("//"):
        raise InvalidConfigError(
            f"malformed URI {location!r}: expected {m.group(1)}://..., "
            "or use a path without a scheme for local storage"
        )
    return m.group(1).lower()


def local_path_from_uri(uri: str) -> str:
    """The absolute local path a ``file://`` (or ``local://``) URI names.

    As RFC 8089 reads it: ``file:///abs/path`` and ``file://localhost/abs/path``
    both mean ``/abs/path``, and the path is percent-decoded
    (``file:///a/sp%20ace`` is ``/a/sp ace``, as ``pathlib.Path.as_uri``
    writes it and ``pyarrow.fs.FileSystem.from_uri`` reads it). Any other host
    part (``file://name/x``) names another machine, which local storage cannot
    reach: refused, rather than writing to ``/name/x`` at the filesystem root.

    Raises:
        InvalidConfigError: the URI names a host other than ``localhost``, or
            no path at all (``file://``: the root is ``file:///``), or its
            path decodes to a control character (``%00``: NUL).
    """
    scheme, _, rest = uri.partition("://")
    if not rest:
        raise InvalidConfigError(
            f"{uri!r} names no path; write {scheme}:///abs/path (three slashes) or a plain path"
        )
    host, _, path = rest.partition("/")
    path = urllib.parse.unquote(path)
    control = _CONTROL_RE.search(path)
    if control is not None:
        # "%00" decodes to NUL: no local name holds one (pyarrow refuses it
        # at the first call, the OS at the first open).
        raise InvalidConfigError(
            f"{redact_uri(uri)!r} decodes to a path holding the control character "
            f"{control.group()!r} (%{ord(control.group()):02X}): no file name holds one; "
            "remove it from the URI"
        )
    if host.lower() not in ("", "localhost"):
        raise InvalidConfigError(
            f"{uri!r} names the host {host!r}: local storage cannot reach another machine. "
            f"For a local absolute path write {scheme}:///{host}/{path} (three slashes) or "
            f"the plain path /{host}/{path}; for a relative path, no scheme at all"
        )
    return canonical_path(pafs.LocalFileSystem(), "/" + path)


def backend_for_scheme(
    scheme: str, uri: str = "", storage_options: Mapping[str, Any] | None = None
) -> Backend:
    """Build the backend that serves ``scheme`` (see module docs for the rules).

    Raises:
        BackendUnavailableError: a known scheme whose plugin is not installed.
        UnknownSchemeError: nobody knows the scheme.
        TypeError: the factory returned something that is not a Backend.
    """
    options = dict(storage_options or {})
    try:
        factory, label = _factory_for(scheme)
    except KeyError:
        pass
    except BackendUnavailableError:
        raise
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"the backend registered for {scheme}:// failed to import "
            f"({type(exc).__name__}: {exc}); check the dotted path given to register_backend"
        ) from None
    else:
        return _call_factory(factory, label, uri or f"{scheme}://", options)
    if scheme in KNOWN_PLUGINS:
        dist = KNOWN_PLUGINS[scheme]
        raise BackendUnavailableError(
            f"{scheme}:// needs the {dist} plugin: pip install {dist}"
        )
    fallback = _fsspec_fallback(scheme, uri, options)
    if fallback is not None:
        return fallback
    known = ", ".join(sorted(available_backends()))
    raise UnknownSchemeError(
        f"unknown storage scheme {scheme!r} in {redact_uri(uri)!r}. Registered schemes: {known}. "
        "Install a plugin for it or call checkpoint_store.register_backend()"
    )


def backend_for_filesystem(filesystem: Any) -> Backend:
    """A Backend for a filesystem instance the user passed in.

    The instance is used as given for every I/O; only the capabilities are
    inferred from its type (and for fsspec filesystems, their protocol).
    One exception: fsspec's local filesystem (bare or in a ``PyFileSystem``)
    is the local disk, served by ``pyarrow.fs.LocalFileSystem`` like any
    local path: its ``mv`` moves a directory *into* an existing one where a
    commit needs the rename to fail, and it has no fsync.

    Raises:
        InvalidConfigError: not a pyarrow or fsspec filesystem instance
            (:func:`~checkpoint_store.backends.handlers.check_filesystem`).
    """
    check_filesystem(filesystem)
    if _fsspec_local_disk(filesystem) is not None:
        return backend_for_scheme("file", "file://", None)
    fs = wrap_filesystem(filesystem)
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler):
        protocol = fs.handler.fs.protocol
        _refuse_unusable(protocol if isinstance(protocol, str) else protocol[0], "")
    # A handler over one of our backends (checkpoint_store.integrations.ray)
    # says which: its real capabilities, not a guess from the wrapper's type.
    if isinstance(fs, pafs.PyFileSystem):
        inner = getattr(fs.handler, "checkpoint_store_backend", None)
        if isinstance(inner, Backend):
            return inner
    return Backend(fs, **_describe(fs))


def _fsspec_local_disk(filesystem: Any) -> Any | None:
    """fsspec's own ``LocalFileSystem`` inside ``filesystem``, else None.
    Subclasses may change behaviour and are used as given."""
    inner = filesystem
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(
        filesystem.handler, pafs.FSSpecHandler
    ):
        inner = filesystem.handler.fs
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        return None
    return inner if type(inner) is LocalFileSystem else None


def _describe(fs: pafs.FileSystem) -> dict[str, Any]:
    if isinstance(fs, pafs.LocalFileSystem):
        return {"scheme": "file", "capabilities": LOCAL_CAPABILITIES, "name": "local"}
    if isinstance(fs, pafs.SubTreeFileSystem):
        return _describe(fs.base_fs)
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler):
        inner = fs.handler.fs
        proto = inner.protocol if isinstance(inner.protocol, str) else inner.protocol[0]
        if proto == "memory":
            return {"scheme": "memory", "capabilities": MEMORY_CAPABILITIES, "name": "memory"}
        if proto in ("file", "local"):
            # A subclass of fsspec's local filesystem (the class itself becomes
            # pyarrow's LocalFileSystem): its mv moves a directory into an
            # existing one instead of failing, so no rename commit.
            caps = Capabilities(directories=True, concurrency=4)
            return {"scheme": "file", "capabilities": caps, "name": "fsspec:local"}
        caps = _generic_capabilities(proto)
        client = type(inner).__module__.partition(".")[0]
        limits = _FSSPEC_NAME_LIMITS.get(client)
        if limits is not None:
            caps = dataclasses.replace(caps, unsupported_name_characters=limits[0],
                                       unsupported_name_hint=limits[1])
        if client in _FSSPEC_NAME_PARTS:
            caps = dataclasses.replace(caps, unsupported_name_parts=_FSSPEC_NAME_PARTS[client])
        return {"scheme": proto, "capabilities": caps, "name": f"fsspec:{proto}"}
    scheme = {"s3": "s3", "gcs": "gs", "abfs": "abfs"}.get(fs.type_name, fs.type_name)
    caps = (_generic_capabilities(fs.type_name) if fs.type_name in _SERVER_COPY_STORES
            else OBJECT_STORE_CAPABILITIES)
    return {"scheme": scheme, "capabilities": caps, "name": fs.type_name}


def local_location(location: Any) -> str:
    """A URI as given, or a plain local path (str or PathLike; ``~``
    expanded) made absolute, as :func:`resolve` reads it: text that names
    the same place in any process started elsewhere (a Ray worker).

    Raises:
        InvalidConfigError: not a non-empty str or PathLike of str, or a
            malformed URI (``s3:/bucket``).
    """
    path = _fspath(location)
    if not isinstance(path, str):
        raise InvalidConfigError(f"location must be a str or PathLike of str, got {path!r}")
    if not path:
        raise InvalidConfigError("location must be a non-empty path or URI")
    if split_scheme(path) is None:
        return os.path.abspath(os.path.expanduser(path))
    return path


_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def local_path_argument(path: Any, what: str) -> str:
    """``path``, an argument that must name a local file or directory, made
    absolute (``~`` expanded); a ``file://`` URI read as the path it names.

    Args:
        path: what the caller was given.
        what: the argument, for the message (``"to_directory(path)"``).

    Raises:
        InvalidConfigError: not a str or PathLike of str, empty, holding a
            NUL byte (no file name holds one), or a URI of another store.
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise InvalidConfigError(
            f"{what} must be a local path (a str or os.PathLike), got {type(path).__name__} "
            f"{path!r}"
        ) from None
    if not isinstance(text, str):
        raise InvalidConfigError(f"{what} must be a path given as str, got bytes {text!r}; "
                                 "decode it (os.fsdecode(path))")
    if not text:
        raise InvalidConfigError(f"{what} must be a non-empty path")
    if "\0" in text:
        raise InvalidConfigError(f"{what} {text!r} holds a NUL byte: no file name holds one; "
                                 "remove it")
    if _URI_RE.match(text):
        if split_scheme(text) in ("file", "local"):
            return local_path_from_uri(text)
        raise InvalidConfigError(
            f"{what} takes a local path, got the URI {redact_uri(text)!r}: name a checkpoint "
            "on a store with Checkpoint(uri), and copy between stores with "
            "`checkpoint-store cp`"
        )
    return os.path.abspath(os.path.expanduser(text))


def _fspath(location: Any) -> Any:
    try:
        return os.fspath(location)
    except TypeError:  # an int, None ...: the caller's mistake, said as such
        raise InvalidConfigError(
            f"location must be a str or PathLike, got {type(location).__name__}"
        ) from None


def resolve(
    location: str | os.PathLike[str],
    *,
    filesystem: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Backend, str]:
    """Resolve a user's location into ``(backend, path within its filesystem)``.

    Args:
        location: a local path (str or PathLike; ``~`` expanded, made
            absolute) or a URI (``file://``, ``memory://``, ``s3://`` ...).
            With ``filesystem``, a path inside that filesystem. Either way the
            path comes back as the filesystem's listings spell it
            (:meth:`Backend.normalize_path`): ``bucket/runs/``, ``/bucket/runs``
            and ``bucket/runs`` are one place.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem instance;
            all I/O then goes through it.
        storage_options: passed to the backend factory (credentials,
            endpoint ...). Not allowed together with ``filesystem``.

    Which locations are refused (docs/backends.md, "Locations"): a control
    character anywhere; in a URI, credentials before ``@``, a URL query
    (``?versionId=1``), a bucket holding ``@`` or ``:`` (``s3://b:9000``), a
    ``..`` component off local disks, an fsspec scheme that cannot hold
    checkpoints (``http``, ``zip`` ...). Empty and ``.`` components are
    dropped: ``memory://u/a//b`` and ``memory://u/a/b`` are one place, for
    the data, the lease and every listing. Every message shows the location
    with credentials and query values hidden.

    Raises:
        InvalidConfigError: malformed or refused location, conflicting
            arguments, ``storage_options`` that is not a mapping, a
            ``filesystem`` that is no filesystem instance (a string, a
            class), or a URI given as the path inside a local filesystem.
            Nothing is built or written.
        UnknownSchemeError, BackendUnavailableError: see :func:`backend_for_scheme`.
    """
    if storage_options is not None and not isinstance(storage_options, Mapping):
        # Never echoed: "secret_access_key=..." given as one string is a credential.
        raise InvalidConfigError(
            f"storage_options must be a mapping of option names to values, got "
            f"{type(storage_options).__name__}: pass a dict such as "
            "{'endpoint_url': 'http://127.0.0.1:9000'}"
        )
    if filesystem is not None:
        check_filesystem(filesystem, "the filesystem (storage_filesystem=, filesystem=)")
        if storage_options:
            raise InvalidConfigError(
                "pass either a filesystem instance or storage_options, not both"
            )
        path = _fspath(location)
        if not isinstance(path, str) or not path:
            raise InvalidConfigError("storage path inside the given filesystem must be non-empty")
        check_location_text(path, uri="://" in path)
        local = _fsspec_local_disk(filesystem)
        if local is not None:
            path = local._strip_protocol(path)  # fsspec's spelling: "file://", "~"
        backend = backend_for_filesystem(filesystem)
        return backend, backend.normalize_path(path)
    path = local_location(location)
    scheme = split_scheme(path)
    if scheme is not None:
        _refuse_unusable(scheme, path)  # first: github's "org:repo@" is no credential
    check_location_text(path, uri=scheme is not None)
    if scheme is None:
        if storage_options:
            raise InvalidConfigError("storage_options were given for a local path")
        backend = backend_for_scheme("file", "file://", None)
        return backend, backend.normalize_path(path)
    backend = backend_for_scheme(scheme, path, storage_options)
    if scheme in ("file", "local"):
        fs_path = local_path_from_uri(path)
    else:
        fs_path = backend.normalize_path(backend.path_from_uri(path))
    if not fs_path.strip("/") and not backend.capabilities.directories:
        raise InvalidConfigError(f"URI {redact_uri(path)!r} names no bucket or container")
    return backend, fs_path
