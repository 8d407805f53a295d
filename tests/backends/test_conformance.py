"""BackendTests against every backend we ship, each on its real local server."""

from __future__ import annotations

import uuid

import pytest

from checkpoint_store.testing import BackendTests, StorageLocation


class TestLocal(BackendTests):
    @pytest.fixture
    def storage_location(self, tmp_path):
        return StorageLocation(f"file://{tmp_path}/store")


class TestMemory(BackendTests):
    @pytest.fixture
    def storage_location(self):
        return StorageLocation(f"memory://cs-{uuid.uuid4().hex[:12]}/ckpt")


class TestS3PyArrow(BackendTests):
    @pytest.fixture
    def storage_location(self, s3_location):
        return s3_location

    @pytest.fixture
    def raw_objects(self, s3_server, s3_bucket):
        return lambda: {f"{s3_bucket}/{k}": v for k, v in s3_server.list_keys(s3_bucket).items()}


class TestS3S3fs(BackendTests):
    @pytest.fixture
    def storage_location(self, s3fs_location):
        return s3fs_location

    @pytest.fixture
    def raw_objects(self, s3_server, s3_bucket):
        return lambda: {f"{s3_bucket}/{k}": v for k, v in s3_server.list_keys(s3_bucket).items()}


class TestAzure(BackendTests):
    @pytest.fixture
    def storage_location(self, azure_location):
        return azure_location

    @pytest.fixture
    def raw_objects(self, azure_server, azure_container):
        return lambda: {
            f"{azure_container}/{k}": v for k, v in azure_server.list_blobs(azure_container).items()
        }


class TestAzurePyArrow(BackendTests):
    """pyarrow's AzureFileSystem engine (adlfs still does the deletes)."""

    @pytest.fixture
    def storage_location(self, azure_server, azure_container):
        return StorageLocation(f"abfs://{azure_container}/ckpt",
                               azure_server.storage_options("pyarrow"))

    @pytest.fixture
    def raw_objects(self, azure_server, azure_container):
        return lambda: {
            f"{azure_container}/{k}": v for k, v in azure_server.list_blobs(azure_container).items()
        }


class TestGCS(BackendTests):
    @pytest.fixture
    def storage_location(self, gcs_location):
        return gcs_location

    @pytest.fixture
    def raw_objects(self, gcs_server, gcs_bucket):
        return lambda: {
            f"{gcs_bucket}/{k}": v for k, v in gcs_server.list_objects(gcs_bucket).items()
        }


class TestToyPlugin(BackendTests):
    """A third-party distribution (tests/plugins/toy), found only via its entry point."""

    @pytest.fixture
    def storage_location(self, tmp_path):
        return StorageLocation("toy://bucket/ckpt", {"root": str(tmp_path / "toy-root")})
