"""DFlash2's mechanics: the block convolution, the candidate selector, the warm start, the selector loss, and the
export in the published contract read back by flashdraft and by the shipped modeling file."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, Qwen3Config

from flashdraft.config import ConfigError, load_config
from flashdraft.errors import BadInput
from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import load_drafter, save_drafter
from flashdraft.model.modeling_dflash import BlockConv
from flashdraft.model.objective import block_masks
from flashdraft.train.objectives import selector_step

TARGET = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1_000_000.0)
K = 4
SETTINGS = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


def dflash(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(draft_config(TARGET, num_layers=2, block_size=K, mask_token_id=95))


def perturbed(drafter: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Every weight moved off its initial value (the identities included), as after training."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * scale)
    return drafter


def dflash2(seed: int = 0) -> DFlash2Drafter:
    return perturbed(DFlash2Drafter.warm_start(dflash(seed), TARGET, **SETTINGS))


def run_blocks(drafter, anchors: torch.Tensor, block_embeds, features):
    """The training forward over every block at `anchors` of one sequence (context = the features)."""
    masks = block_masks(anchors, K, features.shape[1], None, "cpu")
    positions = (anchors[:, None] + torch.arange(K)).view(1, -1)
    with torch.no_grad():
        return drafter(block_embeds, features, positions, torch.arange(features.shape[1])[None], masks)


def test_the_convolution_at_identity_is_a_no_op_and_trained_taps_stay_inside_blocks():
    conv = BlockConv(32, kernel_size=2, group_size=16, block_size=K)
    x = torch.randn(2, 3 * K, 32)
    prepared, kernel = conv.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(conv.finish(x, kernel), x)
    perturbed(conv)
    out, _ = conv.prepare(x)
    changed = x.clone()
    changed[:, K - 1] += 1.0  # the last position of block 0
    after, _ = conv.prepare(changed)
    assert not torch.allclose(out[:, K - 1], after[:, K - 1])  # it moves its own position …
    assert torch.equal(out[:, K:], after[:, K:])  # … and never the next block's first (tap 1 reads zero there)


def test_a_fresh_dflash2_computes_exactly_what_its_dflash_backbone_computes():
    backbone = perturbed(dflash())
    warm = DFlash2Drafter.warm_start(backbone, TARGET, **SETTINGS)
    anchors = torch.tensor([10, 17, 23])
    torch.manual_seed(3)
    block, features = torch.randn(1, 3 * K, 32), torch.randn(1, 30, 2 * 32)
    hidden = run_blocks(warm, anchors, block, features)
    assert torch.equal(hidden, run_blocks(backbone, anchors, block, features))
    head = torch.randn(TARGET.vocab_size, 32)
    unary = warm.unary_logits(hidden[0] @ head.T)
    path, _, _ = warm.walk(unary[1:K], hidden[0, 1:K], anchor=7, pick=lambda score: score.argmax())
    assert torch.equal(path, unary[1:K].argmax(-1))  # the selector keeps the LM head's order until trained


def test_many_blocks_in_one_pass_equal_each_block_alone():
    """With trained (non-identity) convolutions: no tap leaks from one block into the next, padding blocks
    (anchor 0, seeing only themselves) included."""
    drafter = dflash2()
    anchors = torch.tensor([0, 9, 13, 22])  # anchor 0 is what a padding block looks like
    torch.manual_seed(4)
    block, features = torch.randn(1, 4 * K, 32), torch.randn(1, 30, 2 * 32)
    together = run_blocks(drafter, anchors, block, features)
    for n, anchor in enumerate(anchors.tolist()):
        alone = run_blocks(drafter, torch.tensor([anchor]), block[:, n * K : (n + 1) * K], features)
        assert torch.allclose(together[:, n * K : (n + 1) * K], alone, atol=1e-5), n


def top(drafter, unary):
    """The unary top-K′ and their logits, as the loss hands them to the selector."""
    candidates = unary.detach().topk(drafter.selector_top_k, dim=-1).indices
    return candidates, unary.gather(-1, candidates)


def test_gradients_reach_every_convolution_and_selector_tensor():
    drafter = dflash2()
    torch.manual_seed(5)
    anchors = torch.tensor([8, 15])
    block, features = torch.randn(1, 2 * K, 32), torch.randn(1, 24, 2 * 32)
    masks = block_masks(anchors, K, 24, None, "cpu")
    hidden = drafter(block, features, (anchors[:, None] + torch.arange(K)).view(1, -1), torch.arange(24)[None], masks)
    head = torch.randn(TARGET.vocab_size, 32)
    unary = drafter.unary_logits(hidden[0] @ head.T)
    labels = unary.detach().topk(3, dim=-1).indices[:, 2].view(2, K)  # inside the top-5, not the argmax
    weights = torch.ones(2 * K)
    weights[:: K] = 0
    result = selector_step(drafter, *top(drafter, unary), hidden[0], torch.tensor([3, 4]), labels, weights)
    result["weighted_ce"].backward()
    for name in ("layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"):
        grad = dict(drafter.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_a_label_outside_the_top_k_adds_nothing_and_is_counted():
    drafter = dflash2()
    torch.manual_seed(6)
    hidden = torch.randn(K, 32)
    unary = torch.randn(K, TARGET.vocab_size, requires_grad=True)
    ranked = unary.detach().argsort(dim=-1, descending=True)
    inside, outside = ranked[:, 1], ranked[:, 50]  # rank 1 is in the top-5, rank 50 is not
    weights = torch.tensor([0.0, 1.0, 1.0, 1.0])
    mixed = torch.stack([inside[0], inside[1], outside[2], inside[3]])[None]
    result = selector_step(drafter, *top(drafter, unary), hidden, torch.tensor([3]), mixed, weights)
    assert result["recall"].tolist() == [2, 3]  # slots 1 and 3 of the three supervised
    only_outside = torch.stack([inside[0], outside[1], outside[2], outside[3]])[None]
    nothing = selector_step(drafter, *top(drafter, unary), hidden, torch.tensor([3]), only_outside, weights)
    assert float(nothing["weighted_ce"].detach()) == 0.0
    assert nothing["recall"].tolist() == [0, 3] and nothing["selector"].tolist() == [0, 0]
    assert float(result["weighted_ce"].detach()) > 0


def test_the_export_is_the_published_dflash2_contract(tmp_path):
    drafter = dflash2()
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert config["dflash_config"] == {"block_size": K, "mask_token_id": 95, "target_layer_ids": [1, 3],
                                       "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                       "selector_top_k": 5, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    h, v = 32, TARGET.vocab_size
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 2, h)
    assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * h // 16, h)
    assert tensors["candidate_selector.predecessor_codebook"].shape == (v, 8)
    assert tensors["candidate_selector.successor_codebook"].shape == (v, 8)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (8, h)
    assert not [name for name in tensors if "embed" in name or "lm_head" in name]
    reloaded = load_drafter(tmp_path / "d")
    assert type(reloaded) is DFlash2Drafter
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), drafter.state_dict().values(),
                                                 strict=True))


def test_the_shipped_modeling_file_computes_forward_logits_and_path_as_flashdraft(tmp_path):
    drafter = dflash2()
    with torch.no_grad():  # a selector strong enough to re-rank (pairwise terms comparable to the logits)
        drafter.candidate_selector.predecessor_codebook.mul_(30)
        drafter.candidate_selector.successor_codebook.mul_(30)
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    assert type(model).__name__ == "DFlash2DraftModel"
    torch.manual_seed(7)
    context = 20
    block, features = torch.randn(1, K, 32), torch.randn(1, context, 2 * 32)
    head = torch.nn.Linear(32, TARGET.vocab_size, bias=False)
    ours = run_blocks(drafter, torch.tensor([context]), block, features)
    with torch.no_grad():
        theirs = model(position_ids=torch.arange(context + K)[None], noise_embedding=block, target_hidden=features)
        assert torch.allclose(theirs, ours, atol=1e-5)
        unary = drafter.unary_logits(head(ours))
        assert torch.allclose(model.compute_logits(theirs, head), unary, atol=1e-5)
        # exactly as z-lab's decoding loop calls it: the rows after the anchor's, the anchor, the head, T = 0
        path, candidates, q = model.propose(theirs[:, 1 - K:, :], torch.tensor([11]), head, 0.0)
        mine, my_candidates, _ = drafter.walk(unary[0, 1:], ours[0, 1:], 11, lambda score: score.argmax())
    assert path.shape == (1, K - 1) and q is None
    assert torch.equal(path[0], mine) and torch.equal(candidates[0], my_candidates)
    with torch.no_grad():  # sampling: a distribution over each slot's candidates, and the sample is one of them
        torch.manual_seed(0)
        sampled, candidates, q = model.propose(theirs[:, 1 - K:, :], torch.tensor([11]), head, 0.7)
    assert q.shape == (1, K - 1, candidates.shape[-1]) and torch.allclose(q.sum(-1), torch.ones(1, K - 1))
    assert bool((candidates == sampled[..., None]).any(-1).all())
    assert not torch.equal(mine, unary[0, 1:].argmax(-1))  # the trained selector re-ranks: the check has teeth


def test_dflash2_refuses_what_it_does_not_support():
    with pytest.raises(BadInput, match="full vocabulary"):
        dflash2_config(draft_config(TARGET, num_layers=1, block_size=K, mask_token_id=95, draft_vocab_size=24),
                       TARGET, **SETTINGS)
    with pytest.raises(BadInput, match="does not divide the hidden size"):
        dflash2_config(draft_config(TARGET, num_layers=1, block_size=K, mask_token_id=95), TARGET,
                       **{**SETTINGS, "conv_group_size": 12})
    with pytest.raises(ConfigError, match="dflash2 scores the full vocabulary"):
        load_config(None, {"train.architecture": "dflash2", "train.draft_vocab_size": 4096})
    with pytest.raises(ConfigError, match="dflash2 with sliding_window is not supported"):
        load_config(None, {"train.architecture": "dflash2", "train.sliding_window": 64})
