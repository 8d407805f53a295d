"""The Backend: a ``pyarrow.fs.FileSystem`` plus what pyarrow.fs does not say.

pyarrow.fs gives one interface to every store; it does not say how a
filesystem is built from a URI and options, nor what the store can promise.
A :class:`Backend` adds both. The commit protocol, transfer planning and
durability code test :class:`Capabilities` instead of concrete classes.

Also the one spelling of a path or URI of a backend (:func:`canonical_path`,
:func:`canonical_uri_text`, :func:`clean_components`), the refusal of
locations no store can serve as written (:func:`check_location_text`,
:func:`redact_uri`) and strict parsing of typed storage options
(:func:`bool_option`, :func:`typed_options`).
The pyarrow handlers a backend wraps around fsspec clients live in
:mod:`checkpoint_store.backends.handlers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.handlers import wrap_filesystem as wrap_filesystem

# The handlers lived here before: plugins written then still import them from here.
from checkpoint_store.backends.handlers import (
    wrap_fsspec,
)
from checkpoint_store.backends.uris import SCHEME_ALIASES as SCHEME_ALIASES
from checkpoint_store.backends.uris import canonical_path as canonical_path
from checkpoint_store.backends.uris import canonical_uri_text as canonical_uri_text
from checkpoint_store.backends.uris import check_location_text as check_location_text
from checkpoint_store.backends.uris import clean_components as clean_components
from checkpoint_store.backends.uris import join as join
from checkpoint_store.backends.uris import local_absolute as local_absolute
from checkpoint_store.backends.uris import redact_uri as redact_uri
from checkpoint_store.backends.uris import refuse_authority as refuse_authority
from checkpoint_store.backends.uris import (
    refuse_endpoint_credentials as refuse_endpoint_credentials,
)
from checkpoint_store.backends.uris import scrub_secrets as scrub_secrets

__all__ = [
    "LOCAL_CAPABILITIES",
    "MEMORY_CAPABILITIES",
    "OBJECT_STORE_CAPABILITIES",
    "SCHEME_ALIASES",
    "Backend",
    "BackendFactory",
    "Capabilities",
    "bool_option",
    "canonical_path",
    "canonical_uri_text",
    "check_location_text",
    "clean_components",
    "join",
    "local_absolute",
    "redact_uri",
    "scrub_secrets",
    "refuse_authority",
    "typed_options",
    "unstorable_character",
    "unstorable_reason",
]


@dataclass(frozen=True)
class Capabilities:
    """What a store promises. Callers choose strategies from these flags.

    Attributes:
        atomic_rename: renaming a directory is atomic and fails if the target
            exists and is not empty (POSIX ``rename``). Chooses the
            rename-into-place commit; otherwise the marker-last commit.
        needs_fsync: written data is durable only after ``fsync`` (local disks).
            Object stores are durable once a PUT succeeds.
        server_side_copy: ``copy_file`` runs inside the store, no bytes pass
            through this process.
        strong_listing: a listing right after a write shows that write.
        directories: the store has real directories. Object stores do not;
            there we never create directory-marker objects ourselves.
        chunk_size: bytes per read/write call that transfers use by default.
        concurrency: requests (files, parts of files or batches of small
            files) in flight at once: the threads of one transfer.
        memory_budget: bytes of file data one transfer may hold in memory at
            once, all threads together; None: the planner's default
            (:data:`checkpoint_store._transfer.budget.DEFAULT_MEMORY_LIMIT`). Both are
            set per storage with ``StorageContext(max_concurrency=...,
            memory_budget=...)``.
        unsupported_name_characters: characters the store's client cannot
            keep in a file or directory name: it would read, write or delete
            another name (adlfs takes ``?`` as the start of a URL query), so
            two trials could mix their files. A name holding one is refused
            with :class:`~checkpoint_store.errors.InvalidConfigError` before
            anything is written (:func:`unstorable_character`).
        unsupported_name_hint: what to do instead, appended to that refusal
            (e.g. another engine that stores the character).
        unsupported_name_parts: strings the client reads out of a name
            wherever they appear (s3fs takes ``?versionId=`` as an object
            version, and writes ``x?versionId=1/f`` as the object ``x``);
            a name holding one is refused the same way.
    """

    atomic_rename: bool = False
    needs_fsync: bool = False
    server_side_copy: bool = False
    strong_listing: bool = True
    directories: bool = False
    chunk_size: int = 8 * 1024 * 1024
    concurrency: int = 8
    memory_budget: int | None = None
    unsupported_name_characters: str = ""
    unsupported_name_hint: str = ""
    unsupported_name_parts: tuple[str, ...] = ()


def unstorable_character(name: str, caps: Capabilities) -> str | None:
    """The first character of ``name`` that a store with ``caps`` cannot keep
    in a name (:attr:`Capabilities.unsupported_name_characters`), or None."""
    bad = caps.unsupported_name_characters
    if not bad:  # most stores: no loop over every character of every name
        return None
    for char in name:
        if char in bad:
            return char
    return None


def unstorable_reason(char: str, caps: Capabilities, store: str) -> str:
    """Why a name holding ``char`` is refused and what to do, for messages."""
    hint = f" ({caps.unsupported_name_hint})" if caps.unsupported_name_hint else ""
    return (f"holds {char!r}, which {store} cannot store in a name (its files would be "
            f"written under another name); choose a name without {char!r}{hint}")


LOCAL_CAPABILITIES = Capabilities(
    atomic_rename=True,
    needs_fsync=True,
    server_side_copy=True,
    directories=True,
    chunk_size=8 * 1024 * 1024,
    concurrency=4,
)
MEMORY_CAPABILITIES = Capabilities(
    server_side_copy=True, directories=True, chunk_size=8 * 1024 * 1024, concurrency=1
)
OBJECT_STORE_CAPABILITIES = Capabilities(chunk_size=64 * 1024 * 1024, concurrency=16)


@dataclass(frozen=True, repr=False)
class Backend:
    """A filesystem and the facts needed to use it well.

    Args:
        filesystem: any ``pyarrow.fs.FileSystem`` (an fsspec filesystem is
            wrapped with ``pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))``
            by :func:`wrap_filesystem` before it gets here).
        scheme: the URI scheme paths of this backend print with (``"s3"``).
        capabilities: see :class:`Capabilities`.
        name: a human name for messages (``"S3 (pyarrow)"``).
        rebuild: a zero-argument callable that builds a fresh filesystem, used
            once when credentials expire. Never printed.

    The repr shows the scheme, name and filesystem type only: credentials
    held by the filesystem or by ``rebuild`` never appear.

    A ``PyFileSystem`` over pyarrow's stock ``FSSpecHandler`` is re-wrapped
    around the same fsspec instance with :class:`LiteralFSSpecHandler`: the
    stock handler lets fsspec read ``[``, ``*`` and ``?`` in a name as glob
    patterns on deletes, copies and moves, and hands every reader of fsspec's
    memory filesystem one shared file object.
    """

    filesystem: pafs.FileSystem
    scheme: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    name: str = ""
    rebuild: Callable[[], pafs.FileSystem] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.filesystem, pafs.FileSystem):
            raise TypeError(
                f"Backend.filesystem must be a pyarrow.fs.FileSystem, got "
                f"{type(self.filesystem).__name__}; wrap fsspec filesystems with "
                "checkpoint_store.backends.wrap_filesystem()"
            )
        fs = self.filesystem
        if isinstance(fs, pafs.PyFileSystem) and type(fs.handler) is pafs.FSSpecHandler:
            object.__setattr__(self, "filesystem", wrap_fsspec(fs.handler.fs))

    def __repr__(self) -> str:
        return (
            f"Backend(scheme={self.scheme!r}, name={self.name or self.scheme!r}, "
            f"filesystem={type(self.filesystem).__name__})"
        )

    def normalize_path(self, path: str) -> str:
        """The one spelling of ``path`` that this filesystem's listings use.

        Every path that enters from a user (a URI's path, a ``storage_path``
        inside a given filesystem) passes here once; every layer above
        compares only such paths, and paths joined onto them, with what
        listings return. ``"bucket/runs"``, ``"bucket/runs/"`` and
        ``"/bucket/runs"`` name one place on fsspec's memory filesystem, and
        its listings say ``/bucket/runs/...``; on object stores listings say
        ``bucket/runs/...``; on local disks paths are absolute. A plugin
        whose filesystem spells paths in yet another way overrides this.

        Raises:
            InvalidConfigError: a local disk was given a URI instead of a path.
        """
        return canonical_path(self.filesystem, path)

    def check_name(self, name: str, what: str) -> str:
        """Refuse a name this store cannot keep literally.

        ``name`` is one path component a user chose (experiment, trial, a
        file of a checkpoint); ``what`` says which, for the message.

        Returns:
            ``name`` unchanged.

        Raises:
            InvalidConfigError: ``name`` holds one of
                :attr:`Capabilities.unsupported_name_characters`, naming the
                name, the character and the fix. Nothing has been written.
        """
        char = unstorable_character(name, self.capabilities)
        store = self.name or self.scheme
        if char is not None:
            from checkpoint_store.errors import InvalidConfigError

            raise InvalidConfigError(
                f"{what} {name!r} {unstorable_reason(char, self.capabilities, store)}"
            )
        for part in self.capabilities.unsupported_name_parts:
            if part in name:
                from checkpoint_store.errors import InvalidConfigError

                raise InvalidConfigError(
                    f"{what} {name!r} holds {part!r}, which {store} reads as a URL query "
                    f"(its files would be written under another name); choose a name "
                    f"without {part!r}"
                )
        return name

    def path_from_uri(self, uri: str) -> str:
        """The filesystem path for ``uri`` (``s3://b/k`` -> ``b/k``).

        Local-style backends (real directories) keep a leading ``/``.

        Raises:
            InvalidConfigError: the first component (bucket, container) holds
                ``@`` (a user part) or ``:`` (a port): a bucket name holds
                neither, and a server's address goes in the storage options.
        """
        rest = uri.split("://", 1)[1] if "://" in uri else uri
        refuse_authority(uri, rest.partition("/")[0], allow_user=False)
        rest = rest.rstrip("/")
        if self.capabilities.directories and not rest.startswith("/"):
            rest = "/" + rest
        return rest or "/"

    def uri_for(self, path: str) -> str:
        """The URI a user can paste back in for ``path`` of this filesystem.

        Local paths print as ``file://`` URIs with ``%`` escaped (``file://``
        paths are percent-decoded when read back, RFC 8089); a path inside a
        ``SubTreeFileSystem`` over the local disk prints with the subtree's
        base in front, so it names the same directory when pasted back.
        """
        if self.scheme == "file":
            return "file://" + local_absolute(self.filesystem, path).replace("%", "%25")
        return f"{self.scheme}://{path.lstrip('/')}"

    def canonical_uri(self, path: str) -> str:
        """One URI per location of this backend, however it was spelled.

        The scheme's aliases become one scheme (:data:`SCHEME_ALIASES`:
        ``s3a`` -> ``s3``, ``abfs``/``abfss`` -> ``az``, ``gcs`` -> ``gs``),
        lower-cased; the path loses empty and ``.`` components (so no trailing
        ``/``): ``S3A://bkt/./sp/`` and ``s3://bkt/sp`` give ``s3://bkt/sp``.
        For identity only (the lease compares it); :meth:`uri_for` prints.
        Local disks resolve symlinks on top
        (:meth:`checkpoint_store.StorageContext.canonical_uri`).
        """
        if self.scheme.lower() in ("file", "local"):
            path = local_absolute(self.filesystem, path)
        return canonical_uri_text(f"{self.scheme}://{path}")




















def typed_options(options: Mapping[str, Any], types: Mapping[str, type], store: str
                  ) -> dict[str, Any]:
    """``options`` with each string value of a declared option converted to
    its type: the CLI's ``-o KEY=VALUE`` (and environment-driven configs)
    pass strings.

    Args:
        options: the storage options as given.
        types: option name -> ``bool``, ``int``, ``float`` or ``str``; options
            not named here pass unchanged.
        store: the backend's name, for messages.

    Returns:
        A new dict; values that are already of the type, or not strings, are kept.

    Raises:
        InvalidConfigError: a string that does not parse as the declared type
            (``request_timeout=soon``), or a NaN or infinite number. The
            message names the option and its type.
    """
    out = dict(options)
    for key, value in options.items():
        kind = types.get(key, str)
        if isinstance(value, str) and kind is not str:
            out[key] = _parse_typed(key, value, kind, store)
    return out


def _parse_typed(key: str, value: str, kind: type, store: str) -> Any:
    from checkpoint_store.errors import InvalidConfigError

    if kind is bool:
        return bool_option(key, value)
    try:
        number = kind(value.strip())
    except ValueError:
        number = None
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        what = "an integer" if kind is int else "a finite number"
        raise InvalidConfigError(
            f"{store} storage option {key!r} must be {what}, not {value!r}"
        ) from None
    return number




BackendFactory = Callable[[str, Mapping[str, Any]], Backend]




_TRUE_WORDS = frozenset({"true", "1", "yes"})
_FALSE_WORDS = frozenset({"false", "0", "no"})


def timeout_option(store: str, key: str, value: Any, default: float) -> float:
    """A timeout storage option (``request_timeout``, ``connect_timeout``) in seconds.

    Args:
        store: the backend's name, for the error message (``"S3"``, ``"Azure"``).
        key: the option's name, for the error message.
        value: a number (:func:`typed_options` has already converted a string).
        default: the backend's default, named in the error message.

    Raises:
        InvalidConfigError: not a number (a bool included), NaN, infinite or
            not > 0: 0 means "no limit" to some engines and "fail at once" to others.
    """
    from checkpoint_store.errors import InvalidConfigError

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise InvalidConfigError(
            f"{store} storage option {key}={value!r} must be a number of seconds > 0 "
            f"(default {default:g})"
        )
    return float(value)


def bool_option(key: str, value: Any) -> bool:
    """A boolean storage option (``anonymous``, ``anon`` ...), parsed strictly.

    Args:
        key: the option's name, for the error message.
        value: a bool, or one of ``true/false/1/0/yes/no`` (any case; the CLI's
            ``-o KEY=VALUE`` passes strings).

    Raises:
        InvalidConfigError: any other value; a lenient reading would take
            ``anonymous=maybe`` for true and drop the credentials.
    """
    from checkpoint_store.errors import InvalidConfigError

    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise InvalidConfigError(
        f"storage option {key!r} must be a boolean: true/false, 1/0 or yes/no, "
        f"not {value!r}"
    )






