"""The target's states computed one decoder layer at a time from its checkpoint (model/streamed.py), as a trainer
holding only the embedding, final norm and head computes them to prove a fleet's states: equal to the whole model's,
for every family flashdraft trains against (dense, MoE with fused experts, the Gated-DeltaNet hybrid, VLM-wrapped)."""

import pytest
import torch

from flashdraft.model.target import Target
from tests.evaluate.test_targets import KINDS, PROMPT, build


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_states_equal_the_whole_models(kind, tmp_path):
    torch.manual_seed(0)
    build(kind).save_pretrained(tmp_path)
    whole = Target(str(tmp_path), "cpu", print)
    layers = [0, 2, 3]
    whole.watch(layers)
    expected_TNH = whole.features(torch.tensor([PROMPT]))[0].reshape(len(PROMPT), len(layers), -1)
    headless = Target(str(tmp_path), "cpu", print, layers=False)
    headless.watch([0, 2])  # its source layers: these and the last, 3
    assert headless.source_layers() == layers
    streamed_TNH = headless.streamed_states(PROMPT)
    assert streamed_TNH.shape == expected_TNH.shape
    assert torch.allclose(streamed_TNH, expected_TNH.float(), atol=1e-5, rtol=1e-5)
    assert all(p.device.type != "meta" for p in headless.model.parameters())  # the trainer's own model untouched


def test_a_checkpoint_that_lacks_a_layers_tensor_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    from flashdraft.errors import BadInput

    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    headless = Target(str(tmp_path), "cpu", print, layers=False)
    headless.watch([0, 2])
    with pytest.raises(BadInput, match=r"layer 1's mlp\.up_proj\.weight is not in its checkpoint"):
        headless.streamed_states(PROMPT)
