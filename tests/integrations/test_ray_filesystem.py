"""checkpoint_store.integrations.ray, level 1 without Ray: the FileSystemHandler over
our backends (every method, listings, marker-first deletes, pickling, retries)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import uuid

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext, registry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import MEMORY_CAPABILITIES, Backend
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.integrations.ray import CheckpointStoreHandler, backend_of, ray_filesystem
from checkpoint_store.testing.faults import read_call_log

FAULTY = "checkpoint_store.testing.faults:faulty_scheme_backend"


@pytest.fixture
def faulty_memory():
    registry.register_backend("faulty+memory", FAULTY, clobber=True)
    yield
    registry.unregister_backend("faulty+memory")


def _committed(fs: pafs.FileSystem, root: str, name: str = "t") -> Checkpoint:
    src = tempfile.mkdtemp()
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"weights")
    storage = StorageContext("x", "exp", name, storage_filesystem=fs)
    storage.storage_path = root
    return storage.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})


def test_every_handler_method_on_memory() -> None:
    fs, root = ray_filesystem(f"memory://h{uuid.uuid4().hex[:8]}/runs")
    assert root.endswith("/runs") and fs.type_name == "py::checkpoint_store+memory"
    fs.create_dir(f"{root}/a/b")
    with fs.open_output_stream(f"{root}/a/b/f.txt") as out:
        out.write(b"hello")
    with fs.open_append_stream(f"{root}/a/b/f.txt") as out:
        out.write(b" world")
    with fs.open_input_stream(f"{root}/a/b/f.txt") as f:
        assert f.read() == b"hello world"
    with fs.open_input_file(f"{root}/a/b/f.txt") as f:
        assert f.read_at(6, 5) == b" world"  # (nbytes, offset)
    fs.copy_file(f"{root}/a/b/f.txt", f"{root}/a/g.txt")
    fs.move(f"{root}/a/g.txt", f"{root}/a/h.txt")
    [info] = fs.get_file_info([f"{root}/a/h.txt"])
    assert info.type == pafs.FileType.File and info.size == 11
    assert fs.normalize_path(f"{root}/a") == f"{root}/a"
    fs.delete_file(f"{root}/a/h.txt")
    assert fs.get_file_info(f"{root}/a/h.txt").type == pafs.FileType.NotFound
    fs.delete_dir_contents(f"{root}/a")
    assert fs.get_file_info(pafs.FileSelector(f"{root}/a", recursive=True)) == []
    fs.delete_dir(f"{root}/a")
    assert fs.get_file_info(f"{root}/a").type == pafs.FileType.NotFound
    with pytest.raises(OSError, match="refusing"):
        fs.handler.delete_root_dir_contents()


def test_non_recursive_listing_is_one_level_even_if_the_backend_walks_the_tree() -> None:
    import fsspec

    class WalksTree(pafs.FSSpecHandler):  # like adlfs ignoring maxdepth (Ray #41125)
        def get_file_info_selector(self, selector):
            return super().get_file_info_selector(
                pafs.FileSelector(selector.base_dir, selector.allow_not_found, recursive=True)
            )

    mem = fsspec.filesystem("memory")

    def factory(uri, options):
        return Backend(
            pafs.PyFileSystem(WalksTree(mem)), scheme="deep", capabilities=MEMORY_CAPABILITIES
        )

    registry.register_backend("deep", factory, clobber=True)
    try:
        fs, root = ray_filesystem("deep://walk/exp")
        for rel in ("trial_a/checkpoint_000000/w.bin", "trial_a/result.json", "trial_b/x"):
            with fs.open_output_stream(f"{root}/{rel}") as out:
                out.write(b"x")
        inner = fs.handler.backend.filesystem
        assert len(inner.get_file_info(pafs.FileSelector(root))) > 2  # the backend walks
        names = sorted(os.path.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(root)))
        assert names == ["trial_a", "trial_b"]
        deep = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        assert any(i.path.endswith("checkpoint_000000/w.bin") for i in deep)
    finally:
        registry.unregister_backend("deep")


def test_delete_of_a_committed_checkpoint_removes_the_marker_first(faulty_memory, tmp_path) -> None:
    log = tmp_path / "calls"
    log.mkdir()
    fs, root = ray_filesystem(
        f"faulty+memory://d{uuid.uuid4().hex[:8]}/runs", fault_call_log=str(log)
    )
    ckpt = _committed(fs, root)
    assert ckpt.is_committed
    for old in log.iterdir():
        old.unlink()
    fs.delete_dir(ckpt.path)  # what Ray's CheckpointConfig(num_to_keep) calls
    assert fs.get_file_info(ckpt.path).type == pafs.FileType.NotFound
    [calls] = read_call_log(str(log)).values()
    mutations = [
        (m, p) for m, p in calls if m in ("delete_file", "delete_dir", "open_output_stream")
    ]
    assert mutations[0] == ("open_output_stream", f"{ckpt.path}/.cs_deleting")
    assert mutations[1] == ("delete_file", f"{ckpt.path}/.internal_metadata.json")
    assert all("w.bin" not in p for _, p in mutations[:2])


def test_delete_dir_contents_deletes_checkpoints_marker_first(faulty_memory, tmp_path) -> None:
    log = tmp_path / "calls"
    log.mkdir()
    fs, root = ray_filesystem(
        f"faulty+memory://c{uuid.uuid4().hex[:8]}/runs", fault_call_log=str(log)
    )
    ckpt = _committed(fs, root)
    for old in log.iterdir():
        old.unlink()
    fs.delete_dir_contents(f"{root}/exp")
    assert fs.get_file_info(pafs.FileSelector(f"{root}/exp", recursive=True)) == []
    [calls] = read_call_log(str(log)).values()
    deletes = [p for m, p in calls if m.startswith("delete")]
    assert deletes[0] == f"{ckpt.path}/.internal_metadata.json"


def test_uncommitted_directories_delete_plainly(faulty_memory) -> None:
    fs, root = ray_filesystem(f"memory://u{uuid.uuid4().hex[:8]}/runs")
    with fs.open_output_stream(f"{root}/ray_dir/file") as out:  # Ray's own, not ours
        out.write(b"x")
    fs.delete_dir(f"{root}/ray_dir")
    assert fs.get_file_info(f"{root}/ray_dir").type == pafs.FileType.NotFound


def test_pickle_holds_no_secret_and_compares_equal(s3_server, s3_bucket) -> None:
    opts = s3_server.storage_options("pyarrow")
    secret = "sEcReT-" + uuid.uuid4().hex
    token = "tOkEn-" + uuid.uuid4().hex
    fs, root = ray_filesystem(
        f"s3://{s3_bucket}/runs", **{**opts, "secret_access_key": secret, "session_token": token}
    )
    blob = pickle.dumps(fs)
    for value in (secret, token, opts["access_key_id"], "secret_access_key"):
        assert value.encode() not in blob
    assert opts["endpoint_url"].encode() in blob  # configuration travels
    back = pickle.loads(blob)
    assert back == fs and back.equals(fs) and back.handler == fs.handler
    other, _ = ray_filesystem(f"s3://{s3_bucket}/other", **opts)
    assert other != fs
    # In this process the copy keeps the credentials it was given.
    assert back.handler._build() is None and back.handler.backend is not None


def test_unpickled_elsewhere_reads_credentials_from_the_environment(s3_server, s3_bucket) -> None:
    opts = s3_server.storage_options("pyarrow")
    fs, root = ray_filesystem(f"s3://{s3_bucket}/runs", **opts)
    with fs.open_output_stream(f"{root}/hello.txt") as out:
        out.write(b"from the driver")
    code = (
        "import pickle, sys\n"
        "fs = pickle.loads(sys.stdin.buffer.read())\n"
        "assert 'ray' not in sys.modules\n"
        f"print(fs.open_input_stream({root + '/hello.txt'!r}).read().decode())\n"
    )
    env = {**os.environ, **s3_server.env()}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(fs),
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "from the driver"


def test_retries_every_call_under_transient_faults(s3_server, s3_bucket, tmp_path) -> None:
    registry.register_backend("faulty+s3", FAULTY, clobber=True)
    try:
        fs, root = ray_filesystem(
            f"faulty+s3://{s3_bucket}/runs",
            # Which calls fail depends on their paths, and the bucket's name
            # is random: 41 calls at 0.3 inject fewer than 3 faults in fewer
            # than 1 run of 10,000 (at 0.2, 1 run of 150: a CI run got 2),
            # and a call failing all 20 attempts is rarer still.
            retry=RetryPolicy(attempts=20, base_delay=0.001),
            fault_transient_rate=0.3,
            fault_seed=3,
            **s3_server.storage_options("pyarrow"),
        )
        for i in range(20):
            with fs.open_output_stream(f"{root}/f{i}") as out:
                out.write(str(i).encode())
        listed = fs.get_file_info(pafs.FileSelector(root))
        assert sorted(os.path.basename(i.path) for i in listed) == sorted(
            f"f{i}" for i in range(20)
        )
        for i in range(20):
            assert fs.open_input_stream(f"{root}/f{i}").read() == str(i).encode()
        handler = fs.handler.backend.filesystem.handler
        assert sum(handler.calls.values()) - handler.injected["transient"] >= 41
        assert handler.injected["transient"] >= 3
    finally:
        registry.unregister_backend("faulty+s3")


def test_session_start_on_the_ray_filesystem_uses_the_real_backend(tmp_path) -> None:
    from checkpoint_store import session

    fs, root = ray_filesystem(f"file://{tmp_path}/runs")
    backend, retry = backend_of(fs)
    assert backend.capabilities.atomic_rename and retry is not None
    with session.start(
        storage_path=root, storage_filesystem=fs, experiment_name="e", trial_name="t"
    ) as s:
        assert s.storage.backend is backend
        src = tmp_path / "src"
        src.mkdir()
        (src / "w.bin").write_bytes(b"w")
        session.report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(str(src)))
    assert (tmp_path / "runs/e/t/checkpoint_000000/.internal_metadata.json").is_file()


@pytest.mark.parametrize("spell", ["absolute", "relative", "home", "pathlike"])
def test_a_plain_local_path_works_as_for_every_other_entry_point(
        spell, tmp_path, monkeypatch) -> None:
    # As Ray's own storage_path and session.start take it: the same place
    # as a file:// URI, made absolute here (a worker has another directory).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    where = {"absolute": str(tmp_path / "runs"), "relative": "runs", "home": "~/runs",
             "pathlike": tmp_path / "runs"}[spell]
    fs, root = ray_filesystem(where)
    assert root == str(tmp_path / "runs")
    assert fs.type_name == "py::checkpoint_store+file"
    ckpt = _committed(fs, root)
    assert (tmp_path / "runs/exp/t/checkpoint_000000/.internal_metadata.json").is_file()
    # The returned filesystem, as Ray uses it, and a copy of it unpickled in
    # another directory, both name that place.
    monkeypatch.chdir("/")
    again = pickle.loads(pickle.dumps(fs))
    assert again == fs
    info = again.get_file_info(f"{root}/exp/t/checkpoint_000000/w.bin")
    assert info.type == pafs.FileType.File and info.size == len(b"weights")
    assert backend_of(again)[0].capabilities.atomic_rename
    Checkpoint(ckpt.path).verify()  # raises unless every file is whole


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ray_filesystem(""),
        lambda: ray_filesystem(b"/bytes/path"),
        lambda: ray_filesystem("s3:/one-slash"),
        lambda: ray_filesystem("memory://b/x", client=object()),
        lambda: ray_filesystem("memory://b/x", retry=3),
    ],
)
def test_bad_arguments_are_refused(bad) -> None:
    with pytest.raises(InvalidConfigError):
        bad()


def test_importing_the_core_and_the_handler_imports_no_ray() -> None:
    code = (
        "import sys, pickle\n"
        "import checkpoint_store, checkpoint_store.session\n"
        "from checkpoint_store.integrations.ray import ray_filesystem\n"
        "fs, root = ray_filesystem('memory://b/x')\n"
        "pickle.loads(pickle.dumps(fs))\n"
        "assert checkpoint_store.session._ray_session() is None\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_handler_repr_names_no_option_values() -> None:
    h = CheckpointStoreHandler("memory://b/x", {"account_key": "k3y-value", "engine": "x"})
    assert "k3y-value" not in repr(h) and "account_key" not in repr(h)


def test_only_credential_options_stay_behind() -> None:
    from checkpoint_store.integrations.ray import _split_secrets

    public, secret = _split_secrets(
        {
            "endpoint_url": "http://127.0.0.1:9",
            "region": "r",
            "engine": "pyarrow",
            "blob_storage_authority": "127.0.0.1:10",
            "account_name": "dev",
            "anon": False,
            "access_key_id": "a",
            "secret_access_key": "b",
            "session_token": "c",
            "account_key": "d",
            "sas_token": "e",
            "connection_string": "f",
            "client_secret": "g",
            "credential": "h",
            "password": "i",
        }
    )
    assert sorted(public) == [
        "account_name",
        "anon",
        "blob_storage_authority",
        "endpoint_url",
        "engine",
        "region",
    ]
    assert len(secret) == 9


def test_auth_method_sentinels_travel_but_gcs_credentials_do_not(gcs_server, gcs_bucket) -> None:
    """``token="anon"`` names how to authenticate (here: not at all, the
    emulator): it travels, and a copy unpickled in a fresh process reaches
    the bucket with it instead of falling back to default credentials."""
    opts = gcs_server.storage_options()
    assert opts["token"] == "anon"
    fs, root = ray_filesystem(f"gs://{gcs_bucket}/runs", **opts)
    with fs.open_output_stream(f"{root}/hello.txt") as out:
        out.write(b"from the driver")
    blob = pickle.dumps(fs)
    assert b"anon" in blob
    code = (
        "import pickle, sys\n"
        "fs = pickle.loads(sys.stdin.buffer.read())\n"
        f"print(fs.open_input_stream({root + '/hello.txt'!r}).read().decode())\n"
    )
    # No emulator variable and no Google credentials: only the pickle says where and how.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STORAGE_EMULATOR", "GOOGLE_", "GCE_"))
    }
    env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "from the driver"

    # A real credential under the same name stays behind (the handler alone:
    # building the backend would check these made-up keys): a service-account
    # dict, or a string that is not one of the methods (a key file's path, a token).
    uri = f"gs://{gcs_bucket}/runs"
    key = {"type": "service_account", "private_key": "-----sEcReT-" + uuid.uuid4().hex}
    raw = "ya29.tOkEn-" + uuid.uuid4().hex
    for credential, needle in ((key, key["private_key"]), (raw, raw), ("/keys/sa.json", "sa.json")):
        handler = CheckpointStoreHandler(uri, {**opts, "token": credential})
        assert needle.encode() not in pickle.dumps(handler)
        assert handler != fs.handler  # the method is configuration, a secret is not
