"""What a report saves: the source of its checkpoint's files.

- :class:`DirectorySource`: a directory the user reported (``checkpoint=``),
  read where it is by the commit.
- :class:`StagedCopySource`: a private copy of it, for a commit in the
  background (``upload_mode="async"``; ``staging=``).
- :class:`InPlaceSource`: the files are already in ``checkpoint_<index>``
  (``next_checkpoint_dir()``; also a rank passing ``checkpoint=None`` there).
- :class:`StateSource`: a state tree copied into shared-memory staging
  (``report(state=...)``), written into files by the persist process.
- :class:`EmptyPart`: a rank with no files of its own for a checkpoint other
  ranks save.

A source is opened by the reporting thread under the report lock (the index
is known then), read by whichever thread runs the commit, and released when
that commit ends, whatever happens.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Union

from checkpoint_store._format.layout import (
    EMPTY_PART_PREFIX,
    INTERNAL_METADATA,
    STATE_STAGING_PREFIX,
    checkpoint_dir_name,
)
from checkpoint_store._transfer.trees import refuse_chunked_source
from checkpoint_store._util.retry import typed_permanent
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.session._uploads import Staged, stage
from checkpoint_store.state import scratch_dir, staging_root

if TYPE_CHECKING:
    from checkpoint_store.state._staging import Stager
    from checkpoint_store.state._tree import FlatState


class StagedWrite(Protocol):
    """A state in staging, written out by the persist process
    (:class:`~checkpoint_store.state._staging.StagedState`)."""

    nbytes: int

    def write_to(self, directory: str | None = None, *, record: bool = True
                 ) -> dict[str, Any]: ...

    def release(self) -> None: ...


#: What a state report planned before anything waits: the flat state, or (in
#: tests, ``ReportPipeline.report_source``) a staged state given as it is.
Planned = Union["FlatState", StagedWrite]

__all__ = ["DirectorySource", "EmptyPart", "InPlaceSource", "Planned", "Source",
           "StagedCopySource", "StagedWrite", "StateSource", "StateStaging"]

logger = logging.getLogger(__name__)


class Source:
    """The files of one report's checkpoint.

    Attributes:
        in_place: the files are in ``checkpoint_<index>`` already (nothing to copy).
        state: a staged state the commit writes out (:class:`StateSource`).
    """

    in_place = False
    state = False

    def files(self) -> Checkpoint:
        """The files to commit (on the thread that commits)."""
        raise NotImplementedError

    def release(self) -> None:
        """The commit ended (committed or not)."""

    def take_back(self) -> None:
        """The commit will not run (its report raised before it was queued, or
        took it back): undo what opening the source did."""
        self.release()


class DirectorySource(Source):
    """Raises CheckpointNotFoundError when the directory is gone: refused
    before anything is written under the index."""

    def __init__(self, checkpoint: Checkpoint, check: bool = True):
        if check:  # several ranks: the rank's upload names the rank and the path
            require_directory(checkpoint)
        self._checkpoint = checkpoint

    def files(self) -> Checkpoint:
        return self._checkpoint


def require_directory(checkpoint: Checkpoint) -> None:
    """One look at a local ``checkpoint``'s directory before a report takes its
    index (a checkpoint on storage is listed by the commit itself).

    Raises:
        CheckpointNotFoundError: it is not an existing directory.
    """
    from checkpoint_store.errors import CheckpointNotFoundError

    if checkpoint.is_local and not os.path.isdir(checkpoint.path):
        raise CheckpointNotFoundError(
            f"checkpoint directory {checkpoint.path!r} does not exist (deleted before "
            "report()?); nothing was written for this report")


class StagedCopySource(Source):
    """A private copy of a local ``checkpoint`` (``staging``: ``"copy"``,
    ``"hardlink"`` or ``"move"``); a checkpoint already on storage is read
    where it is (nothing the loop could delete under us)."""

    def __init__(self, checkpoint: Checkpoint, staging: str):
        self._checkpoint = checkpoint
        if checkpoint.is_local:
            if os.path.isfile(os.path.join(checkpoint.path, INTERNAL_METADATA)):
                # Refused now, not by the background commit of the staged copy.
                refuse_chunked_source(checkpoint.filesystem, checkpoint.path)
            # The last step: a signal's exception after it finds the source
            # opened (the report takes it back).
            self._staged = stage(checkpoint.path, staging)
        else:
            self._staged = Staged(checkpoint.path, owned=False)

    def files(self) -> Checkpoint:
        if not self._staged.owned:
            return self._checkpoint
        return Checkpoint.from_directory(self._staged.path)

    def release(self) -> None:
        self._staged.cleanup()

    def take_back(self) -> None:
        """With ``staging="move"`` the files go back into the reported
        directory (the report raised: the caller still owns them)."""
        self._staged.take_back()


class InPlaceSource(Source):
    in_place = True

    def files(self) -> Checkpoint:
        raise AssertionError("an in-place checkpoint has no files to copy")


class EmptyPart(Source):
    """A rank without files of its own for this checkpoint (``checkpoint=None``
    under a process group): an empty directory."""

    _path: str | None = None

    def files(self) -> Checkpoint:
        if EmptyPart._path is None or not os.path.isdir(EmptyPart._path):
            EmptyPart._path = tempfile.mkdtemp(prefix=EMPTY_PART_PREFIX)
        return Checkpoint.from_directory(EmptyPart._path)


class StateSource(Source):
    """A state staged into ``directory`` (``in_place``: that is
    ``checkpoint_<index>`` itself, already reserved; else a local scratch
    directory of this source's own, removed on release).

    ``staged`` is a :class:`~checkpoint_store.state._staging.StagedState` (or
    anything with its ``write_to``/``release``/``nbytes``)."""

    state = True

    def __init__(self, staged: StagedWrite, directory: str, in_place: bool,
                 sharding: dict[str, Any] | None = None):
        self.staged = staged
        self.directory = directory
        self.in_place = in_place
        self.sharding = sharding
        #: Several ranks: this rank's part of the state, for rank 0's merge
        #: (:func:`checkpoint_store.state._shards.finish_part`), once written.
        self.part: dict[str, Any] | None = None

    def write(self) -> dict[str, Any]:
        """Wait for the persist process; the tensor index (``"tensors"``).
        A rank's part of a sharded state keeps its index in :attr:`part`
        (and its files without a ``state.json``) and returns ``{}``."""
        tensors: dict[str, Any] = self.staged.write_to(record=self.in_place)
        if self.sharding is None:
            return tensors
        from checkpoint_store.state._shards import finish_part

        self.part = finish_part(self.directory, tensors, self.sharding)
        return {}

    def files(self) -> Checkpoint:
        return Checkpoint.from_directory(self.directory)

    def release(self) -> None:
        release = getattr(self.staged, "release", None)
        if release is not None:
            release()
        if not self.in_place:
            shutil.rmtree(self.directory, ignore_errors=True)


class StateStaging:
    """The session's shared-memory staging (:class:`~checkpoint_store.state._staging.Stager`,
    made on the first state report, with its persist process) and how a state
    is staged for one report.

    Args:
        budget: ``UploadConfig.staging_budget`` (bytes; None: the default).
    """

    def __init__(self, budget: int | None):
        self._budget = budget
        self._stager: Stager | None = None

    @property
    def stager(self) -> Stager:
        from checkpoint_store.state._staging import Stager

        if self._stager is None:
            self._stager = Stager(self._budget)
        return self._stager

    def warm(self, prefault_bytes: Callable[[], int | None]) -> None:
        """On a background thread (returns at once; ``UploadConfig.warm_staging``):
        ``prefault_bytes()``, then, unless it is None, start the persist
        process and fault that many bytes of the area (-1: the whole budget)."""
        stager = self.stager

        def run() -> None:
            try:
                n = prefault_bytes()
            except Exception as exc:  # best effort: the first save warms
                logger.debug("not warming the staging: %s", exc)
                return
            if n is not None:
                stager.warm(stager.budget if n < 0 else n)

        threading.Thread(target=run, name="checkpoint-store-warm", daemon=True).start()

    def plan(self, state: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> Planned:
        """The state's flat plan; a leaf that cannot be stored is refused here,
        before anything waits or is written. With ``world_size > 1``, the
        plan of this rank's pieces (:func:`checkpoint_store.state._placement.localize`),
        written under this rank's own file names; ``.sharding`` says where
        each piece lies in the logical state.

        Raises:
            MetadataError, UnsupportedStateError: a key or leaf of ``state``.
        """
        import dataclasses

        from checkpoint_store.state._placement import local_whole, localize
        from checkpoint_store.state._shards import rank_stem
        from checkpoint_store.state._staging import plan_state

        if world_size == 1:  # DTensors on a one-rank mesh: their local tensors
            return plan_state(local_whole(state))
        local, sharding = localize(state, rank, world_size)
        flat = plan_state(local)
        flat.layout = dataclasses.replace(flat.layout, file_stem=rank_stem(rank))
        flat.sharding = sharding
        return flat

    def stage(self, plan: Planned, directory: str | None, index: int) -> StateSource:
        """Copy the planned state into staging, for the persist process to
        write into ``directory`` (None: a new scratch directory)."""
        from checkpoint_store.state._tree import FlatState

        assert isinstance(plan, FlatState), "a staged state is given to report_source only"
        in_place = directory is not None
        try:
            target = directory or scratch_dir(STATE_STAGING_PREFIX)
        except OSError as exc:
            typed = typed_permanent(exc, f"make a state's scratch directory under "
                                         f"{staging_root()}")
            if typed is exc:
                raise
            raise typed from exc
        try:
            staged = self.stager.stage(plan, target)
        except BaseException:
            if not in_place:
                shutil.rmtree(target, ignore_errors=True)
            raise
        logger.debug("staged %s into %s", checkpoint_dir_name(index), target)
        return StateSource(staged, target, in_place, getattr(plan, "sharding", None))

    def close(self) -> None:
        """Stop the persist process (after every background save finished)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()


def state_bytes(checkpoint: Checkpoint) -> int | None:
    """The tensor bytes of a state checkpoint (its internal metadata's tensor
    index), or None for a directory checkpoint: what a restart of a run that
    saves states expects to stage next (one read of the metadata)."""
    tensors = written_metadata(checkpoint).get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        return None
    from checkpoint_store.state._shards import stored_bytes

    return stored_bytes(tensors)
