"""The shipped hypothesis strategies draw what they promise (others import them)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import validate_component
from checkpoint_store.testing import strategies as cst


@settings(max_examples=60, deadline=None)
@given(name=cst.path_components())
def test_path_components_are_valid_layout_names(name):
    assert validate_component(name, "trial_name") == name
    assert name == name.strip()


@settings(max_examples=60, deadline=None)
@given(m=cst.metrics())
def test_metrics_are_json_objects_without_slash_keys(m):
    clean = _json.to_json_object(m, "metrics")
    back = _json.loads(_json.dumps(clean))

    def same(a, b):
        if isinstance(a, float) and math.isnan(a):
            return isinstance(b, float) and math.isnan(b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    assert same(clean, back)

    def keys(d):
        for k, v in d.items():
            yield k
            if isinstance(v, dict):
                yield from keys(v)

    assert all("/" not in k for k in keys(m))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=cst.directory_trees(), trial=cst.path_components())
def test_directory_trees_round_trip_through_a_checkpoint(tree, trial):
    work = tempfile.mkdtemp(prefix="cs-strategies-")
    try:
        src = os.path.join(work, "src")
        for rel, data in tree.items():
            path = os.path.join(src, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        storage = StorageContext(os.path.join(work, "runs"), "exp", trial, fsync=False)
        ckpt = storage.persist_checkpoint(Checkpoint(src), 0, {})
        out = ckpt.to_directory(os.path.join(work, "out"))
        got = {}
        for root, _, files in os.walk(out):
            for name in files:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    got[os.path.relpath(full, out).replace(os.sep, "/")] = f.read()
        assert got == tree
    finally:
        shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=100, deadline=None)
@given(cfg=cst.checkpoint_configs(), s=cst.scores())
def test_configs_are_valid_and_scores_are_numbers_or_missing(cfg, s):
    assert isinstance(cfg, CheckpointConfig)
    assert cfg.num_to_keep is None or 1 <= cfg.num_to_keep <= 4
    assert s is None or isinstance(s, (int, float))


def test_scores_cover_the_hard_cases():
    seen = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(s=cst.scores())
    def collect(s):
        if s is None:
            seen.add("missing")
        elif isinstance(s, float) and math.isnan(s):
            seen.add("nan")
        elif s in (math.inf, -math.inf):
            seen.add("inf")

    collect()
    assert seen == {"missing", "nan", "inf"}


def test_unused_strategy_names_exist():
    assert isinstance(cst.file_names(), st.SearchStrategy)
    assert isinstance(cst.metric_values(), st.SearchStrategy)
