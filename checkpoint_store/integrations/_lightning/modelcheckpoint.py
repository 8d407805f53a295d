"""``ModelCheckpoint`` reaching its dirpath with the plugin's storage options.

Lightning's ``ModelCheckpoint`` lists and probes its dirpath through its own
fsspec filesystem (``get_filesystem(dirpath)``, built with no options), so on
a store whose credentials or endpoint live only in
``CheckpointStoreIO(storage_options=...)`` its ``setup`` fails
(``NoCredentialsError``) before any checkpoint is written; Lightning takes no
storage options there. This body makes that filesystem the fsspec client of
the plugin's own backend for the dirpath, per callback: nothing process-wide
changes.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.integrations._lightning.io import _StoreIO
from checkpoint_store.registry import split_scheme


class _StoreModelCheckpoint:
    """The body of ``StoreModelCheckpoint`` (see its docstring in lightning.py)."""

    def __init__(self, dirpath: Any = None, *args: Any, **kwargs: Any) -> None:
        remote = dirpath is not None and split_scheme(os.fspath(dirpath)) not in (None, "file")
        # Lightning builds its filesystem for dirpath here already, and some
        # clients refuse to exist without options (adlfs: no account).
        super().__init__(None if remote else dirpath, *args, **kwargs)  # type: ignore[call-arg]
        self._cs_remote = remote
        if remote:
            self.dirpath = dirpath

    # Lightning assigns ``self._fs`` in ``__init__`` and ``setup``: a property
    # makes every later use the plugin's client.
    @property
    def _fs(self) -> Any:
        io = self.__dict__.get("_cs_io")
        own = self.__dict__.get("_cs_lightning_fs")
        if io is None or not self._cs_remote:
            return own
        fss = io._fsspec_for(self.dirpath)
        # A pyarrow filesystem passed to the plugin may have no fsspec twin:
        # Lightning's own filesystem is then the only one there is.
        return fss if fss is not None else own

    @_fs.setter
    def _fs(self, fs: Any) -> None:
        self.__dict__["_cs_lightning_fs"] = fs

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _StoreIO):
            raise InvalidConfigError(
                f"{type(self).__name__} reaches its dirpath with the storage options of "
                f"CheckpointStoreIO, but the trainer's checkpoint IO is {type(io).__name__}: "
                "pass Trainer(plugins=[CheckpointStoreIO(storage_options=...)])")
        self.__dict__["_cs_io"] = io
        if not self._cs_remote:  # local disks need no options: Lightning's own setup
            super().setup(trainer, pl_module, stage)  # type: ignore[misc]
            return
        # Lightning's setup would build its option-less filesystem again (and
        # adlfs refuses to); with dirpath given, the rest of it is this.
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        if self.save_last == "link":  # type: ignore[attr-defined]
            raise ValueError("`ModelCheckpoint(save_last='link')` is only supported for local "
                             f"file paths, got `dirpath={self.dirpath}`.")
        keeps = self.save_top_k != 0  # type: ignore[attr-defined]
        if trainer.is_global_zero and stage == "fit" and keeps \
                and self._fs.isdir(self.dirpath) and self._fs.ls(self.dirpath):
            warnings.warn(f"Checkpoint directory {self.dirpath} exists and is not empty.",
                          UserWarning, stacklevel=2)
