"""A state tree, flattened: its tensors by flattened key, and a JSON skeleton.

A state is a tree of dicts (string or int keys), lists and tuples whose leaves are
torch tensors, numpy arrays (and numpy scalars) or JSON values (``None``,
bools, ints, floats, strings). :func:`flatten_state` walks it once and returns
a :class:`FlatState`: every tensor under its flattened key, and a
:class:`StateLayout` (the skeleton of containers and JSON leaves, and each
tensor's dtype, shape and framework) that is plain data, so it can be
pickled to a persist process without the tensors. :func:`build_tree` is the
inverse: skeleton plus loaded tensors back to the tree.

Flattened keys join the path's components with ``/``: a dict key as
written, a list or tuple position as its decimal index. Inside a dict key,
``~`` is written ``~0`` and ``/`` is written ``~1`` (RFC 6901, JSON
Pointer), so ``{"a/b": {"c": t}}`` flattens to ``a~1b/c`` and every key maps
back to exactly one path. The root's own key is ``""``.

numpy and torch are imported only when a tree holds their objects (a tree
of numpy arrays never imports torch).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store.errors import UnsupportedStateError
from checkpoint_store.state._sharing import find_sharing

__all__ = [
    "DTYPES",
    "FlatState",
    "StateLayout",
    "TensorSpec",
    "build_tree",
    "escape_key",
    "flatten_state",
    "join_key",
    "split_key",
    "unescape_key",
]

#: Deepest nesting of containers accepted (the JSON skeleton nests two levels
#: per container; Python's json decoder stops near 1,000).
MAX_DEPTH = 200

#: safetensors dtype name -> (bytes per element, numpy dtype name or None,
#: torch dtype attribute or None). Every dtype safetensors 0.4+ names with a
#: whole number of bytes per element. numpy has no bfloat16 nor float8: such
#: tensors come only from (and go back only to) torch.
DTYPES: dict[str, tuple[int, str | None, str | None]] = {
    "BOOL": (1, "bool", "bool"),
    "U8": (1, "uint8", "uint8"),
    "I8": (1, "int8", "int8"),
    "U16": (2, "uint16", "uint16"),
    "I16": (2, "int16", "int16"),
    "U32": (4, "uint32", "uint32"),
    "I32": (4, "int32", "int32"),
    "U64": (8, "uint64", "uint64"),
    "I64": (8, "int64", "int64"),
    "F16": (2, "float16", "float16"),
    "BF16": (2, None, "bfloat16"),
    "F32": (4, "float32", "float32"),
    "F64": (8, "float64", "float64"),
    "C64": (8, "complex64", "complex64"),
    "F8_E4M3": (1, None, "float8_e4m3fn"),
    "F8_E4M3FNUZ": (1, None, "float8_e4m3fnuz"),
    "F8_E5M2": (1, None, "float8_e5m2"),
    "F8_E5M2FNUZ": (1, None, "float8_e5m2fnuz"),
}

_BY_NUMPY = {np_name: name for name, (_, np_name, _t) in DTYPES.items() if np_name}
_BY_TORCH = {t_name: name for name, (_, _n, t_name) in DTYPES.items() if t_name}

FRAMEWORKS = ("torch", "numpy")


# -- keys ---------------------------------------------------------------------


def escape_key(key: str | int) -> str:
    """One dict key as a component of a flattened key: ``~`` -> ``~0``, ``/`` -> ``~1``;
    an int key (an optimizer's state) as its decimal digits."""
    if not isinstance(key, str):
        return str(key)
    return key.replace("~", "~0").replace("/", "~1")


def unescape_key(component: str) -> str:
    """The dict key a component of a flattened key stands for (inverse of :func:`escape_key`)."""
    return component.replace("~1", "/").replace("~0", "~")


def join_key(prefix: str, component: str, *, root: bool) -> str:
    """``prefix/component``; just ``component`` below the root."""
    return component if root else f"{prefix}/{component}"


def split_key(key: str) -> list[str]:
    """The components of a flattened key, unescaped (``"a~1b/c"`` -> ``["a/b", "c"]``)."""
    return [unescape_key(c) for c in key.split("/")]


# -- specs ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What a stored tensor is, without its bytes.

    Attributes:
        dtype: the safetensors dtype name (``"F32"``, ``"BF16"``; :data:`DTYPES`).
        shape: elements per dimension (``()`` for a 0-d tensor).
        framework: ``"torch"`` or ``"numpy"``: what :func:`load_state` returns it as.
        scalar: a numpy scalar (``np.float32(1)``), returned as one again.
    """

    dtype: str
    shape: tuple[int, ...]
    framework: str = "torch"
    scalar: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (elements x bytes per element)."""
        return math.prod(self.shape) * DTYPES[self.dtype][0]

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


@dataclass(frozen=True)
class StateLayout:
    """A flattened state without its tensor bytes: plain, picklable data.

    Attributes:
        skeleton: the tree with every container and JSON leaf, tensors as
            references (the ``tree`` of ``state.json``, docs/state.md).
        tensors: flattened key -> :class:`TensorSpec`, in tree order; the
            tensors whose bytes are stored (an alias is not among them).
        aliases: flattened key -> the key of the tensor it is the very same
            view of (tied weights): stored once, loaded as one tensor.
        file_stem: how its shard files are named (:func:`~checkpoint_store.state.shard_name`).
    """

    skeleton: Any
    tensors: dict[str, TensorSpec]
    aliases: dict[str, str] = field(default_factory=dict)
    #: The safetensors files' name stem (``tensors-00001-of-00002``); each
    #: rank of a sharded state has its own (``tensors-rank00003-...``).
    file_stem: str = "tensors"

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data to store (aliases counted once)."""
        return sum(s.nbytes for s in self.tensors.values())


@dataclass
class FlatState:
    """A state tree flattened by :func:`flatten_state`.

    Attributes:
        layout: the :class:`StateLayout` (skeleton, specs, aliases).
        values: flattened key -> the tensor object of the tree (torch tensor
            or numpy array), for the keys of ``layout.tensors``.
    """

    layout: StateLayout
    values: dict[str, Any]
    #: A rank's part of a sharded state: flattened key -> the piece's box
    #: (:func:`checkpoint_store.state._placement.localize`); None for one rank.
    sharding: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def tensor_bytes(self, key: str) -> memoryview:
        """The bytes of one tensor, C order, little-endian, as a flat byte view.

        No copy for a contiguous little-endian CPU tensor (a view of its
        memory: keep the tree alive while using it); a non-contiguous,
        big-endian or non-CPU one is copied first.
        """
        return tensor_bytes(self.values[key])

    def buffers(self) -> Iterator[tuple[str, memoryview]]:
        """``(key, bytes)`` of every stored tensor, in tree order (see :meth:`tensor_bytes`)."""
        for key in self.layout.tensors:
            yield key, self.tensor_bytes(key)


# -- flatten --------------------------------------------------------------------


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_numpy(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.ndarray, np.generic))


def _where(key: str) -> str:
    return repr(key) if key else "the root"


def _check_json_leaf(value: Any, key: str, what: str = "state value at") -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnsupportedStateError(
                f"{what} {_where(key)} holds {value[exc.start]!r} (a lone "
                "surrogate), which is not valid UTF-8; fix the string", key=key,
            ) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        limit = sys.get_int_max_str_digits()
        if limit and value.bit_length() > 3 * limit and abs(value) >= 10**limit:
            raise UnsupportedStateError(
                f"state value at {_where(key)} is an int of more than {limit} digits, "
                "which JSON cannot carry; store float(x), a string or a tensor", key=key,
            )


def _spec_of(value: Any, key: str, framework: str) -> TensorSpec:
    if framework == "torch":
        torch = sys.modules["torch"]
        if value.layout != torch.strided:
            raise UnsupportedStateError(
                f"tensor at {_where(key)} has layout {value.layout}; only dense (strided) "
                "tensors are stored: convert it with .to_dense()", key=key,
            )
        if value.device.type == "meta":
            raise UnsupportedStateError(
                f"tensor at {_where(key)} is on the meta device and has no data", key=key,
            )
        if value.is_quantized or getattr(value, "is_nested", False):
            raise UnsupportedStateError(
                f"tensor at {_where(key)} is quantized or nested; store its dense "
                "values (e.g. .dequantize())", key=key,
            )
        name = str(value.dtype).removeprefix("torch.")
        dtype = _BY_TORCH.get(name)
        if dtype is None:
            raise UnsupportedStateError(
                f"tensor at {_where(key)} has dtype {value.dtype}, which safetensors cannot "
                f"store (supported: {', '.join(sorted(_BY_TORCH))}); convert it with .to()",
                key=key,
            )
        return TensorSpec(dtype, tuple(int(n) for n in value.shape), "torch")
    np = sys.modules["numpy"]
    scalar = isinstance(value, np.generic)
    dt = value.dtype
    dtype = _BY_NUMPY.get(dt.name) if dt.kind in "biufc" or dt.name == "bool" else None
    if dtype is None:
        raise UnsupportedStateError(
            f"array at {_where(key)} has dtype {dt}, which safetensors cannot store "
            f"(supported: {', '.join(sorted(_BY_NUMPY))}); convert it with .astype()",
            key=key,
        )
    return TensorSpec(dtype, tuple(int(n) for n in value.shape), "numpy", scalar)


def flatten_state(tree: Any) -> FlatState:
    """Flatten a state tree (module docstring): its tensors and its layout.

    Two entries that are the very same view of memory (same address, dtype,
    shape and strides: tied weights, one tensor reachable twice) are one
    tensor: the first in tree order is stored, the later ones become
    ``layout.aliases`` and load as that same tensor object. Views of one
    storage that share no element (slices of one buffer, ``t[:, 0]`` and
    ``t[:, 1]``, ``t[::2]`` and ``t[1::2]``) are stored each on its own and
    load as separate tensors. Deciding it costs a sort by address; only
    tensors whose address ranges overlap are compared element by element
    (:mod:`checkpoint_store.state._sharing`). CPU memory only: a tensor on
    an accelerator is stored on its own.

    Args:
        tree: dicts (``str`` or ``int`` keys, as an optimizer's state has; any
            Mapping, returned as ``dict``), lists,
            tuples; leaves torch tensors (any dense dtype of
            :data:`DTYPES`; not on the meta device; a GPU tensor is copied
            to the CPU when its bytes are taken), numpy arrays and scalars of
            those dtypes, ``None``, bools, ints, floats (NaN and infinities
            kept), strings.

    Returns:
        A :class:`FlatState`. Nothing is copied: its values are the tree's
        own tensors (take a snapshot before mutating them).

    Raises:
        UnsupportedStateError: a dict key neither ``str`` nor ``int``, two
            keys of one dict flattening alike (``0`` and ``"0"``), a leaf of another
            type, an unsupported dtype or layout, a container holding itself,
            nesting deeper than :data:`MAX_DEPTH`, or two tensors that
            share an element of memory without being the same view
            (``.clone()`` one of them); ``.key`` names the entry.
    """
    tensors: dict[str, TensorSpec] = {}
    values: dict[str, Any] = {}
    on_path: set[int] = set()

    def tensor(value: Any, key: str, framework: str) -> dict[str, Any]:
        spec = _spec_of(value, key, framework)
        tensors[key] = spec
        values[key] = value
        return {"tensor": key}

    def walk(value: Any, key: str, depth: int) -> Any:
        root = depth == 0
        if _is_torch(value):
            return tensor(value, key, "torch")
        if _is_numpy(value):
            return tensor(value, key, "numpy")
        if value is None or isinstance(value, (bool, int, float, str)):
            _check_json_leaf(value, key)
            return {"value": value}
        if isinstance(value, (Mapping, list, tuple)):
            if depth >= MAX_DEPTH:
                raise UnsupportedStateError(
                    f"state at {_where(key)} is nested more than {MAX_DEPTH} levels deep",
                    key=key,
                )
            if id(value) in on_path:
                raise UnsupportedStateError(
                    f"state at {_where(key)} holds itself (a cycle); a state must be a tree",
                    key=key,
                )
            on_path.add(id(value))
            try:
                if isinstance(value, Mapping):
                    items = []
                    seen: dict[str, Any] = {}
                    for k, v in value.items():
                        if not isinstance(k, (str, int)) or isinstance(k, bool):
                            raise UnsupportedStateError(
                                f"state key {k!r} ({type(k).__name__}) under {_where(key)} "
                                "is not a string (nor an int); state dicts need string keys "
                                "(convert them, e.g. {str(k): v ...})", key=key,
                            )
                        _check_json_leaf(k, key, "state key under")
                        part = escape_key(k)
                        if part in seen:
                            raise UnsupportedStateError(
                                f"state keys {seen[part]!r} and {k!r} under {_where(key)} "
                                f"both flatten to {part!r}; rename one", key=key,
                            )
                        seen[part] = k
                        child = join_key(key, part, root=root)
                        items.append([k, walk(v, child, depth + 1)])
                    return {"dict": items}
                kind = "list" if isinstance(value, list) else "tuple"
                return {kind: [walk(v, join_key(key, str(i), root=root), depth + 1)
                               for i, v in enumerate(value)]}
            finally:
                on_path.discard(id(value))
        raise UnsupportedStateError(
            f"state value at {_where(key)} is a {type(value).__module__}."
            f"{type(value).__qualname__}; a state holds torch tensors, numpy arrays, "
            "dicts, lists, tuples and JSON values (None, bool, int, float, str). No "
            "pickle: convert it (e.g. to a tensor, or its fields to a dict)", key=key,
        )

    skeleton = walk(tree, "", 0)
    aliases = _find_aliases(tensors, values)
    return FlatState(StateLayout(skeleton, tensors, aliases), values)


def _find_aliases(tensors: dict[str, TensorSpec], values: dict[str, Any]) -> dict[str, str]:
    """The aliases of a flattened state (key -> the key stored for it), taken
    out of ``tensors`` and ``values``; refuse two tensors that share an
    element of memory without being the same view (:mod:`._sharing`).
    Tensors off the CPU are not compared: each is copied to the host on its
    own."""
    found = find_sharing((k, v) for k, v in values.items() if _on_cpu(v))
    if found.clash is not None:
        first, second, why = found.clash
        raise UnsupportedStateError(
            f"tensors {first!r} and {second!r} overlap in memory but are not the same "
            f"view ({why}: one is a slice, transpose or reshape of the other); the "
            "state format stores each tensor's own bytes and would not restore that "
            "sharing: store one of them .clone()d (numpy: .copy()). Views that share "
            "no element (t[:, 0] and t[:, 1]; t[::2] and t[1::2]) are stored as they are",
            key=second,
        )
    aliases: dict[str, str] = {}
    for first, *later in found.same:  # each group in tree order
        for key in later:
            aliases[key] = first
    # In tree order, as the skeleton lists them.
    aliases = {k: aliases[k] for k in tensors if k in aliases}
    for key in aliases:
        tensors.pop(key)
        values.pop(key)
    return aliases


def _on_cpu(value: Any) -> bool:
    return not _is_torch(value) or value.device.type == "cpu"


# -- bytes ----------------------------------------------------------------------


def tensor_bytes(value: Any) -> memoryview:
    """A tensor's data as a flat, read-only byte view, C order, little-endian
    (see :meth:`FlatState.tensor_bytes`)."""
    if _is_torch(value):
        return _torch_bytes(value)
    np = sys.modules["numpy"]
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr).reshape(-1)
    return memoryview(arr.view(np.uint8)).toreadonly()


def _torch_bytes(value: Any) -> memoryview:
    import ctypes

    # Made contiguous where it lives, then copied: one copy to the host.
    # (A staged state does not come here: the stager copies each tensor once,
    # straight into shared memory, state._stage_copy.)
    t = value.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf.tensor = t  # type: ignore[attr-defined]  # the view keeps the memory alive
    return memoryview(buf).cast("B").toreadonly()


# -- unflatten ------------------------------------------------------------------


def build_tree(skeleton: Any, tensor_for: Any) -> Any:
    """The tree a skeleton describes, each tensor reference replaced by
    ``tensor_for(key)`` (dicts come back as ``dict``, in their saved order)."""

    def build(node: Any) -> Any:
        if "tensor" in node:
            return tensor_for(node["tensor"])
        if "value" in node:
            return node["value"]
        if "dict" in node:
            return {k: build(v) for k, v in node["dict"]}
        if "list" in node:
            return [build(v) for v in node["list"]]
        return tuple(build(v) for v in node["tuple"])

    return build(skeleton)


def rekey_skeleton(skeleton: Any, new_key: Callable[[str], str]) -> Any:
    """The same skeleton with each tensor reference ``k`` made
    ``new_key(k)`` (values and containers as they are)."""

    def rekey(node: Any) -> Any:
        if "tensor" in node:
            return {"tensor": new_key(node["tensor"])}
        if "value" in node:
            return node
        if "dict" in node:
            return {"dict": [[k, rekey(v)] for k, v in node["dict"]]}
        kind = "list" if "list" in node else "tuple"
        return {kind: [rekey(v) for v in node[kind]]}

    return rekey(skeleton)


def iter_leaves(skeleton: Any) -> Iterator[tuple[str, Any]]:
    """``(flattened key, node)`` of every leaf node of a skeleton, in tree order."""
    stack: list[tuple[str, Any, bool]] = [("", skeleton, True)]
    while stack:
        key, node, root = stack.pop()
        children = _children(key, node, root)
        if children is None:
            yield key, node
        else:
            stack.extend(reversed(children))


def _children(key: str, node: Any, root: bool) -> list[tuple[str, Any, bool]] | None:
    if "dict" in node:
        return [(join_key(key, escape_key(k), root=root), v, False) for k, v in node["dict"]]
    for kind in ("list", "tuple"):
        if kind in node:
            return [(join_key(key, str(i), root=root), v, False)
                    for i, v in enumerate(node[kind])]
    return None
