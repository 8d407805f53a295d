"""Issue 38, kind 2: hostile arguments, and the errors of the engines under
them, end as the project's typed errors, saying what to do, before anything
is written.

Entry points checked, per input:

* a filesystem argument that is no filesystem (a scheme string, a path, a
  class, any object): ``StorageContext``, ``session.start``, ``Checkpoint``,
  ``registry.resolve``/``backend_for_filesystem``, ``backends.wrap_filesystem``,
  and the integrations that take one (torch ``StorageWriter``/``StorageReader``,
  Lightning ``CheckpointStoreIO``/``resume_path``/``checkpoint_file``, HF
  ``CheckpointStoreCallback``/``restore_latest``, Optuna ``objective``);
* a local path argument that is none (an int, bytes, NUL, another store's
  URI): ``Checkpoint.to_directory``/``from_directory``/``from_state``, HF
  ``restore_latest(output_dir)``; ``to_directory(verify=)`` and
  ``StorageContext(fsync=)`` that are no bool;
* ``file://`` URIs decoding to a control character: ``Checkpoint``,
  ``StorageContext``, ``session.start`` (``storage_path``, ``resume_from``), the CLI;
* ``hdfs://`` without Java, and fsspec filesystems failing to build:
  ``Checkpoint``, ``StorageContext``, ``session.start``, the CLI;
* engine errors at storage calls: ``abfss://`` with no account and a dead
  endpoint (adlfs and pyarrow engines; ``Checkpoint.verify``/``to_directory``,
  ``StorageContext``, ``session.start``, the CLI), pyarrow's
  ``ArrowInvalid``/``ArrowNotImplementedError`` from a filesystem passed in,
  botocore's ``NoCredentialsError`` (s3fs engine), the other SDKs' types;
* the local store's own faults: a ``storage_path`` under ``/proc`` and a
  ``.cs_commit.lock`` that is a directory (``session.start``, ``report``,
  ``StorageContext.persist_checkpoint``).
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_store import (
    BackendUnavailableError,
    Checkpoint,
    InvalidConfigError,
    PermanentBackendError,
    StorageContext,
    StorageUnreachableError,
    TransientBackendError,
    session,
)
from checkpoint_store._util import retry as _retry
from checkpoint_store.backends import wrap_filesystem
from checkpoint_store.backends.engine_errors import as_os_error
from checkpoint_store.cli import main
from checkpoint_store.registry import backend_for_filesystem, resolve

FS_MESSAGE = "must be a pyarrow.fs.FileSystem or an fsspec filesystem instance"

#: ``(object, what the message tells to do)``.
NOT_FILESYSTEMS = [
    pytest.param("s3", "Name the store by a URI", id="scheme-string"),
    pytest.param(pathlib.Path("/tmp"), "Name the store by a URI", id="path"),
    pytest.param(MemoryFileSystem, "pass an instance", id="fsspec-class"),
    pytest.param(pafs.LocalFileSystem, "pass an instance", id="pyarrow-class"),
    pytest.param(object(), "build one", id="object"),
    pytest.param({"protocol": "s3"}, "build one", id="dict"),
]


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _empty_or_absent(path: pathlib.Path) -> bool:
    return not path.exists() or not any(path.iterdir())


# -- a filesystem argument that is no filesystem ------------------------------------------


@pytest.mark.parametrize("bad, todo", NOT_FILESYSTEMS)
def test_core_entry_points_refuse_a_non_filesystem_before_any_write(tmp_path, bad, todo):
    root = tmp_path / "store"
    calls = {
        "StorageContext": lambda: StorageContext(str(root), "e", "t", storage_filesystem=bad),
        "session.start": lambda: session.start(storage_path=str(root), storage_filesystem=bad),
        "Checkpoint": lambda: Checkpoint(str(root), filesystem=bad),
        "resolve": lambda: resolve(str(root), filesystem=bad),
        "backend_for_filesystem": lambda: backend_for_filesystem(bad),
        "wrap_filesystem": lambda: wrap_filesystem(bad),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidConfigError, match=FS_MESSAGE) as info:
            call()
        assert todo in str(info.value), (name, str(info.value))
        assert isinstance(info.value, ValueError)
    assert not root.exists()


def _torch_writer(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.torch import StorageWriter

    return StorageWriter(str(root), filesystem=bad)


def _torch_reader(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.torch import StorageReader

    return StorageReader(str(root), filesystem=bad)


def _lightning_io(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.lightning import CheckpointStoreIO

    return CheckpointStoreIO(storage_filesystem=bad)


def _lightning_resume(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.lightning import resume_path

    return resume_path(str(root), storage_filesystem=bad)


def _lightning_file(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.lightning import checkpoint_file

    return checkpoint_file(str(root / "last.ckpt"), storage_filesystem=bad)


def _hf_callback(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.hf import CheckpointStoreCallback

    return CheckpointStoreCallback(str(root), storage_filesystem=bad)


def _hf_restore(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.hf import restore_latest

    return restore_latest(str(root / "out"), storage_path=str(root), storage_filesystem=bad)


def _optuna_objective(bad: Any, root: pathlib.Path) -> Any:
    from checkpoint_store.integrations.optuna import objective

    return objective(lambda config: None, storage_path=str(root), experiment_name="e",
                     metric="loss", storage_filesystem=bad)


INTEGRATIONS = [
    pytest.param(_torch_writer, "torch", id="torch-StorageWriter"),
    pytest.param(_torch_reader, "torch", id="torch-StorageReader"),
    pytest.param(_lightning_io, "lightning", id="lightning-CheckpointStoreIO"),
    pytest.param(_lightning_resume, "lightning", id="lightning-resume_path"),
    pytest.param(_lightning_file, "lightning", id="lightning-checkpoint_file"),
    pytest.param(_hf_callback, "transformers", id="hf-CheckpointStoreCallback"),
    pytest.param(_hf_restore, "transformers", id="hf-restore_latest"),
    pytest.param(_optuna_objective, "optuna", id="optuna-objective"),
]


@pytest.mark.parametrize("build, needs", INTEGRATIONS)
@pytest.mark.parametrize("bad", ["s3", MemoryFileSystem, object()], ids=["str", "class", "obj"])
def test_integrations_refuse_a_non_filesystem_when_built(tmp_path, build, needs, bad):
    pytest.importorskip(needs)
    root = tmp_path / "store"
    with pytest.raises(InvalidConfigError, match=FS_MESSAGE):
        build(bad, root)
    assert not root.exists()


def test_a_real_filesystem_in_each_form_is_still_taken(tmp_path):
    # The check refuses only what is no filesystem: pyarrow's, fsspec's bare
    # and fsspec's wrapped in a PyFileSystem all still resolve.
    fss = MemoryFileSystem()
    for fs in (pafs.LocalFileSystem(), fss, pafs.PyFileSystem(pafs.FSSpecHandler(fss))):
        backend, _ = resolve(str(tmp_path / "x"), filesystem=fs)
        assert isinstance(backend.filesystem, pafs.FileSystem)


# -- a local path argument that is none -----------------------------------------------------


@pytest.fixture
def committed(tmp_path) -> Checkpoint:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"weights")
    ctx = StorageContext(str(tmp_path / "store"), "e", "t")
    return ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})


@pytest.mark.parametrize("target, todo", [
    (5, "must be a local path (a str or os.PathLike), got int 5"),
    (b"/tmp/x", "given as str"),
    ("", "non-empty"),
    ("out\0dir", "holds a NUL byte"),
    ("s3://bucket/out", "takes a local path, got the URI"),
], ids=["int", "bytes", "empty", "nul", "uri"])
def test_to_directory_refuses_a_target_that_is_no_local_path(committed, tmp_path, target,
                                                             todo):
    before = sorted(os.listdir(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(InvalidConfigError) as info:
            committed.to_directory(target)
    finally:
        os.chdir(cwd)
    assert todo in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before  # no lock, marker or staging written


def test_to_directory_takes_a_file_uri_and_refuses_a_verify_that_is_no_bool(committed,
                                                                          tmp_path):
    out = tmp_path / "out"
    assert committed.to_directory(out.as_uri()) == str(out)
    assert (out / "w.bin").read_bytes() == b"weights"
    with pytest.raises(InvalidConfigError, match="verify=.*True or False"):
        committed.to_directory(tmp_path / "out2", verify="no")  # type: ignore[arg-type]
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("path, todo", [
    (5, "must be a local path"), ("src\0x", "holds a NUL byte"),
    ("memory://b/x", "Checkpoint(uri)"),
], ids=["int", "nul", "uri"])
def test_from_directory_and_from_state_refuse_what_is_no_local_path(tmp_path, path, todo):
    with pytest.raises(InvalidConfigError, match=r"from_directory\(path\)") as info:
        Checkpoint.from_directory(path)
    assert todo in str(info.value)
    with pytest.raises(InvalidConfigError, match=r"from_state\(directory=\)") as info:
        Checkpoint.from_state({"step": 1}, path)
    assert todo in str(info.value)


@pytest.mark.parametrize("fsync", ["no", None, 0])
def test_storage_context_refuses_an_fsync_that_is_no_bool(tmp_path, fsync):
    # "no" used to read as True: fsync on, silently.
    with pytest.raises(InvalidConfigError, match="fsync must be True or False"):
        StorageContext(str(tmp_path / "store"), "e", "t", fsync=fsync)
    backend, root = resolve(str(tmp_path / "store"))
    with pytest.raises(InvalidConfigError, match="fsync must be True or False"):
        StorageContext.from_backend(backend, root, "e", "t", fsync=fsync)
    assert not (tmp_path / "store").exists()


def test_hf_restore_latest_refuses_an_output_dir_that_is_no_path(committed, tmp_path):
    pytest.importorskip("transformers")
    from checkpoint_store.integrations.hf import restore_latest

    with pytest.raises(InvalidConfigError, match="restore_latest.output_dir. must be a local"):
        restore_latest(5, storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t")


# -- file:// URIs that decode to a control character ---------------------------------------


@pytest.mark.parametrize("uri", ["file:///x%00y", "file:///tmp/a%0Ab", "local:///x%7Fy"])
def test_a_file_uri_decoding_to_a_control_character_is_refused_everywhere(tmp_path, uri):
    calls = {
        "Checkpoint": lambda: Checkpoint(uri),
        "StorageContext": lambda: StorageContext(uri, "e", "t"),
        "session.start": lambda: session.start(storage_path=uri),
        "resume_from": lambda: session.start(storage_path=str(tmp_path / "store"),
                                             resume_from=uri),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidConfigError, match="decodes to a path holding the control "
                                                     "character") as info:
            call()
        assert "remove it from the URI" in str(info.value), name
    assert _empty_or_absent(tmp_path / "store")
    res = _invoke("ls", uri)
    assert res.exit_code == 2, res.output
    assert "decodes to a path holding the control character" in res.stderr
    assert "Traceback" not in res.output


def test_a_decoded_file_uri_without_control_characters_still_works(tmp_path):
    (tmp_path / "sp ace").mkdir()
    assert Checkpoint((tmp_path / "sp ace").as_uri()).path == str(tmp_path / "sp ace")


# -- filesystems that cannot be built -------------------------------------------------------


def test_hdfs_without_java_says_what_to_install(tmp_path, monkeypatch):
    # A JAVA_HOME without a JVM in it: as a machine without Java (pyarrow
    # looks for libjvm there), whatever this one has installed.
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    uri = "hdfs://namenode/runs"
    calls = {
        "Checkpoint": lambda: Checkpoint(uri + "/checkpoint_000000"),
        "StorageContext": lambda: StorageContext(uri, "e", "t"),
        "session.start": lambda: session.start(storage_path=uri),
    }
    for name, call in calls.items():
        with pytest.warns(UserWarning, match="untested"), \
                pytest.raises(BackendUnavailableError, match="needs a Java runtime") as info:
            call()
        assert "set JAVA_HOME" in str(info.value), name
        # pyarrow's own words: "Unable to load libjvm", then "Prior attempt to
        # load libhdfs failed" in the same process.
        assert isinstance(info.value.__cause__, OSError)
        assert "lib" in str(info.value.__cause__)
    res = _invoke("ls", uri)
    assert res.exit_code == 1, res.output
    assert "needs a Java runtime" in res.stderr and "Traceback" not in res.output


class _Broken(MemoryFileSystem):
    """An fsspec client that fails while it is built (``error`` set per test)."""

    protocol = "csbroken"
    error: Exception = OSError("unset")

    def __init__(self, **kwargs: Any):
        raise type(self).error


@pytest.mark.parametrize("error, typed, says", [
    (OSError("Unable to load libjvm"), BackendUnavailableError, "needs a Java runtime"),
    (ConnectionRefusedError(111, "Connection refused"), TransientBackendError,
     "could not reach its server"),
    (RuntimeError("SSH handshake failed"), PermanentBackendError, "could not be built"),
], ids=["no-java", "refused", "engine-runtime-error"])
def test_an_fsspec_client_failing_to_build_is_typed(monkeypatch, error, typed, says):
    fsspec.register_implementation("csbroken", _Broken, clobber=True)
    monkeypatch.setattr(_Broken, "error", error)
    try:
        with pytest.warns(UserWarning, match="untested"), pytest.raises(typed, match=says):
            Checkpoint("csbroken://bucket/run")
    finally:
        sys.modules["fsspec.registry"]._registry.pop("csbroken", None)


# -- engine errors at storage calls ---------------------------------------------------------


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def dead_abfss(monkeypatch) -> dict[str, str]:
    """Options naming no account and an endpoint nobody answers on (127.0.0.1)."""
    pytest.importorskip("checkpoint_store_azure")
    import checkpoint_store_azure

    for name in list(os.environ):
        if name.startswith("AZURE_STORAGE"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(checkpoint_store_azure, "ENGINE_ATTEMPTS", 1)
    monkeypatch.setenv(_retry.ENV_ATTEMPTS, "1")
    _retry._breaker.close()
    return {"connection_string": f"BlobEndpoint=http://127.0.0.1:{_closed_port()}/;"
                                 "SharedAccessSignature=sv=2020-10-02&sig=x;"}


def test_abfss_with_no_account_and_a_dead_endpoint_is_transient_adlfs(dead_abfss, tmp_path):
    uri = "abfss://cont/runs"
    ck = Checkpoint(uri + "/e/t/checkpoint_000000", storage_options=dead_abfss)
    calls = {
        "verify": ck.verify,
        "to_directory": lambda: ck.to_directory(tmp_path / "out"),
        "StorageContext": lambda: StorageContext(
            uri, "e", "t", storage_options=dead_abfss).committed_checkpoints(),
        "session.start": lambda: session.start(storage_path=uri, storage_options=dead_abfss),
    }
    for name, call in calls.items():
        _retry._breaker.close()
        with pytest.raises(TransientBackendError, match="ServiceRequestError") as info:
            call()
        assert str(info.value).startswith("cannot connect to 127.0.0.1:"), name
        assert isinstance(info.value, StorageUnreachableError), name
    assert not (tmp_path / "out").exists()
    _retry._breaker.close()
    res = _invoke("ls", uri, "-o", f"connection_string={dead_abfss['connection_string']}")
    assert res.exit_code == 1, res.output
    assert "ServiceRequestError" in res.stderr and "Traceback" not in res.output


def test_abfss_with_a_dead_endpoint_is_transient_pyarrow_engine(dead_abfss):
    if getattr(pafs, "AzureFileSystem", None) is None:
        pytest.skip("this pyarrow has no AzureFileSystem")
    opts = {**dead_abfss, "engine": "pyarrow"}
    with pytest.raises(InvalidConfigError, match="account_name"):
        Checkpoint("abfss://cont/x", storage_options=opts)  # no account: said at once
    conn = opts["connection_string"] + "AccountName=devstoreaccount1;"
    ck = Checkpoint("abfss://cont/x", storage_options={**opts, "connection_string": conn})
    with pytest.raises(TransientBackendError, match="Could not connect") as info:
        ck.verify()
    assert str(info.value).startswith("cannot connect to http://127.0.0.1:"), str(info.value)
    assert isinstance(info.value, StorageUnreachableError)


class _ReadOnlyHandler(pafs.FSSpecHandler):
    """A store that refuses writes the way pyarrow's own engines do."""

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        raise pa.ArrowNotImplementedError("this filesystem is read-only")


def test_arrow_errors_of_a_filesystem_passed_in_are_typed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    fs = pafs.PyFileSystem(_ReadOnlyHandler(MemoryFileSystem()))
    ctx = StorageContext("ro/runs", "e", "t", storage_filesystem=fs)
    with pytest.raises(PermanentBackendError, match="does not support this operation") as info:
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert isinstance(info.value.cause, pa.ArrowNotImplementedError)
    local = StorageContext("/ro/runs", "e", "t", storage_filesystem=pafs.PyFileSystem(
        _DirRefusingHandler()))
    with pytest.raises(PermanentBackendError, match="refused the request") as info:
        local.ensure_trial_dir()
    assert isinstance(info.value.__cause__, pa.ArrowInvalid)


class _DirRefusingHandler(pafs.FSSpecHandler):
    def __init__(self) -> None:
        from fsspec.implementations.local import LocalFileSystem

        class _Local(LocalFileSystem):  # a subclass: used as given, real directories
            pass

        super().__init__(_Local())

    def create_dir(self, path: str, recursive: bool) -> None:
        raise pa.ArrowInvalid(f"Cannot create directory {path!r}: invalid key")


def test_missing_s3_credentials_are_a_permanent_error_naming_them(s3_server, s3_bucket,
                                                                  monkeypatch, tmp_path):
    # botocore's NoCredentialsError is no OSError: raw before. The instance
    # metadata service is off (tests/conftest.py); no file holds credentials.
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_EC2_METADATA_DISABLED":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    opts = {"engine": "s3fs", "endpoint_url": s3_server.endpoint_url,
            "region": s3_server.region}
    with pytest.raises(PermanentBackendError, match="NoCredentialsError") as info:
        Checkpoint(f"s3://{s3_bucket}/x", storage_options=opts).verify()
    assert "credentials" in str(info.value)
    assert type(info.value.cause).__name__ == "NoCredentialsError"


@pytest.mark.parametrize("make, kind", [
    (lambda: pa.ArrowInvalid("Embedded NUL char in path"), OSError),
    (lambda: pa.ArrowNotImplementedError("move of directories"), OSError),
    (lambda: pa.ArrowCapacityError("too large"), OSError),
    (lambda: _azure("ServiceRequestError", "Cannot connect to host"), ConnectionError),
    (lambda: _azure("ResourceNotFoundError", "The specified blob does not exist."),
     FileNotFoundError),
    (lambda: _azure("ClientAuthenticationError", "Server failed to authenticate"),
     PermissionError),
    (lambda: _boto("NoCredentialsError"), PermissionError),
    (lambda: _boto("EndpointConnectionError", endpoint_url="http://127.0.0.1:1"),
     ConnectionError),
    (lambda: _google("RefreshError"), PermissionError),
    (lambda: _google("TransportError"), ConnectionError),
    (lambda: _aiohttp_disconnected(), ConnectionError),
], ids=["arrow-invalid", "arrow-not-implemented", "arrow-capacity", "azure-request",
        "azure-not-found", "azure-auth", "boto-no-credentials", "boto-endpoint",
        "google-refresh", "google-transport", "aiohttp-disconnected"])
def test_each_engine_error_is_read_as_the_oserror_it_stands_for(make, kind):
    exc = make()
    got = as_os_error(exc, "list b/x")
    assert isinstance(got, kind) and got is not exc
    assert "list b/x: " in str(got)

    def fail() -> None:
        raise exc

    # Through a storage call: always one of ours (or FileNotFoundError, an answer).
    with pytest.raises((TransientBackendError, PermanentBackendError, FileNotFoundError)) \
            as info:
        _retry.call(fail, policy=_retry.RetryPolicy(attempts=1), what="list b/x")
    assert info.value.__cause__ is exc


def test_errors_that_are_no_engines_pass_unchanged():
    for exc in (ValueError("ours"), KeyError("k"), OSError("io"), KeyboardInterrupt()):
        assert as_os_error(exc, "x") is exc


def _azure(name: str, message: str) -> Exception:
    exceptions = pytest.importorskip("azure.core.exceptions")
    return getattr(exceptions, name)(message)


def _boto(name: str, **kwargs: Any) -> Exception:
    exceptions = pytest.importorskip("botocore.exceptions")
    return getattr(exceptions, name)(**kwargs)


def _google(name: str) -> Exception:
    exceptions = pytest.importorskip("google.auth.exceptions")
    return getattr(exceptions, name)("token endpoint said no")


def _aiohttp_disconnected() -> Exception:
    aiohttp = pytest.importorskip("aiohttp")
    return aiohttp.ServerDisconnectedError()


# -- the local store's own faults -------------------------------------------------------------


def test_a_storage_path_under_proc_is_a_permanent_error_naming_it(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    path = "/proc/checkpoint-store-test/runs"
    with pytest.raises(PermanentBackendError, match="takes no new entries") as info:
        with session.start(storage_path=path, experiment_name="e", trial_name="t"):
            pass
    assert "/proc/checkpoint-store-test" in str(info.value)
    assert "choose a location you can write to" in str(info.value)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    ctx = StorageContext(path, "e", "t")
    with pytest.raises(PermanentBackendError, match="takes no new entries"):
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    res = _invoke("upload", str(src), path + "/e/t/checkpoint_000000")
    assert res.exit_code == 1, res.output
    assert "takes no new entries" in res.stderr and "Traceback" not in res.output


def test_a_commit_lock_that_is_a_directory_fails_the_report_after_resume(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    store = str(tmp_path / "store")
    with session.start(storage_path=store, experiment_name="e", trial_name="t"):
        session.report({"x": 1}, checkpoint=Checkpoint.from_directory(src))
    lock = tmp_path / "store" / "e" / "t" / ".cs_commit.lock"
    if lock.exists():
        lock.unlink()
    lock.mkdir()
    with session.start(storage_path=store, experiment_name="e", trial_name="t"):
        assert session.get_checkpoint() is not None  # resumed
        with pytest.raises(PermanentBackendError, match="it is not a file") as info:
            session.report({"x": 2}, checkpoint=Checkpoint.from_directory(src))
        assert str(lock) in str(info.value)
        assert "move away or remove" in str(info.value)
        assert isinstance(info.value.cause, IsADirectoryError)
    ctx = StorageContext(store, "e", "t")
    assert [ck.path.rsplit("/", 1)[1] for ck, _ in ctx.committed_checkpoints()] == [
        "checkpoint_000000"]
