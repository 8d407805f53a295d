"""Claims: how the writers of one directory take turns where nothing renames atomically.

A claim is a small object ``.cs_claim-<ns>-<writer>``
(:func:`~checkpoint_store._format.layout.claim_name`) that a writer PUTs into the
directory it is about to fill. It serves two readers:

* the other writers of that directory (:func:`take_turn`): each PUTs its
  claim, then lists the directory, and goes on only if its claim is the only
  live one. With read-after-write consistent listings (S3, GCS, Azure,
  memory) two writers can never both see themselves alone: whoever lists
  second sees the other's claim;
* cleanup (:mod:`checkpoint_store._commit.leftovers`): a directory without a commit
  marker but with a claim is ours, left by a writer that died or is still
  writing.

A claim older than :data:`CLAIM_STALE_S` is a dead writer's and is ignored.
Its age is read on the storage's clock where the store keeps modification
times (:mod:`checkpoint_store._util.clock`). Used by
:class:`~checkpoint_store._commit.protocols.MarkerLastCommit` and by writers that fill
a directory in place (:meth:`~checkpoint_store._commit.protocols.CommitProtocol.claim_in_place`).
"""

from __future__ import annotations

import posixpath
import random
import time
from collections.abc import Mapping

import pyarrow.fs as pafs

from checkpoint_store._format.layout import INTERNAL_METADATA, claim_name, parse_claim_name
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import CheckpointConflictError

__all__ = ["CLAIM_STALE_S", "claim_age", "is_claim", "own_claims", "put_claim", "take_turn"]

#: A claim older than this (seconds) is a dead writer's: ignored by other writers.
CLAIM_STALE_S = 3600.0


def is_claim(name: str) -> bool:
    """Whether the file name ``name`` (no directory part) is a claim."""
    return parse_claim_name(name) is not None


def put_claim(dest: Backend, dest_dir: str, writer_id: str,
              retry: RetryPolicy | None = None) -> str:
    """Write a fresh claim of ``writer_id`` into ``dest_dir``; returns its name.

    Never empty: some S3-compatible stores reject zero-byte objects."""
    mine = claim_name(time.time_ns(), writer_id)
    _fsutil.write_bytes(dest.filesystem, posixpath.join(dest_dir, mine), writer_id.encode(),
                        dest.capabilities, fsync=False, retry=retry)
    return mine


def take_turn(dest: Backend, dest_dir: str, writer_id: str, *, timeout: float,
              retry: RetryPolicy | None = None) -> tuple[str, dict[str, pafs.FileInfo]]:
    """Claim ``dest_dir`` and wait until ours is the only live claim there,
    or until the directory holds a commit marker.

    A writer that is not alone withdraws its claim, backs off with jitter
    (10 ms doubling to 500 ms) and claims again. Costs one PUT and one
    listing per try.

    Returns:
        ``(our claim's name, the listing (relative path -> FileInfo) taken
        after it)``. The listing holds ``.internal_metadata.json`` when the
        directory is committed: the caller withdraws the claim and refuses.

    Raises:
        CheckpointConflictError: another writer's live claim outlasted
            ``timeout`` seconds; ours is withdrawn.
    """
    deadline = time.monotonic() + timeout
    rng, delay = random.Random(), 0.01
    while True:
        # The claim goes first: a crash from here on leaves a directory that
        # cleanup recognises as ours.
        mine = put_claim(dest, dest_dir, writer_id, retry)
        listed = {_fsutil.relative(dest_dir, fi.path): fi
                  for fi in _fsutil.list_tree(dest.filesystem, dest_dir, retry=retry)
                  if fi.type == pafs.FileType.File}
        others = [c for c in listed if "/" not in c and is_claim(c)
                  and not c.endswith(f"-{writer_id}")
                  and claim_age(listed, c, mine) < CLAIM_STALE_S]
        if INTERNAL_METADATA in listed or not others:
            return mine, listed
        _fsutil.delete_file(dest.filesystem, posixpath.join(dest_dir, mine), retry=retry)
        if time.monotonic() > deadline:
            raise CheckpointConflictError(
                f"another writer ({others[0]}) has been committing "
                f"{dest.uri_for(dest_dir)} for more than {timeout:.0f}s; retry "
                "later or commit another index"
            )
        time.sleep(delay * (0.5 + rng.random()))
        delay = min(delay * 2, 0.5)


def own_claims(listed: Mapping[str, pafs.FileInfo], mine: str, writer_id: str) -> list[str]:
    """The claims of ``listed`` that are ours: ``mine`` and any an earlier
    attempt of ``writer_id`` left."""
    return [c for c in listed if "/" not in c and is_claim(c)
            and (c == mine or c.endswith(f"-{writer_id}"))]


def claim_age(listed: Mapping[str, pafs.FileInfo], claim: str, mine: str) -> float:
    """Seconds since ``claim`` was written, on the storage's clock: our own claim,
    written a moment ago, stamps the store's "now". Only a store without
    modification times falls back to the time in the claim's name against
    the local clock (:mod:`checkpoint_store._util.clock`)."""
    theirs = _clock.mtime_of(listed[claim])
    now = _clock.mtime_of(listed[mine]) if mine in listed else None
    if theirs is not None and now is not None:
        return now - theirs
    parsed = parse_claim_name(claim)
    return _clock.local_time() - (parsed[0] if parsed is not None else 0.0)
