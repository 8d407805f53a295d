"""A file deleted between its open and its read (a gc, a retention pass or
the assembly of result segments in another process) reads as
``FileNotFoundError`` on every backend, and each reader built to tolerate
that race tolerates it.

pyarrow's S3 client answers such a read three ways by the object's size: a
small one's 404 body overflows the buffer sized for the object ("Failed to
flush response stream", INTERNAL_FAILURE), a medium one says NO_SUCH_KEY,
a large one RESOURCE_NOT_FOUND; all three were a PermanentBackendError
("check the path, bucket and permissions"), which made a chunk store's
next save fail when a gc deleted its condemned list under the read.
"""

from __future__ import annotations

import json
import posixpath

import pytest

from checkpoint_store._chunks.store import CONDEMNED_DIR, ChunkStore
from checkpoint_store._format.layout import RESULT_FILE
from checkpoint_store._results.reader import read_results
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.errors import PermanentBackendError
from checkpoint_store.registry import resolve
from checkpoint_store.testing.faults import faulty_filesystem
from tests.stores import ALL_BACKENDS, make_store, pyarrow_azure

#: Backends whose open handle keeps a deleted file readable (POSIX; fsspec's
#: memory filesystem hands out the bytes it holds).
_KEEPS_OPEN_FILES = {"local", "memory"}
#: Every backend, and Azure through a pyarrow.fs.AzureFileSystem passed in
#: (pyarrow's own Azure client, whose errors differ from adlfs').
_BACKENDS = [pytest.param(k, marks=pytest.mark.slow) if k == "s3fs" else k
             for k in [*ALL_BACKENDS, "azure-pyarrow"]]


def _pyarrow_azure(request):
    fs = pyarrow_azure(request.getfixturevalue("azure_server"))
    return resolve(f"{request.getfixturevalue('azure_container')}/ckpt", filesystem=fs)


def _vanishing(kind, request, tmp_path, mark):
    if kind == "azure-pyarrow":
        backend, root = _pyarrow_azure(request)
    else:
        s = make_store(kind, request, tmp_path)
        backend, root = resolve(s.uri, storage_options=s.options or None)
    inner = backend.filesystem
    inner.create_dir(root, recursive=True)
    fs = faulty_filesystem(inner, vanish_after_open=mark)
    return inner, fs, root, backend


def _put(fs, path, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


@pytest.mark.parametrize("kind", _BACKENDS)
@pytest.mark.parametrize("size", [10, 5000, 200_000])
def test_a_file_deleted_after_its_open_reads_as_not_found(kind, size, request, tmp_path):
    inner, fs, root, _ = _vanishing(kind, request, tmp_path, "gone")
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    for n, reader in enumerate(("read_bytes", "read_file")):
        path = f"{root}/gone-{n}.bin"
        _put(inner, path, data)
        try:
            if reader == "read_bytes":
                got = _fsutil.read_bytes(fs, path)
            else:
                from checkpoint_store._chunks.files import _read_object
                got = _read_object(fs, path)
        except FileNotFoundError:
            assert kind not in _KEEPS_OPEN_FILES, "an open local file stays readable"
        else:
            assert kind in _KEEPS_OPEN_FILES, f"{kind}: read a deleted object"
            assert got == data
        assert fs.handler.injected["vanished"] == n + 1
        assert not _fsutil.exists(inner, path)


@pytest.mark.parametrize("kind", _BACKENDS)
def test_a_condemned_list_deleted_under_the_read_is_left_out(kind, request, tmp_path):
    """The chunk store of one experiment: a gc deletes its condemned list when
    it ends, while a writer of the same experiment reads every list."""
    inner, fs, root, backend = _vanishing(kind, request, tmp_path, "gc-ending")
    store = ChunkStore(fs, f"{root}/.cs_chunks", capabilities=backend.capabilities)
    store.write_control(CONDEMNED_DIR, "gc-ending", ["a" * 64], 1.0)
    store.write_control(CONDEMNED_DIR, "gc-running", ["b" * 64], 2.0)
    read = store.read_controls(CONDEMNED_DIR)
    chunks = {n for c in read for n in c.chunks}
    if kind in _KEEPS_OPEN_FILES:
        assert chunks == {"a" * 64, "b" * 64}
    else:
        assert chunks == {"b" * 64}
    assert fs.handler.injected["vanished"] == 1


@pytest.mark.parametrize("kind", _BACKENDS)
def test_a_marker_deleted_under_the_read_inspects_as_absent(kind, request, tmp_path):
    """ls, show, the page and retention's restore see a checkpoint being deleted
    as not committed, never as a storage error."""
    inner, fs, root, _ = _vanishing(kind, request, tmp_path, ".internal_metadata.json")
    ck = f"{root}/checkpoint_000000"
    inner.create_dir(ck, recursive=True)
    _put(inner, f"{ck}/a.bin", b"a")
    _put(inner, f"{ck}/.internal_metadata.json", json.dumps({"x": 1}).encode())
    got = inspect_checkpoint(fs, ck)
    if kind in _KEEPS_OPEN_FILES:
        assert got.state != "absent"
    else:
        assert got.state == "absent", got


@pytest.mark.parametrize("kind", _BACKENDS)
def test_results_read_while_their_file_is_replaced(kind, request, tmp_path):
    """result.json deleted between the open and the read (a trial being
    deleted): the reader answers with no rows instead of failing."""
    inner, fs, root, _ = _vanishing(kind, request, tmp_path, RESULT_FILE)
    _put(inner, posixpath.join(root, RESULT_FILE), b'{"training_iteration": 1}\n')
    try:
        rows = read_results(fs, root)
    except PermanentBackendError as exc:  # pragma: no cover - the defect
        pytest.fail(f"{kind}: {exc}")
    assert rows == ([{"training_iteration": 1}] if kind in _KEEPS_OPEN_FILES else [])


@pytest.mark.parametrize("kind", _BACKENDS)
def test_the_page_reads_new_rows_of_a_result_file_deleted_under_it(kind, request, tmp_path):
    from checkpoint_store.ui._rows import _read_new_rows, _TrialCache

    inner, fs, root, _ = _vanishing(kind, request, tmp_path, RESULT_FILE)
    path = posixpath.join(root, RESULT_FILE)
    body = b'{"training_iteration": 1}\n'
    _put(inner, path, body)
    cache = _TrialCache()
    _read_new_rows(fs, path, len(body), cache)
    assert cache.file_rows == ([{"training_iteration": 1}] if kind in _KEEPS_OPEN_FILES else [])
    assert cache.offset == (len(body) if kind in _KEEPS_OPEN_FILES else 0)


@pytest.mark.parametrize("message, kind", [
    ("AWS Error NO_SUCH_KEY during GetObject operation: The specified key does not exist.",
     FileNotFoundError),
    ("AWS Error RESOURCE_NOT_FOUND during GetObject operation: ", FileNotFoundError),
    ("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response "
     "stream (eof: 0, bad: 1)", OSError),
    ("AWS Error ACCESS_DENIED during GetObject operation: Access Denied", OSError),
    ("DownloadTo from 'http://h/acct/c/x' at position 0 for 10 bytes failed. ReadAt failed to "
     "read the required byte range. Azure Error: [BlobNotFound] 404 The specified blob does "
     "not exist.", FileNotFoundError),
])
def test_pyarrow_messages_of_a_gone_object_are_typed(message, kind):
    from checkpoint_store._util.retry import classify
    from checkpoint_store.backends.engine_errors import as_os_error

    got = as_os_error(OSError(message), "read b/k")
    assert type(got) is kind
    expected = {"NO_SUCH_KEY": "permanent", "RESOURCE_NOT_FOUND": "permanent",
                "INTERNAL_FAILURE": "transient", "ACCESS_DENIED": "permanent",
                "BlobNotFound": "permanent"}
    assert classify(got) == next(v for k, v in expected.items() if k in message)


@pytest.mark.parametrize("kind", _BACKENDS)
@pytest.mark.parametrize("keys", [None, "w"])
def test_a_state_deleted_under_its_load_is_a_checkpoint_not_found(kind, keys, request,
                                                                  tmp_path):
    """A retention pass deleting the checkpoint a load is reading: the load
    says the checkpoint's file is gone, typed (a CheckpointNotFoundError, still
    a FileNotFoundError), not the engine's bare error (gcsfs: only a URL)."""
    import torch

    from checkpoint_store import Checkpoint, session
    from checkpoint_store.errors import CheckpointNotFoundError

    inner, fs, root, _ = _vanishing(kind, request, tmp_path, "tensors-")
    tree = {"w": torch.randn(300, 300), "b": torch.randn(3)}
    with session.start(storage_path=root, storage_filesystem=inner, experiment_name="e",
                       trial_name="t") as s:
        s.report({"x": 1}, checkpoint=Checkpoint.from_state(tree))
    ck = Checkpoint(f"{root}/e/t/checkpoint_000000", fs)
    try:
        got = ck.load_state(keys=keys)
    except CheckpointNotFoundError as exc:
        assert kind not in _KEEPS_OPEN_FILES, "an open local file stays readable"
        assert "tensors-00001-of-00001.safetensors" in str(exc)
        assert "deleted while" in str(exc), exc
    else:
        assert kind in _KEEPS_OPEN_FILES, f"{kind}: read a deleted object"
        assert torch.equal(got["w"], tree["w"])
    assert fs.handler.injected["vanished"] == 1


@pytest.mark.parametrize("exc", [
    # s3fs's FileExpired (gcsfs's files raise it too): the object's ETag changed.
    pytest.param("s3fs", id="s3fs-file-expired"),
    pytest.param(OSError("DownloadTo from 'http://h/acct/c/x' at position 0 for 65555 bytes "
                         "failed. ReadAt failed to read the required byte range. Azure Error: "
                         "[InvalidRange] 416 The range specified is invalid for the current "
                         "size of the resource."), id="pyarrow-azure-invalid-range"),
])
def test_a_file_replaced_while_read_is_read_again(exc):
    """A file rewritten between a reader's open and its read (a lease renewed,
    the retention state saved) is transient: read again, the new version is
    read whole. Before, both were permanent: the reader failed."""
    from checkpoint_store._util.retry import classify
    from checkpoint_store.backends.engine_errors import as_os_error

    if exc == "s3fs":
        from s3fs.utils import FileExpired

        exc = FileExpired("b/k/.cs_manager_lease.json", '"87a0194f6b43585dee80bd3ea7256fc5"')
    assert classify(as_os_error(exc, "read b/k")) == "transient"
    assert classify(OSError("AWS Error ACCESS_DENIED: 416 objects")) == "permanent"
