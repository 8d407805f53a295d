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

Requires ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from checkpoint_store.retention import CheckpointConfig

__all__ = [
    "checkpoint_configs",
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
