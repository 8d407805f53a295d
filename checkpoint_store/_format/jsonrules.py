"""JSON rules shared by metadata, metrics and our own files.

Only JSON objects with string keys and JSON values are accepted. NaN and
infinities are kept (Python's json writes them as ``NaN``/``Infinity``, which
we read back), because metrics legitimately hold them. numpy scalars and
0-d arrays are converted to Python numbers; anything else is refused with an
error naming the key path.

Everything :func:`dumps` could fail on is refused by :func:`to_json_object`
already, so callers validate before their first write and never fail half-way:
a string (value or key) that is not valid UTF-8 (a lone surrogate such as
``"\\ud800"``), an int longer than Python's int/str conversion limit
(``sys.get_int_max_str_digits()``, 4300 digits by default), and nesting deeper
than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from checkpoint_store.errors import MetadataError

#: Deepest nesting of dicts and lists accepted (far below the interpreter's
#: recursion limit, which json's encoder and decoder both run into).
MAX_DEPTH = 100


def _check_str(text: str, where: str, what: str, kind: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        place = (f"key {text!r} under {where or 'the top level'}" if kind == "key"
                 else f"value at {where!r}")
        raise MetadataError(
            f"{what} {place} holds {text[exc.start]!r} (a lone surrogate), which is "
            "not valid UTF-8 and cannot be stored as JSON; fix the string (e.g. "
            "s.encode('utf-8', 'replace').decode())"
        ) from None


def _check_int(value: int, where: str, what: str) -> None:
    limit = sys.get_int_max_str_digits()
    # An int of at most 3*limit bits is below 10**limit: the common case costs
    # one bit_length(), and a huge int's digits are never computed.
    if limit and value.bit_length() > 3 * limit and abs(value) >= 10**limit:
        raise MetadataError(
            f"{what} value at {where!r} is an int of more than {limit} digits, which "
            "JSON cannot carry (Python's int/str limit); report float(x) or a string"
        )


def _convert(value: Any, where: str, what: str, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, str):
        _check_str(value, where, what, "value")
        return value
    if isinstance(value, int):
        _check_int(value, where, what)
        return value
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_DEPTH:
        raise MetadataError(
            f"{what} at {where!r} is nested more than {MAX_DEPTH} levels deep; "
            "flatten it (e.g. 'a/b/c' keys)"
        )
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise MetadataError(
                    f"{what} key {k!r} under {where or 'the top level'} is not a string; "
                    "JSON objects need string keys"
                )
            _check_str(k, where, what, "key")
            out[k] = _convert(v, f"{where}/{k}" if where else k, what, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_convert(v, f"{where}[{i}]", what, depth + 1) for i, v in enumerate(value)]
    # numpy scalars and 0-d arrays without importing numpy.
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", None)
    if callable(item) and shape == ():
        converted = item()
        if isinstance(converted, (bool, int, float, str)):
            return converted
    raise MetadataError(
        f"{what} value at {where!r} has type {type(value).__name__}, which is not "
        "JSON-serialisable; convert it to a number, string, list or dict "
        "(e.g. float(x) for a tensor)"
    )


def to_json_object(value: Any, what: str = "metadata") -> dict[str, Any]:
    """Validate and convert ``value`` into a plain JSON-ready dict.

    Raises:
        MetadataError: not a mapping, a non-string key, or a value that is not
            JSON-serialisable; the message names the key path.
    """
    if not isinstance(value, Mapping):
        raise MetadataError(f"{what} must be a dict, got {type(value).__name__}")
    return _convert(value, "", what)


# Built once: json.dumps with options builds a new encoder per call, a
# measurable share of a metrics-only report().
_ENCODER = json.JSONEncoder(sort_keys=True, ensure_ascii=False, allow_nan=True)
_LINE_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=True)


def dumps(obj: Any) -> bytes:
    """Serialise to UTF-8 JSON bytes, keys sorted (never empty: at least ``{}``)."""
    return _ENCODER.encode(obj).encode("utf-8")


def dumps_line(obj: Any) -> bytes:
    """One compact JSON line, newline-terminated (for result.json)."""
    return (_LINE_ENCODER.encode(obj) + "\n").encode("utf-8")


def loads(data: bytes | str) -> Any:
    """Parse JSON text.

    Raises:
        ValueError: not JSON, or nested too deep to parse (json's decoder
            recurses; a ``RecursionError`` would escape every reader's
            ``except ValueError``).
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
