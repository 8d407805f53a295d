"""Retention policies: small pure objects that say which checkpoints of a trial to preserve.

The idea is Orbax's ``PreservationPolicy``: each policy looks at the
committed checkpoints of one trial (index, directory name, metrics,
``created_at``) and names the ones it preserves; a checkpoint is deleted
only if no policy preserves it. Policies touch no storage. :func:`evaluate`
is the one evaluation: the manager, :func:`~checkpoint_store.retention.select_kept`
and the CLI's ``prune --dry-run`` (which prints, per checkpoint, the policies
that keep it) all call it.

Each policy has a JSON form (:meth:`to_json`, :func:`policy_from_json`) that
goes into the manager state, so a restarted manager, the CLI and the UI
re-evaluate the same rules. A user callable cannot be stored: it is recorded
as ``{"type": "Custom", "name": ...}`` and read back as
:class:`UnstoredPolicy`, which preserves every checkpoint (a tool that cannot
run the rule deletes nothing).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.scoring import (
    MissingScore,
    ScoreOrder,
    check_retention_fields,
    lookup_metric,
    missing_score_error,
    rank_key,
    score_of,
    score_or_none,
)

__all__ = [
    "AnyOf",
    "BestN",
    "Custom",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "LatestN",
    "PolicyCheckpoint",
    "RetentionPolicy",
    "Steps",
    "UnstoredPolicy",
    "as_policy",
    "evaluate",
    "policy_from_json",
]


@dataclass(frozen=True)
class PolicyCheckpoint:
    """One committed checkpoint as a policy sees it.

    Attributes:
        index: the checkpoint index from its internal metadata (defines order).
        dir_name: the directory name relative to the trial.
        metrics: the metrics reported with it.
        created_at: Unix seconds from its internal metadata (None: not recorded).
    """

    index: int
    dir_name: str
    metrics: Mapping[str, Any]
    created_at: float | None = None


@runtime_checkable
class RetentionPolicy(Protocol):
    """What a policy is: ``preserve(checkpoints) -> indexes`` and a JSON form.

    ``preserve`` receives the committed checkpoints of one trial (in any
    order; one per index) and returns the indexes it preserves, a subset of
    theirs. It must be pure: the same set in, the same set out, whatever the
    order of the sequence.
    """

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> Collection[int]: ...

    def to_json(self) -> dict[str, Any]: ...


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"{what} must be an int >= 1, got {value!r}")
    return value


def _step_of(metrics: Mapping[str, Any], step_key: str) -> int | None:
    """The integral step under ``step_key``, or None when absent or not an integer."""
    value = score_or_none(metrics, step_key)
    if value is None or not math.isfinite(value) or value != int(value):
        return None
    return int(value)


@dataclass(frozen=True)
class KeepAll:
    """Preserve every checkpoint (``CheckpointConfig(num_to_keep=None)``)."""

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        return {c.index for c in checkpoints}

    def to_json(self) -> dict[str, Any]:
        return {"type": "KeepAll"}


@dataclass(frozen=True)
class BestN:
    """The best ``n`` by ``attribute`` in ``order``: the top-K of :class:`CheckpointConfig`.

    Same rules: the score is :func:`~checkpoint_store.retention.lookup_metric`
    (literal key, else metrics flattened with ``/``); NaN and missing scores
    follow ``missing_score`` (``"worst"``: rank below every number,
    ``"keep"``: always preserved and not counted in ``n``, ``"raise"``: the
    report is refused); ties go to the newer checkpoint. ``attribute=None``
    keeps the ``n`` newest.

    Raises:
        InvalidConfigError: ``n`` not an int >= 1, an empty attribute, an
            order other than ``"max"``/``"min"``, an unknown ``missing_score``.
    """

    n: int
    attribute: str | None = None
    order: ScoreOrder = "max"
    missing_score: MissingScore = "worst"

    def __post_init__(self) -> None:
        _positive_int(self.n, "BestN n")
        check_retention_fields(self.n, self.attribute, self.order, False, self.missing_score)

    def score(self, c: PolicyCheckpoint) -> float | None:
        """The score this policy ranks ``c`` by (the index without an attribute)."""
        return (
            float(c.index) if self.attribute is None else score_or_none(c.metrics, self.attribute)
        )

    def check(self, metrics: Mapping[str, Any], index: int | None = None) -> None:
        """Refuse ``metrics`` as a report would be refused.

        Raises:
            InvalidConfigError: the score is not a number, or is missing under
                ``missing_score="raise"``.
        """
        if self.attribute is None:
            return
        if score_of(metrics, self.attribute) is None and self.missing_score == "raise":
            raise missing_score_error(self.attribute, index)

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        order = self.order if self.attribute is not None else "max"
        keep_missing = self.missing_score == "keep" and self.attribute is not None
        missing = [c for c in checkpoints if keep_missing and self.score(c) is None]
        ranked = [c for c in checkpoints if c not in missing] if missing else list(checkpoints)
        # The manager runs this at every registration: no temporary tuples beyond the keys.
        ranked.sort(key=lambda c: rank_key(self.score(c), c.index, order), reverse=True)
        kept = {c.index for c in ranked[: self.n]}
        kept.update(c.index for c in missing)
        return kept

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "BestN",
            "n": self.n,
            "attribute": self.attribute,
            "order": self.order,
            "missing_score": self.missing_score,
        }


@dataclass(frozen=True)
class LatestN:
    """The ``n`` checkpoints with the highest indexes (Orbax ``max_to_keep``, Lightning
    ``save_last`` for ``n=1``).

    Raises:
        InvalidConfigError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "LatestN n")

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        return set(sorted(c.index for c in checkpoints)[-self.n :])

    def to_json(self) -> dict[str, Any]:
        return {"type": "LatestN", "n": self.n}


@dataclass(frozen=True)
class EveryNSteps:
    """Checkpoints whose step (``metrics[step_key]``, an integer) is a multiple of ``n``
    (Orbax ``keep_period``). A checkpoint without an integral step is not preserved.

    Raises:
        InvalidConfigError: ``n`` is not an int >= 1, or ``step_key`` is empty.
    """

    n: int
    step_key: str = "training_iteration"

    def __post_init__(self) -> None:
        _positive_int(self.n, "EveryNSteps n")
        _check_key(self.step_key)

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        steps = ((c.index, _step_of(c.metrics, self.step_key)) for c in checkpoints)
        return {i for i, s in steps if s is not None and s % self.n == 0}

    def to_json(self) -> dict[str, Any]:
        return {"type": "EveryNSteps", "n": self.n, "step_key": self.step_key}


@dataclass(frozen=True)
class EveryNSeconds:
    """One checkpoint per ``seconds`` of wall time (Orbax ``keep_time_interval``).

    Walking in index order, the first checkpoint is preserved, then each one
    created (``created_at``) at least ``seconds`` after the previously
    preserved one. Checkpoints without ``created_at`` are skipped.

    Raises:
        InvalidConfigError: ``seconds`` is not a finite number > 0.
    """

    seconds: float

    def __post_init__(self) -> None:
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not 0 < s < math.inf:
            raise InvalidConfigError(
                f"EveryNSeconds seconds must be a finite number > 0, got {s!r}"
            )

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for c in sorted(checkpoints, key=lambda c: c.index):
            if c.created_at is None:
                continue
            if last is None or c.created_at >= last + self.seconds:
                kept.add(c.index)
                last = c.created_at
        return kept

    def to_json(self) -> dict[str, Any]:
        return {"type": "EveryNSeconds", "seconds": self.seconds}


@dataclass(frozen=True)
class Steps:
    """The checkpoints whose step (``metrics[step_key]``) is one of ``steps``.

    Raises:
        InvalidConfigError: a step is not an int >= 0, or ``step_key`` is empty.
    """

    steps: tuple[int, ...]
    step_key: str = "training_iteration"

    def __init__(self, steps: Iterable[int], step_key: str = "training_iteration"):
        try:
            values = tuple(steps)
        except TypeError:
            raise InvalidConfigError(f"Steps takes a list of ints, got {steps!r}") from None
        for s in values:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise InvalidConfigError(f"Steps takes ints >= 0, got {s!r}")
        _check_key(step_key)
        object.__setattr__(self, "steps", tuple(sorted(set(values))))
        object.__setattr__(self, "step_key", step_key)

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        wanted = set(self.steps)
        return {c.index for c in checkpoints if _step_of(c.metrics, self.step_key) in wanted}

    def to_json(self) -> dict[str, Any]:
        return {"type": "Steps", "steps": list(self.steps), "step_key": self.step_key}


@dataclass(frozen=True)
class AnyOf:
    """The union: a checkpoint is preserved if any of ``policies`` preserves it.

    Raises:
        InvalidConfigError: no policy given, or one is not a policy.
    """

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy | Callable[..., Any]):
        if not policies:
            raise InvalidConfigError("AnyOf needs at least one policy")
        object.__setattr__(self, "policies", tuple(as_policy(p) for p in policies))

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        return set(evaluate(self, checkpoints))

    def to_json(self) -> dict[str, Any]:
        return {"type": "AnyOf", "policies": [p.to_json() for p in self.policies]}


@dataclass(frozen=True)
class Custom:
    """A user callable ``fn(checkpoints) -> indexes`` as a policy.

    Not storable: the state records its name only (see :class:`UnstoredPolicy`).
    """

    fn: Callable[[Sequence[PolicyCheckpoint]], Iterable[int]]
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not self.name:
            label = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            object.__setattr__(self, "name", str(label))

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> Collection[int]:
        result = self.fn(checkpoints)
        return set(result) if isinstance(result, Iterable) else result  # type: ignore[unreachable]

    def to_json(self) -> dict[str, Any]:
        return {"type": "Custom", "name": self.name}


@dataclass(frozen=True)
class UnstoredPolicy:
    """A user callable read back from the state: the rule itself was not stored, so
    every checkpoint is preserved (a tool that cannot run it deletes nothing)."""

    name: str

    def preserve(self, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
        return {c.index for c in checkpoints}

    def to_json(self) -> dict[str, Any]:
        return {"type": "Custom", "name": self.name}


def _check_key(step_key: Any) -> None:
    if not isinstance(step_key, str) or not step_key:
        raise InvalidConfigError(f"step_key must be a non-empty metric name, got {step_key!r}")


def as_policy(obj: Any) -> RetentionPolicy:
    """``obj`` as a policy: a policy object as is, a plain callable wrapped in :class:`Custom`.

    A policy is probed once with no checkpoints, so a rule that does not
    return a collection of indexes is refused here, before any report.

    Raises:
        InvalidConfigError: ``obj`` has no ``preserve`` method and is not
            callable, or its answer is not a collection of ints.
    """
    if isinstance(obj, RetentionPolicy):
        policy: RetentionPolicy = obj
    elif callable(obj):
        policy = Custom(obj)
    else:
        raise InvalidConfigError(
            f"{obj!r} is not a retention policy: pass BestN, LatestN, EveryNSteps, "
            "EveryNSeconds, Steps, AnyOf, or a callable(checkpoints) -> indexes"
        )
    _answer(policy, [])
    return policy


def _answer(policy: RetentionPolicy, checkpoints: Sequence[PolicyCheckpoint]) -> set[int]:
    """``policy.preserve(checkpoints)``, checked: a collection of known indexes."""
    try:
        result = policy.preserve(checkpoints)
    except InvalidConfigError:
        raise
    except Exception as exc:
        raise InvalidConfigError(f"retention policy {_label(policy)} failed: {exc!r}") from exc
    if not isinstance(result, Iterable) or isinstance(result, (str, bytes, Mapping)):
        raise InvalidConfigError(
            f"retention policy {_label(policy)} returned {result!r}; preserve() must return "
            "a collection of checkpoint indexes (ints)"
        )
    known = {c.index for c in checkpoints}
    out: set[int] = set()
    for i in result:
        if isinstance(i, bool) or not isinstance(i, int) or i not in known:
            raise InvalidConfigError(
                f"retention policy {_label(policy)} returned {i!r}, which is not the index "
                "of one of the checkpoints it was given"
            )
        out.add(i)
    return out


def _label(policy: RetentionPolicy) -> str:
    """A short human name: ``BestN(2, 'loss', 'min')``, ``EveryNSteps(4)``."""
    if isinstance(policy, (Custom, UnstoredPolicy)):
        return f"Custom({policy.name})"
    if isinstance(policy, BestN):
        return f"BestN({policy.n}, {policy.attribute!r}, {policy.order!r})"
    if isinstance(policy, (LatestN, EveryNSteps)):
        return f"{type(policy).__name__}({policy.n})"
    if isinstance(policy, EveryNSeconds):
        return f"EveryNSeconds({policy.seconds:g})"
    if isinstance(policy, Steps):
        return f"Steps({list(policy.steps)})"
    return type(policy).__name__ + "()" if isinstance(policy, KeepAll) else repr(policy)


def evaluate(
    policy: RetentionPolicy, checkpoints: Iterable[PolicyCheckpoint]
) -> dict[int, tuple[str, ...]]:
    """The one evaluation: ``index -> labels of the policies that preserve it``.

    The keys are the preserved indexes (a checkpoint not among them is to be
    deleted); the labels name the leaf policies (an :class:`AnyOf` is
    opened), in the order they were given: what ``prune --dry-run`` prints.
    Depends only on the set of checkpoints, not on their order.

    Raises:
        InvalidConfigError: a policy raised, or answered with something other
            than indexes of the given checkpoints.
    """
    given = sorted(checkpoints, key=lambda c: c.index)
    reasons: dict[int, list[str]] = {}
    for leaf in _leaves(policy):
        label = _label(leaf)
        for i in sorted(_answer(leaf, given)):
            reasons.setdefault(i, []).append(label)
    return {i: tuple(reasons[i]) for i in sorted(reasons)}


def _leaves(policy: RetentionPolicy) -> list[RetentionPolicy]:
    if isinstance(policy, AnyOf):
        return [leaf for p in policy.policies for leaf in _leaves(p)]
    return [policy]


def best_policies(policy: RetentionPolicy) -> list[BestN]:
    """The :class:`BestN` leaves of ``policy`` (their attributes are checked at report)."""
    return [p for p in _leaves(policy) if isinstance(p, BestN)]


def check_metrics(
    policy: RetentionPolicy, metrics: Mapping[str, Any], index: int | None = None
) -> None:
    """Refuse ``metrics`` as registering them under ``policy`` would.

    Raises:
        InvalidConfigError: a :class:`BestN` score is not a number, or is
            missing under its ``missing_score="raise"``; a step is ambiguous.
    """
    for best in best_policies(policy):
        best.check(metrics, index)
    for leaf in _leaves(policy):
        if isinstance(leaf, (EveryNSteps, Steps)):
            lookup_metric(metrics, leaf.step_key)  # raises only when ambiguous


_FROM_JSON: dict[str, Callable[[Mapping[str, Any]], RetentionPolicy]] = {
    "KeepAll": lambda o: KeepAll(),
    "BestN": lambda o: BestN(
        o["n"], o.get("attribute"), o.get("order", "max"), o.get("missing_score", "worst")
    ),
    "LatestN": lambda o: LatestN(o["n"]),
    "EveryNSteps": lambda o: EveryNSteps(o["n"], o.get("step_key", "training_iteration")),
    "EveryNSeconds": lambda o: EveryNSeconds(o["seconds"]),
    "Steps": lambda o: Steps(o["steps"], o.get("step_key", "training_iteration")),
    "AnyOf": lambda o: AnyOf(*(policy_from_json(p) for p in o["policies"])),
    "Custom": lambda o: UnstoredPolicy(str(o.get("name", "?"))),
}


def policy_from_json(obj: Any) -> RetentionPolicy:
    """Inverse of ``policy.to_json()``; a stored user callable comes back as
    :class:`UnstoredPolicy` (preserves everything).

    Raises:
        InvalidConfigError: not a policy's JSON form.
    """
    kind = obj.get("type") if isinstance(obj, Mapping) else None
    if kind not in _FROM_JSON:
        raise InvalidConfigError(f"not a stored retention policy: {obj!r}")
    try:
        return _FROM_JSON[kind](obj)
    except (KeyError, TypeError) as exc:
        raise InvalidConfigError(f"stored retention policy {obj!r} is malformed: {exc}") from None
