"""Selecting parts of a saved state: flattened keys, names and globs (``keys=``).

The skeleton (``state.json``'s ``tree``) is walked by flattened key
(``"model/layer1.weight"``); a pattern names a node exactly, else globs with
:func:`fnmatch.fnmatchcase` (``*`` also crosses ``/``); a container's key
selects its whole subtree.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from checkpoint_store.errors import InvalidConfigError, StateKeyError
from checkpoint_store.state._tree import escape_key, join_key


def _nodes(skeleton: Any) -> dict[str, Any]:
    """Every node of a skeleton (containers and leaves) by flattened key."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any, bool]] = [("", skeleton, True)]
    while stack:
        key, node, root = stack.pop()
        out[key] = node
        stack.extend(_children(key, node, root))
    return out


def _children(key: str, node: Any, root: bool) -> list[tuple[str, Any, bool]]:
    if "dict" in node:
        return [(join_key(key, escape_key(k), root=root), v, False) for k, v in node["dict"]]
    for kind in ("list", "tuple"):
        if kind in node:
            return [(join_key(key, str(i), root=root), v, False)
                    for i, v in enumerate(node[kind])]
    return []


def _is_container(node: Any) -> bool:
    return "dict" in node or "list" in node or "tuple" in node


def _patterns(keys: str | Iterable[str] | None) -> list[str] | None:
    if keys is None:
        return None
    if isinstance(keys, (bytes, bytearray)) or not isinstance(keys, (str, Iterable)):
        raise InvalidConfigError(
            f"keys must be a string or a list of strings (names or globs), got "
            f"{type(keys).__name__} {keys!r}")
    pats = [keys] if isinstance(keys, str) else list(keys)
    for p in pats:
        if not isinstance(p, str):
            raise InvalidConfigError(f"keys must be strings (names or globs), got {p!r}")
    return pats


def _select(skeleton: Any, nodes: Mapping[str, Any], pats: list[str]) -> Any:
    """The skeleton pruned to the nodes the patterns name (a whole subtree for
    a container), keeping the path down to them. Dicts keep only what is
    selected; a list or tuple keeps its length, unselected positions None."""
    matched: set[str] = set()
    for p in pats:
        hits = {p} if p in nodes else set()
        if not hits and any(c in p for c in "*?["):
            hits = {k for k in nodes if fnmatch.fnmatchcase(k, p)}
        if not hits:
            close = difflib.get_close_matches(p, [k for k in nodes if k], n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise StateKeyError(
                f"the saved state holds no key matching {p!r}{hint} (keys are flattened "
                "paths such as 'model/layer1.weight'; a container's key selects all of it; "
                "'*' and '?' glob)", key=p)
        matched |= hits

    def prune(key: str, node: Any, root: bool) -> Any:
        if key in matched:
            return node
        if not _is_container(node):
            return None
        kids = [(k, prune(k, n, False)) for k, n, _ in _children(key, node, root)]
        if "dict" in node:
            names = [name for name, _ in node["dict"]]
            kept = [[name, sub] for name, (_, sub) in zip(names, kids, strict=True)
                    if sub is not None]
            return {"dict": kept} if kept else None
        if all(sub is None for _, sub in kids):
            return None
        kind = "list" if "list" in node else "tuple"
        return {kind: [sub if sub is not None else {"value": None} for _, sub in kids]}

    out = prune("", skeleton, True)
    if out is None:
        return {"dict": []} if "dict" in skeleton else {
            ("list" if "list" in skeleton else "tuple"): []}
    return out


def _selected(key: str, pats: Sequence[str]) -> bool:
    """Whether ``key`` or a container above it matches one of ``pats``."""
    parts = key.split("/")
    for i in range(len(parts), 0, -1):
        k = "/".join(parts[:i])
        if any(k == p or (any(c in p for c in "*?[") and fnmatch.fnmatchcase(k, p))
               for p in pats):
            return True
    return any(p == "" for p in pats)


def _tensor_refs(skeleton: Any) -> list[str]:
    out = []
    for node in _nodes(skeleton).values():
        if "tensor" in node:
            out.append(node["tensor"])
    return out
