"""Time for decisions that other machines share: the storage's clock, not ours.

Whether a lease has expired, whether a writer's claim is stale and whether
an uncommitted directory is old enough for ``gc`` are decided by processes
on different machines, whose clocks may disagree by hours (a VM resumed
from a snapshot, a node without NTP). Each such decision compares two
times taken by one clock: the storage's. The modification time the store
stamps on an object is its own; :func:`storage_now` reads it off a tiny
probe object written just now.

The remaining assumption (docs/retention.md): the store stamps modification
times from one clock that runs at the rate of ours. Where a store gives no
modification times (fsspec's memory filesystem, which lives in this process
anyway), the local clock decides.

:func:`local_time` is the one seam for the local clock: tests replace it to
simulate a machine whose clock is off, never the machine's clock itself.
"""

from __future__ import annotations

import posixpath
import time
import uuid

import pyarrow.fs as pafs

from checkpoint_store._format.layout import clock_probe_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Capabilities


def local_time() -> float:
    """This machine's clock (Unix seconds). The seam tests patch to skew it."""
    return time.time()


def mtime_of(info: pafs.FileInfo) -> float | None:
    """The modification time the store recorded for ``info`` (Unix seconds), or None."""
    return info.mtime.timestamp() if info.mtime is not None else None


def storage_now(
    fs: pafs.FileSystem, directory: str, caps: Capabilities, *,
    retry: RetryPolicy | None = None,
) -> float | None:
    """The store's current time (Unix seconds) as seen from ``directory``, or None.

    Writes ``<directory>/.cs_clock-<random>`` (a few bytes), reads its
    modification time and deletes it: three requests on an object store.
    Returns None when the store records no modification times.

    Raises:
        TransientBackendError, PermanentBackendError: storage failed.
    """
    probe = posixpath.join(directory, clock_probe_name(uuid.uuid4().hex[:12]))
    _fsutil.write_bytes(fs, probe, b"clock probe", caps, fsync=False, retry=retry)
    try:
        return mtime_of(_fsutil.info(fs, probe, retry=retry))
    finally:
        _fsutil.delete_file(fs, probe, retry=retry)


def age_on_storage(
    fs: pafs.FileSystem, directory: str, caps: Capabilities, stamps: dict[str, float | None],
    *, retry: RetryPolicy | None = None,
) -> dict[str, float | None]:
    """Ages in seconds of the modification times ``stamps`` (name -> Unix seconds
    as the store recorded them), measured on the store's clock.

    Falls back to the local clock when the store gives no time. A name whose
    stamp is None gets None (age unknown).
    """
    if all(v is None for v in stamps.values()):
        return dict.fromkeys(stamps)
    now = storage_now(fs, directory, caps, retry=retry)
    if now is None:
        now = local_time()
    return {k: (None if v is None else now - v) for k, v in stamps.items()}
