"""BackendTests: the conformance suite every storage backend must pass.

A plugin author subclasses :class:`BackendTests` in their own test suite and
supplies one fixture, ``storage_location``: a fresh, empty place on their store
as a :class:`~checkpoint_store.testing.StorageLocation` (a URI and storage
options). The URI is resolved through the registry, so the suite also proves
that the plugin's entry point is found. Optionally they supply
``raw_objects``: a zero-argument callable listing what the store really holds
(``{path inside the filesystem: size in bytes}``), read behind the backend's
back, which enables the checks on zero-byte and directory-marker objects.

The model is zarr's ``zarr.testing.store.StoreTests``::

    import pytest
    from checkpoint_store.testing import BackendTests, StorageLocation

    class TestMyStore(BackendTests):
        @pytest.fixture
        def storage_location(self, my_server):
            bucket = my_server.new_bucket()
            return StorageLocation(f"myfs://{bucket}/run", {"endpoint": my_server.url})

        @pytest.fixture
        def raw_objects(self, my_server, storage_location):
            return lambda: my_server.list_everything()

What is checked: write/read/overwrite/list/delete through the filesystem;
byte-identical directory round-trips (nested directories, empty and
multi-MiB files, names with spaces, ``%``, ``#`` and non-ASCII letters);
only committed checkpoints are visible; deletes are idempotent; missing
paths raise not-found errors; URI joining and trailing slashes; secrets
absent from ``repr``; that each declared capability holds; incremental
reports (files copied from the previous checkpoint) stay self-contained; and
that nothing
is written outside its place: a source key ``sub/../../../escape.bin`` (where
the store keeps such a key literally) is refused by ``report()`` and
``to_directory()`` before the first byte, and a download into the checkpoint
itself is refused (checkpoints on the local disk).

Paths and names: every spelling of one storage path (``bucket/runs``,
``bucket/runs/``, ``/bucket/runs``) given with the backend's filesystem
instance names one place whose listings match it
(:meth:`~checkpoint_store.backends.Backend.normalize_path`); names holding
``[``, ``*`` or ``?`` are literal on every listing, delete, copy and move,
so trial ``t[x]`` never touches trial ``tx``; a character the backend
declares it cannot store
(:attr:`~checkpoint_store.backends.Capabilities.unsupported_name_characters`)
is refused with ``InvalidConfigError`` in experiment, trial and checkpoint
file names before anything is written, and the other checks leave such names
out; and concurrent readers of one checkpoint each get the right bytes.
"""

from __future__ import annotations

import os
import posixpath
import random
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store import _fsutil
from checkpoint_store._layout import INTERNAL_METADATA
from checkpoint_store.backends.base import Backend, Capabilities
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.registry import local_path_from_uri, resolve
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["BackendTests", "SAMPLE_TREE", "make_tree", "read_tree"]

_MiB = 1024 * 1024

# Relative path -> size in bytes (contents are seeded pseudo-random bytes).
SAMPLE_TREE: dict[str, int] = {
    "model.bin": 3 * _MiB + 17,  # several transfer chunks on small-chunk backends
    "empty.txt": 0,
    "nested/deeper/optim.pt": 4096,
    "nested/zero.bin": 0,
    "with space/ünïcödé 名前.txt": 33,
    "pct%41 #hash.txt": 5,
}

_SECRET_HINTS = ("secret", "key", "token", "password", "sas", "connection_string", "credential")


def make_tree(root: str | os.PathLike[str], spec: Mapping[str, int] = SAMPLE_TREE,
              seed: int = 0) -> dict[str, bytes]:
    """Write ``spec`` (relative path -> size) under ``root``; return path -> bytes."""
    rng = random.Random(seed)
    out: dict[str, bytes] = {}
    for rel, size in spec.items():
        data = rng.randbytes(size)
        path = Path(root, *rel.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out[rel] = data
    return out


def read_tree(root: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file under local ``root`` as relative posix path -> bytes."""
    out: dict[str, bytes] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root).replace(os.sep, "/")] = Path(full).read_bytes()
    return out


def _secret_values(options: Mapping[str, Any]) -> list[str]:
    found = []
    for k, v in options.items():
        if isinstance(v, str) and len(v) >= 6 and any(h in k.lower() for h in _SECRET_HINTS):
            found.append(v)
    return found


class BackendTests:
    """Base class of the backend conformance suite (see the module docstring).

    Fixtures a subclass provides:
        storage_location: a fresh, empty :class:`StorageLocation` per test (required).
        raw_objects: ``() -> {path: size}`` listing the store behind the
            backend's back, or None (the default) to skip those checks.
    """

    # -- fixtures ------------------------------------------------------------------

    @pytest.fixture
    def storage_location(self) -> StorageLocation:
        raise NotImplementedError(
            "subclasses of BackendTests must define a `storage_location` fixture"
        )

    @pytest.fixture
    def raw_objects(self) -> Callable[[], Mapping[str, int]] | None:
        return None

    @pytest.fixture
    def resolved(self, storage_location: StorageLocation) -> tuple[Backend, str]:
        return resolve(storage_location.uri, storage_options=dict(storage_location.storage_options))

    @pytest.fixture
    def backend(self, resolved: tuple[Backend, str]) -> Backend:
        return resolved[0]

    @pytest.fixture(autouse=True)
    def _declared_unstorable(self, backend: Backend) -> None:
        # Names holding these are checked for refusal, and left out elsewhere.
        self._unstorable = set(backend.capabilities.unsupported_name_characters)

    def _storable(self, name: str) -> str:
        """``name`` without the characters the backend declares it cannot store."""
        return "".join(c for c in name if c not in self._unstorable)

    @pytest.fixture
    def root(self, resolved: tuple[Backend, str]) -> str:
        return resolved[1]

    @staticmethod
    def _base_uri(loc: StorageLocation) -> str:
        """The URI the store prints for ``loc``: a plain local path becomes ``file://``,
        with ``%`` escaped as ``%25`` (file URIs are percent-decoded when read back)."""
        if loc.uri.startswith(("file://", "local://")):
            path = local_path_from_uri(loc.uri)
        elif "://" in loc.uri:
            return loc.uri.rstrip("/")
        else:
            path = os.path.abspath(loc.uri)
        return "file://" + path.rstrip("/").replace("%", "%25")

    def _context(self, loc: StorageLocation, uri: str | None = None,
                 trial: str = "trial") -> StorageContext:
        return StorageContext(uri or loc.uri, "exp", trial,
                              storage_options=dict(loc.storage_options))

    # -- the backend object --------------------------------------------------------------

    def test_factory_returns_a_backend(self, backend: Backend, root: str) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.filesystem, pafs.FileSystem)
        assert isinstance(backend.capabilities, Capabilities)
        assert backend.capabilities.chunk_size > 0
        assert backend.capabilities.concurrency >= 1
        assert root and not root.endswith("/")

    def test_repr_hides_secrets(self, backend: Backend, storage_location: StorageLocation,
                                tmp_path: Path) -> None:
        secrets = _secret_values(storage_location.storage_options)
        ctx = self._context(storage_location)
        ckpt = ctx.persist_checkpoint(
            Checkpoint.from_directory(self._src(tmp_path, {"a.txt": 3})), 0, {}
        )
        for text in (repr(backend), str(backend), repr(ctx), repr(ckpt), ckpt.uri,
                     repr(storage_location)):
            for secret in secrets:
                assert secret not in text

    # -- plain filesystem operations ---------------------------------------------------------

    def test_write_read_overwrite(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        path = posixpath.join(root, "dir", "file.bin")
        _fsutil.write_bytes(fs, path, b"first", caps)
        assert _fsutil.read_bytes(fs, path) == b"first"
        _fsutil.write_bytes(fs, path, b"second, longer", caps)
        assert _fsutil.read_bytes(fs, path) == b"second, longer"
        info = fs.get_file_info(path)
        assert info.type == pafs.FileType.File
        assert info.size == len(b"second, longer")

    def test_listing(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        for rel in ("top/a.txt", "top/sub/b.txt", "top/sub/deeper/c.txt"):
            _fsutil.write_bytes(fs, posixpath.join(root, rel), rel.encode(), caps)
        top = posixpath.join(root, "top")
        children = {
            posixpath.basename(fi.path.rstrip("/")): fi.type for fi in _fsutil.list_dir(fs, top)
        }
        assert children == {"a.txt": pafs.FileType.File, "sub": pafs.FileType.Directory}
        assert dict(_fsutil.walk_files(fs, top)) == {
            "a.txt": len("top/a.txt"),
            "sub/b.txt": len("top/sub/b.txt"),
            "sub/deeper/c.txt": len("top/sub/deeper/c.txt"),
        }
        assert _fsutil.is_dir(fs, posixpath.join(top, "sub"))
        assert _fsutil.list_dir(fs, posixpath.join(root, "absent")) == []

    def test_not_found(self, backend: Backend, root: str,
                       storage_location: StorageLocation) -> None:
        fs = backend.filesystem
        missing = posixpath.join(root, "nope", "missing.bin")
        assert fs.get_file_info(missing).type == pafs.FileType.NotFound
        with pytest.raises((FileNotFoundError, OSError)):
            _fsutil.read_bytes(fs, missing)
        ckpt = Checkpoint(storage_location.uri.rstrip("/") + "/checkpoint_000042",
                          storage_options=dict(storage_location.storage_options))
        assert not ckpt.is_committed
        assert ckpt.internal_metadata == {}
        with pytest.raises(CheckpointNotFoundError):
            ckpt.to_directory()

    def test_delete_is_idempotent(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        f = posixpath.join(root, "d", "x.bin")
        _fsutil.write_bytes(fs, f, b"x", caps)
        _fsutil.write_bytes(fs, posixpath.join(root, "d", "sub", "y.bin"), b"y", caps)
        _fsutil.delete_file(fs, f)
        _fsutil.delete_file(fs, f)
        assert not _fsutil.exists(fs, f)
        d = posixpath.join(root, "d")
        _fsutil.delete_dir(fs, d)
        _fsutil.delete_dir(fs, d)
        assert dict(_fsutil.walk_files(fs, d)) == {}
        _fsutil.delete_dir(fs, posixpath.join(root, "never-existed"))

    # -- checkpoints ----------------------------------------------------------------------

    def _src(self, tmp_path: Path, spec: Mapping[str, int] = SAMPLE_TREE,
             name: str = "src") -> str:
        src = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
        make_tree(src, {rel: size for rel, size in spec.items()
                        if not set(rel) & self._unstorable})
        return str(src)

    def test_directory_round_trip(self, storage_location: StorageLocation,
                                  tmp_path: Path) -> None:
        src = self._src(tmp_path)
        expected = read_tree(src)
        ctx = self._context(storage_location)
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"x": 1}})
        assert ckpt.is_committed
        manifest = {e["path"]: e["size"] for e in ckpt.internal_metadata["manifest"]}
        assert manifest == {rel: len(data) for rel, data in expected.items()}
        out = ckpt.to_directory(str(tmp_path / "out"))
        assert read_tree(out) == expected
        # The same checkpoint again, from nothing but its URI and the options.
        again = Checkpoint(ckpt.uri, storage_options=dict(storage_location.storage_options))
        assert again.path == ckpt.path
        assert read_tree(again.to_directory(str(tmp_path / "out2"))) == expected

    def test_checkpoint_pickles(self, storage_location: StorageLocation,
                                tmp_path: Path) -> None:
        """A Checkpoint crosses process boundaries (multiprocessing, Ray) by pickle."""
        import pickle

        src = self._src(tmp_path, {"a.bin": 1000})
        ckpt = self._context(storage_location).persist_checkpoint(
            Checkpoint.from_directory(src), 0, {"metrics": {"m": 1}}
        )
        clone = pickle.loads(pickle.dumps(ckpt))
        assert clone == ckpt and clone.uri == ckpt.uri
        assert clone.internal_metadata["metrics"] == {"m": 1}
        assert read_tree(clone.to_directory(str(tmp_path / "o"))) == read_tree(src)

    def test_special_names_in_storage_path(self, storage_location: StorageLocation,
                                           tmp_path: Path) -> None:
        odd = storage_location.join("a dir", self._storable("100% #1 ünï 名"))
        ctx = self._context(odd)
        ckpt = ctx.persist_checkpoint(
            Checkpoint.from_directory(self._src(tmp_path, {self._storable("f g#%.txt"): 10})),
            0, {}
        )
        assert ckpt.uri == self._base_uri(odd) + "/exp/trial/checkpoint_000000"
        again = Checkpoint(ckpt.uri, storage_options=dict(storage_location.storage_options))
        assert read_tree(again.to_directory(str(tmp_path / "out"))) == read_tree(
            ckpt.to_directory(str(tmp_path / "out-direct"))
        )
        assert [c.path for c, _ in self._context(odd).committed_checkpoints()] == [ckpt.path]

    def test_trailing_slash_and_join(self, storage_location: StorageLocation) -> None:
        plain = self._context(storage_location)
        slashed = self._context(storage_location, uri=storage_location.uri + "/")
        assert plain.trial_path == slashed.trial_path
        uri = plain.uri(plain.trial_path)
        assert uri == self._base_uri(storage_location) + "/exp/trial"
        scheme, _, rest = uri.partition("://")
        assert scheme and rest
        assert "//" not in rest.lstrip("/")

    def test_only_committed_checkpoints_are_visible(self, storage_location: StorageLocation,
                                                    backend: Backend, tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"w.bin": 100})
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        # A writer that died before its commit marker: data files, no internal metadata.
        torn = ctx.checkpoint_path(1)
        _fsutil.write_bytes(backend.filesystem, posixpath.join(torn, "w.bin"), b"partial",
                            backend.capabilities)
        assert [i for i, _ in ctx.checkpoint_dirs()] == [0, 1]
        committed = ctx.committed_checkpoints()
        assert [meta["index"] for _, meta in committed] == [0]
        assert not ctx.checkpoint("checkpoint_000001").is_committed
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 2, {})
        assert read_tree(ckpt.to_directory(str(tmp_path / "o"))) == read_tree(src)
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [0, 2]

    def test_commit_twice_conflicts(self, storage_location: StorageLocation,
                                    tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        first = self._src(tmp_path, {"a.bin": 10}, name="first")
        ctx.persist_checkpoint(Checkpoint.from_directory(first), 3, {})
        with pytest.raises(CheckpointConflictError):
            ctx.persist_checkpoint(
                Checkpoint.from_directory(self._src(tmp_path, {"b.bin": 20}, name="second")),
                3, {},
            )
        out = ctx.checkpoint("checkpoint_000003").to_directory(str(tmp_path / "o"))
        assert read_tree(out) == read_tree(first)

    def test_delete_checkpoint(self, storage_location: StorageLocation,
                               tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"a.bin": 10, "d/b.bin": 5})
        for i in range(2):
            ctx.persist_checkpoint(Checkpoint.from_directory(src), i, {})
        ctx.delete_checkpoint("checkpoint_000000")
        ctx.delete_checkpoint("checkpoint_000000")
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [1]
        assert [i for i, _ in ctx.checkpoint_dirs()] == [1]

    def test_incremental_report_is_self_contained(self, storage_location: StorageLocation,
                                                  tmp_path: Path) -> None:
        # Report twice; between the reports one file changes keeping its size
        # and one grows. Where the store copies server-side, the unchanged
        # files come from checkpoint 0; either way checkpoint 1 holds the new
        # bytes and still verifies once checkpoint 0 is deleted.
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"same.bin": 70_000, "d/changed.bin": 4096, "grows.bin": 10})
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        with open(os.path.join(src, "d", "changed.bin"), "r+b") as f:
            old = f.read(1)
            f.seek(0)
            f.write(bytes([old[0] ^ 0xFF]))  # same size, another CRC32C
        with open(os.path.join(src, "grows.bin"), "ab") as f:
            f.write(b"more")
        expected = read_tree(src)
        second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
        ctx.delete_checkpoint("checkpoint_000000")
        second.verify()
        assert read_tree(second.to_directory(str(tmp_path / "o"))) == expected
        plain = StorageContext(storage_location.uri, "exp", "full",
                               storage_options=dict(storage_location.storage_options),
                               incremental=False, max_concurrency=2, memory_budget=2**21)
        full = plain.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
        assert full.internal_metadata["manifest"] == second.internal_metadata["manifest"]

    def test_session_keeps_best_and_resumes(self, storage_location: StorageLocation,
                                            tmp_path: Path) -> None:
        from checkpoint_store import CheckpointConfig, session

        opts = dict(storage_location.storage_options)
        cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc",
                               checkpoint_score_order="max")
        accs = [0.5, 0.9, 0.7]
        with session.start(storage_path=storage_location.uri, storage_options=opts,
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg):
            assert session.get_checkpoint() is None
            for i, acc in enumerate(accs):
                src = self._src(tmp_path, {"step.txt": i + 1}, name=f"s{i}")
                session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(src))
        ctx = self._context(storage_location, trial="t")
        kept = [meta["index"] for _, meta in ctx.committed_checkpoints()]
        assert kept == [1, 2]  # the best (0.9) and the latest
        assert [row["acc"] for row in ctx.read_results()] == accs
        with session.start(storage_path=storage_location.uri, storage_options=opts,
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg):
            resumed = session.get_checkpoint()
            assert resumed is not None
            assert resumed.internal_metadata["index"] == 2

    def test_rows_of_a_killed_run_are_read_once_and_folded(
        self, storage_location: StorageLocation
    ) -> None:
        """Rows a run flushed before it died (segments on stores without append)
        are all read, once; the next session continues after them and its end
        leaves one ``result.json`` holding every row (docs/format.md)."""
        from checkpoint_store import session
        from checkpoint_store._results import ResultLog, list_segments

        ctx = self._context(storage_location, trial="killed")
        log = ResultLog(ctx, flush_interval=3600)
        for i in range(5):
            log.append({"i": i, "training_iteration": i + 1})
            if i in (1, 4):
                log.flush()  # then the process "dies": no close, no assembly
        assert [r["i"] for r in ctx.read_results()] == list(range(5))
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="killed") as s:
            assert s.report({"i": 5})["training_iteration"] == 6
        assert [r["i"] for r in ctx.read_results()] == list(range(6))
        assert list_segments(ctx.filesystem, ctx.trial_path) == []

    # -- one place, one spelling ----------------------------------------------------------

    @staticmethod
    def _spellings(backend: Backend, root: str) -> list[str]:
        """Spellings of ``root`` that name the same place on this filesystem."""
        out = [root, root + "/"]
        if _fsutil.local_path(backend.filesystem, root) is None:
            # Off local disks a leading '/' changes nothing (on a disk it makes
            # a relative path, another place).
            bare = root.strip("/")
            out += [bare, "/" + bare, bare + "/"]
        return out

    @staticmethod
    def _filesystem_variants(backend: Backend) -> list[Any]:
        """The backend's filesystem as users hand it in: the pyarrow object, and
        for fsspec-based stores the bare fsspec instance and pyarrow's stock wrap
        of it (Ray's ``RunConfig(storage_filesystem=...)``)."""
        fs = backend.filesystem
        out: list[Any] = [fs]
        inner = getattr(getattr(fs, "handler", None), "fs", None)
        if inner is not None and not isinstance(inner, pafs.FileSystem):
            out += [inner, pafs.PyFileSystem(pafs.FSSpecHandler(inner))]
        return out

    def test_every_spelling_of_a_storage_path_is_one_place(
        self, backend: Backend, root: str, tmp_path: Path
    ) -> None:
        src = self._src(tmp_path, {"w.bin": 10})
        trial_paths = set()
        for i, spelling in enumerate(self._spellings(backend, root)):
            ctx = StorageContext(spelling, "exp", "trial", storage_filesystem=backend.filesystem)
            trial_paths.add(ctx.trial_path)
            ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), i, {})
            assert ckpt.is_committed, spelling
            assert [m["index"] for _, m in ctx.committed_checkpoints()] == list(range(i + 1))
            assert dict(_fsutil.walk_files(ctx.filesystem, ckpt.path))["w.bin"] == 10
        assert len(trial_paths) == 1, trial_paths

    def test_sessions_on_a_given_filesystem_commit_and_resume(
        self, backend: Backend, root: str, tmp_path: Path
    ) -> None:
        """``session.start(storage_path=..., storage_filesystem=fs)`` as Ray users
        call it: every report commits, and a restart through another spelling of
        the same path resumes the same checkpoint."""
        from checkpoint_store import session

        spellings = self._spellings(backend, root)
        for v, fs in enumerate(self._filesystem_variants(backend)):
            trial = f"t{v}"
            for attempt in range(2):
                spelling = spellings[(v + attempt) % len(spellings)]
                with session.start(storage_path=spelling, storage_filesystem=fs,
                                   experiment_name="exp", trial_name=trial):
                    got = session.get_checkpoint()
                    if attempt:
                        assert got is not None, (type(fs).__name__, spelling)
                        assert got.internal_metadata["index"] == 0
                    src = self._src(tmp_path, {"a.bin": 5 + attempt}, name=f"s{v}{attempt}")
                    session.report({"a": attempt}, checkpoint=Checkpoint.from_directory(src))
                    latest = session.get_checkpoint()
                    assert latest is not None and latest.is_committed
                    assert latest.internal_metadata["index"] == attempt

    # -- names are literal ------------------------------------------------------------

    # Each name is a glob pattern that matches some of the others.
    _PATTERN_NAMES = ("tx", "t[x]", "t*", "ta", "t?")

    def _pattern_names(self) -> list[str]:
        return [n for n in self._PATTERN_NAMES if not set(n) & self._unstorable]

    def test_glob_characters_are_literal_on_the_filesystem(
        self, backend: Backend, root: str
    ) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        base = posixpath.join(root, "globs")

        def fill(name: str) -> None:
            for rel in ("f.bin", "sub/g.bin"):
                _fsutil.write_bytes(fs, posixpath.join(base, name, rel),
                                    f"{name}:{rel}".encode(), caps)

        def files(name: str) -> dict[str, bytes]:
            d = posixpath.join(base, name)
            return {rel: _fsutil.read_bytes(fs, posixpath.join(d, rel))
                    for rel, _ in _fsutil.walk_files(fs, d)}

        names = self._pattern_names()
        for name in names:
            fill(name)
        for name in names:
            assert files(name) == {"f.bin": f"{name}:f.bin".encode(),
                                   "sub/g.bin": f"{name}:sub/g.bin".encode()}, name
        listed = {posixpath.basename(fi.path) for fi in _fsutil.list_dir(fs, base)}
        assert listed == set(names)

        if caps.server_side_copy:
            fs.copy_file(posixpath.join(base, "t[x]", "f.bin"),
                         posixpath.join(base, "t[x]", "c.bin"))
            assert _fsutil.read_bytes(fs, posixpath.join(base, "t[x]", "c.bin")) == b"t[x]:f.bin"
            _fsutil.delete_file(fs, posixpath.join(base, "t[x]", "c.bin"))
        _fsutil.delete_file(fs, posixpath.join(base, "t*", "f.bin"))
        assert set(files("t*")) == {"sub/g.bin"}
        for name in names:
            if name != "t*":
                assert set(files(name)) == {"f.bin", "sub/g.bin"}, name
        for victim in [n for n in names if n not in ("tx", "ta")]:
            _fsutil.delete_dir(fs, posixpath.join(base, victim))
            assert files(victim) == {}
            assert not _fsutil.exists(fs, posixpath.join(base, victim))
        assert files("tx") == {"f.bin": b"tx:f.bin", "sub/g.bin": b"tx:sub/g.bin"}
        assert files("ta") == {"f.bin": b"ta:f.bin", "sub/g.bin": b"ta:sub/g.bin"}
        if caps.atomic_rename:
            fs.move(posixpath.join(base, "tx"), posixpath.join(base, "t[y]"))
            assert files("t[y]") == {"f.bin": b"tx:f.bin", "sub/g.bin": b"tx:sub/g.bin"}
            assert files("ta") == {"f.bin": b"ta:f.bin", "sub/g.bin": b"ta:sub/g.bin"}

    def test_a_trial_named_like_a_pattern_keeps_to_itself(
        self, storage_location: StorageLocation, tmp_path: Path
    ) -> None:
        """Trial ``t[x]`` evicting with ``num_to_keep=1`` leaves trial ``tx``
        whole, releases its own lease, and restarts; the same for experiments."""
        from checkpoint_store import CheckpointConfig, session

        opts = dict(storage_location.storage_options)

        def run(experiment: str, trial: str, reports: int, keep: int | None) -> int | None:
            with session.start(storage_path=storage_location.uri, storage_options=opts,
                               experiment_name=experiment, trial_name=trial,
                               checkpoint_config=CheckpointConfig(num_to_keep=keep)):
                for i in range(reports):
                    src = self._src(tmp_path, {"w.bin": 3 + i}, name=f"{trial}{i}")
                    session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
                got = session.get_checkpoint()
                return None if got is None else got.internal_metadata["index"]

        def kept(experiment: str, trial: str) -> list[int]:
            ctx = StorageContext(storage_location.uri, experiment, trial, storage_options=opts)
            return [m["index"] for _, m in ctx.committed_checkpoints()]

        run("exp", "tx", 3, None)
        assert run("exp", "t[x]", 3, 1) == 2
        assert kept("exp", "tx") == [0, 1, 2]
        assert kept("exp", "t[x]") == [2]
        assert run("exp", "t[x]", 1, 1) == 3  # the lease was released: a restart works
        assert kept("exp", "t[x]") == [3] and kept("exp", "tx") == [0, 1, 2]
        run("sweepl", "t", 2, None)
        run("sweep[lr=0.1]", "t", 2, 1)
        assert kept("sweepl", "t") == [0, 1]
        assert kept("sweep[lr=0.1]", "t") == [1]

    def test_declared_unstorable_names_are_refused(
        self, storage_location: StorageLocation, backend: Backend, root: str, tmp_path: Path
    ) -> None:
        """Each character in ``Capabilities.unsupported_name_characters`` is
        refused, with the name and the character in the message, in an
        experiment or trial name and in a checkpoint's file name, before
        anything is written (a silent write under another name would mix
        trials)."""
        from checkpoint_store import session

        if not self._unstorable:
            pytest.skip("the backend declares no character it cannot store")
        opts = dict(storage_location.storage_options)
        for i, char in enumerate(sorted(self._unstorable)):
            for experiment, trial, name in (("exp", f"t*1{char}", f"t*1{char}"),
                                            (f"e{char}", "t", f"e{char}"),
                                            ("exp", f"{char}t", f"{char}t")):
                with pytest.raises(InvalidConfigError, match=re.escape(repr(name))) as info:
                    StorageContext(storage_location.uri, experiment, trial,
                                   storage_options=opts)
                assert repr(char) in str(info.value)
                with pytest.raises(InvalidConfigError, match=re.escape(repr(char))):
                    session.start(storage_path=storage_location.uri, storage_options=opts,
                                  experiment_name=experiment, trial_name=trial)
            src = tmp_path / f"bad-{i}"
            make_tree(src, {"ok.bin": 3, f"sub/w{char}": 4})
            with pytest.raises(InvalidConfigError, match=re.escape(f"sub/w{char}")):
                self._context(storage_location).persist_checkpoint(
                    Checkpoint.from_directory(str(src)), 0, {})
        fs = backend.filesystem
        written = ([fi.path for fi in _fsutil.list_tree(fs, root) if fi.is_file]
                   if _fsutil.exists(fs, root) else [])
        assert written == []

    # -- readers ------------------------------------------------------------------------

    def test_concurrent_readers_each_get_the_right_bytes(
        self, storage_location: StorageLocation, tmp_path: Path
    ) -> None:
        """Threads reading one committed checkpoint at once (its metadata, its
        files, downloads into one directory) each see exactly what was written."""
        src = self._src(tmp_path, {"a.bin": 70_000, "b/c.bin": 3000, "d.txt": 11})
        expected = read_tree(src)
        ckpt = self._context(storage_location).persist_checkpoint(
            Checkpoint.from_directory(src), 0, {"metrics": {"m": 1}}
        )
        fs = ckpt.filesystem
        want_meta = ckpt.internal_metadata
        assert want_meta["index"] == 0
        threads = 8
        start = threading.Barrier(threads)
        out = str(tmp_path / "same-dir")

        def reader(k: int) -> None:
            start.wait()
            for _ in range(5):
                assert ckpt.internal_metadata == want_meta
                assert ckpt.is_committed
                rel = sorted(expected)[k % len(expected)]
                assert _fsutil.read_bytes(fs, posixpath.join(ckpt.path, rel)) == expected[rel]
                with fs.open_input_file(posixpath.join(ckpt.path, "a.bin")) as f:
                    assert f.read_at(100, 1000 + k) == expected["a.bin"][1000 + k:1100 + k]
            if k % 2 == 0:
                assert read_tree(ckpt.to_directory(out)) == expected

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(reader, range(threads)))
        assert read_tree(out) == expected

    # -- capabilities -------------------------------------------------------------------

    def test_declared_capabilities_hold(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        a = posixpath.join(root, "cap", "a")
        _fsutil.write_bytes(fs, posixpath.join(a, "f.bin"), b"payload", caps)
        if caps.strong_listing:
            names = [posixpath.basename(fi.path) for fi in _fsutil.list_dir(fs, a)]
            assert names == ["f.bin"]
        if caps.server_side_copy:
            fs.copy_file(posixpath.join(a, "f.bin"), posixpath.join(a, "g.bin"))
            assert _fsutil.read_bytes(fs, posixpath.join(a, "g.bin")) == b"payload"
        if caps.atomic_rename:
            b = posixpath.join(root, "cap", "b")
            fs.move(a, b)
            assert not _fsutil.exists(fs, a)
            assert _fsutil.read_bytes(fs, posixpath.join(b, "f.bin")) == b"payload"
            # Renaming onto a non-empty directory must fail, never merge or replace:
            # that is what makes rename-into-place a safe commit.
            c = posixpath.join(root, "cap", "c")
            _fsutil.write_bytes(fs, posixpath.join(c, "other.bin"), b"other", caps)
            with pytest.raises(OSError):
                fs.move(b, c)
            assert _fsutil.read_bytes(fs, posixpath.join(c, "other.bin")) == b"other"
        if caps.directories:
            d = posixpath.join(root, "cap", "empty-dir")
            fs.create_dir(d, recursive=True)
            assert _fsutil.is_dir(fs, d)

    def test_concurrent_use_from_threads(self, backend: Backend, root: str) -> None:
        """Transfers share one filesystem object across ``capabilities.concurrency``
        threads: concurrent writes, reads and listings must not interfere."""
        from concurrent.futures import ThreadPoolExecutor

        fs, caps = backend.filesystem, backend.capabilities
        workers = max(2, min(caps.concurrency, 8))
        payloads = {f"t/{i:02d}/f.bin": bytes([i]) * (1000 + i) for i in range(2 * workers)}

        def put(item: tuple[str, bytes]) -> None:
            _fsutil.write_bytes(fs, posixpath.join(root, item[0]), item[1], caps)

        def get(rel: str) -> bytes:
            return _fsutil.read_bytes(fs, posixpath.join(root, rel))

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(put, payloads.items()))
            got = dict(zip(payloads, pool.map(get, payloads), strict=True))
        assert got == payloads
        assert dict(_fsutil.walk_files(fs, posixpath.join(root, "t"))) == {
            rel[2:]: len(data) for rel, data in payloads.items()
        }
        if caps.strong_listing:
            victim = posixpath.join(root, "t", "00")
            _fsutil.delete_dir(fs, victim)
            names = {posixpath.basename(fi.path.rstrip("/"))
                     for fi in _fsutil.list_dir(fs, posixpath.join(root, "t"))}
            assert "00" not in names and "01" in names

    def test_no_zero_byte_or_marker_objects_of_ours(
        self, storage_location: StorageLocation, backend: Backend,
        raw_objects: Callable[[], Mapping[str, int]] | None, tmp_path: Path,
    ) -> None:
        if raw_objects is None or backend.capabilities.directories:
            pytest.skip("needs raw_objects on a store without real directories")
        from checkpoint_store import CheckpointConfig, session

        spec = {"w.bin": 64, "empty-by-user.txt": 0}
        cfg = CheckpointConfig(num_to_keep=1)
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg,
                           config={"lr": 0.1}):
            for i in range(3):
                src = self._src(tmp_path, spec, name=f"s{i}")
                session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        objects = dict(raw_objects())
        assert objects, "raw_objects() listed nothing after a session wrote checkpoints"
        markers = [k for k in objects if k.endswith("/")]
        assert markers == [], f"directory-marker objects: {markers}"
        zero = sorted(k for k, size in objects.items() if size == 0)
        assert all(k.endswith("/empty-by-user.txt") for k in zero), (
            f"zero-byte objects not written by the user: {zero}"
        )
        ours = [k for k in objects if posixpath.basename(k) in (
            INTERNAL_METADATA, "result.json", "params.json", ".checkpoint_manager.json")]
        assert ours and all(objects[k] > 0 for k in ours)

    # -- nothing written outside its place -----------------------------------------------

    def _plant_dotdot_key(self, backend: Backend, src: str, rel: str) -> None:
        """Write ``src/model.bin`` and the literal key ``src/<rel>`` (``rel``
        holds ``..``); skip where the store resolves ``..`` itself: there
        the key cannot exist (and writing it would land elsewhere)."""
        fs, caps = backend.filesystem, backend.capabilities
        if _fsutil.local_path(fs, src) is not None:
            pytest.skip("the local disk resolves '..': no such key can exist")
        _fsutil.write_bytes(fs, posixpath.join(src, "model.bin"), b"model", caps)
        try:
            _fsutil.write_bytes(fs, posixpath.join(src, rel), b"escape", caps)
        except Exception as exc:  # noqa: BLE001 (stores refuse it each their own way)
            pytest.skip(f"this store refuses keys with '..' ({type(exc).__name__})")
        if rel not in dict(_fsutil.walk_files(fs, src)):
            pytest.skip("this store normalises '..' in keys")

    @staticmethod
    def _keys_named(backend: Backend, root: str, name: str) -> list[str]:
        return sorted(fi.path for fi in _fsutil.list_tree(backend.filesystem, root)
                      if fi.type == pafs.FileType.File and posixpath.basename(fi.path) == name)

    def test_report_of_a_source_holding_a_dotdot_key_is_refused(
        self, storage_location: StorageLocation, backend: Backend, root: str,
    ) -> None:
        """A key ``sub/../../../escape.bin`` is a literal name on an object store,
        but a way out of the checkpoint (even of the trial) wherever it is
        joined to a path: refused before the first byte, the source unchanged."""
        from checkpoint_store import UnsafePathError, session

        rel = "sub/../../../escape.bin"
        src = posixpath.join(root, "src")
        self._plant_dotdot_key(backend, src, rel)
        source_before = dict(_fsutil.walk_files(backend.filesystem, src))
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="t"):
            with pytest.raises(UnsafePathError) as err:
                session.report({"a": 1}, checkpoint=Checkpoint(src, filesystem=backend.filesystem))
        assert err.value.file == rel
        assert rel in str(err.value)
        assert self._keys_named(backend, root, "escape.bin") == [posixpath.join(src, rel)]
        assert self._keys_named(backend, root, "model.bin") == [posixpath.join(src, "model.bin")]
        assert self._context(storage_location, trial="t").checkpoint_dirs() == []
        assert dict(_fsutil.walk_files(backend.filesystem, src)) == source_before

    def test_download_of_a_dotdot_key_is_refused(
        self, backend: Backend, root: str, tmp_path: Path,
    ) -> None:
        """The same key read back: nothing is written outside the target."""
        from checkpoint_store import UnsafePathError

        rel = "sub/../../escape.bin"
        src = posixpath.join(root, "uncommitted")
        self._plant_dotdot_key(backend, src, rel)
        target = tmp_path / "a" / "out"
        with pytest.raises(UnsafePathError) as err:
            Checkpoint(src, filesystem=backend.filesystem).to_directory(target)
        assert err.value.file == rel
        assert not target.exists()
        assert [p for p in tmp_path.rglob("*") if p.name == "escape.bin"] == []

    def test_download_into_the_checkpoint_itself_is_refused(
        self, storage_location: StorageLocation, tmp_path: Path,
    ) -> None:
        """``to_directory(<the checkpoint>/restore)`` would write into the
        checkpoint and make it invalid; ``to_directory(<its trial>)`` would
        replace it. Both are refused, the checkpoint stays committed."""
        from checkpoint_store import UnsafePathError

        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"w.bin": 100, "d/x.bin": 3})
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        local = _fsutil.local_path(ckpt.filesystem, ckpt.path)
        if local is None:
            pytest.skip("the checkpoint is not on this machine's disk: no overlap possible")
        before = read_tree(local)
        for target in (os.path.join(local, "restore"), local, os.path.dirname(local)):
            with pytest.raises(UnsafePathError, match="choose a directory outside it"):
                ckpt.to_directory(target)
        assert read_tree(local) == before
        assert ckpt.is_committed
        ckpt.verify()
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [0]

    def test_re_download_leaves_exactly_the_new_checkpoint(
        self, storage_location: StorageLocation, tmp_path: Path,
    ) -> None:
        """Two checkpoints downloaded one after the other into the same
        directory, whose name is 241 characters (the lock, marker and staging
        names built from it must still fit in 255 bytes): the directory then
        holds exactly the second one's files and metadata."""
        ctx = self._context(storage_location)
        c0_src = self._src(tmp_path, {"model.pt": 10, "optimizer.pt": 20}, name="c0")
        c0 = ctx.persist_checkpoint(Checkpoint.from_directory(c0_src), 0, {})
        c0.set_metadata({"step": 100})
        c1_src = self._src(tmp_path, {"model.pt": 11}, name="c1")
        c1 = ctx.persist_checkpoint(Checkpoint.from_directory(c1_src), 1, {})
        target = tmp_path / "dl" / ("d" * 241)
        c0.to_directory(target)
        assert sorted(os.listdir(target)) == [".user_metadata.json", "model.pt", "optimizer.pt"]
        c1.to_directory(target)
        assert read_tree(target) == read_tree(c1_src)
        assert all(len(n.encode()) <= 255 for n in os.listdir(tmp_path / "dl"))
