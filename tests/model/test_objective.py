"""The DFlash training objective: the block mask, same-position labels, anchors, τ from rates, layer picks."""

import math

import pytest
import torch

from flashdraft.model.drafter import DFlashDrafter, draft_config, uniform_layer_ids
from flashdraft.model.objective import (
    block_attention_mask,
    build_blocks,
    expected_acceptance_length,
    loss_gamma,
    sample_anchors,
)

# ------------------------------------------------------------------------------------------- the mask


def test_each_block_sees_only_earlier_context_and_itself():
    from transformers import Qwen3Config

    target_config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(target_config, num_layers=2, block_size=4, mask_token_id=127)).eval()
    anchors = torch.tensor([10, 20, 30])
    k, c = 4, 40
    features = torch.randn(1, c, 2 * 32)
    embeds = torch.randn(1, 3 * k, 32)
    positions = (anchors[:, None] + torch.arange(k)).view(1, -1)
    allowed = block_attention_mask(anchors, k, c)[None]

    def out(f, e):
        with torch.no_grad():
            return drafter(e, f, positions, torch.arange(c)[None], allowed).view(3, k, -1)

    base = out(features, embeds)

    def changed(f=features, e=embeds):
        return [not torch.allclose(base[n], out(f, e)[n], atol=1e-6) for n in range(3)]

    f = features.clone()
    f[0, 15] += 1.0  # visible to blocks anchored at 20 and 30 only
    assert changed(f=f) == [False, True, True]
    f = features.clone()
    f[0, 20] += 1.0  # the anchor's own position: strictly-before means block 2 cannot see it
    assert changed(f=f) == [False, False, True]
    e = embeds.clone()
    e[0, k + 2] += 1.0  # a token inside block 2: the whole block sees it (bidirectional), no other block
    assert changed(e=e) == [False, True, False]
    bidirectional = out(features, e)[1, 0]  # position 0 of that block sees a later position of its block
    assert not torch.allclose(bidirectional, base[1, 0], atol=1e-6)


def test_flex_attention_block_mask_matches_the_dense_mask(tiny_target):
    """The CUDA path (FlexAttention BlockMask) computes what the CPU path (SDPA + dense mask) does. Checked
    with FlexAttention's eager implementation, forward only: torch has no FlexAttention backward on CPU."""
    from transformers import AutoConfig

    from flashdraft.model.objective import flex_block_mask

    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(AutoConfig.from_pretrained(tiny_target), num_layers=2, block_size=8,
                                         mask_token_id=127))
    anchors, context = torch.tensor([3, 9, 17, 30]), 31
    args = (torch.randn(1, 32, 64), torch.randn(1, context, 2 * 64), (anchors[:, None] + torch.arange(8)).view(1, -1),
            torch.arange(context)[None])
    with torch.no_grad():
        dense = drafter(*args, block_attention_mask(anchors, 8, context)[None])
        flex = drafter(*args, flex_block_mask(anchors, 8, context, "cpu"))
        dense_window = drafter(*args, block_attention_mask(anchors, 8, context, window=10)[None])
        flex_window = drafter(*args, flex_block_mask(anchors, 8, context, "cpu", window=10))
    assert torch.allclose(dense, flex, atol=1e-5) and torch.allclose(dense_window, flex_window, atol=1e-5)
    assert not torch.allclose(dense, dense_window, atol=1e-3)  # the window does restrict what is seen


@pytest.mark.parametrize("window", [None, 10])
def test_the_flex_mask_rule_is_the_dense_one_at_every_query_and_key_of_a_padded_batch(window):
    """Element for element, what FlexAttention's mask function allows is the dense mask of each sequence — a batch
    whose second row is padded with anchor-0 blocks (they see only themselves) included."""
    from torch.nn.attention.flex_attention import create_mask

    from flashdraft.model.objective import flex_block_mask

    k, context = 8, 31
    anchors = torch.tensor([[3, 9, 17, 30], [5, 12, 0, 0]])
    mask = flex_block_mask(anchors, k, context, "cpu", window=window)
    allowed = create_mask(mask.mask_mod, 2, None, 4 * k, context + 4 * k, "cpu")[:, 0]
    assert torch.equal(allowed[0], block_attention_mask(anchors[0], k, context, window=window))
    padded = block_attention_mask(torch.tensor([5, 12]), k, context, window=window)  # its two real blocks
    assert torch.equal(allowed[1, : 2 * k, :context], padded[:, :context])
    assert torch.equal(allowed[1, : 2 * k, context : context + 2 * k], padded[:, context:])
    assert not allowed[1, : 2 * k, context + 2 * k :].any()  # real blocks never see padding blocks
    for n in (2, 3):  # a padding block: no context, only its own positions
        rows = allowed[1, n * k : (n + 1) * k]
        assert not rows[:, :context].any()
        own = rows[:, context + n * k : context + (n + 1) * k]
        everything = torch.ones(k, k, dtype=torch.bool)
        assert torch.equal(own, everything if window is None else everything.tril())


def test_a_sliding_window_block_sees_only_recent_context_and_its_own_block_causally():
    anchors, k, context, window = torch.tensor([5, 20, 33]), 4, 34, 8
    allowed = block_attention_mask(anchors, k, context, window=window)
    for s in range(len(anchors) * k):
        block, offset = divmod(s, k)
        position = int(anchors[block]) + offset
        for c in range(context):
            assert bool(allowed[s, c]) == (c < anchors[block] and position - c < window), (s, c)
        own = torch.zeros(len(anchors) * k, dtype=torch.bool)
        own[block * k : s + 1] = True  # its own block, up to itself
        assert torch.equal(allowed[s, context:], own)
    full = block_attention_mask(anchors, k, context)
    assert bool(full[0, context + k - 1])  # a full-attention layer's block is bidirectional


def test_sliding_window_layers_export_as_the_standard_fields(tmp_path):
    from transformers import Qwen3Config

    from flashdraft.errors import BadInput
    from flashdraft.model.export import load_drafter, save_drafter

    target = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    drafter = DFlashDrafter(draft_config(target, num_layers=3, block_size=8, mask_token_id=127, sliding_window=64))
    assert drafter.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    save_drafter(drafter, tmp_path / "d")
    raw = __import__("json").loads((tmp_path / "d" / "config.json").read_text())
    assert raw["layer_types"] == drafter.layer_types and raw["sliding_window"] == 64 and raw["use_sliding_window"]
    # No causality override: sliding layers causal and full layers not is every engine's default, and either
    # flag (vLLM's `is_causal`, `dflash_config.causal`) would apply to all layers at once.
    assert "is_causal" not in raw and "causal" not in raw["dflash_config"]
    assert load_drafter(tmp_path / "d").sliding_window == 64
    with pytest.raises(BadInput, match="smaller than the block size"):
        draft_config(target, num_layers=3, block_size=8, mask_token_id=127, sliding_window=4)


def test_blocks_use_same_position_labels_and_decay():
    ids = torch.arange(100, 140)
    mask = torch.ones(40, dtype=torch.long)
    mask[:5] = 0
    anchors = torch.tensor([5, 12])
    block_ids, positions, labels, weights = build_blocks(ids, mask, anchors, 4, mask_token_id=999)
    assert block_ids.tolist() == [[105, 999, 999, 999], [112, 999, 999, 999]]
    assert positions.tolist() == [[5, 6, 7, 8], [12, 13, 14, 15]]
    assert labels.tolist() == [[105, 106, 107, 108], [112, 113, 114, 115]]  # the token AT anchor + k
    assert weights[:, 0].tolist() == [0.0, 0.0]  # the anchor is not predicted
    assert weights[0, 1] == 1.0 and weights[0, 2] < 1.0 and weights[0, 3] < weights[0, 2]
    # The paper's γ for a block size unless `train.loss_decay_gamma` gives one: exp(−(k−1)/γ).
    paper = build_blocks(ids, mask, anchors, 8, mask_token_id=999)[3][0]
    steep = build_blocks(ids, mask, anchors, 8, mask_token_id=999, gamma=2.0)[3][0]
    assert paper[2].item() == pytest.approx(math.exp(-1 / 4)) and steep[2].item() == pytest.approx(math.exp(-1 / 2))
    assert steep[1] == paper[1] == 1.0 and steep[7] < paper[7]
    assert (loss_gamma(16), loss_gamma(10), loss_gamma(8)) == (7.0, 5.0, 4.0)


def test_anchors_come_from_supervised_positions_where_a_block_fits():
    mask = torch.zeros(30, dtype=torch.long)
    mask[10:] = 1
    anchors = sample_anchors(mask, 8, 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == list(range(10, 23))  # ≤ 30 − 8
    few = sample_anchors(mask, 8, 5, torch.Generator().manual_seed(0))
    assert len(few) == 5 and set(few.tolist()) <= set(range(10, 23))
    assert few.tolist() == sorted(few.tolist())


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert expected_acceptance_length([1.0] * 15) == 16.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_acceptance_length([0.5, float("nan"), 1.0]) == 1.5


def test_target_layer_ids_default():
    assert uniform_layer_ids(36, 5) == [1, 9, 17, 25, 33]




def test_dpace_weights_equal_the_formula_written_as_loops():
    from flashdraft.model.objective import dpace_weights

    g = torch.Generator().manual_seed(0)
    ce = torch.rand(6, 8, generator=g) * 3
    supervised = torch.rand(6, 8, generator=g) > 0.25
    for alpha in (0.3, 0.5, 1.0):
        got = dpace_weights(ce, supervised, alpha)
        for n in range(6):
            q = [1.0] + [(1 - alpha) * math.exp(-ce[n, k].item()) + alpha if supervised[n, k] else 1.0
                         for k in range(1, 8)]
            prefix = [math.prod(q[1 : m + 1]) for m in range(8)]
            for j in range(8):
                want = 0.0 if j == 0 or not supervised[n, j] else sum(
                    prefix[m] for m in range(j, 8) if supervised[n, m])
                assert got[n, j].item() == pytest.approx(want, rel=1e-6, abs=1e-7), (alpha, n, j)
    # α = 1: every q̃ is 1, so w_j counts the supervised positions from j on (a confident and an unsure draft alike)
    assert dpace_weights(ce[:1], torch.ones(1, 8, dtype=torch.bool), 1.0).tolist() == [[0, 7, 6, 5, 4, 3, 2, 1]]
