"""Scores and the one rank order: how a checkpoint's metrics become a place in a ranking.

Owns the metric lookup (a literal key, else the metrics flattened with ``/``),
what counts as a score (a real number; NaN and absent count as missing), the
``missing_score`` rule of :class:`~checkpoint_store.retention.CheckpointConfig`,
and :func:`rank_key`, the order every ranking of checkpoints uses: the
manager, ``select_kept``, the CLI's ``best``, the Lightning resume pick and
the web UI (through ``select_kept``).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Final, Literal, Protocol, TypeVar, get_args

from checkpoint_store.errors import AmbiguousMetricError, InvalidConfigError

__all__ = [
    "MissingScore",
    "NOT_FOUND",
    "RankKey",
    "ScoreOrder",
    "ScoredConfig",
    "check_retention_fields",
    "config_score",
    "lookup_metric",
    "missing_score_error",
    "rank_key",
    "score_of",
    "score_or_none",
]


#: Which way a score is better: ``"max"`` (higher) or ``"min"`` (lower).
ScoreOrder = Literal["max", "min"]
#: What a NaN or missing score does (see :class:`CheckpointConfig`).
MissingScore = Literal["worst", "keep", "raise"]

_MISSING_POLICIES: tuple[MissingScore, ...] = get_args(MissingScore)
_SCORE_ORDERS: tuple[ScoreOrder, ...] = get_args(ScoreOrder)


class ScoredConfig(Protocol):
    """What :func:`config_score` reads of a
    :class:`~checkpoint_store.retention.CheckpointConfig` (named by this
    protocol: the config module builds on this one)."""

    @property
    def checkpoint_score_attribute(self) -> str | None: ...

    @property
    def missing_score(self) -> MissingScore: ...


def check_retention_fields(num_to_keep: Any, checkpoint_score_attribute: Any,
                           checkpoint_score_order: Any, keep_latest: Any,
                           missing_score: Any) -> None:
    """Check the retention fields of a :class:`~checkpoint_store.retention.CheckpointConfig`
    (and of a ``BestN`` policy): the one place they are validated.

    Raises:
        InvalidConfigError: a field's value is not one it accepts; the message names it.
    """
    k = num_to_keep
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InvalidConfigError(
            f"num_to_keep must be an int >= 1, or None to keep every checkpoint; got {k!r}"
        )
    attr = checkpoint_score_attribute
    if attr is not None and (not isinstance(attr, str) or not attr):
        raise InvalidConfigError(
            "checkpoint_score_attribute must be a non-empty metric name (nested: "
            f"'eval/loss') or None to keep the most recent; got {attr!r}"
        )
    if checkpoint_score_order not in _SCORE_ORDERS:
        raise InvalidConfigError(
            "checkpoint_score_order must be 'max' (higher is better) or 'min'; "
            f"got {checkpoint_score_order!r}"
        )
    if not isinstance(keep_latest, bool):
        raise InvalidConfigError(f"keep_latest must be True or False, got {keep_latest!r}")
    if missing_score not in _MISSING_POLICIES:
        raise InvalidConfigError(
            f"missing_score must be one of {_MISSING_POLICIES}, got {missing_score!r}"
        )


#: What :func:`lookup_metric` returns for an absent metric (``None`` is a value).
NOT_FOUND: Final = object()

_N = TypeVar("_N")
#: ``(has a score, signed score, newness)``: bigger is better.
RankKey = tuple[int, float, _N]


def lookup_metric(metrics: Mapping[str, Any], attribute: str) -> Any:
    """The value ``attribute`` names in ``metrics``, the way Ray Tune finds a metric.

    ``metrics[attribute]`` if that literal key exists; else the metrics
    flattened with ``/``, so ``"nested/sub/attr"`` finds
    ``{"nested": {"sub/attr": 5}}``, ``{"nested/sub": {"attr": 5}}`` and
    ``{"nested": {"sub": {"attr": 5}}}`` alike. The one lookup of the
    library: the manager, policies, the CLI, the Optuna integration and the
    web UI all call it.

    Returns:
        The value, or :data:`NOT_FOUND` when absent.

    Raises:
        AmbiguousMetricError: two different values are reachable under
            ``attribute``; the message names both paths.
    """
    if attribute in metrics:
        return metrics[attribute]
    found = _flat_matches(metrics, attribute, ())
    if not found:
        return NOT_FOUND
    path, value = found[0]
    for other_path, other in found[1:]:
        if not _same(value, other):
            raise AmbiguousMetricError(
                f"metric {attribute!r} is ambiguous: {_show(path)} = {value!r} but "
                f"{_show(other_path)} = {other!r}; rename one of them in the reported metrics"
            )
    return value


def _flat_matches(node: Mapping[str, Any], rest: str,
                  path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """Every ``(key path, value)`` whose keys joined with ``/`` spell ``rest``."""
    found: list[tuple[tuple[str, ...], Any]] = []
    for key, value in node.items():
        if not isinstance(key, str):
            continue
        if key == rest and path:  # the literal top-level key was tried first
            found.append(((*path, key), value))
        elif rest.startswith(key + "/") and isinstance(value, Mapping):
            found.extend(_flat_matches(value, rest[len(key) + 1:], (*path, key)))
    return found


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an array's ambiguous truth value: not provably the same
        return False


def _show(path: tuple[str, ...]) -> str:
    return "metrics" + "".join(f"[{k!r}]" for k in path)


def score_of(metrics: Mapping[str, Any], attribute: str) -> float | None:
    """The numeric score of ``metrics`` for ``attribute``, or None when missing or NaN.

    ``None`` values count as missing; ints, floats and numpy scalars count as
    numbers (``±inf`` included: they rank like any number).

    Raises:
        InvalidConfigError: the value exists but is not a number (str, bool,
            list, dict ...), or is an int beyond the float range; the message
            names the attribute and the type.
    """
    value = lookup_metric(metrics, attribute)
    if value is NOT_FOUND or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidConfigError(
            f"checkpoint_score_attribute {attribute!r} has value {value!r} of type "
            f"{type(value).__name__}; scores must be numbers (report float(x), or pick "
            "another checkpoint_score_attribute)"
        )
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range (10**400) has no rank
        raise InvalidConfigError(
            f"checkpoint_score_attribute {attribute!r} is an int too large for a float "
            f"(about {int(value.bit_length() * 0.30103)} digits); scores must fit a float "
            "(up to about 1.8e308)"
        ) from None
    return None if math.isnan(value) else value


def score_or_none(metrics: Mapping[str, Any], attribute: str | None) -> float | None:
    """:func:`score_of`, with a value that is not a number counting as missing.

    For readers of what was already stored (a restore, a table, a chart),
    where refusing would only hide the rest.
    """
    if attribute is None:
        return None
    try:
        return score_of(metrics, attribute)
    except InvalidConfigError:
        return None


def rank_key(score: float | None, newness: _N, order: ScoreOrder | str = "max") -> RankKey[_N]:
    """The sort key of one checkpoint; bigger is better.

    Numbers rank above missing scores (None: NaN or absent, which tie with
    each other), then by ``score`` in ``order``'s direction (``"max"``: higher
    is better, ``"min"``: lower), then by ``newness`` (the checkpoint index,
    or any comparable value: ties go to the newer checkpoint).
    ``max(..., key=...)`` picks what the manager calls the best checkpoint.
    """
    if score is None:
        return (0, 0.0, newness)
    return (1, score if order == "max" else -score, newness)


def missing_score_error(attribute: str, index: int | None = None) -> InvalidConfigError:
    """The refusal of a missing or NaN score under ``missing_score="raise"``."""
    where = f" in the metrics of checkpoint index {index}" if index is not None else ""
    return InvalidConfigError(
        f"metric {attribute!r} is missing or NaN{where} (missing_score='raise'); report a "
        "number, or use missing_score='worst' or 'keep'"
    )


def config_score(
    config: ScoredConfig,
    metrics: Mapping[str, Any],
    index: int,
    warned: set[str],
    *,
    lenient: bool = False,
    stacklevel: int = 3,
) -> float | None:
    """The score ``config`` ranks the checkpoint of ``index`` by: the metric's
    score, or the index itself without a score attribute (recency).

    Under ``missing_score="worst"`` a missing score warns once per attribute
    (``warned`` remembers the attributes already warned about). ``lenient``
    (restoring what was already accepted): a value that is not a number, or a
    missing one under ``missing_score="raise"``, counts as missing instead of
    raising, because refusing would only leave the trial unmanageable.

    Raises:
        InvalidConfigError: (unless ``lenient``) the value is not a number, or
            it is missing under ``missing_score="raise"``.
    """
    attr = config.checkpoint_score_attribute
    if attr is None:
        return float(index)
    score = score_or_none(metrics, attr) if lenient else score_of(metrics, attr)
    if score is not None:
        return score
    if config.missing_score == "raise" and not lenient:
        raise missing_score_error(attr, index)
    if config.missing_score == "worst" and attr not in warned:
        warned.add(attr)
        warnings.warn(
            f"checkpoint_score_attribute {attr!r} is missing or NaN for checkpoint index "
            f"{index}; such checkpoints rank below every number and are evicted first "
            "(this warning is given once per attribute)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    return None
