"""One spelling per location, and bad locations refused before the first write.

Every location enters through ``registry.resolve``: empty and ``.`` components
are dropped (the lease compared ``a//b`` as ``a/b`` while the data went under a
literal ``a//b``), and ``..``, URL queries, credentials in a URI, ports in a
bucket, control characters and fsspec schemes that cannot hold checkpoints
are refused with :class:`InvalidConfigError` before anything is written, on
every backend (docs/backends.md, "Locations").
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store.cli import main
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.registry import resolve

_BACKENDS = ["local", "memory", "s3", "s3fs", "azure", "azure-pyarrow", "gcs"]
_REMOTE = [b for b in _BACKENDS if b != "local"]


@dataclasses.dataclass
class Store:
    """A fresh bucket (or directory) of one backend: its root URI, options,
    and a way to read every name stored in it behind the backend's back."""

    kind: str
    root: str
    options: dict[str, Any]
    stored: Any  # () -> set[str]

    def uri(self, rest: str) -> str:
        return f"{self.root}/{rest}"

    def cli_options(self) -> list[str]:
        return [a for k, v in self.options.items() for a in ("-o", f"{k}={v}")]


def _memory_names(prefix: str) -> set[str]:
    from fsspec.implementations.memory import MemoryFileSystem

    return {k for k in MemoryFileSystem.store if k.startswith(prefix)}


def _store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if kind == "local":
        root = tmp_path / "store"
        root.mkdir()
        return Store(kind, str(root), {}, lambda: {str(p.relative_to(root))
                                                     for p in root.rglob("*") if p.is_file()})
    if kind == "memory":
        bucket = f"loc{uuid.uuid4().hex[:8]}"
        return Store(kind, f"memory://{bucket}", {}, lambda: _memory_names(f"/{bucket}"))
    if kind in ("s3", "s3fs"):
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        opts = server.storage_options("pyarrow" if kind == "s3" else "s3fs")
        return Store(kind, f"s3://{bucket}", opts, lambda: set(server.list_keys(bucket)))
    if kind.startswith("azure"):
        server = request.getfixturevalue("azure_server")
        container = request.getfixturevalue("azure_container")
        opts = server.storage_options("pyarrow" if kind == "azure-pyarrow" else "adlfs")
        return Store(kind, f"az://{container}", opts, lambda: set(server.list_blobs(container)))
    server = request.getfixturevalue("gcs_server")
    bucket = request.getfixturevalue("gcs_bucket")
    return Store(kind, f"gs://{bucket}", server.storage_options(),
                 lambda: set(server.list_objects(bucket)))


@pytest.fixture(params=_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return _store(request.param, request, tmp_path)


@pytest.fixture(params=_REMOTE)
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return _store(request.param, request, tmp_path)


def _source(tmp_path: Path) -> Checkpoint:
    src = tmp_path / f"src-{uuid.uuid4().hex[:6]}"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")
    return Checkpoint.from_directory(src)


def _report(location: str, tmp_path: Path, *, options: dict[str, Any] | None = None,
            filesystem: Any = None, trial: str = "t") -> None:
    with session.start(storage_path=location, storage_options=options or None,
                       storage_filesystem=filesystem, experiment_name="e", trial_name=trial):
        session.report({"a": 1}, checkpoint=_source(tmp_path))


def _resumed_index(location: str, *, options: dict[str, Any] | None = None,
                   filesystem: Any = None) -> int | None:
    with session.start(storage_path=location, storage_options=options or None,
                       storage_filesystem=filesystem, experiment_name="e", trial_name="t"):
        got = session.get_checkpoint()
    return None if got is None else got.internal_metadata["index"]


# -- kind 1: empty path components --------------------------------------------------


def test_a_report_through_a_doubled_slash_resumes_through_one(store, tmp_path):
    _report(store.uri("a//b"), tmp_path, options=store.options)
    assert _resumed_index(store.uri("a/b"), options=store.options) == 0
    names = store.stored()
    assert any(n.endswith("a/b/e/t/checkpoint_000000/model.bin") for n in names), names
    assert not any("a//b" in n for n in names), names
    # The listing and the CLI see the one trial, whichever spelling they are given.
    ctx = StorageContext(store.uri("a//./b/"), "e", "t", storage_options=store.options or None)
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
    assert ctx.canonical_uri(ctx.trial_path) == StorageContext(
        store.uri("a/b"), "e", "t", storage_options=store.options or None
    ).canonical_uri(ctx.trial_path)
    res = CliRunner().invoke(main, ["ls", store.uri("a//b/e//t"), *store.cli_options()])
    assert res.exit_code == 0, res.output
    assert "checkpoint_000000" in res.output


def test_a_dot_and_a_leading_doubled_slash_are_the_same_trial(remote, tmp_path):
    # The bucket itself spelled with an empty component after it and a "." inside.
    _report(remote.root + "//./runs/", tmp_path, options=remote.options)
    assert _resumed_index(remote.uri("runs"), options=remote.options) == 0


@pytest.mark.parametrize("name", ["a//b", "", ".", "..", "a/./b", "a/../b", "/a", "a/"])
@pytest.mark.parametrize("field", ["experiment_name", "trial_name"])
def test_run_names_with_empty_or_dot_components_are_refused(tmp_path, name, field):
    names = {"experiment_name": "e", "trial_name": "t", field: name}
    root = tmp_path / "store"
    with pytest.raises(InvalidConfigError):
        with session.start(storage_path=str(root), **names):
            pass
    assert not root.exists()


def _own_filesystem(kind: str, request: pytest.FixtureRequest) -> tuple[Any, str]:
    """A filesystem object of ``kind`` and a fresh bucket (or prefix) in it."""
    if kind == "fsspec-memory":
        return fsspec.filesystem("memory", skip_instance_cache=True), f"m{uuid.uuid4().hex[:8]}"
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    if kind == "pyarrow-s3":
        return pafs.S3FileSystem(access_key=server.access_key_id,
                                 secret_key=server.secret_access_key, region="us-east-1",
                                 scheme="http",
                                 endpoint_override=f"127.0.0.1:{server.port}"), bucket
    import s3fs

    return s3fs.S3FileSystem(key=server.access_key_id, secret=server.secret_access_key,
                             endpoint_url=server.endpoint_url, skip_instance_cache=True,
                             use_listings_cache=False), bucket


@pytest.mark.parametrize("kind", ["fsspec-memory", "pyarrow-s3", "s3fs"])
def test_a_given_filesystem_with_doubled_slashes_is_one_place(kind, tmp_path, request):
    fs, bucket = _own_filesystem(kind, request)
    _report(f"{bucket}//runs//x", tmp_path, filesystem=fs)  # pyarrow: ArrowInvalid before
    assert _resumed_index(f"{bucket}/runs/x", filesystem=fs) == 0
    ctx = StorageContext(f"{bucket}/runs/./x/", "e", "t", storage_filesystem=fs)
    assert ctx.trial_path.lstrip("/") == f"{bucket}/runs/x/e/t"


# -- kind 2: nothing written where it must not be ------------------------------------


def _refused(location: str, store: Store, tmp_path: Path, *, trial: str = "t",
             match: str | None = None) -> InvalidConfigError:
    before = store.stored()
    with pytest.raises(InvalidConfigError, match=match) as exc:
        _report(location, tmp_path, options=store.options, trial=trial)
    assert store.stored() == before  # not one object: no lease, no marker
    return exc.value


def test_dot_dot_in_an_s3_uri_writes_into_no_bucket(request, tmp_path):
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    escaped = server.create_bucket()
    for engine in ("pyarrow", "s3fs"):
        store = Store("s3", f"s3://{bucket}", server.storage_options(engine),
                      lambda: set(server.list_keys(bucket)))
        error = _refused(f"s3://{bucket}/../{escaped}/x", store, tmp_path, match="'..'")
        assert escaped in str(error)
        assert server.list_keys(escaped) == {}


@pytest.mark.parametrize("rest", ["../other/x", "x/..", "x/../../y", "./x/../y"])
def test_dot_dot_is_refused_off_local_disks(remote, tmp_path, rest):
    _refused(remote.uri(rest), remote, tmp_path, match=r"'\.\.'")


@pytest.mark.parametrize("rest", ["x?versionId=1", "x?generation=5/y", "x?a=1&b=2"])
def test_a_url_query_is_refused_before_anything_is_written(store, tmp_path, rest):
    root = store.root if "://" in store.root else "file://" + store.root
    error = _refused(f"{root}/{rest}", store, tmp_path, match="URL query")
    assert "=1" not in str(error) and "=5" not in str(error)  # values are never shown


@pytest.mark.parametrize("kind", ["s3", "s3fs"])
def test_s3_names_holding_version_id_are_refused(kind, request, tmp_path):
    """A trial name or a storage path holding ``?versionId=``: s3fs (which both
    engines delete with) reads it out of any key, as a version."""
    store = _store(kind, request, tmp_path)
    _refused(store.uri("r"), store, tmp_path, trial="t?versionId=1", match=r"\?versionId=")
    # A trial "t?" is a literal name and works.
    _report(store.uri("r"), tmp_path, options=store.options, trial="t?")


@pytest.mark.parametrize("kind", ["fsspec-memory", "pyarrow-s3", "s3fs"])
def test_a_given_filesystem_refuses_dot_dot(kind, request, tmp_path):
    fs, bucket = _own_filesystem(kind, request)
    with pytest.raises(InvalidConfigError, match=r"'\.\.'"):
        _report(f"{bucket}/../other/x", tmp_path, filesystem=fs)
    assert not fs.exists(f"{bucket}/other") if not isinstance(fs, pafs.FileSystem) else \
        fs.get_file_info(f"{bucket}/other").type == pafs.FileType.NotFound


def test_a_given_s3fs_filesystem_refuses_a_version_in_the_path(request, tmp_path):
    fs, bucket = _own_filesystem("s3fs", request)
    with pytest.raises(InvalidConfigError, match=r"\?versionId="):
        _report(f"{bucket}/x?versionId=1/r", tmp_path, filesystem=fs)
    assert request.getfixturevalue("s3_server").list_keys(bucket) == {}


# -- kind 3: secrets ----------------------------------------------------------------

_SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize("uri", [
    f"s3://AKIAIOSFODNN7EXAMPLE:{_SECRET}@bucket/x",
    f"s3://{_SECRET}@bucket/x",
    f"s3://bucket/x?X-Amz-Credential=AKIA&X-Amz-Signature={_SECRET}",
    f"az://container:{_SECRET}@acct.dfs.core.windows.net/x",
    f"az://container/x?sv=2024&sig={_SECRET}",
    f"gs://bucket/x?token={_SECRET}",
    f"memory://u:{_SECRET}@b/x",
    f"file://u:{_SECRET}@localhost/tmp/x",
    f"https://host/x?sig={_SECRET}",
    f"nosuchscheme://u:{_SECRET}@h/x",
])
def test_credentials_in_a_uri_are_refused_and_never_shown(uri, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(InvalidConfigError) as exc:
        with session.start(storage_path=uri, experiment_name="e", trial_name="t"):
            pass
    texts = [str(exc.value), repr(exc.value)]
    with pytest.raises(InvalidConfigError):
        Checkpoint(uri)
    res = CliRunner().invoke(main, ["ls", uri])
    assert res.exit_code == 2, res.output
    texts.append(res.output)
    for command in (["show", uri], ["verify", uri], ["cp", uri, str(tmp_path / "d")],
                    ["prune", uri, "--keep", "1"], ["gc", uri]):
        res = CliRunner().invoke(main, command)
        assert res.exit_code == 2, (command, res.output)
        texts.append(res.output)
    captured = capsys.readouterr()
    texts += [captured.out, captured.err, *(r.getMessage() for r in caplog.records)]
    for text in texts:
        assert _SECRET not in text and _SECRET[:16] not in text
    assert any("hidden" in t for t in texts)


def test_storage_options_given_as_a_string_are_refused_unechoed(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(InvalidConfigError, match="must be a mapping") as exc:
        StorageContext("s3://bucket/x", "e", "t",
                       storage_options=f"secret_access_key={_SECRET}")  # type: ignore[arg-type]
    assert _SECRET not in str(exc.value)
    with pytest.raises(InvalidConfigError, match="must be a mapping"):
        resolve("s3://bucket/x", storage_options="endpoint=x")  # type: ignore[arg-type]
    assert all(_SECRET not in r.getMessage() for r in caplog.records)


def test_reprs_hold_no_secret_of_the_storage_options(s3_server, s3_bucket, tmp_path):
    opts = s3_server.storage_options()
    ctx = StorageContext(f"s3://{s3_bucket}/x", "e", "t", storage_options=opts)
    ckpt = Checkpoint(f"s3://{s3_bucket}/x", storage_options=opts)
    for text in (repr(ctx), str(ctx), repr(ckpt), str(ckpt), repr(ctx.backend)):
        assert s3_server.secret_access_key not in text


# -- kind 4: raw exceptions where a typed error belongs ------------------------------


@pytest.mark.parametrize("rest", ["a\x00b", "a\nb", "a\tb/c"])
def test_control_characters_in_a_location_are_refused(store, tmp_path, rest):
    error = _refused(store.uri(rest), store, tmp_path, match="control character")
    assert repr(rest[1]) in str(error)


@pytest.mark.parametrize("kind", ["s3", "s3fs", "gcs", "azure"])
def test_a_port_in_the_bucket_is_refused_with_the_endpoint_hint(kind, request, tmp_path):
    store = _store(kind, request, tmp_path)
    scheme, _, bucket = store.root.partition("://")
    error = _refused(f"{scheme}://{bucket}:9000/x", store, tmp_path, match="endpoint_url")
    assert f"{bucket}:9000" in str(error)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:9/x", "https://example.com/x",
                                 "zip://x.zip", "github://owner:repo@/x", "tar://a.tar",
                                 "simplecache://x", "filecache://x"])
def test_fsspec_schemes_that_cannot_hold_checkpoints_are_refused(uri, tmp_path):
    with pytest.raises(InvalidConfigError) as exc:
        _report(uri, tmp_path)
    assert repr(uri.split("://", 1)[0].split("::")[0]) in str(exc.value)


def test_a_read_only_fsspec_filesystem_object_is_refused(tmp_path):
    from fsspec.implementations.http import HTTPFileSystem

    with pytest.raises(InvalidConfigError, match="'http'"):
        _report("127.0.0.1/x", tmp_path, filesystem=HTTPFileSystem())


# -- kind 5: the CLI's -o values -----------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "s3fs"])
def test_cli_o_request_timeout_reaches_s3_as_a_number(kind, request, tmp_path, monkeypatch):
    store = _store(kind, request, tmp_path)
    _report(store.uri("r"), tmp_path, options=store.options)
    opts = [*store.cli_options(), "-o", "request_timeout=3", "-o", "connect_timeout=2.5"]
    for command in (["ls", store.uri("r/e/t")], ["verify", store.uri("r")],
                    ["best", store.uri("r/e/t"), "--metric", "a"]):
        res = CliRunner().invoke(main, [*command, *opts])
        assert res.exit_code == 0, (command, res.output)
    from checkpoint_store.ui._server import Server

    monkeypatch.setattr(Server, "serve_forever", lambda self: self._server.server_close())
    res = CliRunner().invoke(main, ["ui", store.uri("r"), *opts])
    assert res.exit_code == 0, res.output
    assert "Serving" in res.output


def test_cli_o_typed_option_of_the_wrong_type_names_it(s3_server, s3_bucket):
    opts = [a for k, v in s3_server.storage_options().items() for a in ("-o", f"{k}={v}")]
    res = CliRunner().invoke(main, ["ls", f"s3://{s3_bucket}/x", *opts,
                                    "-o", "request_timeout=soon"])
    assert res.exit_code == 2
    assert "'request_timeout' must be a finite number" in res.output
    res = CliRunner().invoke(main, ["ls", f"s3://{s3_bucket}/x", *opts, "-o", "bogus=1"])
    assert res.exit_code == 2
    known = res.output.split("known options:", 1)[1]
    for name in ("request_timeout", "connect_timeout", "engine", "endpoint_url"):
        assert name in known


def test_cli_o_keeps_a_numeric_access_key_a_string(s3_server, s3_bucket):
    """An access key id of digits (MinIO allows any) stays a string: the CLI
    never guesses a type, the backend converts only options it declares."""
    from checkpoint_store.cli import parse_storage_options

    assert parse_storage_options(["access_key_id=12345678", "anonymous=true"]) == {
        "access_key_id": "12345678", "anonymous": "true"}
    res = CliRunner().invoke(main, ["ls", f"s3://{s3_bucket}/x", "-o", "anonymous=yes",
                                    "-o", f"endpoint_url={s3_server.endpoint_url}"])
    assert "anonymous" not in res.output  # parsed as a boolean, not refused


def test_azure_and_gcs_convert_their_declared_options(request, tmp_path):
    for kind, extra in (("azure", {"max_concurrency": "2"}),
                        ("gcs", {"block_size": "1048576", "requester_pays": "no"})):
        store = _store(kind, request, tmp_path)
        backend, _ = resolve(store.uri("r"), storage_options={**store.options, **extra})
        client = backend.filesystem.handler.fs
        if kind == "azure":
            assert client.max_concurrency == 2
        else:
            assert (client.default_block_size, client.requester_pays) == (1048576, False)
        _report(store.uri("r"), tmp_path, options=store.options)
        opts = [a for k, v in extra.items() for a in ("-o", f"{k}={v}")]
        res = CliRunner().invoke(main, ["ls", store.uri("r/e/t"), *store.cli_options(), *opts])
        assert res.exit_code == 0, (kind, res.output)


def test_fsspec_fallback_converts_by_the_class_signature():
    from fsspec.implementations.ftp import FTPFileSystem

    from checkpoint_store.registry import _typed_by_signature

    got = _typed_by_signature(FTPFileSystem, {"port": "2121", "host": "h", "tls": "no"}, "ftp")
    assert got == {"port": 2121, "host": "h", "tls": False}
    with pytest.raises(InvalidConfigError, match="'port' must be an integer"):
        _typed_by_signature(FTPFileSystem, {"port": "ftp"}, "ftp")
