"""The z-lab export format, written and read back."""

import json

import torch
from safetensors.torch import load_file

from flashdraft.artifact.manifest import read_manifest
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import load_drafter, save_drafter


def test_export_round_trip(tiny_target, tmp_path):
    from transformers import AutoConfig

    config = draft_config(AutoConfig.from_pretrained(tiny_target), num_layers=2, block_size=8, mask_token_id=127)
    drafter = DFlashDrafter(config)
    save_drafter(drafter, tmp_path / "drafter", stats={"x": 1})
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert raw["num_target_layers"] == 6 and raw["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 3]}
    assert raw["model_type"] == "qwen3" and raw["num_hidden_layers"] == 2
    names = set(load_file(str(tmp_path / "drafter" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    assert read_manifest(tmp_path / "drafter").kind == "drafter"
    loaded = load_drafter(tmp_path / "drafter")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.block_size == 8 and loaded.target_layer_ids == [1, 3] and loaded.mask_token_id == 127


def test_an_architecture_without_decoder_layers_is_named(tmp_path):
    import pytest
    from transformers import GPT2Config, GPT2LMHeadModel

    from flashdraft.errors import BadInput
    from flashdraft.model.target import language_model

    with pytest.raises(BadInput, match="GPT2LMHeadModel: cannot find its decoder layers"):
        language_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
