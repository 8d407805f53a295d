"""What other tools leave on object stores never makes a good checkpoint look bad.

Two shapes, written behind the library's back with the stores' own clients
(docs/format.md, "What other tools leave on storage"):

* directory placeholders: an empty ``dir/`` object (S3 and GCS consoles,
  ``pyarrow.fs``), a zero-byte Azure blob with ``hdi_isfolder=true``
  (AzCopy, blobfuse, Hadoop);
* an object named like a directory beside its prefix
  (``<trial>/checkpoint_000000`` beside ``<trial>/checkpoint_000000/...``).

The reported input: one ``x/`` placeholder inside a committed checkpoint on
S3 (s3fs engine) made ``get_checkpoint()`` return None after a restart and
``checkpoint-store verify`` exit 1.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.testing import StorageLocation
from checkpoint_store.testing.conformance import make_tree, read_tree
from tests.cli.cli_helpers import invoke

TREE = {"model.bin": 2000, "nested/opt.pt": 300, "nested/empty.txt": 0}


@dataclass
class Place:
    """A location, how to write other tools' objects there, and (for the
    variants a user passes a filesystem object) that object."""

    loc: StorageLocation
    placeholder: Callable[[str], None]  # (key inside the bucket) -> None
    put: Callable[[str, bytes], None]  # (key, data) -> None
    filesystem: Any = None
    options: dict[str, Any] = field(default_factory=dict)

    def start(self, **kwargs: Any) -> Any:
        where: dict[str, Any] = (
            {"storage_filesystem": self.filesystem,
             "storage_path": self.loc.uri.split("://", 1)[1]}
            if self.filesystem is not None
            else {"storage_path": self.loc.uri, "storage_options": dict(self.loc.storage_options)}
        )
        return session.start(experiment_name="e", trial_name="t", **where, **kwargs)

    def context(self) -> StorageContext:
        if self.filesystem is not None:
            return StorageContext(self.loc.uri.split("://", 1)[1], "e", "t",
                                  storage_filesystem=self.filesystem)
        return StorageContext(self.loc.uri, "e", "t",
                              storage_options=dict(self.loc.storage_options))

    def cli_options(self) -> list[str]:
        return [a for k, v in self.loc.storage_options.items() for a in ("-o", f"{k}={v}")]


def _bucket(loc: StorageLocation) -> str:
    return loc.uri.split("://", 1)[1].split("/", 1)[0]


def _key(loc: StorageLocation, rel: str) -> str:
    """The key of ``rel`` (relative to the location's root) inside its bucket."""
    root = loc.uri.split("://", 1)[1].split("/", 1)[1]
    return posixpath.join(root, rel)


_KINDS = ["s3", "s3fs", "azure", "azure-pyarrow", "gcs", "s3fs-object", "pyarrow-s3-object",
          "pyarrow-azure-object"]


@pytest.fixture(params=_KINDS)
def place(request: pytest.FixtureRequest) -> Place:
    kind = request.param
    if kind.startswith(("s3", "pyarrow-s3")):
        srv = request.getfixturevalue("s3_server")
        loc = request.getfixturevalue("s3fs_location" if kind == "s3fs" else "s3_location")
        bucket = _bucket(loc)
        fs: Any = None
        if kind == "s3fs-object":
            import s3fs

            fs = s3fs.S3FileSystem(key=srv.access_key_id, secret=srv.secret_access_key,
                                   endpoint_url=srv.endpoint_url, use_listings_cache=False,
                                   client_kwargs={"region_name": srv.region})
        elif kind == "pyarrow-s3-object":
            fs = pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                                   endpoint_override=srv.endpoint_url.split("://")[1],
                                   scheme="http", region=srv.region)
        return Place(loc, lambda k: srv.put_object(bucket, _key(loc, k) + "/"),
                     lambda k, d: srv.put_object(bucket, _key(loc, k), d), fs)
    if "azure" in kind:
        srv = request.getfixturevalue("azure_server")
        container = request.getfixturevalue("azure_container")
        engine = "adlfs" if kind == "azure" else "pyarrow"
        loc = StorageLocation(f"az://{container}/ckpt", srv.storage_options(engine))
        host = srv.endpoint_url.split("://")[1]
        native = pafs.AzureFileSystem(
            account_name=srv.account_name, account_key=srv.account_key,
            blob_storage_authority=host, blob_storage_scheme="http",
            dfs_storage_authority=host, dfs_storage_scheme="http",
        ) if kind == "pyarrow-azure-object" else None
        return Place(
            loc,
            lambda k: srv.put_blob(container, _key(loc, k), metadata={"hdi_isfolder": "true"}),
            lambda k, d: srv.put_blob(container, _key(loc, k), d), native)
    srv = request.getfixturevalue("gcs_server")
    loc = request.getfixturevalue("gcs_location")
    bucket = _bucket(loc)
    return Place(loc, lambda k: srv.put_object(bucket, _key(loc, k) + "/"),
                 lambda k, d: srv.put_object(bucket, _key(loc, k), d))


def _report(place: Place, tmp_path: Path, n: int = 1) -> dict[str, bytes]:
    src = tmp_path / f"src-{uuid.uuid4().hex[:6]}"
    expected = make_tree(src, TREE)
    with place.start(checkpoint_config=CheckpointConfig(num_to_keep=1)):
        for i in range(n):
            session.report({"i": i}, checkpoint=Checkpoint.from_directory(str(src)))
    return expected


def _resumed_index(place: Place) -> int | None:
    with place.start():
        got = session.get_checkpoint()
        return None if got is None else got.internal_metadata["index"]


def _check_cli(place: Place, tmp_path: Path, expected: dict[str, bytes]) -> None:
    ckpt = place.loc.join("e", "t", "checkpoint_000000").uri
    opts = place.cli_options()
    res = invoke(["verify", ckpt, *opts, "--json"])
    assert res.exit_code == 0, res.output
    res = invoke(["ls", place.loc.join("e", "t").uri, *opts])
    assert res.exit_code == 0 and "checkpoint_000000" in res.output, res.output
    res = invoke(["download", ckpt, str(tmp_path / "dl"), *opts])
    assert res.exit_code == 0, res.output
    assert read_tree(tmp_path / "dl") == expected
    res = invoke(["cp", place.loc.join("e", "t").uri, str(tmp_path / "copy" / "e" / "t"), *opts])
    assert res.exit_code == 0, res.output
    copied = StorageContext(str(tmp_path / "copy"), "e", "t").committed_checkpoints()
    assert [m["index"] for _, m in copied] == [0]
    assert read_tree(copied[0][0].to_directory(str(tmp_path / "cp-out"))) == expected


@pytest.mark.slow
def test_placeholder_inside_a_committed_checkpoint_resumes_and_verifies(place, tmp_path):
    """The reported input, on every backend and engine: ``x/`` inside checkpoint 0."""
    expected = _report(place, tmp_path)
    place.placeholder("e/t/checkpoint_000000/x")
    assert _resumed_index(place) == 0
    ckpt = place.context().checkpoint("checkpoint_000000")
    ckpt.verify()
    assert read_tree(ckpt.to_directory(str(tmp_path / "out"))) == expected
    if place.filesystem is None:
        _check_cli(place, tmp_path, expected)


def test_placeholders_on_every_directory_of_a_trial_change_nothing(place, tmp_path):
    """Placeholders of the checkpoint, trial and experiment directories and of
    a directory the checkpoint holds; the next report still evicts checkpoint 0."""
    expected = _report(place, tmp_path)
    for rel in ("e", "e/t", "e/t/checkpoint_000000", "e/t/checkpoint_000000/nested"):
        place.placeholder(rel)
    assert _resumed_index(place) == 0
    ctx = place.context()
    assert read_tree(ctx.checkpoint("checkpoint_000000").to_directory(
        str(tmp_path / "out"))) == expected
    _report(place, tmp_path)
    assert [i for i, _ in ctx.checkpoint_dirs()] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("stray", [b"", b"not a checkpoint"])
def test_object_named_like_the_checkpoint_is_its_marker(place, tmp_path, stray):
    """``<trial>/checkpoint_000000`` as an object beside its prefix (and
    ``nested`` beside ``nested/``, ``t`` beside the trial's prefix): the
    checkpoint is handed out, downloads, verifies from the command line,
    and is evicted object and all."""
    expected = _report(place, tmp_path)
    place.put("e/t/checkpoint_000000", stray)
    place.put("e/t/checkpoint_000000/nested", stray)
    place.put("e/t", stray)
    assert _resumed_index(place) == 0
    with place.start():
        got = session.get_checkpoint()
        assert got is not None
        assert read_tree(got.to_directory(str(tmp_path / "out"))) == expected
    if place.filesystem is None:
        _check_cli(place, tmp_path, expected)
    ctx = place.context()
    _report(place, tmp_path)
    assert [i for i, _ in ctx.checkpoint_dirs()] == [1]
    assert ctx.filesystem.get_file_info(ctx.checkpoint_path(0)).type == pafs.FileType.NotFound


def test_adopting_a_copied_in_directory_leaves_its_placeholders_out(place, tmp_path):
    """A manifest built from a listing at commit time (``StorageContext.adopt``
    of a directory a tool copied in, markers and all) lists the files alone."""
    if place.filesystem is not None:
        pytest.skip("writes through the location's own backend")
    ctx = place.context()
    files = {"w.bin": b"weights", "nested/o.pt": b"opt"}
    for rel, data in files.items():
        _fsutil.write_bytes(ctx.filesystem, posixpath.join(ctx.checkpoint_path(3), rel), data,
                            ctx.backend.capabilities)
    for rel in ("e/t/checkpoint_000003", "e/t/checkpoint_000003/nested",
                "e/t/checkpoint_000003/empty"):
        place.placeholder(rel)
    ckpt = ctx.adopt("checkpoint_000003")
    assert sorted(e["path"] for e in ckpt.internal_metadata["manifest"]) == sorted(files)
    ckpt.verify()
    assert _resumed_index(place) == 3


def test_the_backends_own_listing_names_each_directory_once(place, tmp_path):
    """What lists through a backend's filesystem itself (Ray's pyarrow calls)
    sees a placeholder, or an object beside its prefix, as one directory
    (a pyarrow filesystem passed in is used as given: not checked)."""
    if isinstance(place.filesystem, pafs.FileSystem):
        pytest.skip("a pyarrow filesystem passed in lists as pyarrow does")
    _report(place, tmp_path)
    place.placeholder("e/t/checkpoint_000000/x")
    place.put("e/t/checkpoint_000000/nested", b"")
    ctx = place.context()
    for recursive in (False, True):
        listed = ctx.filesystem.get_file_info(
            pafs.FileSelector(ctx.checkpoint_path(0), recursive=recursive))
        paths = [fi.path for fi in listed]
        assert len(paths) == len(set(paths)), paths
        kinds = {posixpath.basename(fi.path): fi.type for fi in listed}
        assert kinds["x"] == kinds["nested"] == pafs.FileType.Directory


def test_memory_file_named_like_a_checkpoint_leaves_it_readable(tmp_path):
    """fsspec's memory filesystem keeps a file ``checkpoint_000000`` beside the
    directory of that name (set in its store: its ``pipe_file`` refuses); its
    listings then answer with the file alone. The checkpoint is still handed
    out and downloads. (Nothing can be written under such a name there, so
    its eviction fails loudly and is retried.)"""
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    uri = f"memory://cs-{uuid.uuid4().hex[:12]}/r"
    place = Place(StorageLocation(uri), lambda k: None, lambda k, d: None)
    expected = _report(place, tmp_path)
    path = place.context().checkpoint_path(0)
    MemoryFileSystem.store[path] = MemoryFile(None, path, b"stray")
    with place.start():
        got = session.get_checkpoint()
        assert got is not None and got.internal_metadata["index"] == 0
        assert read_tree(got.to_directory(str(tmp_path / "out"))) == expected
    res = invoke(["verify", place.loc.join("e", "t", "checkpoint_000000").uri])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_tree_uploaded_by_pyarrow_copy_files_copies_as_its_files(engine, s3_server, s3_bucket,
                                                                 tmp_path):
    """``pyarrow.fs.copy_files`` writes a ``dir/`` marker for every directory it
    creates; a Checkpoint on that upload (and ``cp`` of it into a trial) holds
    the files alone."""
    src = tmp_path / "src"
    expected = make_tree(src, TREE)
    (src / "hollow").mkdir()  # an empty directory: copy_files marks it too
    native = pafs.S3FileSystem(access_key=s3_server.access_key_id,
                               secret_key=s3_server.secret_access_key,
                               endpoint_override=s3_server.endpoint_url.split("://")[1],
                               scheme="http", region=s3_server.region)
    pafs.copy_files(str(src), f"{s3_bucket}/upload", destination_filesystem=native)
    native.create_dir(f"{s3_bucket}/upload/hollow")
    markers = [k for k in s3_server.list_keys(s3_bucket) if k.endswith("/")]
    assert markers, "pyarrow wrote no directory markers: the shape under test is gone"
    opts = s3_server.storage_options(engine)
    uploaded = Checkpoint(f"s3://{s3_bucket}/upload", storage_options=opts)
    assert read_tree(uploaded.to_directory(str(tmp_path / "out"))) == expected
    ctx = StorageContext(f"s3://{s3_bucket}/runs", "e", "t", storage_options=opts)
    ckpt = ctx.persist_checkpoint(uploaded, 0, {})
    assert sorted(e["path"] for e in ckpt.internal_metadata["manifest"]) == sorted(expected)
    res = invoke(["cp", f"s3://{s3_bucket}/runs/e/t", str(tmp_path / "copy" / "e" / "t"),
                  *[a for k, v in opts.items() for a in ("-o", f"{k}={v}")]])
    assert res.exit_code == 0, res.output
    res = invoke(["verify", str(tmp_path / "copy" / "e" / "t" / "checkpoint_000000"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)


def test_placeholders_as_directories_keeps_order_and_names_each_directory_once():
    from checkpoint_store.backends.handlers import placeholders_as_directories

    File, Dir = pafs.FileType.File, pafs.FileType.Directory
    listed = [
        pafs.FileInfo("b/ck/", File, size=0),  # the base's own placeholder
        pafs.FileInfo("b/ck/a.bin", File, size=3),
        pafs.FileInfo("b/ck/x", Dir),
        pafs.FileInfo("b/ck/x/", File, size=0),
        pafs.FileInfo("b/ck/sub", File, size=5),  # an object beside its prefix
        pafs.FileInfo("b/ck/sub/f", File, size=1),
        pafs.FileInfo("b/ck/sub", Dir),
        pafs.FileInfo("b/ck/lone/", File, size=0),  # a placeholder alone
        pafs.FileInfo("b/ck/empty", File, size=0),  # a user's empty file
    ]
    got = [(fi.path, fi.type) for fi in placeholders_as_directories("b/ck", listed)]
    assert got == [("b/ck/a.bin", File), ("b/ck/x", Dir), ("b/ck/sub", Dir),
                   ("b/ck/sub/f", File), ("b/ck/lone", Dir), ("b/ck/empty", File)]
