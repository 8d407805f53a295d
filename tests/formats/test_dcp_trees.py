"""DCP keeps a tree as flat entries: tensors, and every other value pickled
whole (a tuple, a list of plain values). An export must put real bytes in
the pickled ones, and an import must give back the lists DCP's paths name."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from checkpoint_store import Checkpoint
from checkpoint_store.formats import export_checkpoint, import_checkpoint
from tests.formats.test_round_trips import same_bits


def test_tensors_in_a_tuple_are_exported_with_their_bytes(tmp_path: Any) -> None:
    """Found by a new user's try: DCP pickles a tuple whole, and the export
    pickled the meta-device placeholder it plans with: the tensor inside
    came back as a meta tensor (no bytes). It is read in now; DCP's own
    tools and the import give back the tuple, bit-exact."""
    w = torch.randn(3, 4)
    tree = {"model": {"w": w, "pair": (torch.arange(5), 3, "s", None),
                      "nested": [(torch.ones(2, dtype=torch.bfloat16),)]}, "step": 2}
    ck = Checkpoint.from_state(tree, str(tmp_path / "ck"))
    out = str(tmp_path / "dcp")
    export_checkpoint(ck, out, format="dcp")
    dcp_to_torch_save(out, str(tmp_path / "back.pt"))
    got = torch.load(str(tmp_path / "back.pt"), weights_only=True)
    pair = got["model"]["pair"]
    assert pair[0].device.type == "cpu" and torch.equal(pair[0], torch.arange(5))
    assert pair[1:] == (3, "s", None)
    assert torch.equal(got["model"]["nested"][0][0], tree["model"]["nested"][0][0])
    back = import_checkpoint(out, str(tmp_path / "imported")).load_state()
    same_bits({"w": back["model"]["w"], "p": back["model"]["pair"][0],
               "n": back["model"]["nested"][0][0]},
              {"w": w, "p": torch.arange(5), "n": tree["model"]["nested"][0][0]})
    assert isinstance(back["model"]["pair"], tuple) and back["model"]["pair"][1:] == (3, "s", None)
    assert back["step"] == 2


def test_an_imported_dcp_keeps_its_lists(tmp_path: Any) -> None:
    """Found by a new user's try: DCP names a list's items by their index
    (an int in its paths; a dict's int keys it writes as strings), and the
    import made every list a dict keyed "0", "1": an optimizer's
    ``param_groups`` no longer loaded. Lists come back as lists, as
    ``dcp_to_torch_save`` gives them."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tree = {"model": model.state_dict(), "optim": opt.state_dict(),
            "layers": [{"w": torch.ones(2)}, {"w": torch.zeros(2)}], "step": 3}
    src = str(tmp_path / "dcp")
    dcp.save(tree, checkpoint_id=src, no_dist=True)
    got = import_checkpoint(src, str(tmp_path / "imported")).load_state()
    dcp_to_torch_save(src, str(tmp_path / "ref.pt"))
    ref = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    assert isinstance(got["layers"], list) and isinstance(got["optim"]["param_groups"], list)
    assert torch.equal(got["layers"][1]["w"], torch.zeros(2))
    assert got["optim"]["param_groups"][0]["lr"] == 0.01
    assert got["optim"]["param_groups"][0]["params"] == [0, 1]
    assert sorted(got["optim"]["state"]) == sorted(ref["optim"]["state"])
    for k, v in ref["optim"]["state"]["0"].items():
        assert torch.equal(got["optim"]["state"]["0"][k], v), k
    # A list of the state's own comes back as a list after an export too.
    ck = Checkpoint.from_state({"layers": [torch.ones(1), {"b": torch.zeros(1)}]},
                               str(tmp_path / "ck"))
    export_checkpoint(ck, str(tmp_path / "out"), format="dcp")
    again = import_checkpoint(str(tmp_path / "out"), str(tmp_path / "again")).load_state()
    assert isinstance(again["layers"], list) and torch.equal(again["layers"][0], torch.ones(1))
