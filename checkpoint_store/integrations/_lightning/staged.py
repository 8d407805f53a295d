"""The bounded snapshot behind ``CheckpointStoreIO(async_save=True)``.

``save_checkpoint`` must return before the background save, while the loop
goes on changing parameters and optimizer state in place, so the save works
on a snapshot taken at the call. The snapshot's tensors go through the same
bounded shared-memory staging and persist process as ``report(state=...)``
(:class:`checkpoint_store.state._staging.Stager`): the call copies them into
at most ``staging_budget`` bytes of staging (blocking only for what does not
fit), the persist process writes them to safetensors files in a local
scratch directory, and the background save memory-maps them back to stream
the usual state file (``torch.save`` of Lightning's dict, so loads are
unchanged). So a pending save holds no second copy of the state in the
training process's memory: its bytes are in the page cache, which the kernel
may write out and reclaim.

Tensors safetensors cannot hold (complex, sparse, quantized) and tensors off
the CPU are still cloned as before; the others are saved as CPU tensors.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store._format.layout import LIGHTNING_STAGING_PREFIX
from checkpoint_store.state import scratch_dir

__all__ = ["StagedSnapshot", "snapshot"]


@dataclass(frozen=True)
class _Slot:
    name: str


class StagedSnapshot:
    """A Lightning checkpoint dict whose tensors are staged; :meth:`materialize`
    (background thread) gives the dict back with memory-mapped tensors."""

    def __init__(self, skeleton: Any, staged: Any, directory: str):
        self._skeleton = skeleton
        self._staged = staged
        self._directory = directory

    def materialize(self) -> dict[str, Any]:
        """Wait for the persist process, then the checkpoint dict with every
        staged tensor memory-mapped from its file (copy-on-write: file pages,
        no copy in the process's own memory)."""
        import math
        import mmap

        import torch
        from lightning_utilities.core.apply_func import apply_to_collection

        from checkpoint_store.state._tree import DTYPES

        dtypes = {name: getattr(torch, t) for name, (_, _n, t) in DTYPES.items() if t}
        tensors: dict[str, Any] = {}
        if self._staged is not None:
            index = self._staged.write_to(record=False)
            maps: dict[str, Any] = {}
            for name, e in index.items():
                if "alias_of" in e:
                    continue
                begin, end = e["offsets"]
                dtype = dtypes[e["dtype"]]
                if end == begin:
                    tensors[name] = torch.empty(e["shape"], dtype=dtype)
                    continue
                if e["file"] not in maps:
                    with open(os.path.join(self._directory, e["file"]), "rb") as f:
                        maps[e["file"]] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                count = math.prod(e["shape"]) if e["shape"] else 1
                tensors[name] = torch.frombuffer(maps[e["file"]], dtype=dtype, count=count,
                                                 offset=begin).view(e["shape"])
            for name, e in index.items():  # one tensor reachable twice: stored once
                if "alias_of" in e:
                    tensors[name] = tensors[e["alias_of"]]
        out: dict[str, Any] = apply_to_collection(self._skeleton, _Slot,
                                                  lambda s: tensors[s.name])
        return out

    def release(self) -> None:
        if self._staged is not None:
            self._staged.release()
        shutil.rmtree(self._directory, ignore_errors=True)

    def discard(self) -> None:
        """Release a snapshot no save will read: once the persist process has
        written its files (it may still be writing into the directory, and
        would leave a file of it behind the removal), or has failed."""
        try:
            if self._staged is not None:
                self._staged.write_to(record=False)
        except Exception:  # noqa: BLE001 - nothing of it is kept either way
            pass
        finally:
            self.release()


def snapshot(checkpoint: Mapping[str, Any], stager: Any) -> StagedSnapshot:
    """Stage the tensors of ``checkpoint`` (see this module's docstring)."""
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    from checkpoint_store.state._tree import DTYPES

    known = {f"torch.{t}" for (_, _n, t) in DTYPES.values() if t}
    flat: dict[str, Any] = {}

    def place(t: Any) -> Any:
        if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                or str(t.dtype) not in known):
            return t.detach().clone()
        name = f"t{len(flat)}"
        flat[name] = t.detach()
        return _Slot(name)

    skeleton = apply_to_collection(dict(checkpoint), torch.Tensor, place)
    # Named after this process: a kill mid-save leaves it to the next save's sweep.
    directory = scratch_dir(LIGHTNING_STAGING_PREFIX)
    try:
        staged = stager.stage(flat, directory) if flat else None
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return StagedSnapshot(skeleton, staged, directory)
