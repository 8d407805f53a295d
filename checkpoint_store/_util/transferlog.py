"""INFO lines for long transfers: what, how many bytes, how long, how fast.

A transfer that takes at least :data:`LONG_S` seconds (a state's load, a
download, a checkpoint's commit, a wait for background saves) logs one line
at INFO on its module's logger, so a run that logs at INFO says where its
time went; quick ones stay silent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

#: Seconds from which a transfer is logged at INFO.
LONG_S = 1.0


def fmt_bytes(n: float) -> str:
    """``n`` bytes as B, KiB, MiB, GiB or TiB with one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB" and abs(n) < 1024 ** 2:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def log_if_long(logger: logging.Logger, what: str,
                nbytes: int | Callable[[], int | None] | None, seconds: float) -> None:
    """Log ``what`` took ``seconds`` for ``nbytes`` (None: unknown; a callable:
    asked only when the line is logged) at INFO, with the rate, when
    ``seconds`` >= :data:`LONG_S`."""
    if seconds < LONG_S or not logger.isEnabledFor(logging.INFO):
        return
    if callable(nbytes):
        try:
            nbytes = nbytes()
        except OSError:
            nbytes = None
    if nbytes is None:
        logger.info("%s: %.2f s", what, seconds)
        return
    logger.info("%s: %s in %.2f s (%s/s)", what, fmt_bytes(nbytes), seconds,
                fmt_bytes(nbytes / seconds))


def manifest_bytes(meta: Mapping[str, Any] | None) -> int | None:
    """The bytes a checkpoint's manifest lists (None without one)."""
    manifest = (meta or {}).get("manifest")
    if not isinstance(manifest, list):
        return None
    return sum(int(e.get("size", 0)) for e in manifest if isinstance(e, Mapping))


def local_tree_bytes(path: str) -> int:
    """The bytes of the files under the local directory ``path``."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def tree_bytes(tree: Any) -> int:
    """The bytes of the tensors and arrays in a loaded state (``nbytes`` of each leaf)."""
    total = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        else:
            n = getattr(node, "nbytes", None)
            if isinstance(n, int):
                total += n
    return total


__all__ = ["LONG_S", "fmt_bytes", "local_tree_bytes", "log_if_long", "manifest_bytes",
           "tree_bytes"]
