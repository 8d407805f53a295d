"""Paths and names: every spelling of one storage path is one place, names
holding glob characters are literal, and characters the backend declares it
cannot store are refused before anything is written."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing.conformance._base import BackendFixtures, make_tree
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["NameTests"]


class NameTests(BackendFixtures):
    """One place per storage path, literal names, and refused unstorable names."""

    # -- one place, one spelling ----------------------------------------------------------

    @staticmethod
    def _spellings(backend: Backend, root: str) -> list[str]:
        """Spellings of ``root`` that name the same place on this filesystem:
        with a trailing ``/``, an empty component (``a//b``) and a ``.``
        component (``a/./b``) too, which the lease compares as ``a/b``."""
        out = [root, root + "/"]
        head, sep, tail = root.rstrip("/").rpartition("/")
        if sep and head.strip("/"):
            out += [f"{head}//{tail}", f"{head}/./{tail}/"]
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

    def test_a_location_that_names_another_place_is_refused(
        self, storage_location: StorageLocation, backend: Backend, root: str, tmp_path: Path
    ) -> None:
        """``..`` off local disks, a URL query (``?versionId=1``) and a control
        character in the location are refused with ``InvalidConfigError``
        before anything is written; every message hides the query's values."""
        from checkpoint_store import session

        uri = storage_location.uri.rstrip("/")
        opts = dict(storage_location.storage_options) or None
        bad = [f"{uri}/x\x00y"]
        if "://" in uri:
            bad.append(f"{uri}/x?versionId=12345")
        if _fsutil.local_path(backend.filesystem, root) is None:
            bad += [f"{uri}/../x", f"{uri}/x/.."]
        for location in bad:
            with pytest.raises(InvalidConfigError) as info:
                with session.start(storage_path=location, storage_options=opts,
                                   experiment_name="exp", trial_name="t"):
                    pass
            assert "12345" not in str(info.value), location
        fs = backend.filesystem
        written = ([fi.path for fi in _fsutil.list_tree(fs, root) if fi.is_file]
                   if _fsutil.exists(fs, root) else [])
        assert written == []

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
