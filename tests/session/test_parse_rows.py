"""``parse_result_rows``: the rows of ``result.json`` bytes, each line on its own.

The lines are parsed together in one call where that gives the same rows;
these files mix good rows with every kind of line a reader must skip, and the
answer must be the rows of the lines that are one JSON object alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from checkpoint_store._results.reader import parse_result_rows


def _one_by_one(raw: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


GOOD = [json.dumps({"acc": i / 7, "training_iteration": i + 1, "note": "a\u2028b"},
                   ensure_ascii=False) for i in range(5)]


@pytest.mark.parametrize("odd", [
    [],  # only rows: the one-call path
    ['{"acc": 0.3, "lo'],  # torn (a crash mid-write)
    ['{"a": {"b": 1}'],  # torn right after a nested object
    ['{"a": 1}, {"b": 2}'],  # two objects on one line
    ["[1", "2]"],  # a value spanning two lines
    ['{"a": [{"x": 1}', '{"y": 2}]}', '{"p": 1}, {"q": 2}'],  # spans and pairs balancing
    ["1", '"text"', "[]", "null"],  # values that are not objects
    ['{"s": "open', 'close"}'],  # a string across a line break
    ["", "   ", "\r"],  # blank lines
    ['{"a": NaN, "b": Infinity}'],  # what Python's json writes for nan and inf
    ["\x00\xff garbage"],
])
def test_rows_are_the_lines_that_are_one_object(odd: list[str]) -> None:
    lines = GOOD[:2] + odd + GOOD[2:]
    raw = "\n".join(lines).encode("utf-8") + b"\n"
    rows = parse_result_rows(raw)
    assert rows == _one_by_one(raw)
    assert rows[:2] + rows[-3:] == [json.loads(g) for g in GOOD]


def test_invalid_utf8_and_empty_input() -> None:
    assert parse_result_rows(b"") == []
    assert parse_result_rows(b"\n\n") == []
    raw = b'{"a": "\xff"}\n{"b": 1}\n'
    assert parse_result_rows(raw) == [{"a": "\ufffd"}, {"b": 1}]
