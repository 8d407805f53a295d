"""Hypothesis strategies for checkpoint-store's inputs, for our tests and yours.

Import them in any property test::

    from hypothesis import given
    from checkpoint_store.testing import strategies as cst

    @given(cst.metrics())
    def test_report_accepts(metrics): ...

What they draw:

* :func:`scores`: a float score with the hard cases weighted in: NaN, ``±inf``,
  ``-0.0``, ties (a small pool of repeated values), and ``None`` for "missing".
* :func:`metric_values` / :func:`metrics`: JSON metric dicts with NaN/inf,
  nesting up to ``max_depth`` and unicode keys (never containing ``/``, so a
  nested path names one value).
* :func:`path_components`: unicode names valid as one path component
  (experiment and trial names): no ``/``, ``\\``, NUL, ``.`` or ``..``.
* :func:`directory_trees`: ``{relative posix path: bytes}`` describing the
  files of a checkpoint directory, nested, with unicode names and empty files.
* :func:`checkpoint_configs`: valid :class:`~checkpoint_store.CheckpointConfig`.
* :func:`tensors` / :func:`state_trees`: tensors of every dtype the state
  format stores (numpy arrays; torch tensors, bfloat16 and float8 included,
  when torch is importable), zero-size and 0-d ones, non-contiguous views;
  and state trees of them with dicts (keys holding ``/`` and ``~``), lists,
  tuples and JSON leaves. :func:`same_state` compares two trees exactly
  (types, dtypes, shapes and bytes; NaN payloads too).

Requires ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from checkpoint_store.retention import CheckpointConfig

__all__ = [
    "checkpoint_configs",
    "same_state",
    "state_trees",
    "tensors",
    "directory_trees",
    "file_names",
    "metric_keys",
    "metric_values",
    "metrics",
    "path_components",
    "scores",
]

#: Values that tie often: drawing from a small pool makes equal scores common.
_TIE_POOL = (-1.0, 0.0, 0.5, 1.0, 2.0)


def scores(*, allow_missing: bool = True, allow_nan: bool = True) -> st.SearchStrategy[Any]:
    """A score as a user might report it.

    Returns floats (NaN, ``±inf`` and ties weighted in), ints, and ``None``
    meaning "the metric was not reported" when ``allow_missing``.
    """
    special: list[Any] = [math.inf, -math.inf, -0.0]
    if allow_nan:
        special.append(math.nan)
    parts: list[st.SearchStrategy[Any]] = [
        st.sampled_from(_TIE_POOL),
        st.sampled_from(special),
        st.floats(allow_nan=allow_nan, allow_infinity=True, width=64),
        st.integers(min_value=-(2**53), max_value=2**53),
    ]
    if allow_missing:
        parts.append(st.none())
    return st.one_of(*parts)


def metric_keys() -> st.SearchStrategy[str]:
    """A non-empty unicode metric name without ``/`` (the nesting separator)."""
    return st.text(
        alphabet=st.characters(exclude_categories=("Cs", "Co"), exclude_characters="/"),
        min_size=1, max_size=12,
    )


def metric_values(max_depth: int = 2) -> st.SearchStrategy[Any]:
    """A JSON value as reported in metrics: numbers (NaN/inf included), bools,
    strings, None, lists, and nested dicts up to ``max_depth`` levels."""
    leaves = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.booleans(),
        st.none(),
        st.text(max_size=10),
    )
    if max_depth <= 0:
        return leaves
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(metric_keys(), children, max_size=3),
        ),
        max_leaves=8,
    )


def metrics(max_depth: int = 2, *, max_size: int = 6) -> st.SearchStrategy[dict[str, Any]]:
    """A metrics dict with string keys (unicode, no ``/``) and JSON values,
    nested dicts included."""
    return st.dictionaries(metric_keys(), metric_values(max_depth), max_size=max_size)


def path_components() -> st.SearchStrategy[str]:
    """A unicode name valid as one path component on every backend: no
    ``/``, ``\\``, NUL or control characters, not ``.``/``..``, at most 40
    characters, no leading/trailing space (object stores and Windows trim them)."""
    alphabet = st.characters(
        exclude_categories=("Cs", "Cc", "Zl", "Zp"),
        exclude_characters="/\\\x00",
    )
    return (
        st.text(alphabet=alphabet, min_size=1, max_size=40)
        .map(str.strip)
        .filter(lambda s: s not in ("", ".", "..") and len(s.encode("utf-8")) <= 120)
    )


def file_names() -> st.SearchStrategy[str]:
    """A file or directory name: a :func:`path_components` value that does not
    start with ``.`` (hidden names are reserved for our metadata files)."""
    return path_components().filter(lambda s: not s.startswith("."))


def directory_trees(
    *, max_files: int = 6, max_depth: int = 3, max_file_size: int = 256
) -> st.SearchStrategy[dict[str, bytes]]:
    """``{relative posix path: content}`` for the files of a checkpoint directory.

    Paths are unique, have 1 to ``max_depth`` components, and no path is both
    a file and a directory prefix of another file. Contents may be empty.
    """
    paths = st.lists(file_names(), min_size=1, max_size=max_depth).map("/".join)

    def consistent(tree: dict[str, bytes]) -> bool:
        names = set(tree)
        folded = {p.casefold() for p in names}
        if len(folded) != len(names):  # case-insensitive disks (macOS) would merge them
            return False
        return not any(other.startswith(p + "/") for p in names for other in names)

    return st.dictionaries(
        paths, st.binary(max_size=max_file_size), min_size=1, max_size=max_files
    ).filter(consistent)


def checkpoint_configs(
    *,
    attributes: tuple[str | None, ...] = ("score", "eval/loss", None),
    max_keep: int = 4,
    missing_policies: tuple[str, ...] = ("worst", "keep"),
) -> st.SearchStrategy[CheckpointConfig]:
    """A valid :class:`CheckpointConfig` (``num_to_keep`` None or 1..``max_keep``)."""
    return st.builds(
        CheckpointConfig,
        num_to_keep=st.one_of(st.none(), st.integers(min_value=1, max_value=max_keep)),
        checkpoint_score_attribute=st.sampled_from(attributes),
        checkpoint_score_order=st.sampled_from(("max", "min")),
        keep_latest=st.booleans(),
        missing_score=st.sampled_from(missing_policies),
    )


# -- states (docs/state.md) -------------------------------------------------------

#: Dtypes of the state format numpy holds, and those only torch does.
_NUMPY_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                 "int64", "float16", "float32", "float64", "complex64")
_TORCH_ONLY = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
               "float8_e5m2fnuz")


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def tensors(*, frameworks: tuple[str, ...] = ("numpy", "torch"), max_dims: int = 3,
            max_side: int = 4) -> st.SearchStrategy[Any]:
    """A numpy array or torch tensor (torch only where importable) of any dtype
    the state format stores, any bytes (NaN payloads included), shapes with 0
    to ``max_dims`` dimensions (0-d and zero-size included), and now and then a
    non-contiguous view (a transpose or a strided slice)."""
    fws = [f for f in frameworks if f != "torch" or _torch_available()]

    @st.composite
    def draw(draw_: Any) -> Any:
        import numpy as np

        fw = draw_(st.sampled_from(fws))
        names = _NUMPY_DTYPES + (_TORCH_ONLY if fw == "torch" else ())
        dtype = draw_(st.sampled_from(names))
        shape = tuple(draw_(st.lists(st.integers(0, max_side), max_size=max_dims)))
        item = 1 if dtype in ("bool", "uint8", "int8") or dtype.startswith("float8") else (
            2 if dtype in ("uint16", "int16", "float16", "bfloat16") else
            8 if dtype in ("uint64", "int64", "float64", "complex64") else 4)
        count = 1
        for n in shape:
            count *= n
        raw = draw_(st.binary(min_size=count * item, max_size=count * item))
        if dtype == "bool":  # only 0 and 1 are bools
            raw = bytes(b & 1 for b in raw)
        view = draw_(st.sampled_from(("plain", "plain", "transpose", "strided")))
        if fw == "numpy":
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
            if view == "transpose" and arr.ndim >= 2:
                return arr.T
            if view == "strided" and arr.ndim >= 1:
                return np.concatenate([arr, arr])[::2]
            return arr
        import torch

        t = torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)[:len(raw)]
        t = t.view(getattr(torch, dtype)).reshape(shape).clone()
        if view == "transpose" and t.dim() >= 2:
            return t.t() if t.dim() == 2 else t.transpose(0, 1)
        if view == "strided" and t.dim() >= 1:
            return torch.cat([t, t])[::2]
        return t

    return draw()


def state_trees(*, max_leaves: int = 10, frameworks: tuple[str, ...] = ("numpy", "torch")
                ) -> st.SearchStrategy[Any]:
    """A state tree: dicts (unicode keys, ``/``, ``~``, the empty key and
    ``__metadata__``, the name safetensors reserves, included; int keys, as
    an optimizer's ``state_dict()`` has), lists and tuples (empty ones too)
    over :func:`tensors` and JSON leaves (NaN and infinities, big ints,
    unicode strings, None, bools)."""
    chars = st.characters(exclude_categories=["Cs"])  # lone surrogates are not UTF-8
    keys = st.text(alphabet=chars, max_size=6) | st.sampled_from(
        ["a/b", "~", "~1", "/", "", "model", "layer.0.weight", "__metadata__",
         "~2__metadata__"])
    leaves = st.one_of(
        tensors(frameworks=frameworks),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.booleans(), st.none(), st.text(alphabet=chars, max_size=8),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(st.integers(-3, 2**70), children, max_size=3),  # optimizer state
        ),
        max_leaves=max_leaves,
    )


def same_state(a: Any, b: Any) -> bool:
    """Whether two state trees are exactly alike: the same containers (dict,
    list, tuple) and keys in the same order, JSON leaves equal (NaN equal to
    NaN, ``-0.0`` told from ``0.0``, ``1`` from ``1.0`` and ``True``), tensors
    of the same framework, dtype, shape and bytes."""
    import sys

    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        if a.numel() == 0:
            return True
        # Fresh tensors of default strides (a size-1 dimension may carry any stride).
        ua = a.new_empty(a.shape).copy_(a).reshape(-1).view(torch.uint8)
        ub = b.new_empty(b.shape).copy_(b).reshape(-1).view(torch.uint8)
        return bool(torch.equal(ua, ub))
    if np is not None and isinstance(a, (np.ndarray, np.generic)):
        if type(a) is not type(b) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return bool(np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same_state(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same_state(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, float):
        return isinstance(b, float) and (
            (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                   math.copysign(1, b)))
    return type(a) is type(b) and a == b
