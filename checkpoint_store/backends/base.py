"""The Backend: a ``pyarrow.fs.FileSystem`` plus what pyarrow.fs does not say.

pyarrow.fs gives one interface to every store; it does not say how a
filesystem is built from a URI and options, nor what the store can promise.
A :class:`Backend` adds both. The commit protocol, transfer planning and
durability code test :class:`Capabilities` instead of concrete classes.
"""

from __future__ import annotations

import datetime
import os
import posixpath
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from glob import has_magic
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store.backends.forwarding import ForwardingHandler


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
            (:data:`checkpoint_store._budget.DEFAULT_MEMORY_LIMIT`). Both are
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


def unstorable_character(name: str, caps: Capabilities) -> str | None:
    """The first character of ``name`` that a store with ``caps`` cannot keep
    in a name (:attr:`Capabilities.unsupported_name_characters`), or None."""
    for char in name:
        if char in caps.unsupported_name_characters:
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
        if char is not None:
            from checkpoint_store.errors import InvalidConfigError

            store = self.name or self.scheme
            raise InvalidConfigError(
                f"{what} {name!r} {unstorable_reason(char, self.capabilities, store)}"
            )
        return name

    def path_from_uri(self, uri: str) -> str:
        """The filesystem path for ``uri`` (``s3://b/k`` -> ``b/k``).

        Local-style backends (real directories) keep a leading ``/``.
        """
        rest = uri.split("://", 1)[1] if "://" in uri else uri
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
    disks ``.`` components are dropped too: the stores read ``b/./k`` as
    ``b/k``, so keeping them would give one object two spellings.
    """
    if not isinstance(fs, pafs.LocalFileSystem) and "/./" in f"/{path}/":
        lead = "/" if path.startswith("/") else ""
        path = lead + "/".join(p for p in path.split("/") if p != ".")
    if isinstance(fs, pafs.LocalFileSystem):
        if "://" in path:
            from checkpoint_store.errors import InvalidConfigError

            raise InvalidConfigError(
                f"{path!r} is a URI; a local filesystem takes a path. Pass the URI as "
                "storage_path without a filesystem instance, or give the path alone"
            )
        return os.path.abspath(os.path.expanduser(path))
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


def _literal_rm_files(fs: Any, paths: list[str]) -> None:
    """Delete exactly the files ``paths`` through fsspec, whatever their names hold.

    fsspec's ``rm`` expands a path holding ``[``, ``*`` or ``?`` as a glob
    pattern, so deleting ``t[x]/a`` would delete ``tx/a``. Paths without
    such characters go to ``rm`` in one call (one bulk request on S3 and
    GCS); the others one by one through ``rm_file``, which never expands.
    """
    plain = [p for p in paths if not has_magic(p)]
    magic = [p for p in paths if has_magic(p)]
    if plain:
        fs.rm(plain)
    if len(magic) == 1:
        fs.rm_file(magic[0])
    elif magic:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(fs.rm_file, magic))


def _literal_rm_tree(fs: Any, files: Iterable[str], dirs: Iterable[str]) -> None:
    """Delete ``files``, then the ``dirs`` that still exist, deepest first
    (stores with real directories; on object stores they vanish with their files)."""
    _literal_rm_files(fs, list(files))
    for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
        if fs.exists(d):
            fs.rmdir(d)


class LiteralFSSpecHandler(pafs.FSSpecHandler):
    """``pyarrow.fs.FSSpecHandler`` for our use: names are literal, readers
    independent, listings one level deep.

    * Literal names. The stock handler deletes, copies and moves through
      fsspec calls that read ``[``, ``*`` and ``?`` as glob patterns: deleting
      trial ``t[x]`` deleted trial ``tx``. Paths holding those characters
      take literal calls here (``find``, ``rm_file``, ``cp_file``).
    * Independent readers. fsspec's memory filesystem hands every reader of
      a path the same file object, so concurrent readers moved each other's
      position; each reader here gets its own immutable buffer.
    * One-level listings. pyarrow lists a directory with
      ``fs.find(path, maxdepth=1)``; some fsspec filesystems (adlfs) ignore
      ``maxdepth`` and walk the whole subtree. A delimiter listing (``fs.ls``)
      costs one request per 5000 entries instead.
    * One spelling: :meth:`normalize_path` gives a path as this store's
      listings spell it.
    """

    def __eq__(self, other: object) -> bool:
        # fsspec compares instances by a token that differs after a pickle
        # round trip; the class and the options are what identify the store.
        if not isinstance(other, pafs.FSSpecHandler):
            return NotImplemented
        a, b = self.fs, other.fs
        if a is b or a == b:
            return True
        opts = getattr(a, "storage_options", None)
        return type(a) is type(b) and opts is not None and opts == getattr(
            b, "storage_options", None
        )

    def __hash__(self) -> int:
        return hash(type(self.fs))

    @staticmethod
    def _create_file_info(path: str, info: dict[str, Any]) -> pafs.FileInfo:
        # pyarrow reads only "mtime"; s3fs says "LastModified", adlfs
        # "last_modified". Decisions shared between machines judge ages by
        # these stamps, the store's own clock (checkpoint_store._clock).
        fi = pafs.FSSpecHandler._create_file_info(path, info)
        if fi.mtime is not None or fi.type != pafs.FileType.File:
            return fi
        stamp = _modified(info)
        if stamp is None:
            return fi
        return pafs.FileInfo(fi.path, fi.type, size=fi.size, mtime=stamp)

    def normalize_path(self, path: str) -> str:
        # Only the protocol prefix is cut here: implementations' own
        # _strip_protocol also parse '?' or '#' (versions) out of a key.
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (
            self.fs.protocol,)
        for proto in protocols:
            if path.startswith(f"{proto}://"):
                path = path[len(proto) + 3:]
                break
        stripped = path.strip("/")
        root = getattr(self.fs, "root_marker", "") or ""
        return root + stripped if stripped else root or "/"

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        if selector.recursive:
            return super().get_file_info_selector(selector)
        base = selector.base_dir
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            entries = []
        stripped = base.strip("/")
        infos = [
            self._create_file_info(e["name"], e)
            for e in entries
            if e["name"].strip("/") != stripped
        ]
        if not infos and not self.fs.isdir(base):
            if self.fs.exists(base):
                raise NotADirectoryError(base)
            if selector.allow_not_found:
                return []
            raise FileNotFoundError(base)
        return infos

    def delete_dir(self, path: str) -> None:
        if not has_magic(path):
            return super().delete_dir(path)
        if not self.fs.isdir(path):
            raise FileNotFoundError(path)
        found = self.fs.find(path, withdirs=True, detail=True)
        files = [p for p, i in found.items() if i.get("type") != "directory"]
        dirs = [p for p, i in found.items() if i.get("type") == "directory"]
        _literal_rm_tree(self.fs, files, [*dirs, path])

    def _delete_dir_contents(self, path: str, missing_dir_ok: bool) -> None:
        try:
            found = self.fs.find(path, withdirs=True, detail=True)
        except FileNotFoundError:
            found = {}
        if not found and not self.fs.isdir(path):
            if missing_dir_ok:
                return
            raise FileNotFoundError(path)
        stripped = path.strip("/")
        found = {p: i for p, i in found.items() if p.strip("/") != stripped}
        files = [p for p, i in found.items() if i.get("type") != "directory"]
        dirs = [p for p, i in found.items() if i.get("type") == "directory"]
        _literal_rm_tree(self.fs, files, dirs)

    def delete_file(self, path: str) -> None:
        if not self.fs.isfile(path):
            raise FileNotFoundError(path)
        self.fs.rm_file(path)

    def move(self, src: str, dest: str) -> None:
        if not (has_magic(src) or has_magic(dest)):
            return super().move(src, dest)
        if self.fs.isfile(src):
            self.fs.cp_file(src, dest)
            self.fs.rm_file(src)
            return
        found = self.fs.find(src, detail=True)
        if not found:
            raise FileNotFoundError(src)
        prefix = src.rstrip("/") + "/"
        for p in found:
            self.fs.cp_file(p, dest.rstrip("/") + "/" + p[len(prefix):])
        self.delete_dir(src)

    def copy_file(self, src: str, dest: str) -> None:
        if not (has_magic(src) or has_magic(dest)):
            return super().copy_file(src, dest)
        if not self.fs.isfile(src):
            raise FileNotFoundError(src)
        self.fs.cp_file(src, dest)

    def _own_view(self, path: str) -> Any:
        from fsspec.implementations.memory import MemoryFileSystem

        if isinstance(self.fs, MemoryFileSystem):
            # cat_file copies the bytes; the shared file object is never touched.
            return pa.BufferReader(self.fs.cat_file(path))
        return None

    def open_input_stream(self, path: str) -> Any:
        view = self._own_view(path)
        return view if view is not None else super().open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        view = self._own_view(path)
        return view if view is not None else super().open_input_file(path)


def _modified(info: Mapping[str, Any]) -> datetime.datetime | None:
    """The modification time in an fsspec ``info`` dict, whatever its key and type."""
    for key in ("LastModified", "last_modified", "updated", "mtime"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
        if isinstance(value, str):
            try:
                parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)
    return None


class MarkerFreeDeletesHandler(ForwardingHandler):
    """A native pyarrow filesystem for everything but deletes, an fsspec one for deletes.

    pyarrow's object-store filesystems (S3, Azure) write an empty ``parent/``
    directory-marker object after every delete so that the parent keeps
    "existing". That costs a request per delete, leaves zero-byte objects, and
    fails on stores that reject them. The fsspec client of the same store
    deletes just the keys, so deletes go through it; reads, writes and
    listings stay on pyarrow's C++ client.

    Args:
        native: the pyarrow filesystem.
        deleter: an fsspec filesystem on the same store and credentials.
        type_name: what ``type_name`` reports (``"s3"``, ``"abfs"``).
    """

    def __init__(self, native: pafs.FileSystem, deleter: Any, type_name: str):
        super().__init__(native)
        self.deleter = deleter
        self.type_name = type_name

    @property
    def native(self) -> pafs.FileSystem:
        """The pyarrow filesystem: reads and writes may bypass this handler
        and go to it directly (see ``_plan._native_of``)."""
        return self.inner

    def get_type_name(self) -> str:
        return self.type_name

    def normalize_path(self, path: str) -> str:
        return self.native.normalize_path(path).strip("/")

    def delete_dir(self, path: str) -> None:
        if self.native.get_file_info(path).type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if not has_magic(path):
            self.deleter.rm(path.rstrip("/"), recursive=True)
            return
        # fsspec would read the name as a glob pattern: list (pyarrow lists
        # literally) and delete each key by its name.
        self.delete_dir_contents(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        infos = self.native.get_file_info(
            pafs.FileSelector(path, allow_not_found=missing_dir_ok, recursive=True)
        )
        _literal_rm_files(self.deleter, [fi.path for fi in infos
                                         if fi.type == pafs.FileType.File])

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to delete every bucket or container of an account")

    def delete_file(self, path: str) -> None:
        if self.native.get_file_info(path).type != pafs.FileType.File:
            raise FileNotFoundError(path)
        self.deleter.rm_file(path)

    def move(self, src: str, dest: str) -> None:
        # A copy and a delete on object stores; the delete must not leave a marker either.
        info = self.native.get_file_info(src)
        if info.type == pafs.FileType.File:
            self.native.copy_file(src, dest)
            self.delete_file(src)
            return
        self.native.move(src, dest)


def wrap_fsspec(fs: Any) -> pafs.FileSystem:
    """``pyarrow.fs.PyFileSystem(LiteralFSSpecHandler(fs))`` for an fsspec filesystem."""
    return pafs.PyFileSystem(LiteralFSSpecHandler(fs))


def wrap_filesystem(filesystem: Any) -> pafs.FileSystem:
    """Return ``filesystem`` as a ``pyarrow.fs.FileSystem``.

    Raises:
        TypeError: it is neither a pyarrow nor an fsspec filesystem.
    """
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return wrap_fsspec(filesystem)
    raise TypeError(
        f"filesystem must be a pyarrow.fs.FileSystem or an fsspec AbstractFileSystem, "
        f"got {type(filesystem).__name__}"
    )
