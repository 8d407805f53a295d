"""The exported Hugging Face folder is what ``transformers`` and
``safetensors`` expect: ``from_pretrained`` loads it (sharded, with its
index) into a model equal to the one reported, and ``safe_open`` reads
each shard alone."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from checkpoint_store.errors import FormatConversionError
from checkpoint_store.formats import export_checkpoint, import_checkpoint

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> Any:
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _equal(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_from_pretrained_loads_a_sharded_export(make, tmp_path: Any) -> None:
    place = make("local")
    model = _llama()
    ck = place.persist_state(tmp_path, {"model": model.state_dict(), "step": 12})
    target = tmp_path / "hf"
    out = export_checkpoint(ck, str(target), max_shard_size=8 << 10)
    assert len(out.files) > 3 and "model.safetensors.index.json" in out.files
    model.config.save_pretrained(str(target))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    _equal(model, loaded)

    from safetensors import safe_open

    index = json.loads((target / "model.safetensors.index.json").read_text())
    seen = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(target / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                seen[k] = f.get_tensor(k)
    assert set(seen) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in seen.values())


def test_tied_weights_are_refused_unless_dropped(make, tmp_path: Any) -> None:
    place = make("local")
    model = _gpt2()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    ck = place.persist_state(tmp_path, {"model": sd})
    target = tmp_path / "hf"
    with pytest.raises(FormatConversionError, match="shares its storage") as err:
        export_checkpoint(ck, str(target))
    assert err.value.key == "model/lm_head.weight"
    assert not target.exists() or os.listdir(target) == []
    export_checkpoint(ck, str(target), shared="drop")
    model.config.save_pretrained(str(target))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    _equal(model, loaded)


def test_a_hub_folder_imported_fine_tunes_from_load_state_into(tmp_path: Any) -> None:
    """``save_pretrained``'s own folder (sharded) becomes a checkpoint in
    place; ``load_state(into=)`` fills a fresh model with it."""
    model = _llama()
    hub = tmp_path / "hub"
    model.save_pretrained(str(hub), max_shard_size="20KB")
    assert (hub / "model.safetensors.index.json").exists()
    ck = import_checkpoint(str(hub))
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(model.config)
    ck.load_state(into={"model": fresh.state_dict()})
    _equal(model, fresh)
