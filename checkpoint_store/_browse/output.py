"""How the command line prints: tables, strict JSON, sizes, UTC times and values.

Every command formats through these, so a size or a time reads the same in
``ls``, ``show``, ``cp`` and the web page (which shares :func:`json_safe`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import click

__all__ = [
    "fmt_size",
    "fmt_time",
    "fmt_value",
    "json_safe",
    "one_line",
    "print_json",
    "shown",
    "table",
]


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines too) made one space."""
    return " ".join(str(text).split())


def fmt_time(ts: Any) -> str:
    """A POSIX timestamp (seconds) as ``YYYY-MM-DD HH:MM:SS`` in UTC; ``-`` if not a number."""
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def fmt_size(n: int | None) -> str:
    """A byte count in binary units (``12 B``, ``3.4 MiB``); ``-`` for None."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_value(v: Any) -> str:
    """A metric or metadata value: floats to 6 significant digits, None as ``-``,
    objects and lists as compact JSON."""
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.3f}"
    if v is None:
        return "-"
    return str(v) if not isinstance(v, (dict, list)) else json.dumps(v, sort_keys=True)


def json_safe(value: Any) -> Any:
    """NaN and infinities become null: strict JSON for jq and friends."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented strict JSON (:func:`json_safe`) to stdout."""
    click.echo(json.dumps(json_safe(obj), indent=2, sort_keys=False, allow_nan=False))


def shown(cell: str) -> str:
    """``cell`` as a table prints it: quoted and escaped (``repr``) when it
    has a character the eye cannot tell apart or the terminal would act on
    (leading or trailing whitespace, a control character such as ESC), so
    trial ``"t1 "`` never reads as ``"t1"`` and a name on shared storage never
    moves the cursor or recolours the terminal; any other cell unchanged."""
    if cell == "" or (cell.isprintable() and cell == cell.strip()):
        return cell
    return repr(cell)


def table(headers: list[str], rows: list[list[str]], right: Iterable[int] = ()) -> None:
    """Print ``rows`` under ``headers`` in aligned columns; columns in ``right``
    (0-based) are right-aligned. Each cell goes through :func:`shown`."""
    right = set(right)
    rows = [[shown(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    click.echo(line(headers))
    for row in rows:
        click.echo(line(row))
