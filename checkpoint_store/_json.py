"""JSON rules shared by metadata, metrics and our own files.

Only JSON objects with string keys and JSON values are accepted. NaN and
infinities are kept (Python's json writes them as ``NaN``/``Infinity``, which
we read back), because metrics legitimately hold them. numpy scalars and
0-d arrays are converted to Python numbers; anything else is refused with an
error naming the key path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from checkpoint_store.errors import MetadataError


def _convert(value: Any, where: str, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise MetadataError(
                    f"{what} key {k!r} under {where or 'the top level'} is not a string; "
                    "JSON objects need string keys"
                )
            out[k] = _convert(v, f"{where}/{k}" if where else k, what)
        return out
    if isinstance(value, (list, tuple)):
        return [_convert(v, f"{where}[{i}]", what) for i, v in enumerate(value)]
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
    return json.loads(data)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
