"""Moving checkpoint files between filesystems (the public face).

The work lives in :mod:`checkpoint_store._transfer.trees`: :func:`copy_tree`
(upload, fed by :func:`source_files`) and :func:`download_tree` (download,
verified against the manifest). This module keeps the documented import path.
"""

from __future__ import annotations

from checkpoint_store._transfer.trees import copy_tree as copy_tree
from checkpoint_store._transfer.trees import download_tree as download_tree
from checkpoint_store._transfer.trees import source_files as source_files

__all__ = ["copy_tree", "download_tree", "source_files"]
