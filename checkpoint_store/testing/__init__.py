"""Test harness shipped with checkpoint-store: real local servers and a conformance suite.

Installed as a pytest plugin (entry point ``pytest11``), so these fixtures
exist in any test run where checkpoint-store is installed. Servers start on
first use, once per session, on 127.0.0.1 and free ports, and stop at the end.
Without the server's program they skip, except with ``CI=true``: then they fail.

S3 (moto server, ``python -m moto.server``):

==========================  ========  ====================================================
fixture                     scope     value
==========================  ========  ====================================================
``s3_server``               session   :class:`~checkpoint_store.testing.servers.S3Server`:
                                      ``endpoint_url``, ``access_key_id``,
                                      ``secret_access_key``, ``region``,
                                      ``storage_options(engine)``, ``env()``,
                                      ``create_bucket()``, ``list_keys(bucket)``
``s3_bucket``               test      name of a fresh empty bucket (deleted afterwards)
``s3_storage_options``      test      ``dict`` for ``storage_options=`` (pyarrow engine)
``s3_uri``                  test      ``"s3://<fresh bucket>/ckpt"``
``s3_location``             test      :class:`StorageLocation` (``.uri``,
                                      ``.storage_options``, ``.env``), pyarrow engine
``s3fs_location``           test      the same with ``{"engine": "s3fs"}``
``s3_env``                  test      sets ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
                                      ``AWS_REGION``, ``AWS_ENDPOINT_URL`` for the test and
                                      returns them (pass to child processes: torchrun, CLI)
==========================  ========  ====================================================

Azure Blob (Azurite from ``tools/node_modules``, or ``$AZURITE_BLOB``):
``azure_server`` (session; ``connection_string``, ``storage_options()``,
``env()``, ``list_blobs(container)``), ``azure_container``,
``azure_storage_options``, ``azure_uri`` (``"az://<fresh container>/ckpt"``),
``azure_location``, ``azure_env`` (sets ``AZURE_STORAGE_CONNECTION_STRING``).

GCS (gcp-storage-emulator): ``gcs_server`` (session; ``endpoint_url``,
``storage_options()``, ``env()``, ``list_objects(bucket)``), ``gcs_bucket``,
``gcs_storage_options``, ``gcs_uri`` (``"gs://<fresh bucket>/ckpt"``),
``gcs_location``, ``gcs_env`` (sets ``STORAGE_EMULATOR_HOST``).

Example::

    def test_resume_on_s3(s3_location):
        with session.start(storage_path=s3_location.uri,
                           storage_options=s3_location.storage_options): ...

    def test_cli_on_s3(s3_location, tmp_path):
        env = {**os.environ, **s3_location.env}   # credentials for a child process
        subprocess.run([..., s3_location.uri], env=env, check=True)

Property testing (needs ``hypothesis``): :mod:`checkpoint_store.testing.strategies`
draws scores (NaN, ``±inf``, ties, missing), metrics (nested, unicode keys),
path components and directory trees; :mod:`checkpoint_store.testing.stateful`
holds ``RetentionMachine``, which checks ``CheckpointManager`` against a
sorted-list model through random reports, restarts and failing deletes::

    from checkpoint_store.testing.stateful import RetentionMachine
    TestRetention = RetentionMachine.TestCase

Conformance suite for backend plugins (the model is zarr's ``StoreTests``)::

    from checkpoint_store.testing import BackendTests, StorageLocation

    class TestMyStore(BackendTests):
        @pytest.fixture
        def storage_location(self, tmp_path):
            return StorageLocation("myfs://bucket/run", {"option": "value"})

See :class:`~checkpoint_store.testing.conformance.BackendTests` and docs/plugins.md.

Faults and crashes (docs/format.md, "Commit protocol")::

    from checkpoint_store.testing.faults import FaultPlan, faulty_backend, SimulatedCrash
    backend = faulty_backend(my_backend, FaultPlan(seed=1, transient_rate=0.2))
    # also: permanent={"write": "access_denied"}, latency=0.05,
    #       crash_after_writes=N, crash_on_path=".internal_metadata.json", expire_after=N

    from checkpoint_store.testing.crash import CrashConfig, CrashHarness
    report = CrashHarness(CrashConfig(storage_path=..., log_path=...)).run(kills=100)
    assert report.violations == []

Inside a session, for tests of this package: ``session_internals(s)`` gives
its local tier, its background upload lane, its ``result.json`` writer, its
state staging and its report pipeline (one seam, so the session's field
names can change without touching tests).
"""

from __future__ import annotations

from typing import Any

from checkpoint_store.testing.servers import (
    AzureServer,
    GCSServer,
    S3Server,
    ServerStartError,
    StorageLocation,
)

__all__ = [
    "AzureServer",
    "BackendTests",
    "GCSServer",
    "S3Server",
    "ServerStartError",
    "StorageLocation",
    "session_internals",
]


def __getattr__(name: str) -> Any:
    # The suite imports pytest; keep ``import checkpoint_store.testing`` light.
    if name == "BackendTests":
        from checkpoint_store.testing.conformance import BackendTests

        return BackendTests
    if name == "session_internals":
        from checkpoint_store.session._session import session_internals

        return session_internals
    raise AttributeError(f"module 'checkpoint_store.testing' has no attribute {name!r}")
