"""Real storage servers on 127.0.0.1 for tests: S3 (moto), Azure Blob (Azurite), GCS.

Each server runs as a child process on a free loopback port, is polled until
it answers, and is stopped by :meth:`_Server.stop`. The pytest fixtures in
:mod:`checkpoint_store.testing.plugin` wrap these classes; they can also be
used on their own (benchmarks, notebooks)::

    with S3Server.start() as s3:
        s3.create_bucket("ckpt")
        StorageContext("s3://ckpt/run", "exp", "trial", storage_options=s3.storage_options())

Measured start-up on a 2-core machine: moto ~0.5 s, Azurite ~0.5 s, the GCS
emulator ~1 s. Pitfalls these classes avoid are listed in SERVERS.md-style
notes next to each class.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"

# moto accepts any credentials; these are fake and deliberately recognisable so
# the secrets scan can look for them.
S3_ACCESS_KEY_ID = "AKIACHECKPOINTSTORE01"
S3_SECRET_ACCESS_KEY = "cs-test-secret-5b3c9e0f-do-not-leak"
S3_REGION = "us-east-1"

# Azurite's published development account (documented by Microsoft; not a secret
# of anyone's, but treated as one by our tests).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

GCS_PROJECT = "test-project"


class ServerStartError(RuntimeError):
    """A test server did not start or did not answer in time. The message has
    the command and the last lines of its output."""


_running: dict[int, _Server] = {}


def _stop_all() -> None:
    for server in list(_running.values()):
        server.stop()


atexit.register(_stop_all)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the server gets SIGTERM if the test process dies without cleaning
    up (killed, crashed), so no orphan keeps a port or memory."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def unique_name(prefix: str = "cs") -> str:
    """A bucket/container name valid on S3, Azure and GCS (3-63 lowercase chars)."""
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


def _http(
    method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    # The proxy settings of the environment must never route loopback traffic.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _list_pages(url: str, token_param: str, what: str,
                page: Callable[[bytes], tuple[dict[str, int], str]]) -> dict[str, int]:
    """``{name: size}`` of a listing read page by page: ``page`` turns a
    response body into its entries and the next page's token ("" at the end),
    sent back as the query parameter ``token_param``.

    Raises:
        OSError: a page did not answer 200.
    """
    out: dict[str, int] = {}
    token = ""
    sep = "&" if "?" in url else "?"
    while True:
        query = f"{sep}{token_param}={urllib.parse.quote(token, safe='')}" if token else ""
        status, body = _http("GET", url + query)
        if status != 200:
            raise OSError(f"listing {what} failed: {status} {body[:200]!r}")
        items, token = page(body)
        out.update(items)
        if not token:
            return out


@dataclass
class _Server:
    """A child process serving HTTP on ``HOST:port``."""

    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    workdir: str | None = field(default=None, repr=False)
    log_path: str | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return HOST

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    # -- lifecycle ------------------------------------------------------------

    @classmethod
    def _command(cls, port: int, workdir: str, **kwargs: Any) -> list[str]:
        raise NotImplementedError

    def _ping(self) -> bool:
        """True once the server answers HTTP."""
        try:
            _http("GET", self.endpoint_url + "/", timeout=1.0)
        except (OSError, urllib.error.URLError):
            return False
        return True

    @classmethod
    def start(cls, *, timeout: float = 60.0, attempts: int = 3, **kwargs: Any):
        """Start the server on a free port and wait until it answers.

        Args:
            timeout: seconds to wait for the first answer, per attempt.
            attempts: start again on a new port if a start fails (a port
                taken between choosing and binding it).

        Raises:
            ServerStartError: it never answered; the message has its output.
        """
        last = ""
        for _ in range(attempts):
            port = free_port()
            workdir = tempfile.mkdtemp(prefix=f"cs-{cls.__name__.lower()}-")
            log_path = os.path.join(workdir, "server.log")
            cmd = cls._command(port, workdir, **kwargs)
            env = dict(os.environ)
            env.update(cls._env())
            try:
                with open(log_path, "wb") as log:
                    # Own session: a Ctrl-C aimed at pytest does not kill the server
                    # before the tests' teardown has used it.
                    proc = subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env=env, cwd=workdir, start_new_session=True,
                        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                    )
            except OSError as exc:  # the program is missing or not executable
                shutil.rmtree(workdir, ignore_errors=True)
                raise ServerStartError(
                    f"{cls.__name__} could not run {cmd[0]!r}: {exc}"
                ) from None
            server = cls(port=port, process=proc, workdir=workdir, log_path=log_path, **kwargs)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if server._ping():
                    _running[id(server)] = server
                    return server
                time.sleep(0.05)
            last = f"{' '.join(cmd)}\n{server._log_tail()}"
            server.stop()
        raise ServerStartError(f"{cls.__name__} did not start on {HOST}:\n{last}")

    @classmethod
    def _env(cls) -> dict[str, str]:
        return {}

    def _log_tail(self, lines: int = 20) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 5 s) and remove its files."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.process = None
        _running.pop(id(self), None)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- S3 -----------------------------------------------------------------------


@dataclass(repr=False)
class S3Server(_Server):
    """moto in server mode (``python -m moto.server``), in its own process so
    that its request handling does not compete with the test for the GIL.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT``.
        access_key_id, secret_access_key, region: credentials moto accepts.
    """

    access_key_id: str = S3_ACCESS_KEY_ID
    secret_access_key: str = S3_SECRET_ACCESS_KEY
    region: str = S3_REGION

    def __repr__(self) -> str:
        return f"S3Server(endpoint_url={self.endpoint_url!r})"

    @classmethod
    def _command(cls, port: int, workdir: str, **kwargs: Any) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]

    @classmethod
    def _env(cls) -> dict[str, str]:
        return {"AWS_EC2_METADATA_DISABLED": "true"}

    def storage_options(self, engine: str = "pyarrow") -> dict[str, Any]:
        """Options for ``checkpoint-store-s3`` pointing at this server.

        Args:
            engine: ``"pyarrow"`` (default) or ``"s3fs"``.
        """
        return {
            "engine": engine,
            "endpoint_url": self.endpoint_url,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "region": self.region,
        }

    def env(self) -> dict[str, str]:
        """The standard AWS variables for a child process (torchrun, the CLI)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when None) and return its name."""
        name = name or unique_name()
        status, body = _http("PUT", f"{self.endpoint_url}/{name}", body=b"")
        if status != 200:
            raise ServerStartError(f"creating bucket {name!r} failed: {status} {body[:200]!r}")
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (best effort, for test teardown)."""
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(
            access_key=self.access_key_id, secret_key=self.secret_access_key,
            region=self.region, scheme="http", endpoint_override=f"{HOST}:{self.port}",
            allow_bucket_deletion=True,
        )
        with contextlib.suppress(OSError):
            fs.delete_dir(name)

    def list_keys(self, bucket: str) -> dict[str, int]:
        """``{key: size}`` of every object in ``bucket``, directory markers
        (``key/``) included, read with raw ListObjectsV2 behind the backend's back."""
        import xml.etree.ElementTree as ET

        def page(body: bytes) -> tuple[dict[str, int], str]:
            root = ET.fromstring(body)
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            items = {item.findtext(f"{ns}Key") or "": int(item.findtext(f"{ns}Size") or 0)
                     for item in root.iter(f"{ns}Contents")}
            token = root.findtext(f"{ns}NextContinuationToken") or ""
            truncated = (root.findtext(f"{ns}IsTruncated") or "false").lower() == "true"
            return items, token if truncated else ""

        return _list_pages(f"{self.endpoint_url}/{bucket}?list-type=2", "continuation-token",
                           f"bucket {bucket!r}", page)

    def put_object(self, bucket: str, key: str, data: bytes = b"") -> None:
        """Write one object behind the backend's back with boto3, as other
        tools do (``key/`` placeholders of the S3 console, stray objects)."""
        import boto3  # type: ignore[import-untyped]

        client = boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key, region_name=self.region,
        )
        client.put_object(Bucket=bucket, Key=key, Body=data)

    def reset(self) -> None:
        """Empty the whole server (every bucket)."""
        _http("POST", f"{self.endpoint_url}/moto-api/reset", body=b"")


# -- Azure ----------------------------------------------------------------------


def find_azurite(start: str | os.PathLike[str] | None = None) -> str | None:
    """The ``azurite-blob`` executable: ``$AZURITE_BLOB``, else
    ``tools/node_modules/.bin/azurite-blob`` in ``start`` or a parent of it
    (the project-local npm install of ``scripts/bootstrap.sh``), else ``PATH``."""
    explicit = os.environ.get("AZURITE_BLOB")
    if explicit:
        return explicit
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        cand = d / "tools" / "node_modules" / ".bin" / "azurite-blob"
        if cand.exists():
            return str(cand)
    # The checkout this package was installed from (editable installs).
    pkg_root = Path(__file__).resolve().parents[2]
    cand = pkg_root / "tools" / "node_modules" / ".bin" / "azurite-blob"
    if cand.exists():
        return str(cand)
    return shutil.which("azurite-blob")


@dataclass(repr=False)
class AzureServer(_Server):
    """Azurite's blob service (npm ``azurite``), with the flags that keep it on
    loopback and offline: ``--blobHost 127.0.0.1``, ``--disableTelemetry``.

    Attributes:
        account_name, account_key: Azurite's development account.
        connection_string: what adlfs and azure-storage-blob accept.
    """

    account_name: str = AZURITE_ACCOUNT
    account_key: str = AZURITE_KEY
    executable: str | None = None

    def __repr__(self) -> str:
        return f"AzureServer(endpoint_url={self.endpoint_url!r})"

    @classmethod
    def start(cls, *, timeout: float = 60.0, attempts: int = 3, executable: str | None = None,
              **kwargs: Any):
        try:
            import azure.storage.blob  # noqa: F401  (creates the test containers)
        except ImportError:
            raise ServerStartError(
                "the Azure fixtures need azure-storage-blob: pip install checkpoint-store-azure"
            ) from None
        exe = executable or find_azurite()
        if exe is None:
            raise ServerStartError(
                "azurite-blob not found: run `bash scripts/bootstrap.sh test` (npm install "
                "in tools/), or set AZURITE_BLOB to the azurite-blob executable"
            )
        return super().start(timeout=timeout, attempts=attempts, executable=exe, **kwargs)

    @classmethod
    def _command(cls, port: int, workdir: str, **kwargs: Any) -> list[str]:
        return [
            kwargs["executable"], "--blobHost", HOST, "--blobPort", str(port),
            "--location", workdir, "--skipApiVersionCheck", "--loose", "--silent",
            "--disableTelemetry",
        ]

    @property
    def blob_endpoint(self) -> str:
        return f"{self.endpoint_url}/{self.account_name}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account_name};"
            f"AccountKey={self.account_key};BlobEndpoint={self.blob_endpoint};"
        )

    def storage_options(self, engine: str = "adlfs") -> dict[str, Any]:
        """Options for ``checkpoint-store-azure`` pointing at this server."""
        return {"engine": engine, "connection_string": self.connection_string}

    def env(self) -> dict[str, str]:
        """The standard Azure variable for a child process."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def _service(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def create_container(self, name: str | None = None) -> str:
        """Create a container (fresh unique name when None) and return its name."""
        name = name or unique_name()
        with self._service() as svc:
            svc.create_container(name)
        return name

    def delete_container(self, name: str) -> None:
        with contextlib.suppress(Exception), self._service() as svc:
            svc.delete_container(name)

    def put_blob(self, container: str, name: str, data: bytes = b"",
                 metadata: Mapping[str, str] | None = None) -> None:
        """Write one blob behind the backend's back with azure-storage-blob, as
        other tools do: ``metadata={"hdi_isfolder": "true"}`` on a zero-byte
        blob is the folder blob of AzCopy, blobfuse and Hadoop."""
        with self._service() as svc:
            svc.get_container_client(container).upload_blob(
                name, data, metadata=dict(metadata or {}) or None, overwrite=True)

    def list_blobs(self, container: str) -> dict[str, int]:
        """``{blob name: size}`` in ``container``, read behind the backend's back."""
        with self._service() as svc:
            cc = svc.get_container_client(container)
            return {b.name: b.size for b in cc.list_blobs()}


# -- GCS --------------------------------------------------------------------------


@dataclass(repr=False)
class GCSServer(_Server):
    """gcp-storage-emulator (PyPI) in memory, run through
    :mod:`checkpoint_store.testing.gcs_emulator` (it keeps an uploaded
    object's last ``\\r``, which the emulator's own multipart reading drops).

    gcsfs must be imported with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` or
    every bucket operation waits 60 s on a call the emulator cannot answer;
    :func:`prepare_gcsfs_env` sets it, and ``checkpoint-store-gcs`` does too.
    """

    project: str = GCS_PROJECT

    def __repr__(self) -> str:
        return f"GCSServer(endpoint_url={self.endpoint_url!r})"

    @classmethod
    def _command(cls, port: int, workdir: str, **kwargs: Any) -> list[str]:
        return [
            sys.executable, "-m", "checkpoint_store.testing.gcs_emulator", "start", "--host", HOST,
            "--port", str(port), "--in-memory", "-q",
        ]

    def storage_options(self) -> dict[str, Any]:
        """Options for ``checkpoint-store-gcs`` pointing at this server."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": self.project}

    def env(self) -> dict[str, str]:
        """Variables for a child process (the emulator host convention of Google's SDKs)."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def create_bucket(self, name: str | None = None) -> str:
        name = name or unique_name()
        status, body = _http(
            "POST", f"{self.endpoint_url}/storage/v1/b?project={self.project}",
            body=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        if status not in (200, 201):
            raise ServerStartError(f"creating bucket {name!r} failed: {status} {body[:200]!r}")
        return name

    def list_objects(self, bucket: str) -> dict[str, int]:
        """``{object name: size}`` in ``bucket``, read behind the backend's back."""

        def page(body: bytes) -> tuple[dict[str, int], str]:
            doc = json.loads(body or b"{}")
            items = {item["name"]: int(item.get("size", 0)) for item in doc.get("items", [])}
            return items, doc.get("nextPageToken", "")

        return _list_pages(f"{self.endpoint_url}/storage/v1/b/{bucket}/o", "pageToken",
                           f"bucket {bucket!r}", page)

    def put_object(self, bucket: str, name: str, data: bytes = b"") -> None:
        """Write one object behind the backend's back with the JSON API's
        multipart upload, as other tools do (``name/`` placeholders of the
        console). The emulator drops a media upload with an empty body.

        Raises:
            OSError: the upload did not answer 200.
        """
        boundary = f"cs-{uuid.uuid4().hex}"
        body = b"".join([
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
            json.dumps({"name": name}).encode(),
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data, f"\r\n--{boundary}--\r\n".encode(),
        ])
        status, answer = _http(
            "POST", f"{self.endpoint_url}/upload/storage/v1/b/{bucket}/o?uploadType=multipart",
            body=body, headers={"Content-Type": f"multipart/related; boundary={boundary}"})
        if status != 200:
            raise OSError(f"uploading {name!r} to {bucket!r} failed: {status} {answer[:200]!r}")

    def delete_bucket(self, name: str) -> None:
        with contextlib.suppress(Exception):
            for obj in self.list_objects(name):
                _http("DELETE", f"{self.endpoint_url}/storage/v1/b/{name}/o/"
                      + urllib.parse.quote(obj, safe=""))
            _http("DELETE", f"{self.endpoint_url}/storage/v1/b/{name}")


def prepare_gcsfs_env() -> None:
    """Set what gcsfs needs before it is imported (see :class:`GCSServer`)."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@contextlib.contextmanager
def running(server_cls: type[_Server], **kwargs: Any) -> Iterator[Any]:
    """``with running(S3Server) as s3: ...`` starts and stops a server."""
    server = server_cls.start(**kwargs)
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class StorageLocation:
    """A fresh place to store checkpoints: a URI and the storage options for it.

    ``repr`` hides the options (they hold credentials).

    Example::

        def test_save(s3_location):
            ctx = StorageContext(s3_location.uri, "exp", "trial",
                                 storage_options=s3_location.storage_options)
    """

    uri: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"StorageLocation(uri={self.uri!r})"

    def join(self, *parts: str) -> StorageLocation:
        """The location ``uri/part/...`` with the same options."""
        uri = "/".join([self.uri.rstrip("/"), *(p.strip("/") for p in parts)])
        return StorageLocation(uri, self.storage_options, self.env)
