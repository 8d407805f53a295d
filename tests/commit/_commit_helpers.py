"""Helpers shared by the commit tests (imported as a top-level module by pytest)."""

from __future__ import annotations

import os

from checkpoint_store._format.layout import is_internal_name


def make_source(path, seed: int, files: int = 3, size: int = 4096) -> str:
    """A local checkpoint directory whose bytes depend on ``seed``."""
    os.makedirs(path, exist_ok=True)
    for i in range(files):
        sub = os.path.join(path, "shards") if i % 2 else path
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"part{i}.bin"), "wb") as f:
            f.write(bytes((seed * 31 + i * 7 + j) % 251 for j in range(size)))
    return str(path)


def read_tree(fs, root: str) -> dict[str, bytes]:
    """Every user file under ``root`` -> bytes (our ``.cs_*`` and metadata files excluded)."""
    from checkpoint_store._format.layout import is_internal_file
    from checkpoint_store._util import fs as _fsutil

    out = {}
    for rel, _ in _fsutil.walk_files(fs, root):
        if not is_internal_file(rel) and rel != ".user_metadata.json":
            out[rel] = _fsutil.read_bytes(fs, root.rstrip("/") + "/" + rel)
    return out


def local_tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, path).replace(os.sep, "/")
            if not is_internal_name(n) and n not in (".internal_metadata.json",
                                                       ".user_metadata.json"):
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out
