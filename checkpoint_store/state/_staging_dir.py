"""Where local staged copies go: one directory per machine, chosen by environment.

Owns :data:`ENV_STAGING_DIR` and :func:`staging_root`. Every writer that
stages files on the local disk before a background upload uses it: the
session's staged copies and state scratch directories, and Lightning's
bounded snapshots. It sits here, below ``session`` and ``integrations``,
so that both import it without reaching into each other's private modules.
"""

from __future__ import annotations

import os
import tempfile

from checkpoint_store._format.layout import STAGING_ROOT_NAME

#: Where staged copies go unless ``CHECKPOINT_STORE_STAGING_DIR`` says otherwise.
ENV_STAGING_DIR = "CHECKPOINT_STORE_STAGING_DIR"


def staging_root() -> str:
    """The directory staged checkpoints go to (created on demand).

    Called by whichever thread stages a copy (the training thread in
    ``report()``, Lightning's ``save_checkpoint``); safe from any thread.
    """
    root = os.environ.get(ENV_STAGING_DIR) or os.path.join(
        tempfile.gettempdir(), STAGING_ROOT_NAME
    )
    os.makedirs(root, exist_ok=True)
    return root
