"""The ``pyarrow.fs`` handlers a backend puts around fsspec clients.

pyarrow's stock ``FSSpecHandler`` reads ``[``, ``*`` and ``?`` in a name as a
glob pattern on deletes, copies and moves, shares one file object between the
readers of fsspec's memory filesystem, and lists a whole subtree on stores
that ignore ``maxdepth``; :class:`LiteralFSSpecHandler` does none of these.
pyarrow's own S3 and Azure filesystems leave a directory-marker object after
every delete; :class:`MarkerFreeDeletesHandler` deletes through the store's
fsspec client instead. :func:`wrap_filesystem` turns any filesystem a user
passes into the ``pyarrow.fs.FileSystem`` a :class:`~checkpoint_store.backends.Backend`
holds. :func:`placeholders_as_directories` turns the directory placeholders
other tools leave on object stores into the directories they stand for.
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from glob import has_magic
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.errors import InvalidConfigError

__all__ = [
    "LiteralFSSpecHandler",
    "MarkerFreeDeletesHandler",
    "folder_blobs_as_directories",
    "placeholders_as_directories",
    "check_filesystem",
    "wrap_filesystem",
    "wrap_fsspec",
]


def placeholders_as_directories(base: str, infos: Iterable[pafs.FileInfo]
                                ) -> list[pafs.FileInfo]:
    """A listing of ``base`` with directory placeholders read as directories.

    Other tools mark directories on object stores with objects: an object
    whose key ends in ``/`` (the S3 and GCS consoles, ``pyarrow.fs``'s own
    ``create_dir`` and ``copy_files``, Hadoop S3A), or an object named like
    the directory beside its prefix (blobfuse, AzCopy and Hadoop write
    zero-byte ``hdi_isfolder`` blobs; anyone may write ``dir`` beside
    ``dir/...``). Neither can be a file of a directory tree. Here such an
    entry becomes the directory it names (once, however many markers it
    has), a placeholder of ``base`` itself disappears, and the order of the
    other entries is kept.

    Args:
        base: the directory listed, as its listings spell it.
        infos: the entries listed under it (one level or recursive).

    Returns:
        The entries, every path without a trailing ``/``, no path twice.
    """
    stripped = base.rstrip("/")
    infos = list(infos)
    dirs = {fi.path.rstrip("/") for fi in infos
            if fi.type == pafs.FileType.Directory or fi.path.endswith("/")}
    out: list[pafs.FileInfo] = []
    seen: set[str] = set()
    for fi in infos:
        path = fi.path.rstrip("/")
        if path == stripped or path in seen:
            continue
        if path in dirs:
            if fi.type != pafs.FileType.Directory:
                fi = pafs.FileInfo(path, pafs.FileType.Directory)
        seen.add(path)
        out.append(fi)
    return out


def folder_blobs_as_directories(fs: pafs.FileSystem, infos: Iterable[pafs.FileInfo]
                                ) -> list[pafs.FileInfo]:
    """``infos`` listed by pyarrow's ``AzureFileSystem`` ``fs``, its folder blobs
    as directories.

    A folder blob (zero bytes, metadata ``hdi_isfolder=true``: AzCopy,
    blobfuse, Azure Storage Explorer, Hadoop) lists as an empty file, and
    pyarrow refuses to open it ("Not a regular file"): that refusal tells
    it from a user's empty file, at one metadata request per empty file.
    Any other filesystem's ``infos`` come back as they are.
    """
    infos = list(infos)
    azure = getattr(pafs, "AzureFileSystem", None)
    if azure is None or not isinstance(fs, azure):
        return infos
    return [pafs.FileInfo(fi.path, pafs.FileType.Directory)
            if fi.type == pafs.FileType.File and fi.size == 0 and _refused_as_folder(fs, fi.path)
            else fi for fi in infos]


def _refused_as_folder(fs: pafs.FileSystem, path: str) -> bool:
    try:
        fs.open_input_file(path).close()
    except FileNotFoundError:  # deleted since the listing: its answer stands
        return False
    except OSError as exc:
        return "Not a regular file" in str(exc)
    return False


def _only_the_object(path: str, entries: Iterable[Any]) -> bool:
    """Whether a listing of ``path`` (fsspec entries, or bare names) holds
    nothing but ``path`` itself as a file: the answer of clients that see a
    name that is both an object and a prefix as the object alone."""
    entries = list(entries)
    stripped = path.strip("/")
    return bool(entries) and all(
        isinstance(e, str) and e.strip("/") == stripped
        or isinstance(e, Mapping) and e.get("type") == "file"
        and str(e.get("name", "")).strip("/") == stripped
        for e in entries)


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


def _is_memory(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    # Subclasses may change behaviour: they get their own rm.
    return type(fs) is MemoryFileSystem


def _memory_rm_tree(fs: Any, path: str) -> None:
    """Delete ``path`` and what is under it from fsspec's memory filesystem in
    one pass over its store. Its own ``rm`` stats every path against the
    whole store (a 2,000-file checkpoint took a second in a store of a few
    checkpoints); the names are literal here (no glob).

    Raises:
        FileNotFoundError: nothing is there.
    """
    key = fs._strip_protocol(path).rstrip("/") or fs.root_marker
    inner = key.rstrip("/") + "/"
    # list(): one atomic snapshot while other threads write other paths.
    files = [k for k in list(fs.store) if k.startswith(inner)]
    dirs = [d for d in list(fs.pseudo_dirs) if d == key or d.startswith(inner)]
    if not files and not dirs:
        raise FileNotFoundError(path)
    for k in files:
        fs.store.pop(k, None)
    for d in dirs:
        try:
            fs.pseudo_dirs.remove(d)
        except ValueError:  # removed by another thread meanwhile
            pass


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
    * Whole writes. fsspec's memory filesystem publishes a file as its
      writer opens it, so a reader saw it empty or half written (a rank
      reading another's marker mid-write got a ``JSONDecodeError``); here a
      written file appears, or replaces the old one, when its writer closes
      it, as one object store PUT does.
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
        # these stamps, the store's own clock (checkpoint_store._util.clock).
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
        base = selector.base_dir
        if selector.recursive:
            entries = [dict(info, name=path) for path, info in self._find(base).items()]
        else:
            try:
                entries = self.fs.ls(base, detail=True)
            except FileNotFoundError:
                entries = []
        infos = self._infos(base, entries)
        if infos:
            return infos
        if _only_the_object(base, entries):
            # adlfs and fsspec's memory filesystem answer for a name that is
            # both an object and a prefix with the object alone.
            inner = base.rstrip("/") + "/"
            beside = [dict(info, name=path) for path, info in self._find_beside_object(base).items()
                      if selector.recursive or "/" not in path[len(inner):].strip("/")]
            if beside:
                return self._infos(base, beside)
            raise NotADirectoryError(base)
        # Empty, absent or a file: one question, answered from one state of
        # the store. Asked as two (is it a directory? does it exist?, as
        # pyarrow's handler does), a writer creating the directory's first
        # entry between them made an absent directory look like a file.
        try:
            kind = self.fs.info(base).get("type")
        except FileNotFoundError:
            kind = None
        if kind == "file":
            raise NotADirectoryError(base)
        if kind is None and not selector.allow_not_found:
            raise FileNotFoundError(base)
        return []

    def _infos(self, base: str, entries: Iterable[dict[str, Any]]) -> list[pafs.FileInfo]:
        # s3fs and gcsfs list a `dir/` placeholder object as a zero-byte file.
        stripped = base.strip("/")
        return placeholders_as_directories(base, (
            self._create_file_info(e["name"], e)
            for e in entries
            if e["name"].strip("/") != stripped
        ))

    def delete_dir(self, path: str) -> None:
        if _is_memory(self.fs):
            return _memory_rm_tree(self.fs, path)
        if not has_magic(path):
            return super().delete_dir(path)
        if not self.fs.isdir(path):
            raise FileNotFoundError(path)
        found = self._find(path)
        files = [p for p, i in found.items() if i.get("type") != "directory"]
        dirs = [p for p, i in found.items() if i.get("type") == "directory"]
        _literal_rm_tree(self.fs, files, [*dirs, path])

    def _find(self, path: str) -> dict[str, dict[str, Any]]:
        """``{path: info}`` of every entry under ``path``; empty when absent."""
        try:
            found = self.fs.find(path, withdirs=True, detail=True)
        except FileNotFoundError:
            return {}
        if isinstance(found, dict) and not _only_the_object(path, found.values()):
            return found
        return self._find_beside_object(path)

    def _find_beside_object(self, path: str) -> dict[str, dict[str, Any]]:
        """``{path: info}`` under ``path`` when ``path`` is also an object.

        adlfs answers ``find`` and ``ls`` of a name that is both a blob and a
        prefix with the blob alone (and so for every name below such a
        parent), as fsspec's memory filesystem does; a listing of the
        container limited to the key's prefix finds the entries (a client
        that ignores ``prefix=`` lists the container, filtered here).
        """
        stripped = path.rstrip("/")
        container, _, key = stripped.partition("/")
        try:
            found = self.fs.find(container, withdirs=True, detail=True, prefix=key)
        except (FileNotFoundError, TypeError):  # TypeError: a find without prefix=
            return {}
        if not isinstance(found, dict):
            return {}
        return {p: i for p, i in found.items() if p.startswith(stripped + "/")}

    def _delete_dir_contents(self, path: str, missing_dir_ok: bool) -> None:
        found = self._find(path)
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

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        from fsspec.implementations.memory import MemoryFileSystem

        if isinstance(self.fs, MemoryFileSystem):
            return pa.PythonFile(_PublishOnClose(self.fs, path), mode="w")
        return super().open_output_stream(path, metadata)

    def open_input_stream(self, path: str) -> Any:
        view = self._own_view(path)
        return view if view is not None else super().open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        view = self._own_view(path)
        return view if view is not None else super().open_input_file(path)


class _PublishOnClose(io.BytesIO):
    """A memory filesystem file written here and stored whole by ``close``
    (``pipe_file``: one assignment into the store); a writer that never
    closes publishes nothing, also once it is garbage collected (``IOBase``
    closes an object it collects: that would store a half file)."""

    def __init__(self, fs: Any, path: str):
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._fs.pipe_file(self._path, data)

    def __del__(self) -> None:
        if not self.closed:
            super().close()  # dropped unclosed: nothing is stored


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
        and go to it directly (see ``checkpoint_store.backends.clients._native_of``)."""
        return self.inner

    def get_type_name(self) -> str:
        return self.type_name

    def normalize_path(self, path: str) -> str:
        return self.native.normalize_path(path).strip("/")

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        # pyarrow lists an object beside a prefix of its name twice, as a file
        # and as a directory; whoever lists through us (Ray) sees one directory.
        return placeholders_as_directories(selector.base_dir, self.native.get_file_info(selector))

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
        InvalidConfigError: it is neither a pyarrow nor an fsspec filesystem
            (see :func:`check_filesystem`).
    """
    check_filesystem(filesystem)
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    return wrap_fsspec(filesystem)


def check_filesystem(filesystem: Any, what: str = "filesystem") -> None:
    """Refuse anything but a ``pyarrow.fs.FileSystem`` or fsspec filesystem
    instance, saying what to pass instead.

    Args:
        filesystem: what the caller was given.
        what: the argument's name, for the message (``"storage_filesystem"``).

    Raises:
        InvalidConfigError: a string (a scheme meant as a location), a class
            instead of an instance, or any other object. Nothing is built.
    """
    if isinstance(filesystem, pafs.FileSystem):
        return
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return
    got = type(filesystem).__name__
    if isinstance(filesystem, (str, bytes)) or hasattr(filesystem, "__fspath__"):
        hint = (f" {filesystem!r}: a location is not a filesystem. Name the store by a URI "
                "in the path argument (storage_path='s3://bucket/runs', "
                "Checkpoint('s3://bucket/run/checkpoint_000001')) and leave the filesystem "
                "argument out")
    elif isinstance(filesystem, type):
        got = f"the class {filesystem.__module__}.{filesystem.__qualname__}"
        hint = ": pass an instance (call it with its options), not the class"
    else:
        hint = (": build one (pyarrow.fs.S3FileSystem(...), s3fs.S3FileSystem(...)), or "
                "give a URI as the location and leave the filesystem argument out")
    raise InvalidConfigError(
        f"{what} must be a pyarrow.fs.FileSystem or an fsspec filesystem instance, got "
        f"{got}{hint}"
    )
