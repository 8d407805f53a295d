"""An empty marker is a commit that never published one.

pyarrow's ``AzureFileSystem`` creates a blob empty when it opens it for
writing and fills it when the stream closes: a writer killed in between
leaves ``.internal_metadata.json`` at 0 bytes beside every data file. That
directory read as a damaged checkpoint ("invalid"): listed as committed and
broken, never removed by ``gc``, its index refused to a new commit. It is an
uncommitted directory: the restart resumes the checkpoint before it, ``ls``
shows it uncommitted, and ``gc`` removes it.
"""

from __future__ import annotations

import json
import posixpath

import pyarrow.fs as pafs
import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint


def test_pyarrow_azure_shows_a_blob_empty_while_its_writer_has_it_open(azure_server,
                                                                        azure_container):
    """The premise, on Azurite: between open and close the marker is there,
    at 0 bytes, for every other reader."""
    from tests.stores import pyarrow_azure

    fs = pyarrow_azure(azure_server)
    path = f"{azure_container}/premise/{INTERNAL_METADATA}"
    out = fs.open_output_stream(path)
    try:
        out.write(b'{"index": 1}' * 100)
        info = fs.get_file_info(path)
        assert info.type == pafs.FileType.File and info.size == 0
    finally:
        out.close()
    assert fs.get_file_info(path).size == 1200


@pytest.mark.parametrize("kind", ["local", "memory", "s3", "azure"])
def test_an_empty_marker_is_an_uncommitted_directory_everywhere(kind, request, tmp_path):
    from tests.stores import make_store

    s = make_store(kind, request, tmp_path)
    store = Store(s.uri, dict(s.options))
    opts = dict(store.options) or None
    for i in range(2):
        with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                           storage_options=opts):
            src = write_tree(str(tmp_path / f"src{i}"), {"model.bin": bytes([i]) * 300})
            session.report({"step": i}, checkpoint=Checkpoint.from_directory(src))
    ctx = StorageContext(store.uri, "exp", "t1", storage_options=opts)
    fs, victim = ctx.filesystem, posixpath.join(ctx.trial_path, "checkpoint_000001")
    _fsutil.write_bytes(fs, posixpath.join(victim, INTERNAL_METADATA), b"",
                        ctx.backend.capabilities, fsync=False)

    assert inspect_checkpoint(fs, victim).state == "absent"
    res = invoke(["ls", store.join("exp", "t1"), *store.opt_args(), "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.stdout)
    assert [c["name"] for c in listed["checkpoints"]] == ["checkpoint_000000"]
    assert (listed["uncommitted"], listed["invalid"], listed["corrupt"]) == (1, [], [])
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       storage_options=opts) as s:
        latest = s.get_checkpoint()
        assert latest is not None and latest.path.endswith("checkpoint_000000")
        src = write_tree(str(tmp_path / "src2"), {"model.bin": b"\x02" * 300})
        row = session.report({"step": 2}, checkpoint=Checkpoint.from_directory(src))
        assert row["checkpoint_dir_name"] == "checkpoint_000002"
    res = invoke(["gc", store.join("exp", "t1"), *store.opt_args(), "--min-age", "0"])
    assert res.exit_code == 0, res.output
    assert not _fsutil.exists(fs, victim), "gc left the directory of the killed commit"
    assert inspect_checkpoint(
        fs, posixpath.join(ctx.trial_path, "checkpoint_000002")).state == "committed"



@pytest.mark.parametrize("form", ["pyarrow-azure", "fsspec-dirfs"])
def test_an_empty_marker_is_uncommitted_through_a_filesystem_passed_in(form, request,
                                                                       tmp_path):
    """The same through a filesystem object the user passes in: pyarrow's own
    AzureFileSystem (the store that leaves such markers) and an fsspec one.
    The restart resumes the checkpoint before it, commits the next index,
    and the session's start removes the killed commit's directory."""
    if form == "pyarrow-azure":
        from tests.stores import pyarrow_azure

        fs = pyarrow_azure(request.getfixturevalue("azure_server"))
        root = f"{request.getfixturevalue('azure_container')}/runs"
    else:
        from fsspec.implementations.dirfs import DirFileSystem
        from fsspec.implementations.local import LocalFileSystem

        (tmp_path / "dirfs").mkdir()
        fs, root = DirFileSystem(path=str(tmp_path / "dirfs"), fs=LocalFileSystem()), "runs"
    where = {"storage_path": root, "storage_filesystem": fs, "experiment_name": "exp",
             "trial_name": "t1"}
    for i in range(2):
        with session.start(**where):
            src = write_tree(str(tmp_path / f"src{i}"), {"model.bin": bytes([i]) * 300})
            session.report({"step": i}, checkpoint=Checkpoint.from_directory(src))
    ctx = StorageContext(root, "exp", "t1", storage_filesystem=fs)
    victim = posixpath.join(ctx.trial_path, "checkpoint_000001")
    _fsutil.write_bytes(ctx.filesystem, posixpath.join(victim, INTERNAL_METADATA), b"",
                        ctx.backend.capabilities, fsync=False)
    assert inspect_checkpoint(ctx.filesystem, victim).state == "absent"
    assert "checkpoint_000001" in ctx.scan().uncommitted
    with session.start(**where) as s:
        latest = s.get_checkpoint()
        assert latest is not None and latest.path.endswith("checkpoint_000000")
        src = write_tree(str(tmp_path / "src2"), {"model.bin": b"\x02" * 300})
        row = session.report({"step": 2}, checkpoint=Checkpoint.from_directory(src))
        assert row["checkpoint_dir_name"] == "checkpoint_000002"
    assert not _fsutil.exists(ctx.filesystem, victim), "the killed commit's directory stayed"
