"""Every name checkpoint-store writes beside or inside a user's data, and every
scratch name it makes on a local disk, is spelled once, in
checkpoint_store/_format/layout.py (docs/format.md), as a constant or a
builder, with a parser where anything reads the name back.

Three kinds of tests: the bytes of every name layout.py exports (the format
must not change when code moves); build/parse round trips of each pair, and
that no name of ours reads as another; a scan of the package's source (its
syntax tree, so docstrings and comments may still show names) that finds no
name spelled outside ``_format/``.
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path

import pytest

from checkpoint_store._format import layout
from checkpoint_store._format.layout import (
    COMMIT_LOCK,
    DELETE_TOMBSTONE,
    LEASE_FILE,
    POINTER_FILE,
    RESULT_SEGMENTS_DIR,
    TEMP_FILE_PREFIX,
    TIER_STATE_FILE,
    WRITTEN_STATE_RECORD,
    abort_file_name,
    attempt_file_name,
    claim_name,
    clock_probe_name,
    deleting_dir_name,
    is_abort_file_name,
    is_attempt_file_name,
    is_deleting_dir_name,
    is_internal_name,
    is_local_tier_pointer_name,
    is_temp_file_name,
    is_written_record,
    local_tier_pointer_name,
    local_tier_rank_dir_name,
    parse_claim_name,
    parse_rank_marker_name,
    parse_staging_dir_name,
    parse_state_chunk_name,
    parse_state_log_name,
    parse_temp_file_name,
    parse_tier_exchange_name,
    rank_marker_name,
    share_dir_prefix,
    staging_dir_name,
    state_chunk_name,
    state_log_name,
    temp_file_name,
    tier_exchange_name,
    written_record_name,
)
from checkpoint_store.tiers import local_trial_dir

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "checkpoint_store"

# -- the bytes ------------------------------------------------------------------------

#: Every text constant layout.py exports, as it is stored: changing one is a
#: format change (docs/format.md), never a refactor.
LAYOUT_BYTES = {
    "STATE_KIND": "checkpoint_manager_state",
    "CHECKPOINT_PREFIX": "checkpoint_",
    "CHUNK_DIR": ".cs_chunks",
    "CHUNK_ROOT": "../../.cs_chunks",
    "CLOCK_PROBE_PREFIX": ".cs_clock-",
    "COMMIT_LOCK": ".cs_commit.lock",
    "DELETE_TOMBSTONE": ".cs_deleting",
    "EMPTY_PART_PREFIX": "cs-empty-part-",
    "ERROR_FILE": "error.txt",
    "INTERNAL_METADATA": ".internal_metadata.json",
    "INTERNAL_PREFIX": ".cs_",
    "LEASE_FILE": ".cs_manager_lease.json",
    "LEASE_LOCK": ".cs_manager_lease.lock",
    "LIGHTNING_STAGING_PREFIX": "lightning-",
    "DOWNLOAD_PREFIX": "download-",
    "LOCAL_TIER_POINTER_PREFIX": ".cs_local_tier-",
    "MANAGER_STATE": ".checkpoint_manager.json",
    "PARAMS_FILE": "params.json",
    "POINTER_FILE": ".cs_current",
    "RESULT_FILE": "result.json",
    "RESULT_SEGMENTS_DIR": ".cs_results",
    "SHARED_STAGING_NAME": "checkpoint-store-staging",
    "SHARED_STAGING_PREFIX": "checkpoint-store-staging-",
    "STAGED_COPY_PREFIX": "stage-",
    "KEPT_STAGED_PREFIX": "kept-",
    "STAGING_ROOT_NAME": "checkpoint_store_staging",
    "STATE_STAGING_PREFIX": "state-",
    "STOPPED_FILE": "stopped.json",
    "TEMP_FILE_PREFIX": ".cs_tmp-",
    "TIER_EXCHANGE_PREFIX": ".cs_tier-",
    "TIER_HOLDER_FILE": ".cs_tier_holder.json",
    "TIER_LOCK_FILE": ".cs_tier.lock",
    "TIER_STATE_FILE": ".cs_tier_state.json",
    "USER_METADATA": ".user_metadata.json",
    "WRITTEN_STATE_RECORD": ".cs_written-state.json",
}


def _exported_text() -> dict[str, str]:
    return {k: v for k in layout.__all__ if isinstance(v := getattr(layout, k), str)}


def test_every_layout_name_keeps_its_bytes() -> None:
    assert _exported_text() == LAYOUT_BYTES


def test_every_exported_layout_name_exists() -> None:
    assert [k for k in layout.__all__ if not hasattr(layout, k)] == []


# -- build/parse pairs ----------------------------------------------------------------


@pytest.mark.parametrize("attempt", ["0123456789abcdef", "torchrun-job-7-3", "a.b_c"])
@pytest.mark.parametrize("rank", [0, 7, 1024])
def test_a_tier_exchange_name_round_trips(attempt: str, rank: int) -> None:
    name = tier_exchange_name(attempt, rank)
    assert name == f".cs_tier-{attempt}-{rank}.json"
    assert parse_tier_exchange_name(name) == (attempt, rank)
    assert is_internal_name(name)


@pytest.mark.parametrize("name", [".cs_tier-a.json", ".cs_tier-a-1.json.x", ".cs_tier--1.json",
                                  ".cs_tier-a-x.json", TIER_STATE_FILE, "cs_tier-a-1.json"])
def test_other_names_are_no_tier_exchange_name(name: str) -> None:
    assert parse_tier_exchange_name(name) is None


def test_a_local_tier_pointer_name_keeps_a_safe_host_and_the_rank() -> None:
    assert local_tier_pointer_name("node-1.example", 3) == ".cs_local_tier-node-1.example-3.json"
    assert local_tier_pointer_name("a b/c\\d", 0) == ".cs_local_tier-a_b_c_d-0.json"
    assert local_tier_pointer_name("", 2) == ".cs_local_tier-host-2.json"
    long = local_tier_pointer_name("h" * 300, 1)
    assert long == f".cs_local_tier-{'h' * 64}-1.json"
    for name in (long, local_tier_pointer_name("é", 5)):
        assert is_local_tier_pointer_name(name) and is_internal_name(name)
    for other in (TIER_STATE_FILE, tier_exchange_name("a", 1), ".cs_local_tier-x-1.json.tmp"):
        assert not is_local_tier_pointer_name(other)


def test_a_local_tier_keeps_each_rank_in_its_rank_dir() -> None:
    assert local_tier_rank_dir_name(3) == "rank_3"
    assert local_trial_dir("/t", "e", "r", world_rank=3, world_size=4) == os.path.join(
        "/t", "e", "r", local_tier_rank_dir_name(3))
    assert local_trial_dir("/t", "e", "r") == os.path.join("/t", "e", "r")


def test_the_written_state_record_is_a_written_record() -> None:
    assert WRITTEN_STATE_RECORD == written_record_name("state")
    assert is_written_record(WRITTEN_STATE_RECORD)


def test_both_kinds_of_temporary_file_are_temporary_files(tmp_path: Path) -> None:
    fd, path = tempfile.mkstemp(prefix=TEMP_FILE_PREFIX, dir=tmp_path)
    os.close(fd)
    made = os.path.basename(path)
    built = temp_file_name("x.json", "12_34", "abcd")
    assert is_temp_file_name(made) and is_temp_file_name(built)
    assert is_internal_name(made)
    assert parse_temp_file_name(built) == "12_34"
    assert not is_temp_file_name(TIER_STATE_FILE)


@pytest.mark.parametrize("kind", [layout.STAGED_COPY_PREFIX, layout.STATE_STAGING_PREFIX,
                                  layout.LIGHTNING_STAGING_PREFIX, layout.DOWNLOAD_PREFIX])
def test_a_scratch_dir_name_round_trips_its_owner(kind: str) -> None:
    name = layout.scratch_dir_prefix(kind, "4242_98765") + "k2j_x9"
    assert layout.parse_scratch_dir_owner(name) == "4242_98765"
    assert layout.parse_scratch_dir_owner(f"{kind}k2j_x9") is None  # made before owners
    assert layout.parse_scratch_dir_owner("checkpoint_store_staging") is None
    with pytest.raises(ValueError):
        layout.scratch_dir_prefix("other-", "1_2")


def test_a_share_dir_prefix_names_its_directory() -> None:
    assert share_dir_prefix("checkpoint-500") == ".cs-share-checkpoint-500-"


#: name -> the one reader that must take it; every reader refuses every other name.
_READERS = {
    "tier exchange": lambda n: parse_tier_exchange_name(n) is not None,
    "local tier pointer": is_local_tier_pointer_name,
    "tier state": lambda n: n == TIER_STATE_FILE,
    "tier lock": lambda n: n in (layout.TIER_LOCK_FILE, layout.TIER_HOLDER_FILE),
    "temporary file": is_temp_file_name,
    "written record": is_written_record,
    "state log": lambda n: parse_state_log_name(n) is not None,
    "state chunk": lambda n: parse_state_chunk_name(n) is not None,
    "staging": lambda n: parse_staging_dir_name(n) is not None,
    "deleting": is_deleting_dir_name,
    "tombstone": lambda n: n == DELETE_TOMBSTONE,
    "attempt": is_attempt_file_name,
    "abort": is_abort_file_name,
    "claim": lambda n: parse_claim_name(n) is not None,
    "rank marker": lambda n: parse_rank_marker_name(n) is not None,
    "pointer": lambda n: n == POINTER_FILE,
    "lease": lambda n: n in (LEASE_FILE, layout.LEASE_LOCK),
    "commit lock": lambda n: n == COMMIT_LOCK,
    "result segments": lambda n: n == RESULT_SEGMENTS_DIR,
    "clock probe": lambda n: n.startswith(layout.CLOCK_PROBE_PREFIX),
}
_SAMPLES = {
    "tier exchange": [tier_exchange_name("att-1", 0), tier_exchange_name("a", 12)],
    "local tier pointer": [local_tier_pointer_name("host-1", 0)],
    "tier state": [TIER_STATE_FILE],
    "tier lock": [layout.TIER_LOCK_FILE, layout.TIER_HOLDER_FILE],
    "temporary file": [temp_file_name(TIER_STATE_FILE, "1_2", "ab"), f"{TEMP_FILE_PREFIX}k2j_x9"],
    "written record": [WRITTEN_STATE_RECORD, written_record_name("rank3")],
    "state log": [state_log_name(7)],
    "state chunk": [state_chunk_name(7, 2)],
    "staging": [staging_dir_name("checkpoint_000001", "w1")],
    "deleting": [deleting_dir_name("checkpoint_000001", "w1")],
    "tombstone": [DELETE_TOMBSTONE],
    "attempt": [attempt_file_name("att-1")],
    "abort": [abort_file_name("checkpoint_000001", "att-1")],
    "claim": [claim_name(10**18, "w1")],
    "rank marker": [rank_marker_name(3)],
    "pointer": [POINTER_FILE],
    "lease": [LEASE_FILE, layout.LEASE_LOCK],
    "commit lock": [COMMIT_LOCK],
    "result segments": [RESULT_SEGMENTS_DIR],
    "clock probe": [clock_probe_name("abc")],
}


def test_no_name_of_ours_reads_as_another() -> None:
    assert set(_SAMPLES) == set(_READERS)
    wrong = {(kind, name, [k for k, read in _READERS.items() if read(name)])
             for kind, names in _SAMPLES.items() for name in names
             if [k for k, read in _READERS.items() if read(name)] != [kind]}
    assert wrong == set()
    assert all(is_internal_name(n) for names in _SAMPLES.values() for n in names)


# -- no name spelled outside _format/ ---------------------------------------------------

_TEMP_CALLS = {"mkdtemp", "mkstemp", "TemporaryDirectory", "NamedTemporaryFile",
               "SpooledTemporaryFile"}


def _scan(rel: str, source: str) -> set[tuple[str, str]]:
    """``(rel, what)`` for each name spelled in ``source`` instead of taken
    from layout.py, at most one finding per expression:

    - a temporary file's or directory's literal prefix, or a shared memory name;
    - a name built with ``INTERNAL_PREFIX`` first (f-string or ``+``);
    - a text literal (or an f-string's literal part) that holds ``.cs_`` or
      ``.cs-``, or that equals a name layout.py exports.

    Docstrings (and other bare string statements) are not code and not scanned.
    """
    values = {v: k for k, v in _exported_text().items()}
    tree = ast.parse(source)
    skip = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found: set[tuple[str, str]] = set()

    def mark(node: ast.AST, what: str) -> None:
        found.add((rel, f"{what}: {ast.unparse(node)}"))
        skip.update(id(n) for n in ast.walk(node))

    def is_prefix_name(node: ast.AST) -> bool:
        return ast.unparse(node).split(".")[-1] == "INTERNAL_PREFIX"

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = [k.value for k in node.keywords if k.arg == "prefix"]
            if called in ("mkdtemp", "mkstemp") and len(node.args) >= 2:
                args.append(node.args[1])  # (suffix, prefix, dir)
            if called == "memfd_create" and node.args:
                args.append(node.args[0])
            for arg in args:
                if called in _TEMP_CALLS | {"memfd_create"} and isinstance(
                        arg, (ast.Constant, ast.JoinedStr)):
                    mark(arg, "temporary name")
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(
                node.values[0], ast.FormattedValue) and is_prefix_name(node.values[0].value):
            mark(node, "built on INTERNAL_PREFIX")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) \
                and is_prefix_name(node.left):
            mark(node, "built on INTERNAL_PREFIX")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if ".cs_" in node.value or ".cs-" in node.value:
                mark(node, "spelled .cs name")
            elif node.value in values:
                mark(node, f"spelled {values[node.value]}")
    return found


def _modules() -> dict[str, str]:
    """Every module of the package outside ``_format/``: relative path -> source."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("checkpoint_store/_format/"):
            out[rel] = path.read_text(encoding="utf-8")
    return out


#: Scratch directories in the system temporary directory (or beside a test
#: harness's own log), made and removed by one process: never on storage, in
#: the staging root or beside a user's files, so not layout names. Listed one
#: by one, so a new literal prefix anywhere fails the scan until it is put
#: here, with a reason, or in layout.py.
SYSTEM_TEMP_SCRATCH = {
    # Checkpoint.from_state / to_directory / as_directory without a directory.
    ("checkpoint_store/checkpoint.py", "temporary name: 'checkpoint-state-'"),
    ("checkpoint_store/demo/__init__.py", "temporary name: 'digits-ckpt-'"),
    # formats: a remote torch.save/DCP source read locally, a torch.save/DCP
    # export written locally before its upload; removed when the call returns.
    ("checkpoint_store/formats/_api.py", "temporary name: 'checkpoint-store-format-'"),
    ("checkpoint_store/formats/_export.py", "temporary name: 'checkpoint-store-export-'"),
    ("checkpoint_store/integrations/_lightning/callback.py", "temporary name: 'cs-lightning-'"),
    ("checkpoint_store/integrations/_lightning/callback.py",
     "temporary name: 'cs-lightning-resume-'"),
    ("checkpoint_store/integrations/ray/_session.py", "temporary name: 'cs-ray-'"),
    # Test harnesses (crash children, the retention state machine, emulators).
    ("checkpoint_store/testing/crash/_child.py", "temporary name: 'cs-crash-child-'"),
    ("checkpoint_store/testing/crash/tiers.py", "temporary name: 'cs-crash-tier-'"),
    ("checkpoint_store/testing/servers.py", "temporary name: f'cs-{cls.__name__.lower()}-'"),
    ("checkpoint_store/testing/stateful.py", "temporary name: 'cs-retention-src-'"),
    ("checkpoint_store/testing/chunk_gc.py", "temporary name: 'cs-chunk-gc-'"),
    ("checkpoint_store/testing/stateful.py", "temporary name: 'cs-retention-'"),
}

#: Names session/ still spells while its modules are being rewritten; each goes
#: when session/ takes the layout name in brackets. Empty this set as they do:
#: the second test below fails for an entry that is no longer found.
PENDING_SESSION_SWITCHES: set[tuple[str, str]] = set()


def _found() -> set[tuple[str, str]]:
    return {f for rel, source in _modules().items() for f in _scan(rel, source)}


def test_no_name_is_spelled_outside_layout() -> None:
    extra = _found() - SYSTEM_TEMP_SCRATCH - PENDING_SESSION_SWITCHES
    assert extra == set(), (
        "take these names from checkpoint_store/_format/layout.py (add them there "
        f"first, with their bytes in LAYOUT_BYTES): {sorted(extra)}")


def test_every_listed_exception_is_still_found() -> None:
    stale = (SYSTEM_TEMP_SCRATCH | PENDING_SESSION_SWITCHES) - _found()
    assert stale == set(), f"no longer spelled there: remove from this test's lists: {stale}"


def test_the_scan_covers_the_package_and_finds_each_kind_of_spelling() -> None:
    modules = _modules()
    for rel in ("checkpoint_store/tiers/view.py", "checkpoint_store/state/_staging.py",
                "checkpoint_store/session/_tier_recovery.py", "checkpoint_store/integrations/hf.py",
                "checkpoint_store/testing/stateful.py"):
        assert rel in modules
    assert not any(rel.startswith("checkpoint_store/_format/") for rel in modules)
    source = '''
"""Docstrings may say .cs_tier_state.json."""
import os, tempfile
from checkpoint_store._format.layout import INTERNAL_PREFIX
from checkpoint_store._format import layout
A = f"{INTERNAL_PREFIX}tier-{1}.json"
B = layout.INTERNAL_PREFIX + "current"
C = ".cs_written-state.json"
D = tempfile.mkdtemp(prefix="stage-")
E = tempfile.mkstemp(".x", "mine-")
F = os.memfd_create("shm", 0)
G = f"checkpoint_{7:06d}"
H = {"name": "result.json"}
I = f"{os.sep}.cs-share-{A}-"
'''
    assert {what.split(":")[0] for _, what in _scan("m.py", source)} == {
        "built on INTERNAL_PREFIX", "spelled .cs name", "temporary name",
        "spelled CHECKPOINT_PREFIX", "spelled RESULT_FILE"}
    assert len(_scan("m.py", source)) == 9
