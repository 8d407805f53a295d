"""Every name and import path the documentation shows still imports.

The lists were extracted once from docs/api.md (its `:::` entries), from the
`import` / `from ... import` lines and from the dotted `checkpoint_store.` names
of docs/*.md and README.md. A move inside the package must keep each working;
private paths (a segment starting with `_`) are not listed: they may move.
"""

from __future__ import annotations

import importlib

import pytest

DOTTED = [
    "checkpoint_store.Checkpoint",
    "checkpoint_store.CheckpointConfig",
    "checkpoint_store.CheckpointManager",
    "checkpoint_store.LocalTier",
    "checkpoint_store.StorageContext",
    "checkpoint_store.UploadConfig",
    "checkpoint_store.available_backends",
    "checkpoint_store.backends",
    "checkpoint_store.backends.Backend",
    "checkpoint_store.backends.Capabilities",
    "checkpoint_store.backends.handlers",
    "checkpoint_store.checkpoint",
    "checkpoint_store.errors",
    "checkpoint_store.errors.InvalidConfigError",
    "checkpoint_store.integrations.hf",
    "checkpoint_store.integrations.hf.CheckpointStoreCallback",
    "checkpoint_store.integrations.hf.restore_latest",
    "checkpoint_store.integrations.lightning",
    "checkpoint_store.integrations.lightning.CheckpointStoreIO",
    "checkpoint_store.integrations.lightning.ReportCheckpointCallback",
    "checkpoint_store.integrations.lightning.checkpoint_file",
    "checkpoint_store.integrations.lightning.resume_path",
    "checkpoint_store.integrations.optuna",
    "checkpoint_store.integrations.optuna.objective",
    "checkpoint_store.integrations.pytorch_lightning",
    "checkpoint_store.integrations.ray",
    "checkpoint_store.integrations.ray.CheckpointStoreHandler",
    "checkpoint_store.integrations.ray.as_checkpoint",
    "checkpoint_store.integrations.ray.ray_filesystem",
    "checkpoint_store.integrations.ray.upload_fn",
    "checkpoint_store.integrations.torch",
    "checkpoint_store.integrations.torch.StorageReader",
    "checkpoint_store.integrations.torch.StorageWriter",
    "checkpoint_store.register_backend",
    "checkpoint_store.registry",
    "checkpoint_store.registry.resolve",
    "checkpoint_store.retention",
    "checkpoint_store.retention.evaluate",
    "checkpoint_store.retention.live_lease",
    "checkpoint_store.retention.lookup_metric",
    "checkpoint_store.retention.rank_key",
    "checkpoint_store.retention.recorded_invalid",
    "checkpoint_store.retention.score_of",
    "checkpoint_store.retention.select_kept",
    "checkpoint_store.session",
    "checkpoint_store.session.Session.next_checkpoint_dir",
    "checkpoint_store.session.SessionContext",
    "checkpoint_store.session.TrialRunner",
    "checkpoint_store.session.get_checkpoint",
    "checkpoint_store.session.get_context",
    "checkpoint_store.session.report",
    "checkpoint_store.session.start",
    "checkpoint_store.session.wait",
    "checkpoint_store.session.Session.durable_index",
    "checkpoint_store.storage",
    "checkpoint_store.testing",
    "checkpoint_store.testing.BackendTests",
    "checkpoint_store.testing.relay",
    "checkpoint_store.testing.relay.FaultRelay",
    "checkpoint_store.testing.stateful.RetentionMachine",
    "checkpoint_store._transfer.trees",
]

FROM_IMPORTS = [
    "checkpoint_store.backends:Backend",
    "checkpoint_store.backends:Capabilities",
    "checkpoint_store.backends:wrap_filesystem",
    "checkpoint_store.errors:InvalidConfigError",
    "checkpoint_store.integrations.hf:CheckpointStoreCallback",
    "checkpoint_store.integrations.hf:restore_latest",
    "checkpoint_store.integrations.lightning:CheckpointStoreIO",
    "checkpoint_store.integrations.lightning:ReportCheckpointCallback",
    "checkpoint_store.integrations.lightning:StoreModelCheckpoint",
    "checkpoint_store.integrations.lightning:checkpoint_file",
    "checkpoint_store.integrations.lightning:resume_path",
    "checkpoint_store.integrations.optuna:ATTR_BEST_CHECKPOINT",
    "checkpoint_store.integrations.optuna:objective",
    "checkpoint_store.integrations.ray:CommitCallback",
    "checkpoint_store.integrations.ray:as_checkpoint",
    "checkpoint_store.integrations.ray:ray_filesystem",
    "checkpoint_store.integrations.ray:upload_fn",
    "checkpoint_store.integrations.torch:StorageReader",
    "checkpoint_store.integrations.torch:StorageWriter",
    "checkpoint_store.retention:AnyOf",
    "checkpoint_store.retention:BestN",
    "checkpoint_store.retention:CheckpointConfig",
    "checkpoint_store.retention:CheckpointRecord",
    "checkpoint_store.retention:EveryNSeconds",
    "checkpoint_store.retention:EveryNSteps",
    "checkpoint_store.retention:LatestN",
    "checkpoint_store.retention:Steps",
    "checkpoint_store.retention:select_kept",
    "checkpoint_store.testing.relay:FaultRelay",
    "checkpoint_store.testing:BackendTests",
    "checkpoint_store.testing:StorageLocation",
    "checkpoint_store:Checkpoint",
    "checkpoint_store:CheckpointConfig",
    "checkpoint_store:StorageContext",
    "checkpoint_store:TrialRunner",
    "checkpoint_store:UnknownSchemeError",
    "checkpoint_store:UploadConfig",
    "checkpoint_store:register_backend",
    "checkpoint_store:session",
]


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted", DOTTED)
def test_documented_name_resolves(dotted: str) -> None:
    assert _resolve(dotted) is not None


@pytest.mark.parametrize("spec", FROM_IMPORTS)
def test_documented_from_import_works(spec: str) -> None:
    module, name = spec.split(":")
    namespace: dict[str, object] = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is not None
