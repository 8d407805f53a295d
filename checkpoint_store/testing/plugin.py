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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


def _start(cls: type[_Server], what: str, **kwargs: Any) -> Any:
    try:
        return cls.start(**kwargs)
    except ServerStartError as exc:
        if _in_ci():
            pytest.fail(f"{what} could not start (CI=true, so this fails): {exc}", pytrace=False)
        pytest.skip(f"{what} could not start: {exc}")


# One factory makes the six fixtures of each server family: the families differ
# only in the data of a _Family and a set-up step before the server starts (S3's
# metadata-probe switch, Azurite's executable lookup, gcsfs's environment), so a
# fix to the fixtures reaches all three. The names are bound at the bottom.
@dataclass(frozen=True)
class _Family:
    """One server family and the set-up its server needs before it starts."""

    prefix: str  # fixture names: <prefix>_server, <prefix>_<place>, ...
    server: type[_Server]
    what: str  # in skip and failure messages
    scheme: str  # of the URIs
    place: str  # "bucket" or "container": the server has create_<place>/delete_<place>
    # Run before the server starts; returns the keyword arguments of its start().
    prepare: Callable[[pytest.FixtureRequest], dict[str, Any]]


def _fixtures(f: _Family) -> tuple[Any, ...]:
    """The six fixtures of a family: ``<prefix>_server`` (session), then a fresh
    ``<prefix>_<place>`` per test, ``_storage_options``, ``_uri``, ``_location``
    and ``_env`` (see :mod:`checkpoint_store.testing` for what each holds)."""
    p, server_of = f.prefix, f"{f.prefix}_server"

    @pytest.fixture(scope="session", name=server_of)
    def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
        """The family's server for the whole session (its ``storage_options()``, ``env()``)."""
        started = _start(f.server, f.what, **f.prepare(request))
        yield started
        started.stop()

    @pytest.fixture(name=f"{p}_{f.place}")
    def place(request: pytest.FixtureRequest) -> Iterator[str]:
        """A fresh, empty bucket (container on Azure); deleted after the test."""
        srv = request.getfixturevalue(server_of)
        name = getattr(srv, f"create_{f.place}")()
        yield name
        getattr(srv, f"delete_{f.place}")(name)

    @pytest.fixture(name=f"{p}_storage_options")
    def storage_options(request: pytest.FixtureRequest) -> dict[str, Any]:
        """storage_options pointing at the server (S3: the pyarrow engine)."""
        return request.getfixturevalue(server_of).storage_options()

    @pytest.fixture(name=f"{p}_uri")
    def uri(request: pytest.FixtureRequest) -> str:
        """``<scheme>://<fresh bucket or container>/ckpt``, with ``<prefix>_storage_options``."""
        return f"{f.scheme}://{request.getfixturevalue(f'{p}_{f.place}')}/ckpt"

    @pytest.fixture(name=f"{p}_location")
    def location(request: pytest.FixtureRequest) -> StorageLocation:
        """A fresh location: ``.uri``, ``.storage_options``, ``.env``."""
        srv = request.getfixturevalue(server_of)
        return StorageLocation(request.getfixturevalue(f"{p}_uri"), srv.storage_options(),
                               srv.env())

    @pytest.fixture(name=f"{p}_env")
    def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
        """Sets the server's variables (credentials, endpoint) in this process for the
        test; returns them for child processes."""
        variables = request.getfixturevalue(server_of).env()
        for k, v in variables.items():
            monkeypatch.setenv(k, v)
        return variables

    return server, place, storage_options, uri, location, env


def _s3_prepare(request: pytest.FixtureRequest) -> dict[str, Any]:
    # Before any S3 client exists: clients otherwise probe the instance-metadata host.
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return {}


def _azure_prepare(request: pytest.FixtureRequest) -> dict[str, Any]:
    from checkpoint_store.testing.servers import find_azurite

    return {"executable": find_azurite(request.config.rootpath)}


def _gcs_prepare(request: pytest.FixtureRequest) -> dict[str, Any]:
    prepare_gcsfs_env()
    return {}


# S3 (moto): storage_options and location use the pyarrow engine.
s3_server, s3_bucket, s3_storage_options, s3_uri, s3_location, s3_env = _fixtures(
    _Family("s3", S3Server, "moto S3 server", "s3", "bucket", _s3_prepare))
# Azure (Azurite's blob service): storage_options hold a connection string.
azure_server, azure_container, azure_storage_options, azure_uri, azure_location, azure_env = (
    _fixtures(_Family("azure", AzureServer, "Azurite", "az", "container", _azure_prepare)))
# GCS (gcp-storage-emulator).
gcs_server, gcs_bucket, gcs_storage_options, gcs_uri, gcs_location, gcs_env = _fixtures(
    _Family("gcs", GCSServer, "GCS emulator", "gs", "bucket", _gcs_prepare))


@pytest.fixture
def s3fs_location(s3_server: S3Server, s3_bucket: str) -> StorageLocation:
    """Like :func:`s3_location` but with ``{"engine": "s3fs"}``."""
    return StorageLocation(
        f"s3://{s3_bucket}/ckpt", s3_server.storage_options("s3fs"), s3_server.env()
    )
