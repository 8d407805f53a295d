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
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

# The handlers lived here before: plugins written then still import them from here.
from checkpoint_store.backends.handlers import (
    LiteralFSSpecHandler,
    MarkerFreeDeletesHandler,
    wrap_fsspec,
)
from checkpoint_store.backends.handlers import wrap_filesystem as wrap_filesystem

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


#: Schemes that name the same backend as another (registered as aliases of
#: one factory): :meth:`Backend.canonical_uri` writes every location of them
#: with the second.
SCHEME_ALIASES: dict[str, str] = {
    "s3a": "s3", "abfs": "az", "abfss": "az", "gcs": "gs", "local": "file",
}


def canonical_uri_text(uri: str) -> str:
    """``uri`` in the form of :meth:`Backend.canonical_uri`, from its text alone
    (also for URIs recorded by older versions): scheme lower-cased and
    de-aliased, empty and ``.`` path components dropped."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    scheme = scheme.lower()
    scheme = SCHEME_ALIASES.get(scheme, scheme)
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    return f"{scheme}://" + ("/" if scheme == "file" else "") + "/".join(parts)


# A URL query as clients and users write one: s3fs reads "?versionId=" as an
# object version, gcsfs "?generation=", and signed URLs carry their
# credentials there ("?sig=", "?X-Amz-Signature="). A '?' not followed by
# NAME= stays a literal character of a name (a trial "t*1?").
_QUERY_RE = re.compile(r"\?([A-Za-z_][\w.\-]*)=")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# Query parameter names that carry credentials (SAS tokens, signed URLs, keys).
_SECRET_PARAM_RE = re.compile(
    r"key|secret|sig|token|sas|passw|credential|auth|^(sv|se|sp|st|sr|spr)$", re.IGNORECASE)


def _userinfo_span(text: str) -> tuple[int, int] | None:
    """Where the user part of a ``scheme://user[:password]@host/...`` URI
    lies in ``text`` (``@`` excluded), or None."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return None
    host = rest.partition("/")[0]
    at = host.rfind("@")
    if at < 0:
        return None
    start = len(scheme) + len(sep)
    return start, start + at


def redact_uri(text: str) -> str:
    """``text`` as messages show it: a user part (``user:password@``) becomes
    ``<credentials hidden>@`` and the value of every URL query parameter
    ``<hidden>``, whatever its name. Anything else is kept."""
    span = _userinfo_span(text)
    if span is not None:
        text = text[:span[0]] + "<credentials hidden>" + text[span[1]:]
    if _QUERY_RE.search(text):
        head, _, query = text.partition("?")
        names = [p.partition("=")[0] for p in query.split("&")]
        text = head + "?" + "&".join(f"{n}=<hidden>" for n in names)
    return text


def check_location_text(text: str, *, uri: bool) -> None:
    """Refuse a location (a URI, or a path inside a given filesystem) no
    store can serve as written, before anything is built or written.

    Args:
        text: the location as the user gave it.
        uri: whether ``text`` is a URI (``scheme://...``); a URI's user part
            and query are refused, a path's characters are literal.

    Raises:
        InvalidConfigError: ``text`` holds a control character (NUL, newline
            ...: no store keeps one in a name, pyarrow refuses NUL); or, for
            a URI, credentials before ``@`` (``s3://KEY:SECRET@bucket``) or a
            URL query (``?versionId=1``, ``?sig=...``: no backend honours
            one; credentials go in the storage options). The message shows
            the location with credentials and query values hidden.
    """
    from checkpoint_store.errors import InvalidConfigError

    shown = redact_uri(text) if uri else text
    control = _CONTROL_RE.search(text)
    if control is not None:
        raise InvalidConfigError(
            f"location {shown!r} holds the control character {control.group()!r}: no store "
            "keeps one in a name; remove it"
        )
    if not uri:
        return
    span = _userinfo_span(text)
    if span is not None and ":" in text[span[0]:span[1]]:
        raise InvalidConfigError(
            f"location {shown!r} carries credentials before '@': pass them as storage "
            "options (storage_options={...}, or -o KEY=VALUE on the command line) or the "
            "backend's environment variables, never in the URI"
        )
    query = _QUERY_RE.search(text)
    if query is not None:
        secret = _SECRET_PARAM_RE.search(query.group(1)) is not None
        raise InvalidConfigError(
            f"location {shown!r} holds a URL query ({query.group(1)!r}): checkpoint-store "
            "locations take none (no object versions, no signed URLs); "
            + ("pass credentials as storage options or environment variables"
               if secret else "give the location without '?...'")
        )


def refuse_endpoint_credentials(option: str, value: object) -> None:
    """Refuse an endpoint option (``endpoint_url``) that carries a user part
    (``http://user:password@host``): credentials go in their own options, and a
    client would send them to a server in a way nobody asked for.

    Raises:
        InvalidConfigError: naming the option, with the credentials hidden.
    """
    from checkpoint_store.errors import InvalidConfigError

    if isinstance(value, str) and _userinfo_span(value) is not None:
        raise InvalidConfigError(
            f"storage option {option}={redact_uri(value)!r} carries credentials before "
            "'@': give the endpoint as scheme://host[:port] and the credentials as their "
            "own storage options (or the backend's environment variables)"
        )


def refuse_authority(uri: str, authority: str, *, allow_user: bool) -> None:
    """Refuse a URI whose first component (bucket, container) reads as
    ``user@host`` or ``host:port`` (``s3://bucket:9000/x``).

    Args:
        uri: the whole URI, for the message (shown through :func:`redact_uri`).
        authority: its first component.
        allow_user: a ``name@host`` form without ``:`` before the ``@`` is the
            backend's own (Azure's ``container@account.dfs.core.windows.net``).

    Raises:
        InvalidConfigError: naming the URI and what to write instead.
    """
    from checkpoint_store.errors import InvalidConfigError

    user, at, host = authority.rpartition("@")
    if at and not allow_user:
        raise InvalidConfigError(
            f"{redact_uri(uri)!r} holds a user part before '@': a bucket name holds no "
            "'@'; pass credentials as storage options or environment variables"
        )
    if ":" in host or ":" in user:
        raise InvalidConfigError(
            f"{redact_uri(uri)!r} names the bucket {host!r}, which holds ':' (a port?): for "
            "a server at host:port pass its address as the endpoint_url storage option "
            "(-o endpoint_url=http://host:port) and the bucket alone in the URI"
        )


def clean_components(path: str) -> str:
    """``path`` of a store without real parent links, in its one spelling:
    empty and ``.`` components dropped (``b//k/./x`` is ``b/k/x``, as the lease
    compares it, :func:`canonical_uri_text`), a leading ``/`` kept, no
    trailing ``/``.

    Raises:
        InvalidConfigError: a ``..`` component. Object keys hold it
            literally, pyarrow refuses it and fsspec resolves it, so
            ``s3://bucket-a/../b/x`` would write into bucket ``b`` by one
            client and ``bucket-a`` by another; write the location without it.
    """
    parts = path.split("/")
    if ".." in parts:
        from checkpoint_store.errors import InvalidConfigError

        raise InvalidConfigError(
            f"path {path!r} holds a '..' component: off local disks it would name a place "
            "outside the one written; write the location without '..'"
        )
    kept = [p for p in parts if p not in ("", ".")]
    return ("/" if path.startswith("/") else "") + "/".join(kept)


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


def local_absolute(fs: pafs.FileSystem, path: str) -> str:
    """``path`` of a local filesystem as an absolute OS path: a path inside a
    ``SubTreeFileSystem`` over the local disk gets the subtree's base in front."""
    if isinstance(fs, pafs.SubTreeFileSystem) and not path.startswith("/"):
        return posixpath.join(local_absolute(fs.base_fs, fs.base_path.rstrip("/")), path)
    return path


BackendFactory = Callable[[str, Mapping[str, Any]], Backend]


def join(path: str, *parts: str) -> str:
    """Join filesystem paths with ``/`` whatever the platform (never a URI)."""
    return posixpath.join(path, *parts)


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


_OBJECT_STORE_TYPES = frozenset({"s3", "gcs", "abfs"})


def canonical_path(fs: pafs.FileSystem, path: str) -> str:
    """``path`` spelled as ``fs``'s listings spell it (see :meth:`Backend.normalize_path`).

    Local disks: absolute and normalised. Object stores (pyarrow's S3, GCS
    and Azure clients, and handlers that say so): no leading or trailing
    ``/``. fsspec filesystems: stripped of their protocol, with fsspec's own
    root marker (``/`` for memory, nothing for buckets) in front. Any other
    handler: its own ``normalize_path``, without a trailing ``/``. Off local
    disks empty and ``.`` components are dropped too and ``..`` is refused
    (:func:`clean_components`): the stores read ``b/./k`` as ``b/k``, and
    the lease compares ``b//k`` as ``b/k``, so keeping them would give one
    place two spellings.

    Raises:
        InvalidConfigError: a URI given to a local filesystem, or a ``..``
            component off local disks.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        if "://" in path:
            from checkpoint_store.errors import InvalidConfigError

            raise InvalidConfigError(
                f"{path!r} is a URI; a local filesystem takes a path. Pass the URI as "
                "storage_path without a filesystem instance, or give the path alone"
            )
        absolute = os.path.abspath(os.path.expanduser(path))
        # POSIX keeps a leading "//" apart; Linux and macOS read it as "/".
        return "/" + absolute.lstrip("/") if absolute.startswith("//") else absolute
    return clean_components(_store_spelling(fs, path))


def _store_spelling(fs: pafs.FileSystem, path: str) -> str:
    """``path`` as the store ``fs`` (not a local disk) spells it, before
    :func:`clean_components`: a protocol is stripped first, so that the
    ``//`` of ``memory://`` is not taken for an empty component."""
    if isinstance(fs, pafs.SubTreeFileSystem):
        return path.strip("/")
    if isinstance(fs, pafs.PyFileSystem):
        normalized = fs.normalize_path(path)
        if isinstance(fs.handler, (LiteralFSSpecHandler, MarkerFreeDeletesHandler)):
            return normalized
        return normalized.rstrip("/") or "/"
    if fs.type_name in _OBJECT_STORE_TYPES:
        return path.strip("/")
    return path.rstrip("/") or "/"
