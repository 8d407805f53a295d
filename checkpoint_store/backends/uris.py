"""The one spelling of a location: URI text checks, redaction and canonical forms.

Every location a user gives (a URI or a path) is checked here before a
backend is built (:func:`check_location_text`, :func:`refuse_authority`,
:func:`refuse_endpoint_credentials`), shown with its secrets hidden
(:func:`redact_uri`), and written one way whatever its spelling
(:func:`canonical_uri_text`, :func:`canonical_path`, :data:`SCHEME_ALIASES`).
:mod:`checkpoint_store.backends.base` re-exports these names.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.handlers import LiteralFSSpecHandler, MarkerFreeDeletesHandler
from checkpoint_store.errors import InvalidConfigError

__all__ = [
    "SCHEME_ALIASES",
    "canonical_path",
    "canonical_uri_text",
    "check_location_text",
    "clean_components",
    "join",
    "local_absolute",
    "redact_uri",
    "refuse_authority",
    "refuse_endpoint_credentials",
    "scrub_secrets",
]


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


# ``name=value`` after ``?``, ``&`` or ``;`` (URL queries, connection strings),
# where the name says it carries a credential: ``access_token=...`` in a URL an
# engine's error quotes, ``sig=`` of a SAS, ``AccountKey=`` of an Azure string.
_SECRET_PAIR_RE = re.compile(
    r"(?P<lead>[?&;]\s*)(?P<name>[A-Za-z_][\w.\-]*)=(?P<value>[^&;\s'\"<>)]+)")

#: Shortest option value hidden by its text alone (shorter ones are words).
_MIN_SECRET_LEN = 4


def scrub_secrets(text: str, options: Mapping[str, Any] | None = None) -> str:
    """``text`` (a message, often quoting an engine's error) with credentials
    hidden: the value of every ``name=value`` pair after ``?``, ``&`` or ``;``
    whose name says it carries one (``access_token``, ``sig``, ``AccountKey``
    ...), and, given the storage ``options``, the text of every option whose
    key says so (``secret_access_key``, ``token``, ``connection_string``,
    ``password``, ``sas_token`` ...), wherever it appears.
    """
    for key, value in (options or {}).items():
        if isinstance(value, str) and len(value) >= _MIN_SECRET_LEN and (
                _SECRET_PARAM_RE.search(key) or "connection" in key.lower()):
            text = text.replace(value, "<hidden>")

    def hide(m: re.Match[str]) -> str:
        if not _SECRET_PARAM_RE.search(m.group("name")):
            return m.group(0)
        return f"{m.group('lead')}{m.group('name')}=<hidden>"

    return _SECRET_PAIR_RE.sub(hide, text)


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


def local_absolute(fs: pafs.FileSystem, path: str) -> str:
    """``path`` of a local filesystem as an absolute OS path: a path inside a
    ``SubTreeFileSystem`` over the local disk gets the subtree's base in front."""
    if isinstance(fs, pafs.SubTreeFileSystem) and not path.startswith("/"):
        return posixpath.join(local_absolute(fs.base_fs, fs.base_path.rstrip("/")), path)
    return path


def join(path: str, *parts: str) -> str:
    """Join filesystem paths with ``/`` whatever the platform (never a URI)."""
    return posixpath.join(path, *parts)


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
