"""What a format cannot hold, and damaged sources, are typed errors raised
before anything is written; a missing Hugging Face index is rebuilt."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    FormatConversionError,
    InvalidConfigError,
    TensorCorruptError,
)
from checkpoint_store.formats import export_checkpoint, import_checkpoint
from tests.formats.conftest import Place


def _files(place: Place, name: str) -> list[str]:
    from checkpoint_store.registry import resolve

    backend, path = resolve(place.loc(name), filesystem=place.fs,
                            storage_options=(place.options or None) if place.fs is None
                            else None)
    import pyarrow.fs as pafs

    sel = pafs.FileSelector(path, allow_not_found=True, recursive=True)
    return sorted(i.path for i in backend.filesystem.get_file_info(sel))


def test_names_colliding_after_mapping_write_nothing(place: Place, tmp_path: Any) -> None:
    # "a.b" and {"a": {"b"}} both become the Hugging Face name "a.b".
    ck = place.persist_state(tmp_path, {"model": {"a.b": torch.zeros(2),
                                                  "a": {"b": torch.ones(2)}}})
    with pytest.raises(FormatConversionError, match="both map to the name 'a.b'") as err:
        export_checkpoint(ck, place.loc("hf"), **place.side("target_"))
    assert err.value.key == "model/a/b"
    assert _files(place, "hf") == []


def test_a_tensor_named_like_the_safetensors_header_writes_nothing(tmp_path: Any, make) -> None:
    # A state may hold a key "__metadata__" (escaped in our shards); as a
    # Hugging Face name it would overwrite the header's metadata entry.
    place = make("local")
    ck = place.persist_state(tmp_path, {"__metadata__": torch.arange(4.0), "w": torch.ones(2)})
    with pytest.raises(FormatConversionError, match="reserves") as err:
        export_checkpoint(ck, place.loc("hf"))
    assert err.value.key == "__metadata__"
    assert not os.path.exists(place.loc("hf"))
    # Under a name prefix it is an ordinary name, and the shard opens.
    out = export_checkpoint(ck, place.loc("hf2"), name_prefix="model.")
    from safetensors import safe_open

    with safe_open(os.path.join(place.loc("hf2"), out.files[0]), "pt") as f:
        assert sorted(f.keys()) == ["model.__metadata__", "model.w"]
        assert torch.equal(f.get_tensor("model.__metadata__"), torch.arange(4.0))


def test_a_value_safetensors_cannot_hold_writes_nothing(tmp_path: Any, make) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2), "kind": "linear"}})
    with pytest.raises(FormatConversionError, match="not a tensor") as err:
        export_checkpoint(ck, place.loc("hf"))
    assert err.value.key == "model/kind"
    assert not os.path.exists(place.loc("hf"))
    with pytest.raises(FormatConversionError, match="no tensor under 'encoder'"):
        export_checkpoint(ck, place.loc("hf"), prefix="encoder")
    assert not os.path.exists(place.loc("hf"))


def test_an_existing_export_is_not_overwritten(tmp_path: Any, make) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2)}})
    export_checkpoint(ck, place.loc("hf"))
    before = open(os.path.join(place.loc("hf"), "model.safetensors"), "rb").read()
    with pytest.raises(InvalidConfigError, match="holds 'model.safetensors' already"):
        export_checkpoint(ck, place.loc("hf"))
    assert open(os.path.join(place.loc("hf"), "model.safetensors"), "rb").read() == before


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_an_export_into_a_committed_checkpoint_writes_nothing(place: Place, tmp_path: Any,
                                                              fmt: str) -> None:
    """Found by a new user's try: ``export CKPT_0 CKPT_1`` added files to a
    committed checkpoint, which then failed verification and was skipped on
    resume. A folder holding a checkpoint's metadata is refused."""
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2)}})
    other = place.persist_state(tmp_path, {"model": {"w": torch.ones(2)}}, index=1)
    target = place.loc("exp/t/" + other.path.rstrip("/").rsplit("/", 1)[-1])
    with pytest.raises(InvalidConfigError, match="is a checkpoint"):
        export_checkpoint(ck, target, format=fmt, **place.side("target_"))
    other.verify()  # untouched: every file still the manifest's


def test_a_corrupt_tensor_stops_the_export_and_removes_its_files(tmp_path: Any,
                                                                 make) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.ones(1000)}})
    shard = next(n for n in os.listdir(ck.path) if n.endswith(".safetensors"))
    with open(os.path.join(ck.path, shard), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\x00" * 4)
    with pytest.raises(TensorCorruptError) as err:
        export_checkpoint(ck, place.loc("hf"))
    assert err.value.tensor == "model/w"
    assert not os.path.exists(place.loc("hf"))  # the folder it made too, as DCP's


@pytest.mark.parametrize("fmt", ["torch_save", "dcp"])
def test_a_corrupt_tensor_stops_a_streamed_torch_export_and_removes_it(
        fmt: str, tmp_path: Any, make) -> None:
    """torch.save and DCP exports write tensor by tensor, so a damaged tensor
    after the first stops them half-way: what they wrote goes, and a DCP
    directory's earlier files stay."""
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"a": torch.ones(8), "w": torch.ones(1000)}})
    shard = next(n for n in os.listdir(ck.path) if n.endswith(".safetensors"))
    with open(os.path.join(ck.path, shard), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\x00" * 4)
    target = place.loc("x.pt" if fmt == "torch_save" else "dcp")
    if fmt == "dcp":
        os.makedirs(target)
        open(os.path.join(target, "README"), "w").close()
    with pytest.raises(TensorCorruptError) as err:
        export_checkpoint(ck, target, format=fmt)
    assert err.value.tensor == "model/w"
    if fmt == "dcp":
        assert os.listdir(target) == ["README"]
    else:
        assert not os.path.exists(target)


def test_a_missing_hf_index_is_rebuilt_and_a_missing_shard_refused(place: Place,
                                                                   tmp_path: Any) -> None:
    tensors = {f"layer.{i}.w": torch.full((8,), float(i)) for i in range(6)}
    ck = place.persist_state(tmp_path, {"model": tensors})
    out = export_checkpoint(ck, place.loc("hf"), max_shard_size=70, **place.side("target_"))
    from checkpoint_store.registry import resolve

    backend, hf = resolve(place.loc("hf"), filesystem=place.fs,
                          storage_options=(place.options or None) if place.fs is None else None)
    backend.filesystem.delete_file(f"{hf}/model.safetensors.index.json")
    back = import_checkpoint(place.loc("hf"), place.loc("ck"), **place.side(""),
                             **place.side("dest_"))
    got = back.load_state()["model"]
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    # Without a shard the set is incomplete: refused, nothing written there.
    backend.filesystem.delete_file(f"{hf}/{out.files[1]}")
    with pytest.raises(CheckpointCorruptError, match="shard 2 of"):
        import_checkpoint(place.loc("hf"), **place.side(""))
    assert not any(p.endswith("state.json") for p in _files(place, "hf"))


def test_an_index_that_disagrees_with_the_headers_is_refused(tmp_path: Any) -> None:
    folder = tmp_path / "hub"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "gone.safetensors"}}')
    with pytest.raises(CheckpointCorruptError, match="names 'b'"):
        import_checkpoint(str(folder))
    assert sorted(os.listdir(folder)) == ["model-00001-of-00001.safetensors",
                                          "model.safetensors.index.json"]


def test_dcp_without_metadata_is_refused(tmp_path: Any, make) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(3)}})
    export_checkpoint(ck, place.loc("dcp"), format="dcp")
    os.remove(os.path.join(place.loc("dcp"), ".metadata"))
    with pytest.raises(CheckpointCorruptError, match="no .metadata"):
        import_checkpoint(place.loc("dcp"), str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck")


def test_a_torch_save_with_objects_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(2), "cfg": _Config()}, path)
    with pytest.raises(FormatConversionError, match="weights_only"):
        import_checkpoint(str(path), str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck")
    with pytest.raises(InvalidConfigError, match="give dest="):
        torch.save({"w": torch.zeros(2)}, tmp_path / "y.pt")
        import_checkpoint(str(tmp_path / "y.pt"))


class _Config:
    lr = 0.1


def test_overlapping_views_in_a_torch_save_are_refused(tmp_path: Any) -> None:
    base = torch.arange(10.0)
    torch.save({"a": base[:6], "b": base[4:]}, tmp_path / "x.pt")
    from checkpoint_store.errors import UnsupportedStateError

    with pytest.raises(UnsupportedStateError, match="overlap"):
        import_checkpoint(str(tmp_path / "x.pt"), str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck")


def test_a_committed_folder_is_not_imported_again(tmp_path: Any) -> None:
    folder = tmp_path / "hub"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "model.safetensors"))
    import_checkpoint(str(folder))
    with pytest.raises((CheckpointConflictError, InvalidConfigError)):
        import_checkpoint(str(folder), source_format="hf")


def test_a_dcp_object_a_state_cannot_hold_is_refused(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2), "cfg": {1, 2}}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    with pytest.raises(FormatConversionError, match="'cfg'.* set") as err:
        import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    assert err.value.key == "cfg"
    assert not os.path.exists(tmp_path / "ck")
    before = sorted(os.listdir(tmp_path / "dcp"))
    with pytest.raises(FormatConversionError):
        import_checkpoint(str(tmp_path / "dcp"))  # in place: nothing added either
    assert sorted(os.listdir(tmp_path / "dcp")) == before


def test_a_truncated_dcp_file_is_a_corrupt_checkpoint_on_import(tmp_path: Any) -> None:
    """DCP wraps a read failure in its CheckpointException (a BaseException):
    the import unwraps it into a CheckpointCorruptError and commits nothing."""
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(1000), "b": torch.zeros(10)}, checkpoint_id=src, no_dist=True)
    data = next(n for n in os.listdir(src) if n.endswith(".distcp"))
    os.truncate(os.path.join(src, data), os.path.getsize(os.path.join(src, data)) // 2)
    with pytest.raises(CheckpointCorruptError, match="DCP directory .* cannot be read"):
        import_checkpoint(src, str(tmp_path / "ck"))
    assert not (tmp_path / "ck" / ".internal_metadata.json").exists()


@pytest.mark.parametrize("fmt,name", [("torch_save", "x.pt"), ("dcp", "sub/dcp"),
                                      ("hf", "sub/hf")])
def test_an_export_under_a_committed_checkpoint_writes_nothing(fmt: str, name: str,
                                                               tmp_path: Any, make) -> None:
    """Found by a new user's try: ``export CKPT CKPT/model.pt`` (or a folder
    below it) wrote into the committed checkpoint, which then failed
    verification. A target at or below a checkpoint's folder is refused, as
    is one inside the source itself (an uncommitted ``from_state`` folder)."""
    from checkpoint_store import Checkpoint

    for kind in ("local", "memory"):
        place = make(kind)
        ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2)}, "step": 1})
        before = _files(place, "exp")
        with pytest.raises(InvalidConfigError, match="inside the checkpoint"):
            export_checkpoint(ck, f"{ck.uri}/{name}", format=fmt)
        assert _files(place, "exp") == before
        ck.verify()
    src = Checkpoint.from_state({"model": {"w": torch.zeros(2)}}, str(tmp_path / "state"))
    before = sorted(os.listdir(src.path))
    with pytest.raises(InvalidConfigError, match="inside the checkpoint"):
        export_checkpoint(src, str(tmp_path / "state" / name), format=fmt)
    assert sorted(os.listdir(src.path)) == before


def test_a_dcp_export_never_overwrites_a_folder_of_dcp_files(tmp_path: Any, make) -> None:
    """Found by a new user's try: a folder left by an unfinished DCP save
    (``.distcp`` files, no ``.metadata``) was exported into: the export
    overwrote ``__0_0.distcp``, and files of the old save stayed beside the
    new ``.metadata``. Any ``.distcp`` there is refused before a write."""
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2)}, "step": 1})
    target = place.loc("dcp")
    os.makedirs(target)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        with open(os.path.join(target, name), "wb") as f:
            f.write(b"old save")
    with pytest.raises(InvalidConfigError, match="DCP files"):
        export_checkpoint(ck, target, format="dcp")
    assert sorted(os.listdir(target)) == ["__0_0.distcp", "__1_0.distcp"]
    assert open(os.path.join(target, "__0_0.distcp"), "rb").read() == b"old save"


@pytest.mark.parametrize("fmt,name,fail", [("dcp", "dcp", "__0_2.distcp"),
                                           ("dcp", "dcp2", ".metadata"),
                                           ("torch_save", "x.pt", "x.pt")])
def test_a_failed_upload_leaves_nothing_at_the_target(fmt: str, name: str, fail: str,
                                                      tmp_path: Any, make) -> None:
    """Found by a new user's try: a torch.save or DCP export to an object
    store is written locally, then uploaded; an upload failing half-way left
    the files uploaded so far (a ``.metadata`` among them, whichever order
    the listing gave), a DCP folder that looked complete. The ``.metadata``
    is uploaded last, and a failed upload removes what it put there."""
    import pyarrow.fs as pafs

    from checkpoint_store.testing.faults import faulty_filesystem

    ck = make("local").persist_state(
        tmp_path, {"model": {f"w{i}": torch.full((100,), float(i)) for i in range(4)},
                   "step": 1})
    inner = pafs.PyFileSystem(pafs.FSSpecHandler(__import__("fsspec").filesystem("memory")))
    fs = faulty_filesystem(inner, permanent={"write": "no_space"}, path_contains=fail)
    root = f"/upload-{os.getpid()}-{name}"
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(ck, f"{root}/{name}", format=fmt, target_filesystem=fs)
    sel = pafs.FileSelector(root, allow_not_found=True, recursive=True)
    assert [i.path for i in inner.get_file_info(sel) if i.type == pafs.FileType.File] == []


def _damage_last_dcp_file(place: Place, name: str) -> None:
    """Overwrite the last ``.distcp`` file of DCP folder ``name`` with half its bytes."""
    from checkpoint_store.registry import resolve

    backend, path = resolve(place.loc(name), filesystem=place.fs,
                            storage_options=(place.options or None) if place.fs is None
                            else None)
    fs = backend.filesystem
    last = max(f for f in _files(place, name) if f.endswith(".distcp"))
    with fs.open_input_stream(last) as f:
        data = f.read()
    with fs.open_output_stream(last) as f:
        f.write(data[:len(data) // 2])


def test_an_in_place_import_failing_half_way_leaves_the_folder_as_it_was(
        place: Place, tmp_path: Any) -> None:
    """Found by a new user's try: an in-place import of a DCP folder whose
    second tensor file is damaged raised CheckpointCorruptError but left the
    state shards written before it in the user's folder."""
    ck = place.persist_state(tmp_path, {"a": torch.ones(4000), "b": torch.zeros(4000)})
    export_checkpoint(ck, place.loc("dcp"), format="dcp", **place.side("target_"))
    _damage_last_dcp_file(place, "dcp")
    before = _files(place, "dcp")
    with pytest.raises(CheckpointCorruptError, match="cannot be read"):
        import_checkpoint(place.loc("dcp"), shard_bytes=1000, **place.side(""))
    assert _files(place, "dcp") == before


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_an_in_place_import_of_a_read_only_folder_says_to_give_dest(fmt: str, tmp_path: Any,
                                                                     make) -> None:
    import pyarrow.fs as pafs
    from click.testing import CliRunner

    from checkpoint_store.cli import main
    from checkpoint_store.errors import PermanentBackendError
    from checkpoint_store.testing.faults import faulty_filesystem

    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.ones(3), "b": torch.zeros(2)}})
    src = place.loc(fmt)
    export_checkpoint(ck, src, format=fmt)
    before = sorted(os.listdir(src))
    read_only = faulty_filesystem(pafs.LocalFileSystem(), permanent={"write": "access_denied"})
    with pytest.raises(PermanentBackendError, match=r"cannot be written .*dest="):
        import_checkpoint(src, filesystem=read_only)
    assert sorted(os.listdir(src)) == before
    ck = import_checkpoint(src, str(tmp_path / "ck"), filesystem=read_only)  # dest: fine
    assert ck.is_committed and sorted(os.listdir(src)) == before
    if os.geteuid() == 0:
        return  # root writes a read-only folder: the CLI's check needs another user
    os.chmod(src, 0o555)
    try:
        res = CliRunner().invoke(main, ["import", src])
    finally:
        os.chmod(src, 0o755)
    assert res.exit_code == 1 and "DEST" in res.output, res.output
    assert sorted(os.listdir(src)) == before


@pytest.mark.parametrize("old", ["model.safetensors", "model-00001-of-00003.safetensors",
                                 "model.safetensors.index.json"])
def test_an_hf_export_beside_another_models_weights_writes_nothing(old: str, place: Place,
                                                                    tmp_path: Any) -> None:
    """Found by a new user's try: a sharded export into a folder holding an
    older ``model.safetensors`` succeeded, and transformers (which loads
    ``model.safetensors`` before the index) then loaded the old weights; an
    export beside an older shard set made a folder no import could read."""
    from safetensors.torch import save

    from checkpoint_store.registry import resolve

    ck = place.persist_state(tmp_path, {"model": {"w": torch.ones(4), "b": torch.zeros(4)}})
    backend, path = resolve(place.loc("hf"), filesystem=place.fs,
                            storage_options=(place.options or None) if place.fs is None
                            else None)
    backend.filesystem.create_dir(path, recursive=True)
    for name in (old, "README.md"):
        with backend.filesystem.open_output_stream(f"{path}/{name}") as f:
            f.write(save({"q": torch.ones(1)}) if name.endswith(".safetensors") else b"{}")
    before = _files(place, "hf")
    for shard in (4, 1000):  # sharded and one file
        with pytest.raises(InvalidConfigError, match=f"holds .*{re.escape(old)}"):
            export_checkpoint(ck, place.loc("hf"), max_shard_size=shard,
                              **place.side("target_"))
    assert _files(place, "hf") == before


def test_an_hf_export_beside_other_files_is_fine(tmp_path: Any, make) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.ones(4)}})
    os.makedirs(place.loc("hf"))
    open(os.path.join(place.loc("hf"), "config.json"), "w").write("{}")
    export_checkpoint(ck, place.loc("hf"))
    assert sorted(os.listdir(place.loc("hf"))) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("fmt,name", [("hf", "afile/hf"), ("torch_save", "afile/x.pt"),
                                      ("dcp", "afile/sub/dcp")])
def test_an_export_below_a_file_is_refused_before_any_write(fmt: str, name: str,
                                                            tmp_path: Any, make) -> None:
    """Found by a new user's try: a target below a file failed half-way with
    a bare FileExistsError (torch_save), NotADirectoryError (dcp), or an
    error blaming credentials (hf), in the Python API and the CLI alike."""
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"w": torch.ones(3)}})
    with open(place.loc("afile"), "w") as f:
        f.write("x")
    with pytest.raises(InvalidConfigError, match="which is a file"):
        export_checkpoint(ck, place.loc(name), format=fmt)
    res = CliRunner().invoke(main, ["export", ck.path, place.loc(name), "--format", fmt])
    assert res.exit_code == 2 and "which is a file" in res.output, res.output
    assert open(place.loc("afile")).read() == "x"


def test_an_import_into_or_below_a_file_or_a_checkpoint_writes_nothing(place: Place,
                                                                       tmp_path: Any) -> None:
    """Found by a new user's try: ``import m.safetensors CKPT/sub`` committed
    a checkpoint inside another, which then failed verification ('sub/...'
    is not in the manifest), where an export to the same place is refused;
    a destination that is a file or below one failed with an error blaming
    credentials."""
    from checkpoint_store.errors import NestedCheckpointError

    src = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2)}, str(src))
    ck = place.persist_state(tmp_path, {"model": {"w": torch.zeros(2)}})
    before = _files(place, "")
    at = ck.path if place.fs is not None else ck.uri
    for below in ("sub", "sub/deeper"):
        with pytest.raises(NestedCheckpointError, match="inside the committed checkpoint"):
            import_checkpoint(str(src), f"{at}/{below}", **place.side("dest_"))
    assert _files(place, "") == before
    ck.verify()
    if place.kind == "local":
        from click.testing import CliRunner

        from checkpoint_store.cli import main

        open(place.loc("afile"), "w").write("x")
        for dest in ("afile", "afile/ck"):
            with pytest.raises(InvalidConfigError, match="a file; import into a new folder"):
                import_checkpoint(str(src), place.loc(dest))
            res = CliRunner().invoke(main, ["import", str(src), place.loc(dest)])
            assert res.exit_code == 2 and "a file; import into" in res.output, res.output
        res = CliRunner().invoke(main, ["import", str(src), f"{ck.path}/sub"])
        assert res.exit_code == 2 and "inside the committed checkpoint" in res.output
        assert open(place.loc("afile")).read() == "x"
