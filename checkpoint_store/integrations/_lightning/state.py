"""A Lightning checkpoint's state file: written, read and verified on storage.

``torch.save`` streams Lightning's checkpoint dict into ``checkpoint.ckpt``
inside the checkpoint directory, CRC32C computed on the way; a load checks the
file against the manifest as it reads. Also what the index and metrics of a
checkpoint are taken from (``epoch``, ``global_step``, monitored values).
"""

from __future__ import annotations

import ast
import io
import math
import os
import posixpath
from collections.abc import Callable, Mapping
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._chunks.files import ChunkedFile
from checkpoint_store._format.manifest import is_chunked
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.inspect import (
    ManifestEntry,
    inspect_checkpoint,
    read_checked,
    read_with_crc,
    verify_files,
)
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.clients import writer_of
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_store.integrations._lightning.replace import current_dir

__all__ = [
    "STATE_FILE",
    "_checkpoint_metrics",
    "_checkpoint_monitor",
    "_stream_state",
    "_to_float",
    "state_file",
    "verified",
    "verified_state",
]

#: The file inside a checkpoint directory that holds Lightning's checkpoint dict.
STATE_FILE = "checkpoint.ckpt"


class _CrcWriter:
    """A binary file-like that forwards writes and keeps size and CRC32C."""

    def __init__(self, raw: Any):
        self._raw = raw
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        chunk = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        self._raw.write(chunk)
        self.crc = google_crc32c.extend(self.crc, chunk)
        self.size += len(chunk)
        return len(chunk)

    def flush(self) -> None:
        flush = getattr(self._raw, "flush", None)
        if flush is not None:
            flush()


def _stream_state(
    checkpoint: Mapping[str, Any], fsync: bool, retry: RetryPolicy | None
) -> Callable[[pafs.FileSystem, str], list[ManifestEntry]]:
    """The ``write`` of :meth:`CommitProtocol.commit`: ``torch.save`` straight into
    the backend's output stream (no local copy), CRC32C computed on the way."""
    import torch

    def write_once(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
        path = posixpath.join(directory, STATE_FILE)
        local = _fsutil.local_path(fs, path)
        if local is not None:
            with open(local, "wb") as f:
                w = _CrcWriter(f)
                torch.save(checkpoint, w)  # type: ignore[arg-type]  # any object with write()
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if fsync:
                _fsutil.fsync_dir(os.path.dirname(local))
        else:
            with writer_of(fs).open_output_stream(path) as out:
                w = _CrcWriter(out)
                torch.save(checkpoint, w)  # type: ignore[arg-type]  # any object with write()
        return [ManifestEntry(STATE_FILE, w.size, f"{w.crc:08x}")]

    def write(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
        return _retry.call(lambda: write_once(fs, directory), policy=retry, store=fs,
                           what=f"write {directory}/{STATE_FILE}")

    return write


def _to_float(value: Any) -> float | None:
    """A Python float for a number or one-element tensor, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        try:
            return float(value.item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _checkpoint_metrics(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``epoch``, ``step`` (global step) and each ``ModelCheckpoint``'s monitored
    value (its ``current_score``) from Lightning's checkpoint dict."""
    metrics: dict[str, Any] = {}
    for key, out in (("epoch", "epoch"), ("global_step", "step")):
        value = checkpoint.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            metrics[out] = value
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, Mapping):
        for state in callbacks.values():
            if not isinstance(state, Mapping):
                continue
            monitor = state.get("monitor")
            score = _to_float(state.get("current_score"))
            if isinstance(monitor, str) and score is not None and math.isfinite(score):
                metrics[monitor] = score
    return metrics


def _checkpoint_monitor(checkpoint: Mapping[str, Any], dirpath: str) -> dict[str, str]:
    """``{"monitor": ..., "mode": ...}`` of the ``ModelCheckpoint`` saving into
    ``dirpath`` (the directory as Lightning names it), else of the only one
    that monitors something; ``{}`` when neither says. What ``checkpoint-store
    ls`` shows as the score of a directory without a retention state."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return {}
    found = []
    for key, state in callbacks.items():
        if isinstance(state, Mapping) and isinstance(state.get("monitor"), str):
            found.append((key, state))
    mine = [ks for ks in found if str(ks[1].get("dirpath", "")).rstrip("/") == dirpath.rstrip("/")]
    chosen = mine or (found if len(found) == 1 else [])
    if len(chosen) != 1:
        return {}
    key, state = chosen[0]
    out = {"monitor": state["monitor"]}
    mode = _mode_of_state_key(key)
    if mode is not None:
        out["mode"] = mode
    return out


def _mode_of_state_key(key: Any) -> str | None:
    """The ``mode`` in a ``ModelCheckpoint`` state key
    (``"ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', ...}"``): its
    state holds no mode of its own."""
    text = str(key)
    try:
        kwargs = ast.literal_eval(text[text.index("{"):])
    except (ValueError, SyntaxError):
        return None
    mode = kwargs.get("mode") if isinstance(kwargs, dict) else None
    return mode if mode in ("min", "max") else None


def state_file(state: str | bytes) -> str | io.BytesIO:
    """A :func:`verified` state as ``torch.load`` and Lightning's loaders take
    it: the local file's path, or the bytes as an in-memory binary file."""
    return state if isinstance(state, str) else io.BytesIO(state)


def verified_state(backend: Backend, fs_path: str, *, retry: RetryPolicy | None = None,
                   keep: bool = True) -> str | bytes:
    """:func:`verified`'s state alone."""
    return verified(backend, fs_path, retry=retry, keep=keep)[0]


def verified(backend: Backend, fs_path: str, *, retry: RetryPolicy | None = None,
             keep: bool = True) -> tuple[str | bytes, Mapping[str, Any] | None]:
    """The state of a committed checkpoint directory (every file checked
    against its manifest) or of a plain legacy ``.ckpt`` file (unchecked).
    ``fs_path`` is a Lightning path: one a re-save replaced is followed to
    the directory holding its checkpoint (:func:`._lightning_replace.current_dir`).

    Returns:
        ``(state, internal metadata)``: the state is, on the local disk, the
        state file's OS path (checked by one streaming read; ``torch.load``
        reads it again, from the page cache), elsewhere its bytes, checked as
        they arrived (``b""`` unless ``keep``); the metadata is None for a
        legacy file.

    Raises:
        CheckpointNotFoundError: nothing at the path, or a directory that is not
            a committed checkpoint (an interrupted save).
        CheckpointCorruptError: a file is missing or does not match the manifest
            (:func:`checkpoint_store._util.inspect.check_entry` says which and how).
    """
    fs = backend.filesystem
    # A path replaced by a re-save names its checkpoint by a pointer.
    fs_path = current_dir(backend, fs_path, retry)
    uri = backend.uri_for(fs_path)
    kind = _fsutil.info(fs, fs_path, retry=retry).type
    if kind == pafs.FileType.NotFound:
        raise CheckpointNotFoundError(f"checkpoint {uri} does not exist")
    if kind == pafs.FileType.File:
        local = _fsutil.local_path(fs, fs_path)
        if local is not None:
            return local, None
        return read_with_crc(fs, fs_path, keep=keep, retry=retry)[2], None
    insp = inspect_checkpoint(fs, fs_path, retry=retry)
    if insp.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {uri} is corrupt: {insp.reason}",
                                     path=fs_path, file=insp.file)
    if insp.state != "committed":
        raise CheckpointNotFoundError(
            f"{uri} is not a committed checkpoint (no commit marker): a save that did not "
            "finish. Resume from another one (checkpoint_store.integrations.lightning."
            "resume_path finds the newest complete one)"
        )
    assert insp.meta is not None
    manifest = insp.meta["manifest"]
    state_file = (insp.meta.get("lightning") or {}).get("state_file", STATE_FILE)
    entry = next((e for e in manifest if e["path"] == state_file), None)
    if entry is None:
        raise CheckpointCorruptError(f"checkpoint {uri} has no {state_file} in its manifest",
                                     path=fs_path, file=state_file)
    others = [e for e in manifest if e is not entry]
    plain = [e for e in others if not is_chunked(e)]
    if plain:
        verify_files(fs, fs_path, plain, retry=retry)
    for e in others:
        if is_chunked(e):  # kept as chunks (dedup): read and checked through them
            ChunkedFile(fs, fs_path, insp.meta, e, retry=retry).verify()
    if is_chunked(entry):
        return ChunkedFile(fs, fs_path, insp.meta, entry, retry=retry).read_all(), insp.meta
    local = _fsutil.local_path(fs, posixpath.join(fs_path, state_file))
    data = read_checked(fs, fs_path, entry, keep=keep and local is None, retry=retry)
    return (local if local is not None else data), insp.meta
