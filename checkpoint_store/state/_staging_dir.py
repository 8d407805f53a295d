"""Where local staged copies go: one directory per machine, chosen by environment.

Owns :data:`ENV_STAGING_DIR`, :func:`staging_root`, :func:`scratch_dir` and
:func:`sweep_staging_root`. Every writer that stages files on the local disk
before a background upload uses it: the session's staged copies and state
scratch directories, Lightning's bounded snapshots, and downloads into a new
temporary directory. It sits here, below ``session`` and ``integrations``,
so that both import it without reaching into each other's private modules.

Each scratch directory's name carries its maker's
:func:`~checkpoint_store._util.liveness.writer_tag`
(:func:`~checkpoint_store._format.layout.scratch_dir_prefix`), so that what a
killed process left (a partial state file per preemption) is removed by the
next session or save on the machine (:func:`sweep_staging_root`), never a
directory of a process still running.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

from checkpoint_store._format.layout import (
    STAGING_ROOT_NAME,
    parse_scratch_dir_owner,
    scratch_dir_prefix,
)
from checkpoint_store._util.liveness import writer_tag, writer_tag_alive

__all__ = ["ENV_STAGING_DIR", "scratch_dir", "staging_root", "sweep_staging_root"]

logger = logging.getLogger(__name__)

#: Where staged copies go unless ``CHECKPOINT_STORE_STAGING_DIR`` says otherwise.
ENV_STAGING_DIR = "CHECKPOINT_STORE_STAGING_DIR"

# Staging roots this process swept at their first use (the later sweeps are the
# session starts' and the Lightning plugin's).
_swept: set[str] = set()
_swept_lock = threading.Lock()


def staging_root() -> str:
    """The directory staged checkpoints go to (created on demand; swept of
    dead processes' scratch directories at its first use in this process).

    Called by whichever thread stages a copy (the training thread in
    ``report()``, Lightning's ``save_checkpoint``); safe from any thread.
    """
    root = os.environ.get(ENV_STAGING_DIR) or os.path.join(
        tempfile.gettempdir(), STAGING_ROOT_NAME
    )
    os.makedirs(root, exist_ok=True)
    with _swept_lock:
        first = root not in _swept
        _swept.add(root)
    if first:
        sweep_staging_root(root)
    return root


def scratch_dir(kind: str, root: str | None = None) -> str:
    """A new scratch directory ``<root>/<kind><writer tag>-<random>`` (``root``:
    default :func:`staging_root`); ``kind`` is a layout prefix (``stage-``,
    ``state-``, ``lightning-``, ``download-``). The caller removes it; after a
    kill, :func:`sweep_staging_root` does."""
    return tempfile.mkdtemp(prefix=scratch_dir_prefix(kind, writer_tag()),
                            dir=root or staging_root())


def sweep_staging_root(root: str | None = None) -> list[str]:
    """Remove the scratch directories in ``root`` (default: :func:`staging_root`)
    whose maker is dead. Never one of a live process, nor a name without an
    owner (made by an older version: left alone). Never raises (logged).

    Costs one listing of ``root`` and one ``/proc`` read per scratch directory.

    Returns:
        The names removed, sorted.
    """
    try:
        root = root or staging_root()
        names = os.listdir(root)
    except OSError as exc:
        logger.debug("cannot list the staging root %s: %s", root, exc)
        return []
    removed = []
    for name in sorted(names):
        owner = parse_scratch_dir_owner(name)
        if owner is None or writer_tag_alive(owner) is not False:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if not os.path.lexists(os.path.join(root, name)):
            removed.append(name)
    if removed:
        logger.info("removed %d scratch directories of dead processes from %s: %s",
                    len(removed), root, ", ".join(removed))
    return removed
