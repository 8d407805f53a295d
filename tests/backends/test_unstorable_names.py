"""A name the backend cannot store is refused before anything is written,
never written under another name. adlfs reads a ``?`` or ``#`` that ends a
name as an empty URL query or fragment and drops it, so trial ``t*1?`` wrote
into trial ``t*1``'s blobs. The Azure backend declares both with adlfs, and
``#`` with the pyarrow engine, which deletes through adlfs
(``Capabilities.unsupported_name_characters``), and every entry point refuses
them: ``session.start``, ``StorageContext``, checkpoint file names in uploads
and copies, the CLI's destinations."""

from __future__ import annotations

import re

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, InvalidConfigError, StorageContext, session
from checkpoint_store._transfer.trees import copy_tree
from checkpoint_store.backends import Capabilities
from checkpoint_store.cli import main
from checkpoint_store.errors import UnsafePathError
from checkpoint_store.testing import StorageLocation


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


#: What each Azure engine cannot store, as measured against Azurite.
REFUSED = {"adlfs": "?#", "pyarrow": "#"}


@pytest.fixture(params=["adlfs", "pyarrow"])
def azure(request, azure_server, azure_container):
    """Azure with each engine, a view of its blobs behind the backend's back,
    and the characters the engine refuses."""
    loc = StorageLocation(f"abfs://{azure_container}/runs",
                          azure_server.storage_options(request.param))
    return loc, lambda: dict(azure_server.list_blobs(azure_container)), REFUSED[request.param]


def test_each_engine_declares_what_it_cannot_store(azure):
    from checkpoint_store.registry import resolve

    loc, _, refused = azure
    backend, _ = resolve(loc.uri, storage_options=dict(loc.storage_options))
    assert backend.capabilities.unsupported_name_characters == refused


def _opts(loc: StorageLocation) -> list[str]:
    return [a for k, v in loc.storage_options.items() for a in ("-o", f"{k}={v}")]


def _src(tmp_path, files: dict[str, bytes], name: str = "src"):
    d = tmp_path / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def test_a_trial_named_with_a_trailing_question_mark_is_refused_not_mixed(azure, tmp_path):
    loc, blobs, refused = azure
    opts = dict(loc.storage_options)
    with session.start(storage_path=loc.uri, storage_options=opts,
                       experiment_name="exp", trial_name="t*1"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(
            _src(tmp_path, {"w.bin": b"t*1's weights"})))
    before = blobs()
    for char in refused:
        with pytest.raises(InvalidConfigError,
                           match=re.escape(f"trial_name 't*1{char}' holds {char!r}")):
            session.start(storage_path=loc.uri, storage_options=opts,
                          experiment_name="exp", trial_name=f"t*1{char}")
        with pytest.raises(InvalidConfigError, match=re.escape(f"experiment_name 'exp{char}'")):
            StorageContext(loc.uri, f"exp{char}", "t", storage_options=opts)
        with pytest.raises(InvalidConfigError,
                           match=re.escape(f"storage_path component 'runs{char}'")):
            StorageContext(loc.uri + char, "exp", "t", storage_options=opts)
    assert blobs() == before


def test_a_checkpoint_file_the_store_cannot_name_is_refused_before_the_first_write(
        azure, tmp_path):
    loc, blobs, refused = azure
    ctx = StorageContext(loc.uri, "exp", "t", storage_options=dict(loc.storage_options))
    for char in refused:
        src = _src(tmp_path, {"a.bin": b"a", f"sub/opt{char}": b"o", "z.bin": b"z"}, char)
        with pytest.raises(UnsafePathError,
                           match=re.escape(f"'sub/opt{char}' under") + f".*holds {char!r}.*Azure"):
            ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        with session.start(storage_path=loc.uri, storage_options=dict(loc.storage_options),
                           experiment_name="exp", trial_name="t"):
            with pytest.raises(InvalidConfigError, match=re.escape(f"'sub/opt{char}'")):
                session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
            assert session.get_checkpoint() is None
    assert [k for k in blobs() if "/t/checkpoint_" in k] == []


def test_cli_upload_and_cp_refuse_unstorable_names(azure, tmp_path):
    loc, blobs, _ = azure
    good = _src(tmp_path, {"w.bin": b"w"}, "good")
    bad = _src(tmp_path, {"w.bin": b"w", "notes#": b"n"}, "bad")
    res = _cli("upload", str(good), f"{loc.uri}/exp/t#", *_opts(loc))
    assert res.exit_code != 0 and "'t#'" in res.output and "'#'" in res.output
    res = _cli("upload", str(bad), f"{loc.uri}/exp/t", *_opts(loc))
    assert res.exit_code != 0 and "'notes#'" in res.output
    # cp of a trial whose second checkpoint holds such a file: refused before
    # the first checkpoint is copied.
    local = str(tmp_path / "local")
    with session.start(storage_path=local, experiment_name="exp", trial_name="t"):
        session.report({"i": 0}, checkpoint=Checkpoint.from_directory(good))
        session.report({"i": 1}, checkpoint=Checkpoint.from_directory(bad))
    res = _cli("cp", f"{local}/exp/t", f"{loc.uri}/exp/t", *_opts(loc))
    assert res.exit_code != 0 and "'notes#'" in res.output
    assert blobs() == {}


def test_copy_tree_checks_names_against_the_destination(tmp_path):
    # The path per-rank uploads take: no Backend at hand, only its capabilities.
    src = _src(tmp_path, {"a.bin": b"a", "b~c": b"b"})
    dst = tmp_path / "dst"
    caps = Capabilities(directories=True, unsupported_name_characters="~",
                        unsupported_name_hint="rename it")
    local = pafs.LocalFileSystem()
    with pytest.raises(UnsafePathError, match=r"'b~c'.*holds '~'.*\(rename it\)"):
        copy_tree(local, str(src), local, str(dst), caps)
    assert not dst.exists()
    copy_tree(local, str(src), local, str(dst), Capabilities(directories=True))
    assert (dst / "b~c").read_bytes() == b"b"


def test_storage_context_from_backend_checks_names_against_the_store(tmp_path):
    # The path integrations take (a Ray trial's name, the UI's listing): the
    # backend's limits apply as they do to StorageContext(...).
    import dataclasses

    from checkpoint_store.registry import resolve

    backend, root = resolve(str(tmp_path))
    caps = dataclasses.replace(backend.capabilities, unsupported_name_characters="~",
                               unsupported_name_hint="rename it")
    strict = dataclasses.replace(backend, capabilities=caps)
    with pytest.raises(InvalidConfigError, match=r"trial_name 't~1' holds '~'.*rename it"):
        StorageContext.from_backend(strict, root, "exp", "t~1")
    with pytest.raises(InvalidConfigError, match=r"experiment_name 'e~'"):
        StorageContext.from_backend(strict, root, "e~", "t")
    ctx = StorageContext.from_backend(strict, root, "exp", "t_1")
    assert ctx.trial_path == f"{root}/exp/t_1"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidConfigError, match=r"storage_path component 'r~'"):
        StorageContext.from_backend(strict, f"{root}/r~", "exp", "t")
    with pytest.raises(InvalidConfigError, match="a name checkpoint-store uses inside a trial"):
        StorageContext.from_backend(strict, root, "exp", "checkpoint_000001")


@pytest.mark.parametrize("wrap", [False, True], ids=["adlfs", "PyFileSystem(adlfs)"])
def test_an_adlfs_filesystem_passed_in_refuses_what_adlfs_drops(
        azure_server, azure_container, tmp_path, wrap):
    # The same client as the adlfs engine, handed over as an object: its
    # limits are the engine's ("d/a?" would be written as the blob "d/a").
    import adlfs

    fs = adlfs.AzureBlobFileSystem(connection_string=azure_server.connection_string,
                                   skip_instance_cache=True)
    if wrap:
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    root = f"{azure_container}/runs"
    ctx = StorageContext(root, "exp", "t", storage_filesystem=fs)
    ctx.persist_checkpoint(Checkpoint.from_directory(_src(tmp_path, {"w.bin": b"w"})), 0, {})
    before = dict(azure_server.list_blobs(azure_container))
    for char in REFUSED["adlfs"]:
        src = _src(tmp_path, {"a.bin": b"a", f"sub/opt{char}": b"o"}, f"bad{char}")
        with pytest.raises(UnsafePathError, match=re.escape(f"'sub/opt{char}'")
                           + f".*holds {char!r}.*engine': 'pyarrow'"):
            ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
        with pytest.raises(InvalidConfigError, match=re.escape(f"trial_name 't{char}'")):
            StorageContext(root, "exp", f"t{char}", storage_filesystem=fs)
    assert dict(azure_server.list_blobs(azure_container)) == before
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
