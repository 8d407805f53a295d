"""BackendTests against every backend we ship, each on its real local server."""

from __future__ import annotations

import uuid

import pytest

from checkpoint_store.testing import BackendTests, StorageLocation


def _key(path: str) -> tuple[str, str]:
    """``bucket/key`` as a filesystem path -> ``(bucket, key)``."""
    bucket, _, key = path.lstrip("/").partition("/")
    return bucket, key


class _S3Raw:
    """Placeholders as the S3 console and pyarrow write them: an empty ``key/`` object."""

    @pytest.fixture
    def raw_objects(self, s3_server, s3_bucket):
        return lambda: {f"{s3_bucket}/{k}": v for k, v in s3_server.list_keys(s3_bucket).items()}

    @pytest.fixture
    def raw_placeholder(self, s3_server):
        return lambda path: s3_server.put_object(*_key(path + "/"))

    @pytest.fixture
    def raw_object(self, s3_server):
        return lambda path, data: s3_server.put_object(*_key(path), data)


class _AzureRaw:
    """Folder blobs as AzCopy, blobfuse and Hadoop write them."""

    @pytest.fixture
    def raw_objects(self, azure_server, azure_container):
        return lambda: {
            f"{azure_container}/{k}": v for k, v in azure_server.list_blobs(azure_container).items()
        }

    @pytest.fixture
    def raw_placeholder(self, azure_server):
        return lambda path: azure_server.put_blob(*_key(path), metadata={"hdi_isfolder": "true"})

    @pytest.fixture
    def raw_object(self, azure_server):
        return lambda path, data: azure_server.put_blob(*_key(path), data)


class TestLocal(BackendTests):
    @pytest.fixture
    def storage_location(self, tmp_path):
        return StorageLocation(f"file://{tmp_path}/store")


class TestMemory(BackendTests):
    @pytest.fixture
    def storage_location(self):
        return StorageLocation(f"memory://cs-{uuid.uuid4().hex[:12]}/ckpt")


class TestS3PyArrow(_S3Raw, BackendTests):
    @pytest.fixture
    def storage_location(self, s3_location):
        return s3_location


class TestS3S3fs(_S3Raw, BackendTests):
    @pytest.fixture
    def storage_location(self, s3fs_location):
        return s3fs_location


class TestAzure(_AzureRaw, BackendTests):
    @pytest.fixture
    def storage_location(self, azure_location):
        return azure_location


class TestAzurePyArrow(_AzureRaw, BackendTests):
    """pyarrow's AzureFileSystem engine (adlfs still does the deletes)."""

    @pytest.fixture
    def storage_location(self, azure_server, azure_container):
        return StorageLocation(f"abfs://{azure_container}/ckpt",
                               azure_server.storage_options("pyarrow"))


class TestGCS(BackendTests):
    @pytest.fixture
    def storage_location(self, gcs_location):
        return gcs_location

    @pytest.fixture
    def raw_objects(self, gcs_server, gcs_bucket):
        return lambda: {
            f"{gcs_bucket}/{k}": v for k, v in gcs_server.list_objects(gcs_bucket).items()
        }

    @pytest.fixture
    def raw_placeholder(self, gcs_server):
        """An empty ``name/`` object, as the Cloud console's "create folder" writes."""
        return lambda path: gcs_server.put_object(*_key(path + "/"))

    @pytest.fixture
    def raw_object(self, gcs_server):
        return lambda path, data: gcs_server.put_object(*_key(path), data)


class TestToyPlugin(BackendTests):
    """A third-party distribution (tests/plugins/toy), found only via its entry point."""

    @pytest.fixture
    def storage_location(self, tmp_path):
        return StorageLocation("toy://bucket/ckpt", {"root": str(tmp_path / "toy-root")})
