"""Loading into existing tensors (``into=``): the checks, then the copy.

:func:`_check_into` refuses a key the saved state lacks or a tensor of
another dtype or shape, or a target that cannot be written in place (a
read-only array, an expanded tensor), before anything is read or changed; :func:`_fill`
copies a checked tensor's bytes into its target (``copy_`` / ``copyto``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from checkpoint_store.errors import InvalidConfigError, StateKeyError, StateMismatchError
from checkpoint_store.state._placement import StateSlice, _is_dtensor, why_not_servable
from checkpoint_store.state._select import _is_container
from checkpoint_store.state._tree import DTYPES, escape_key, join_key


def _into_leaves(into: Any) -> dict[str, Any]:
    """``into``'s leaves by flattened key (containers: Mappings, lists, tuples)."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any, bool]] = [("", into, True)]
    while stack:
        key, value, root = stack.pop()
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise InvalidConfigError(
                        f"into: key {k!r} under {key or 'the root'!r} is not a string "
                        "(nor an int)")
                stack.append((join_key(key, escape_key(k), root=root), v, False))
        elif isinstance(value, (list, tuple)) and not _is_tensor(value):
            for i, v in enumerate(value):
                stack.append((join_key(key, str(i), root=root), v, False))
        else:
            out[key] = value
    return out


def _is_tensor(value: Any) -> bool:
    if isinstance(value, StateSlice):
        return True
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return bool((torch is not None and isinstance(value, torch.Tensor))
                or (np is not None and isinstance(value, np.ndarray)))


def _describe_target(value: Any) -> str:
    if isinstance(value, StateSlice):
        return f"a slice at {value.offset} of {_describe_target(value.tensor)}"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return f"torch {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return f"numpy {value.dtype} {list(value.shape)}"
    return type(value).__name__


def _target_dtype(value: Any) -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
    else:
        name = value.dtype.name
    return next((k for k, (_, n, t) in DTYPES.items()
                 if (n == name if not (torch is not None and isinstance(value, torch.Tensor))
                     else t == name)), None)


def _check_into(into: Any, nodes: Mapping[str, Any], tensors: Mapping[str, Any]
                ) -> dict[str, Any]:
    """``{key: target tensor}`` for every tensor of ``into``; refuses before any change."""
    leaves = _into_leaves(into)
    targets: dict[str, Any] = {}
    for key, value in leaves.items():
        node = nodes.get(key)
        if node is None:
            raise StateKeyError(f"into: {key!r} is not in the saved state", key=key)
        saved_is_tensor = "tensor" in node
        if saved_is_tensor != _is_tensor(value) or _is_container(node):
            e = tensors.get(node.get("tensor", ""), {})
            saved = (f"{e.get('dtype')} {e.get('shape')}" if saved_is_tensor
                     else "a subtree" if _is_container(node) else "a JSON value")
            raise StateMismatchError(
                f"into: {key!r} holds {_describe_target(value)}; the saved state holds "
                f"{saved} there", key=key, expected=saved, found=_describe_target(value))
        if not saved_is_tensor:
            continue
        e = tensors[node["tensor"]]
        expected = f"{e['dtype']} {e['shape']}"
        boxed = isinstance(value, StateSlice) or _is_dtensor(value)
        if boxed:
            why = why_not_servable(value, e["shape"])
            if why:
                raise StateMismatchError(
                    f"into: {key!r} cannot be loaded from the saved tensor {expected}: {why}",
                    key=key, expected=expected, found=_describe_target(value))
        tensor = value.tensor if isinstance(value, StateSlice) else value
        dtype = _target_dtype(tensor)
        if dtype != e["dtype"] or (not isinstance(value, StateSlice)
                                   and list(value.shape) != e["shape"]):
            raise StateMismatchError(
                f"into: {key!r} is {_describe_target(value)}; the saved tensor is {expected} "
                "(no conversion: give a tensor of that dtype and shape, or load without "
                "into= and convert)", key=key, expected=expected, found=_describe_target(value))
        unwritable = _why_unwritable(tensor)
        if unwritable:
            raise StateMismatchError(
                f"into: {key!r} is {_describe_target(value)} that cannot be written in place "
                f"({unwritable}); give a writable tensor of its own memory (.clone() it, or "
                "for numpy .copy()), or load without into=", key=key, expected="a writable "
                f"tensor {expected}", found=f"{_describe_target(value)}, {unwritable}")
        targets[key] = value
    return targets


def _why_unwritable(value: Any) -> str | None:
    """Why ``copy_``/``copyto`` into ``value`` would fail half-way through a
    load, or None: a read-only numpy array, a tensor whose elements share
    memory (``expand``, a stride of 0)."""
    if _is_dtensor(value):  # its local shard is what a load writes
        value = value.to_local()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() > 1 and any(st == 0 and n > 1
                                     for st, n in zip(value.stride(), value.shape, strict=True)):
            return "several of its elements share one memory location, as expand() makes"
        overlap = getattr(torch, "_debug_has_internal_overlap", None)
        if overlap is not None and overlap(value) == 1:
            return "several of its elements share one memory location"
        return None
    if not value.flags.writeable:
        return "a read-only array"
    return None


def _fill(target: Any, source: Any) -> None:
    if isinstance(target, StateSlice):
        target = target.tensor
    if _is_dtensor(target):  # ``source`` is its local shard's box, read as such
        target = target.to_local()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        if not isinstance(source, torch.Tensor):
            source = torch.from_numpy(source)
        with torch.no_grad():
            target.copy_(source)
        return
    np = sys.modules["numpy"]
    if torch is not None and isinstance(source, torch.Tensor):
        source = source.numpy()
    np.copyto(target, source)
