"""A store that keeps a written file at another size fails the commit, not the
restore: before its marker, a marker-last commit lists what it wrote.

The store here is real: gcp-storage-emulator as published, whose multipart
reading drops the last byte of an object ending in ``\\r`` (gcsfs frames a
simple upload with a bare ``\\n``; checkpoint_store.testing.gcs_emulator, the
harness's GCS server, reads it byte-exact). Before the check, such a
checkpoint was committed and its restore refused it: ``file 'small_01.bin'
has 1000 bytes, the manifest says 1001``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from _commit_helpers import local_tree

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store.errors import PermanentBackendError
from checkpoint_store.testing.servers import GCSServer, prepare_gcsfs_env
from tests.cli.cli_helpers import write_tree


class PublishedEmulator(GCSServer):
    """gcp-storage-emulator run as its own ``python -m gcp_storage_emulator``."""

    @classmethod
    def _command(cls, port: int, workdir: str, **kwargs):
        cmd = super()._command(port, workdir, **kwargs)
        cmd[cmd.index("checkpoint_store.testing.gcs_emulator")] = "gcp_storage_emulator"
        return cmd


@pytest.fixture(scope="module")
def lossy() -> Iterator[GCSServer]:
    prepare_gcsfs_env()
    server = PublishedEmulator.start()
    try:
        yield server
    finally:
        server.stop()


def _store(server: GCSServer) -> tuple[StorageContext, str]:
    bucket = server.create_bucket()
    return StorageContext(f"gs://{bucket}/ckpt", "exp", "t",
                          storage_options=server.storage_options()), bucket


def test_the_published_emulator_is_lossy(lossy) -> None:
    # What the tests below stand on: a file ending in \r comes back short.
    import gcsfs

    bucket = lossy.create_bucket()
    fs = gcsfs.GCSFileSystem(**lossy.storage_options())
    fs.pipe_file(f"{bucket}/cr", b"x" * 10 + b"\r")
    assert lossy.list_objects(bucket) == {"cr": 10}


def test_a_file_stored_short_fails_the_commit_and_nothing_stays(lossy, tmp_path) -> None:
    st, bucket = _store(lossy)
    good = st.persist_checkpoint(
        Checkpoint.from_directory(write_tree(str(tmp_path / "a"), {"w.bin": b"a" * 1000})), 0, {})
    before = lossy.list_objects(bucket)
    src = write_tree(str(tmp_path / "b"), {"small_00.bin": os.urandom(1000) + b"a",
                                  "small_01.bin": os.urandom(1000) + b"\r"})
    with pytest.raises(PermanentBackendError) as err:
        st.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    message = str(err.value)
    assert "holds 1000 bytes of 'small_01.bin' after 1001 bytes" in message
    assert "Nothing was committed" in message
    # Every object of the failed commit is gone; the earlier checkpoint is whole.
    assert lossy.list_objects(bucket) == before
    good.to_directory(str(tmp_path / "back"))
    assert local_tree(str(tmp_path / "back")) == {"w.bin": b"a" * 1000}


def test_a_state_stored_short_fails_the_report(lossy, tmp_path) -> None:
    # The same shape on the state path (shards written straight to storage):
    # the last tensor's last byte is 13, the safetensors file ends in \r.
    bucket = lossy.create_bucket()
    state = {"w": np.arange(16, dtype=np.float32), "z": np.full(7, 13, dtype=np.uint8)}
    # The state is persisted off the loop: the error comes at wait() (and at
    # the session's end), not from report().
    with pytest.raises(PermanentBackendError, match=r"bytes of '.*\.safetensors'"):
        with session.start(storage_path=f"gs://{bucket}/ckpt", experiment_name="exp",
                           trial_name="t", storage_options=lossy.storage_options()):
            session.report({"loss": 1.0}, state=state)
            session.wait()
    names = lossy.list_objects(bucket)
    assert not [n for n in names if "checkpoint_000000" in n], names


def test_the_harness_emulator_keeps_those_files(gcs_location, tmp_path) -> None:
    # Through the harness's server the same bytes commit and come back exact.
    st = StorageContext(gcs_location.uri, "exp", "t",
                        storage_options=gcs_location.storage_options)
    contents = {"cr.bin": os.urandom(100) + b"\r", "crlf.bin": b"\r\n",
                "lf.bin": b"x\n", "boundary.bin": b"--==0==--\r"}
    src = write_tree(str(tmp_path / "src"), contents)
    st.persist_checkpoint(Checkpoint.from_directory(src), 0, {}).to_directory(
        str(tmp_path / "back"))
    assert local_tree(str(tmp_path / "back")) == contents
