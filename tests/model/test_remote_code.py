"""An exported drafter read through `AutoModel.from_pretrained(dir, trust_remote_code=True)` — the modeling
file flashdraft ships beside the weights — computes what flashdraft's own drafter computes."""

import pytest
import torch
from transformers import AutoModel, DynamicCache, Qwen3Config

from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import save_drafter
from flashdraft.model.objective import block_masks

TARGET = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1_000_000.0)
CONTEXT, K = 20, 4


def trained_like(sliding_window=None, draft_vocab_size=None) -> DFlashDrafter:
    """A drafter with every weight away from its initial value (norms included), as after training."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(TARGET, num_layers=3, block_size=K, mask_token_id=95,
                                         sliding_window=sliding_window, draft_vocab_size=draft_vocab_size))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


def flashdraft_hidden(drafter: DFlashDrafter, block_embeds, features) -> torch.Tensor:
    """The block at the end of the context, as eval drafts it: the training masks for one anchor."""
    anchors = torch.tensor([CONTEXT])
    masks = block_masks(anchors, K, CONTEXT, drafter.sliding_window, "cpu")
    with torch.no_grad():
        return drafter(block_embeds, features, torch.arange(CONTEXT, CONTEXT + K)[None],
                       torch.arange(CONTEXT)[None], masks)


def inputs(drafter: DFlashDrafter):
    torch.manual_seed(1)
    features = torch.randn(1, CONTEXT, len(drafter.target_layer_ids) * TARGET.hidden_size)
    return torch.randn(1, K, TARGET.hidden_size), features


@pytest.mark.parametrize("sliding_window", [None, 6], ids=["full-attention", "sliding-window"])
def test_trust_remote_code_forward_equals_flashdraft(tmp_path, sliding_window):
    drafter = trained_like(sliding_window)
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    loaded = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    assert type(loaded).__name__ == "DFlashDraftModel" and loaded.fc.weight.shape == drafter.fc.weight.shape
    block, features = inputs(drafter)
    with torch.no_grad():
        theirs = loaded(position_ids=torch.arange(CONTEXT + K)[None], noise_embedding=block, target_hidden=features)
    assert torch.allclose(theirs, flashdraft_hidden(drafter, block, features), atol=1e-5)


def test_a_sliding_window_changes_what_is_computed_in_both(tmp_path):
    """The equality above is not vacuous: the window (and causality) make a difference both sides see."""
    full, windowed = trained_like(None), trained_like(6)
    block, features = inputs(full)
    assert not torch.allclose(flashdraft_hidden(full, block, features),
                              flashdraft_hidden(windowed, block, features), atol=1e-3)


def test_the_cached_path_equals_one_pass(tmp_path):
    """The reference's decoding loop: context features arrive in pieces, the draft cache keeps their keys and
    values and is cropped back to the context after each block."""
    drafter = trained_like(6)
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    block, features = inputs(drafter)
    positions = torch.arange(CONTEXT + K)[None]
    with torch.no_grad():
        whole = model(position_ids=positions, noise_embedding=block, target_hidden=features)
        cache, split = DynamicCache(), 12
        model(position_ids=positions[:, : split + K], noise_embedding=block, target_hidden=features[:, :split],
              past_key_values=cache, use_cache=True)
        cache.crop(-K)  # drop the block: keep the context (negative: how many to remove, in 4.x and 5.x)
        pieces = model(position_ids=positions[:, split:], noise_embedding=block, target_hidden=features[:, split:],
                       past_key_values=cache, use_cache=True)
    assert torch.allclose(whole, pieces, atol=1e-5)


def test_a_reduced_vocabulary_scores_as_flashdraft_does(tmp_path):
    drafter = trained_like(draft_vocab_size=24)
    drafter.set_draft_vocab(torch.randperm(TARGET.vocab_size)[:24])
    target_head = torch.nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    save_drafter(drafter, tmp_path / "d", dtype="float32", target_lm_head=target_head.weight.detach())
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    block, features = inputs(drafter)
    hidden = flashdraft_hidden(drafter, block, features)
    with torch.no_grad():
        ours = drafter.to_target_vocab(hidden @ drafter.head_weight(target_head.weight).T, TARGET.vocab_size)
        theirs = model.compute_logits(hidden, target_head)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1)) and bool(torch.isinf(theirs).any())


def test_bf16_export_loads_in_bf16(tmp_path):
    drafter = trained_like()
    save_drafter(drafter, tmp_path / "d")  # bf16 by default
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True, dtype="auto")
    assert model.fc.weight.dtype == torch.bfloat16
    assert torch.equal(model.fc.weight, drafter.fc.weight.to(torch.bfloat16))
