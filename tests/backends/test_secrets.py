"""Credentials never appear in repr, log records, exception messages or files we write."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointStoreError,
    StorageContext,
    session,
)
from checkpoint_store.registry import resolve
from checkpoint_store.testing.conformance import make_tree
from checkpoint_store.testing.servers import AZURITE_KEY, S3_SECRET_ACCESS_KEY


def _secret_forms(secret: str) -> list[bytes]:
    return [secret.encode(), secret[:16].encode(), repr(secret).encode()]


def _scan_local(root: Path, secret: str) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and any(f in p.read_bytes() for f in _secret_forms(secret)):
            hits.append(str(p))
    return hits


def _run_session(uri: str, options: dict | None, tmp_path: Path) -> Checkpoint:
    cfg = CheckpointConfig(num_to_keep=1)
    with session.start(storage_path=uri, storage_options=options, experiment_name="exp",
                       trial_name="t", checkpoint_config=cfg, config={"lr": 1}) as s:
        for i in range(2):
            src = tmp_path / f"src{i}"
            make_tree(src, {"w.bin": 100})
            session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        texts = [repr(s), str(s)]
    ckpt = StorageContext(uri, "exp", "t", storage_options=options).committed_checkpoints()[-1][0]
    texts += [repr(ckpt), ckpt.uri, repr(ckpt.backend), str(ckpt.backend)]
    ckpt.to_directory(str(tmp_path / "downloaded"))
    return ckpt, texts


@pytest.fixture
def all_logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def _assert_clean(secret: str, texts: list[str], logs, tmp_path: Path, stored: dict[str, bytes]):
    for t in texts:
        assert secret not in t
    for rec in logs.records:
        assert secret not in rec.getMessage(), rec.name
    assert _scan_local(tmp_path, secret) == []
    leaks = [k for k, data in stored.items() if any(f in data for f in _secret_forms(secret))]
    assert leaks == []


def _s3_objects(s3_server, bucket: str) -> dict[str, bytes]:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key=s3_server.access_key_id,
                           secret_key=s3_server.secret_access_key, region="us-east-1",
                           scheme="http", endpoint_override=f"127.0.0.1:{s3_server.port}")
    return {k: fs.open_input_stream(f"{bucket}/{k}").read() for k in s3_server.list_keys(bucket)}


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_s3_secret_from_storage_options(engine, s3_server, s3_bucket, tmp_path, all_logs):
    secret = s3_server.secret_access_key
    assert secret == S3_SECRET_ACCESS_KEY
    opts = s3_server.storage_options(engine)
    _, texts = _run_session(f"s3://{s3_bucket}/run", opts, tmp_path)
    _assert_clean(secret, texts, all_logs, tmp_path, _s3_objects(s3_server, s3_bucket))


def test_s3_secret_from_environment(s3_env, s3_server, s3_bucket, tmp_path, all_logs):
    _, texts = _run_session(f"s3://{s3_bucket}/run", None, tmp_path)
    _assert_clean(s3_env["AWS_SECRET_ACCESS_KEY"], texts, all_logs, tmp_path,
                  _s3_objects(s3_server, s3_bucket))


def test_azure_key_in_connection_string(azure_server, azure_container, tmp_path, all_logs):
    _, texts = _run_session(f"az://{azure_container}/run", azure_server.storage_options(),
                            tmp_path)
    with azure_server._service() as svc:
        cc = svc.get_container_client(azure_container)
        stored = {b.name: cc.download_blob(b.name).readall() for b in cc.list_blobs()}
    _assert_clean(AZURITE_KEY, texts, all_logs, tmp_path, stored)


def _errors(s3_server, bucket: str) -> list[BaseException]:
    good = s3_server.storage_options("pyarrow")
    cases = [
        {**good, "engine": "nope"},
        {**good, "endpoint_url": "ftp://127.0.0.1:1"},
        {**good, "not_an_option": 1},
        {**good, "access_key_id": None},
    ]
    out: list[BaseException] = []
    for opts in cases:
        with pytest.raises(Exception) as exc:
            resolve(f"s3://{bucket}/x", storage_options=opts)
        out.append(exc.value)
    # A server that does not answer: the error comes from the first real request.
    dead = {**good, "endpoint_url": "http://127.0.0.1:9", "connect_timeout": 0.2,
            "request_timeout": 0.2}
    with pytest.raises(Exception) as exc:
        StorageContext(f"s3://{bucket}/x", "e", "t", storage_options=dead).write_params({})
    out.append(exc.value)
    return out


def test_exception_messages_hold_no_secret(s3_server, s3_bucket):
    secret = s3_server.secret_access_key
    errors = _errors(s3_server, s3_bucket)
    assert any(isinstance(e, CheckpointStoreError) for e in errors)
    for e in errors:
        chain = []
        cur: BaseException | None = e
        while cur is not None:
            chain.append(cur)
            cur = cur.__cause__ or cur.__context__
        for c in chain:
            assert secret not in str(c) and secret not in repr(c), type(c)


def test_azure_errors_hold_no_key(azure_server, azure_container):
    import base64

    wrong = base64.b64encode(b"not-the-real-key-" * 4).decode()
    bad = azure_server.connection_string.replace(azure_server.account_key, wrong)
    with pytest.raises(Exception) as exc:  # Azurite refuses the signature (403)
        StorageContext(f"az://{azure_container}/x", "e", "t",
                       storage_options={"connection_string": bad}).write_params({})
    for text in (str(exc.value), repr(exc.value)):
        assert wrong not in text and wrong[:16] not in text


def test_backend_repr_and_pickle_of_checkpoint_hide_nothing_they_should_not(s3_server,
                                                                             s3_bucket):
    backend, _ = resolve(f"s3://{s3_bucket}/x", storage_options=s3_server.storage_options())
    assert s3_server.secret_access_key not in repr(backend)
    assert s3_server.secret_access_key not in repr(s3_server)
    ckpt = Checkpoint(f"s3://{s3_bucket}/x", storage_options=s3_server.storage_options())
    assert s3_server.secret_access_key not in repr(ckpt)
    # A pickled Checkpoint must still work in another process (Ray, multiprocessing);
    # it carries the filesystem, as pyarrow's own pickling does.
    assert pickle.loads(pickle.dumps(ckpt)).path == ckpt.path


def test_environment_is_not_copied_into_files(s3_env, s3_server, s3_bucket, tmp_path):
    _run_session(f"s3://{s3_bucket}/run", None, tmp_path)
    stored = _s3_objects(s3_server, s3_bucket)
    for value in (s3_env["AWS_SECRET_ACCESS_KEY"], s3_env["AWS_ACCESS_KEY_ID"]):
        assert not any(value.encode() in data for data in stored.values())
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == s3_env["AWS_SECRET_ACCESS_KEY"]


@pytest.mark.parametrize("item", [
    "secret_access_key:{secret}",  # ':' for '='
    "secret_access_key {secret}",  # a space for '='
    "{secret}",  # the value alone
    "={secret}",  # no key
])
def test_cli_argument_errors_hold_no_secret(s3_server, s3_bucket, item, all_logs):
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    secret = s3_server.secret_access_key
    opts = [a for k, v in s3_server.storage_options("pyarrow").items()
            if k != "secret_access_key" for a in ("-o", f"{k}={v}")]
    for command in (["ls"], ["verify"], ["best", "--metric", "m"], ["prune", "--keep", "1"],
                    ["cp", f"s3://{s3_bucket}/b"]):
        res = CliRunner().invoke(main, [command[0], f"s3://{s3_bucket}/a", *command[1:], *opts,
                                        "-o", item.format(secret=secret)])
        assert res.exit_code == 2, res.output
        out = res.output.encode()
        assert not any(f in out for f in _secret_forms(secret)), command
    for rec in all_logs.records:
        assert secret not in rec.getMessage(), rec.name


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_error_txt_of_a_failed_session_holds_no_secret(engine, s3_server, s3_bucket, tmp_path,
                                                       all_logs):
    """A session ended by one of our own errors raised deep in a storage call on
    S3 (the client holds the secret) records the whole traceback in error.txt,
    but no frame's locals: no form of the secret reaches it."""
    from checkpoint_store.errors import CheckpointNotFoundError

    secret = s3_server.secret_access_key
    opts = s3_server.storage_options(engine)
    uri = f"s3://{s3_bucket}/failing"
    with pytest.raises(CheckpointNotFoundError):
        with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                           trial_name="t", config={"lr": 1}):
            session.report({"i": 0})
            ctx = StorageContext(uri, "exp", "t", storage_options=opts)
            ctx.checkpoint("checkpoint_999999").to_directory(str(tmp_path / "restore"))
    stored = _s3_objects(s3_server, s3_bucket)
    error = [k for k in stored if k.endswith("/exp/t/error.txt")]
    assert len(error) == 1
    assert b"CheckpointNotFoundError" in stored[error[0]]
    assert b"to_directory" in stored[error[0]]  # the traceback reached into our code
    _assert_clean(secret, [], all_logs, tmp_path, stored)


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_credentials_in_an_endpoint_option_are_refused_unechoed(engine, capsys, caplog):
    from checkpoint_store.errors import InvalidConfigError
    from checkpoint_store.registry import resolve

    with pytest.raises(InvalidConfigError, match="endpoint_url") as info:
        resolve("s3://bucket/x", storage_options={
            "engine": engine, "endpoint_url": "http://AKIAUSER:s3cr3tpw@127.0.0.1:1"})
    shown = str(info.value) + repr(info.value) + capsys.readouterr().err + caplog.text
    assert "s3cr3tpw" not in shown and "AKIAUSER" not in shown


GCS_TOKEN = "ya29.cs-test-token-do-not-leak"


def test_an_engine_error_quoting_the_gcs_token_is_scrubbed(all_logs):
    """`checkpoint-store ls gs://b/x -o token=TOKEN`: gcsfs checks a token string
    at construction (GET /tokeninfo?access_token=TOKEN) and, with no network,
    its ConnectionError quotes that URL: the token was printed whole. With a
    network the answer is a refusal; in both the token stays hidden."""
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    pytest.importorskip("gcsfs")
    res = CliRunner().invoke(main, ["ls", "gs://cs-no-such-bucket/x", "-o", f"token={GCS_TOKEN}"])
    assert res.exit_code != 0, res.output
    assert GCS_TOKEN not in res.output and GCS_TOKEN[:16] not in res.output, res.output
    for rec in all_logs.records:  # what the command line prints; a client's debug log may
        if rec.levelno >= logging.WARNING:  # quote its own requests (urllib3)
            assert GCS_TOKEN not in rec.getMessage(), rec.name


class _LeakyFileSystem:
    """An fsspec filesystem whose constructor fails quoting what it was given, as
    clients do (a URL with its token, a connection string): the text of an error
    we must not pass on."""

    protocol = "csleaky"

    def __init__(self, password: str = "", sas_token: str = "", **kwargs):
        raise ValueError(f"login refused for password {password} at "
                         f"https://acct.example/c?sv=2024&sig={sas_token}")


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["ui", "--port", "0"],
                                     ["ls", "--debug"]])
def test_a_generic_engine_error_quoting_an_option_is_scrubbed(command, all_logs):
    """The generic fsspec backend quoted the engine's error whole: a password
    given with -o came back on stderr, a SAS signature in a URL too. With
    ``--debug`` the traceback, whose chained engine error quotes them, is
    scrubbed the same way."""
    import fsspec
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    fsspec.register_implementation("csleaky", _LeakyFileSystem, clobber=True)
    password, sig = "pw-do-not-leak-31337", "sig-do-not-leak-4242"
    res = CliRunner().invoke(main, [command[0], "csleaky://bucket/x", *command[1:],
                                    "-o", f"password={password}", "-o", f"sas_token={sig}"])
    assert res.exit_code == 1, res.output
    assert "login refused" in res.output  # the engine's words, its secrets hidden
    assert password not in res.output and sig not in res.output, res.output
    if "--debug" in command:
        assert "Traceback" in res.output and "ValueError" in res.output, res.output
    with pytest.raises(CheckpointStoreError) as info:
        resolve("csleaky://bucket/x", storage_options={"password": password, "sas_token": sig})
    assert password not in str(info.value) and sig not in str(info.value)
    for rec in all_logs.records:
        assert password not in rec.getMessage() and sig not in rec.getMessage()
