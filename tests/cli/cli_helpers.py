"""Helpers for the command-line tests: a storage root, a trial builder, the runner."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from click.testing import CliRunner, Result

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.cli import main

STAGING = ".cs_staging-checkpoint_000009-4242-0123456789ab"


@dataclass
class Store:
    """A storage root for one test: its URI and the backend options it needs."""

    uri: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def opt_args(self) -> list[str]:
        """``-o KEY=VALUE`` arguments for the CLI."""
        out: list[str] = []
        for k, v in self.options.items():
            out += ["-o", f"{k}={v}"]
        return out

    def join(self, *parts: str) -> str:
        return "/".join([self.uri.rstrip("/"), *parts])

    def ctx(self, experiment: str = "exp", trial: str = "t1") -> StorageContext:
        return StorageContext(self.uri, experiment, trial,
                              storage_options=dict(self.options) or None)


def invoke(args: Sequence[str]) -> Result:
    """Run the CLI in-process (stdout is not a terminal: no progress bars)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_tree(root: str, files: Mapping[str, bytes]) -> str:
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return root


def make_trial(
    store: Store,
    tmp_path: Any,
    losses: Sequence[float],
    *,
    experiment: str = "exp",
    trial: str = "t1",
    uncommitted: bool = False,
    staging: bool = False,
    foreign: bool = False,
) -> StorageContext:
    """A trial with one committed checkpoint per loss (index = position), each with
    a ``model.bin`` of distinct bytes, a nested file and user metadata; plus
    optionally an uncommitted ``checkpoint_<n>`` and a foreign file."""
    ctx = store.ctx(experiment, trial)
    for i, loss in enumerate(losses):
        src = tmp_path / f"src-{experiment}-{trial}-{i}"
        write_tree(str(src), {
            "model.bin": bytes((i * 7 + j) % 256 for j in range(3000 + 100 * i)),
            "optim/state.bin": b"opt" * (i + 1),
        })
        ckpt = Checkpoint.from_directory(src)
        ckpt.set_metadata({"epoch": i, "note": f"checkpoint {i}"})
        ctx.persist_checkpoint(ckpt, i, {"metrics": {"loss": loss, "epoch": i}})
    if uncommitted:
        # A directory without a commit marker: not a checkpoint, whoever wrote it.
        put(ctx, posixpath.join(ctx.checkpoint_path(len(losses)), "model.bin"), b"half-written")
    if staging:
        # What a writer killed mid-upload leaves on a local disk (docs/format.md).
        put(ctx, posixpath.join(ctx.trial_path, STAGING, "model.bin"), b"half-written")
    if foreign:
        put(ctx, posixpath.join(ctx.trial_path, "notes.txt"), b"someone else's file")
    return ctx


def put(ctx: StorageContext, path: str, data: bytes) -> None:
    fs = ctx.filesystem
    if ctx.backend.capabilities.directories:
        fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


def get(ctx: StorageContext, path: str) -> bytes:
    with ctx.filesystem.open_input_stream(path) as f:
        return f.read()


def committed_names(ctx: StorageContext) -> list[str]:
    return [posixpath.basename(c.path) for c, _ in ctx.committed_checkpoints()]


