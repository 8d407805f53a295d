"""Real-world failures designed out, one test each."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from checkpoint_store import BackendUnavailableError, Checkpoint, StorageContext
from checkpoint_store.registry import resolve
from checkpoint_store.testing.conformance import make_tree, read_tree


def test_pyarrow_without_s3_does_not_break_local_checkpointing(tmp_path, s3_server, s3_bucket):
    """A pyarrow built without S3 (its ``_s3fs`` module missing) still saves and
    loads local checkpoints, and ``s3://`` falls back to s3fs or says what to do."""
    code = textwrap.dedent(
        f"""
        import json, sys, warnings
        sys.modules["pyarrow._s3fs"] = None          # as in a pyarrow built without S3
        import pyarrow.fs
        try:
            pyarrow.fs.S3FileSystem
        except ImportError:
            pass
        else:
            raise SystemExit("simulation failed: S3FileSystem still importable")
        from checkpoint_store import Checkpoint, CheckpointConfig, session
        from checkpoint_store.errors import BackendUnavailableError
        import os
        src = {str(tmp_path / "src")!r}
        os.makedirs(src)
        open(os.path.join(src, "w.bin"), "wb").write(b"weights")
        with session.start(storage_path={str(tmp_path / "store")!r}, experiment_name="e",
                           trial_name="t", checkpoint_config=CheckpointConfig(num_to_keep=1)):
            session.report({{"x": 1}}, checkpoint=Checkpoint.from_directory(src))
        with session.start(storage_path={str(tmp_path / "store")!r}, experiment_name="e",
                           trial_name="t"):
            with session.get_checkpoint().as_directory() as d:
                local_ok = open(os.path.join(d, "w.bin"), "rb").read() == b"weights"
        opts = {json.dumps(s3_server.storage_options())}
        try:
            from checkpoint_store.registry import resolve
            resolve("s3://{s3_bucket}/x", storage_options=opts)
            explicit = "no error"
        except BackendUnavailableError as exc:
            explicit = str(exc)
        del opts["engine"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend, _ = resolve("s3://{s3_bucket}/x", storage_options=opts)
        print(json.dumps({{"local_ok": local_ok, "explicit": explicit, "fallback": backend.name,
                          "warned": [str(w.message) for w in caught]}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["local_ok"] is True
    assert "built without S3 support" in result["explicit"]
    assert "'engine': 's3fs'" in result["explicit"]
    assert result["fallback"] == "S3 (s3fs)"
    assert any("without S3 support" in w for w in result["warned"])


def test_s3_class_raising_on_access_gives_a_clear_error(s3_bucket, s3_server, monkeypatch):
    import checkpoint_store_s3

    monkeypatch.delattr(pafs, "S3FileSystem")
    with pytest.raises(BackendUnavailableError, match="built without S3 support"):
        resolve(f"s3://{s3_bucket}/x", storage_options=s3_server.storage_options("pyarrow"))
    assert checkpoint_store_s3._pyarrow_s3_class() is None


class _NoFilenoHandler(pafs.FileSystemHandler):
    """In-memory store whose output handles are plain Python objects without
    ``fileno()`` or ``fsync``, as s3fs's streaming writers are."""

    def __init__(self):
        self.files: dict[str, bytes] = {}

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)

    def get_type_name(self):
        return "nofileno"

    def normalize_path(self, path):
        return path

    def _type(self, path):
        p = path.rstrip("/")
        if p in self.files:
            return pafs.FileType.File
        if any(k.startswith(p + "/") for k in self.files):
            return pafs.FileType.Directory
        return pafs.FileType.NotFound

    def get_file_info(self, paths):
        return [pafs.FileInfo(p, self._type(p),
                              size=len(self.files[p]) if p in self.files else None)
                for p in paths]

    def get_file_info_selector(self, selector):
        base = selector.base_dir.rstrip("/") + "/"
        out: dict[str, pafs.FileInfo] = {}
        for k, v in self.files.items():
            if not k.startswith(base):
                continue
            rest = k[len(base):]
            if selector.recursive:
                parts = rest.split("/")
                for i in range(1, len(parts)):
                    d = base + "/".join(parts[:i])
                    out[d] = pafs.FileInfo(d, pafs.FileType.Directory)
                out[k] = pafs.FileInfo(k, pafs.FileType.File, size=len(v))
            elif "/" in rest:
                d = base + rest.split("/")[0]
                out[d] = pafs.FileInfo(d, pafs.FileType.Directory)
            else:
                out[k] = pafs.FileInfo(k, pafs.FileType.File, size=len(v))
        if not out and not selector.allow_not_found and self._type(selector.base_dir) is \
                pafs.FileType.NotFound:
            raise FileNotFoundError(selector.base_dir)
        return list(out.values())

    def create_dir(self, path, recursive):
        pass

    def delete_dir(self, path):
        for k in [k for k in self.files if k.startswith(path.rstrip("/") + "/")]:
            del self.files[k]

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.delete_dir(path)

    def delete_root_dir_contents(self):
        self.files.clear()

    def delete_file(self, path):
        if path not in self.files:
            raise FileNotFoundError(path)
        del self.files[path]

    def move(self, src, dest):
        raise OSError("no rename on this store")

    def copy_file(self, src, dest):
        self.files[dest] = self.files[src]

    def open_input_stream(self, path):
        if path not in self.files:
            raise FileNotFoundError(path)
        return pa.BufferReader(self.files[path])

    def open_input_file(self, path):
        return self.open_input_stream(path)

    def open_output_stream(self, path, metadata):
        handler = self

        class Writer(io.RawIOBase):
            def __init__(self):
                self.buf = bytearray()

            def writable(self):
                return True

            def write(self, b):
                self.buf += bytes(b)
                return len(b)

            def fileno(self):
                raise io.UnsupportedOperation("fileno")

            def close(self):
                if not self.closed:
                    handler.files[path] = bytes(self.buf)
                super().close()

        return pa.PythonFile(Writer(), mode="w")

    def open_append_stream(self, path, metadata):
        raise OSError("no append on this store")


def test_file_handles_without_fileno_still_save(tmp_path):
    handler = _NoFilenoHandler()
    fs = pafs.PyFileSystem(handler)
    with fs.open_output_stream("probe") as f, pytest.raises((io.UnsupportedOperation, OSError)):
        os.fsync(f.fileno())
    src = tmp_path / "src"
    make_tree(src, {"w.bin": 5000, "d/e.bin": 0})
    ctx = StorageContext("/store", "exp", "t", storage_filesystem=fs)
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert ckpt.is_committed
    assert "/store/exp/t/checkpoint_000000/.internal_metadata.json" in handler.files
    assert read_tree(ckpt.to_directory(str(tmp_path / "out"))) == read_tree(src)


def _gets_for(log_path: str, key: str) -> int:
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if '"GET /' in line and key in line)


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_large_downloads_use_large_ranged_reads(engine, s3_server, s3_bucket, tmp_path):
    """A 24 MiB file is fetched in one or two GETs, not 24 of pyarrow's default 1 MiB."""
    src = tmp_path / "src"
    make_tree(src, {"big.bin": 24 * 1024 * 1024})
    opts = s3_server.storage_options(engine)
    ctx = StorageContext(f"s3://{s3_bucket}/{engine}", "e", "t", storage_options=opts)
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    before = _gets_for(s3_server.log_path, f"{engine}/e/t/checkpoint_000000/big.bin")
    out = ckpt.to_directory(str(tmp_path / "out"))
    after = _gets_for(s3_server.log_path, f"{engine}/e/t/checkpoint_000000/big.bin")
    assert read_tree(out) == read_tree(src)
    assert 1 <= after - before <= 2


def test_s3_deletes_stay_on_pyarrow_when_only_pyarrow_can_authenticate():
    """With a pyarrow-only access option (role_arn ...), an s3fs client could not
    delete with the same identity, so pyarrow does the deletes itself."""
    from checkpoint_store_s3 import MarkerFreeS3Handler

    base = {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1"}
    plain, _ = resolve("s3://b/x", storage_options={**base, "access_key_id": "a",
                                                    "secret_access_key": "b"})
    assert isinstance(plain.filesystem.handler, MarkerFreeS3Handler)
    role, _ = resolve("s3://b/x", storage_options={**base, "role_arn": "arn:aws:iam::1:role/r",
                                                   "load_frequency": 900})
    assert isinstance(role.filesystem, pafs.S3FileSystem)


def test_s3_class_raising_when_used_leaves_local_checkpointing_working(tmp_path, monkeypatch):
    class BrokenS3:
        def __init__(self, *args, **kwargs):
            raise ImportError("The pyarrow installation is not built with support for S3")

    monkeypatch.setattr(pafs, "S3FileSystem", BrokenS3)
    src = tmp_path / "src"
    make_tree(src, {"w.bin": 2048})
    ctx = StorageContext(str(tmp_path / "store"), "e", "t")
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert read_tree(ckpt.to_directory(str(tmp_path / "out"))) == read_tree(src)
    with pytest.raises(BackendUnavailableError, match="'engine': 's3fs'"):
        resolve("s3://b/x", storage_options={"engine": "pyarrow",
                                             "endpoint_url": "http://127.0.0.1:9"})


def test_gcs_emulator_works_when_gcsfs_picked_its_namespace_variant(gcs_server, gcs_bucket):
    """gcsfs chooses its hierarchical-namespace class at import unless
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; that class stalls 60 s per bucket
    call on emulators. The plugin must not depend on how gcsfs was imported."""
    code = textwrap.dedent(
        f"""
        import gcsfs
        from checkpoint_store import StorageContext
        print(gcsfs.GCSFileSystem.__name__)
        ctx = StorageContext("gs://{gcs_bucket}/hns", "e", "t",
                             storage_options={gcs_server.storage_options()!r})
        ctx.write_params({{"a": 1}})
        print(ctx.filesystem.open_input_stream(ctx.trial_path + "/params.json").read())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=40)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "ExtendedGcsFileSystem"  # the variant really was picked
    assert '"a"' in lines[-1]
