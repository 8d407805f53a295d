"""pytest plugin (entry point ``pytest11``): real storage servers as fixtures.

Loaded automatically wherever checkpoint-store is installed; importing it
starts nothing. Servers start on first use, once per test session, on
127.0.0.1 and free ports, and stop when the session ends. Each test gets a
fresh bucket or container. When a server cannot start, the tests that need it
are skipped, except with ``CI=true`` in the environment, where they fail.

The fixture names are listed in :mod:`checkpoint_store.testing`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from checkpoint_store.testing.servers import (
    AzureServer,
    GCSServer,
    S3Server,
    ServerStartError,
    StorageLocation,
    _Server,
    prepare_gcsfs_env,
)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


# The three server fixtures below stay written out rather than made by one
# factory: each has its own set-up step (S3's metadata-probe switch, Azurite's
# executable lookup, gcsfs's environment), and a plugin author reading this
# file should find `def s3_server` and what it does. What they share is here.
def _start(cls: type[_Server], what: str, **kwargs: Any) -> Any:
    try:
        return cls.start(**kwargs)
    except ServerStartError as exc:
        if _in_ci():
            pytest.fail(f"{what} could not start (CI=true, so this fails): {exc}", pytrace=False)
        pytest.skip(f"{what} could not start: {exc}")


# -- S3 (moto) ----------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server for the whole session (:class:`S3Server`: ``endpoint_url``,
    ``access_key_id``, ``secret_access_key``, ``region``, ``storage_options()``, ``env()``)."""
    # Before any S3 client exists: clients otherwise probe the instance-metadata host.
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    server = _start(S3Server, "moto S3 server")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket on :func:`s3_server`; deleted after the test."""
    name = s3_server.create_bucket()
    yield name
    s3_server.delete_bucket(name)


@pytest.fixture
def s3_storage_options(s3_server: S3Server) -> dict[str, Any]:
    """storage_options for the pyarrow engine pointing at :func:`s3_server`."""
    return s3_server.storage_options("pyarrow")


@pytest.fixture
def s3_uri(s3_bucket: str) -> str:
    """``s3://<fresh bucket>/ckpt``: use with :func:`s3_storage_options`."""
    return f"s3://{s3_bucket}/ckpt"


@pytest.fixture
def s3_location(s3_server: S3Server, s3_bucket: str) -> StorageLocation:
    """A fresh S3 location (pyarrow engine): ``.uri``, ``.storage_options``, ``.env``."""
    return StorageLocation(
        f"s3://{s3_bucket}/ckpt", s3_server.storage_options("pyarrow"), s3_server.env()
    )


@pytest.fixture
def s3fs_location(s3_server: S3Server, s3_bucket: str) -> StorageLocation:
    """Like :func:`s3_location` but with ``{"engine": "s3fs"}``."""
    return StorageLocation(
        f"s3://{s3_bucket}/ckpt", s3_server.storage_options("s3fs"), s3_server.env()
    )


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Sets the standard AWS_* variables (credentials, region, AWS_ENDPOINT_URL) for
    :func:`s3_server` in this process for the test; returns them for child processes."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


# -- Azure (Azurite) ------------------------------------------------------------


@pytest.fixture(scope="session")
def azure_server(request: pytest.FixtureRequest) -> Iterator[AzureServer]:
    """Azurite's blob service for the whole session (:class:`AzureServer`:
    ``connection_string``, ``account_name``, ``account_key``, ``storage_options()``, ``env()``)."""
    from checkpoint_store.testing.servers import find_azurite

    exe = find_azurite(request.config.rootpath)
    server = _start(AzureServer, "Azurite", executable=exe)
    yield server
    server.stop()


@pytest.fixture
def azure_container(azure_server: AzureServer) -> Iterator[str]:
    """A fresh, empty container on :func:`azure_server`; deleted after the test."""
    name = azure_server.create_container()
    yield name
    azure_server.delete_container(name)


@pytest.fixture
def azure_storage_options(azure_server: AzureServer) -> dict[str, Any]:
    """storage_options (a connection string) pointing at :func:`azure_server`."""
    return azure_server.storage_options()


@pytest.fixture
def azure_uri(azure_container: str) -> str:
    """``az://<fresh container>/ckpt``: use with :func:`azure_storage_options`."""
    return f"az://{azure_container}/ckpt"


@pytest.fixture
def azure_location(azure_server: AzureServer, azure_container: str) -> StorageLocation:
    """A fresh Azure location: ``.uri`` (``az://``), ``.storage_options``, ``.env``."""
    return StorageLocation(
        f"az://{azure_container}/ckpt", azure_server.storage_options(), azure_server.env()
    )


@pytest.fixture
def azure_env(azure_server: AzureServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Sets AZURE_STORAGE_CONNECTION_STRING for :func:`azure_server` for the test."""
    env = azure_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


# -- GCS (gcp-storage-emulator) ------------------------------------------------------


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """A GCS emulator for the whole session (:class:`GCSServer`: ``endpoint_url``,
    ``storage_options()``, ``env()``)."""
    prepare_gcsfs_env()
    server = _start(GCSServer, "GCS emulator")
    yield server
    server.stop()


@pytest.fixture
def gcs_bucket(gcs_server: GCSServer) -> Iterator[str]:
    """A fresh, empty bucket on :func:`gcs_server`; deleted after the test."""
    name = gcs_server.create_bucket()
    yield name
    gcs_server.delete_bucket(name)


@pytest.fixture
def gcs_storage_options(gcs_server: GCSServer) -> dict[str, Any]:
    """storage_options pointing at :func:`gcs_server`."""
    return gcs_server.storage_options()


@pytest.fixture
def gcs_uri(gcs_bucket: str) -> str:
    """``gs://<fresh bucket>/ckpt``: use with :func:`gcs_storage_options`."""
    return f"gs://{gcs_bucket}/ckpt"


@pytest.fixture
def gcs_location(gcs_server: GCSServer, gcs_bucket: str) -> StorageLocation:
    """A fresh GCS location: ``.uri`` (``gs://``), ``.storage_options``, ``.env``."""
    return StorageLocation(
        f"gs://{gcs_bucket}/ckpt", gcs_server.storage_options(), gcs_server.env()
    )


@pytest.fixture
def gcs_env(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Sets the emulator variables for :func:`gcs_server` for the test."""
    env = gcs_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
