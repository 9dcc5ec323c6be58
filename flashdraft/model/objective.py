"""DFlash training blocks: anchors, block inputs, same-position labels, the attention mask, the weighted loss.

For a sequence of T tokens and N anchors a_1 < … < a_N, block n is [token a_n, MASK × (K−1)] at positions
a_n … a_n+K−1. Block position k (1 ≤ k < K) predicts the token AT a_n + k (same position, no shift; the
anchor itself is not in the loss). Block n sees context features at positions < a_n, its own K positions in
both directions (in a sliding-window layer only up to itself), and no other block — so every block of a
sequence trains in one forward pass.

Shape legend: T tokens, N anchors, K block size, S = N·K block positions, C context positions (= T).
"""

from __future__ import annotations

import math

import torch

from flashdraft.model.transfer import to_device

DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's γ for common block sizes


def loss_gamma(block_size: int) -> float:
    return DECAY_GAMMA.get(block_size, max(1.0, (block_size - 2) / 2))


def sample_anchors(loss_mask_T: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator):
    """Random anchors among supervised positions p ≤ T − K (a full block fits), sorted; may be empty."""
    t = loss_mask_T.shape[0]
    candidates = torch.nonzero(loss_mask_T[: max(0, t - block_size + 1)], as_tuple=True)[0]
    if len(candidates) > max_anchors:
        pick = torch.randperm(len(candidates), generator=generator)[:max_anchors]
        candidates = candidates[pick]
    return torch.sort(candidates).values


def build_blocks(input_ids_T, loss_mask_T, anchors_N, block_size: int, mask_token_id: int,
                 gamma: float | None = None, label_ids_T=None):
    """(block_ids_NK, positions_NK, labels_NK, label_weight_NK). Weights are 0 at k = 0 and where the label
    token is not supervised; elsewhere exp(−(k−1)/γ), γ the paper's for the block size unless given. Labels are
    the sequence's own tokens, or `label_ids_T` (the target's greedy token at each position, train.labels)."""
    k = torch.arange(block_size)
    positions = anchors_N[:, None] + k[None, :]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids_T[anchors_N]
    # same position: block position k predicts the token at anchor + k
    labels = (input_ids_T if label_ids_T is None else torch.as_tensor(label_ids_T).to(input_ids_T))[positions]
    decay = torch.exp(-(k.float() - 1).clamp(min=0) / (gamma or loss_gamma(block_size)))
    decay[0] = 0.0  # the anchor is given, not predicted
    weights = decay[None, :] * loss_mask_T[positions].float()
    return block_ids, positions, labels, weights


DSPARK_GAMMA = 4.0  # DeepSpec's loss_decay_gamma, for its block sizes (7) and others alike


def build_dspark_blocks(input_ids_T, loss_mask_T, anchors_N, block_size: int, mask_token_id: int,
                        gamma: float | None = None, label_ids_T=None):
    """DSpark's blocks (DeepSpec's layout): the same [anchor, MASK × (K−1)] at positions a … a+K−1, but slot k
    predicts the token AT a + k + 1 — every slot, the anchor's included. Weights exp(−k/γ) (γ = 4 unless given),
    kept only over the leading slots whose labels are all supervised (a slot after an unsupervised one is not
    trained: decoding never reaches it). Anchors need their K labels inside the sequence (`sample_anchors` with
    K + 1). Returns what `build_blocks` returns, labels of the same N × K shape."""
    k = torch.arange(block_size)
    positions = anchors_N[:, None] + k[None, :]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids_T[anchors_N]
    labels = (input_ids_T if label_ids_T is None else torch.as_tensor(label_ids_T).to(input_ids_T))[positions + 1]
    supervised = torch.cumprod(loss_mask_T[positions + 1].int(), dim=1).float()
    weights = torch.exp(-k.float() / (gamma or DSPARK_GAMMA))[None, :] * supervised
    return block_ids, positions, labels, weights


def block_attention_mask(anchors_N: torch.Tensor, block_size: int, context_len: int,
                         window: int | None = None) -> torch.Tensor:
    """allowed_SX (bool): block position s may attend key x, keys = [context 0..C−1, block positions 0..S−1].
    With `window` (a sliding-window draft layer), a block position at absolute position p sees context position
    c only if p − c < window, and only the positions of its own block up to itself: sliding draft layers are
    causal. That is the convention every reader of the format shares — the z-lab reference model, vLLM's
    loader by default and SGLang's only behaviour (a `sliding_attention` draft layer is a decoder layer) — so
    no engine-specific flag is needed for them to compute what training computed."""
    n = anchors_N.shape[0]
    block_of = torch.arange(n).repeat_interleave(block_size)  # S
    anchor_of = anchors_N[block_of]  # S (anchors are host tensors: planned on the host)
    context = torch.arange(context_len)[None, :]
    sees_context = context < anchor_of[:, None]  # S × C: strictly before the anchor
    if window is not None:
        position_of = anchor_of + torch.arange(n * block_size) % block_size  # S: absolute position
        sees_context &= position_of[:, None] - context < window
    sees_block = block_of[:, None] == block_of[None, :]  # S × S: own block, both directions
    if window is not None:
        offset = torch.arange(n * block_size) % block_size
        sees_block &= offset[None, :] <= offset[:, None]  # sliding layers: causal within the block
    return torch.cat([sees_context, sees_block], dim=1)


def flex_block_mask(anchors: torch.Tensor, block_size: int, context_len: int, device, window: int | None = None):
    """`block_attention_mask` as a FlexAttention BlockMask, what CUDA training uses: tiles no query may see
    are skipped instead of computed and masked. Same keys layout: context first, then the blocks. `anchors`:
    one sequence's (N) or a batch's (B × N, see `block_masks`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = to_device(anchors, device)
    rows = rows[None] if rows.dim() == 1 else rows

    # As few operations as the rule needs: create_block_mask evaluates this at every (query, key) pair, and the
    # kernel again inside every partly visible tile. An anchor is at most `context_len` (the context ends at the
    # last anchor), so a key before its anchor is a context key; a context key's block index, (kv − C) // K, is
    # negative, so it never equals a block's own.
    def allowed(b, h, q, kv):
        block = q // block_size
        anchor = rows[b, block]
        sees_context = kv < anchor
        sees_block = (kv - context_len) // block_size == block
        if window is not None:  # a sliding layer: the last `window` positions, causal within the block
            sees_context &= anchor + q % block_size - kv < window
            sees_block &= (kv - context_len) % block_size <= q % block_size
        return sees_context | sees_block

    s = rows.shape[1] * block_size
    return create_block_mask(allowed, B=rows.shape[0] if anchors.dim() == 2 else None, H=None, Q_LEN=s,
                             KV_LEN=context_len + s, device=device)


def block_masks(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None, device):
    """The attention masks a drafter's layers need, by layer type: block-sparse FlexAttention on CUDA, a dense
    boolean mask (for SDPA, B × S × X) elsewhere. Only `full_attention` unless the drafter has sliding-window
    layers. `anchors`: one sequence's (N) or a batch's (B × N, every row padded to N blocks with anchor 0: a
    padding block sees no context, only itself, and carries no loss)."""
    rows = anchors if anchors.dim() == 2 else anchors[None]

    def build(w):
        if str(device).startswith("cuda"):
            return flex_block_mask(anchors, block_size, context_len, device, window=w)
        dense = torch.stack([block_attention_mask(r, block_size, context_len, window=w) for r in rows])
        return to_device(dense, device)

    masks = {"full_attention": build(None)}
    if window is not None:
        masks["sliding_attention"] = build(window)
    return masks


@torch.no_grad()
def dpace_weights(ce_NK: torch.Tensor, supervised_NK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (no gradient), per block over positions k = 1..K−1: p_k = exp(−CE_k), the draft's
    own probability of the label; q̃_k = (1 − α)·p_k + α (1 where the label is not supervised); prefix_m =
    Π_{i≤m} q̃_i, how likely decoding still runs at m; w_j = Σ_{m≥j, supervised} prefix_m, the accepted tokens
    that ride on position j being right. Zero at k = 0 (the anchor) and where not supervised."""
    q = torch.where(supervised_NK[:, 1:], (1 - alpha) * torch.exp(-ce_NK[:, 1:].float()) + alpha, 1.0)
    reach = torch.cumprod(q, dim=1) * supervised_NK[:, 1:]  # prefix_m, counted only where m is supervised
    w = torch.flip(torch.cumsum(torch.flip(reach, [1]), dim=1), [1]) * supervised_NK[:, 1:]
    return torch.cat([torch.zeros_like(w[:, :1]), w], dim=1)


def weighted_loss(logits_SV: torch.Tensor, labels_S: torch.Tensor, weights_S: torch.Tensor) -> torch.Tensor:
    """Cross-entropy weighted by position decay × loss mask, normalised by the weight sum."""
    ce = torch.nn.functional.cross_entropy(logits_SV.float(), labels_S, reduction="none")
    return (ce * weights_S).sum() / weights_S.sum().clamp(min=1e-8)


def acceptance_length(accepted_drafts: list[int]) -> float:
    """τ measured: mean tokens emitted per target verify pass, given the drafts accepted at each pass (each
    pass also emits the target's own bonus token). Used by eval's decoder and its report."""
    return sum(n + 1 for n in accepted_drafts) / max(1, len(accepted_drafts))


def expected_acceptance_length(accept_rate_by_position: list[float]) -> float:
    """τ expected from per-position acceptance rates (block positions 1..K−1, each conditional on the earlier
    ones being accepted): 1 bonus token + Σ_k Π_{j≤k} rate_j. Shared by training metrics and eval reports."""
    tau, survive = 1.0, 1.0
    for rate in accept_rate_by_position:
        if math.isnan(rate):  # no sample reached this position: count nothing beyond it
            break
        survive *= rate
        tau += survive
    return tau


def position_counts(predicted_NK, labels_NK, weights_NK) -> torch.Tensor:
    """Greedy acceptance at block positions 1..K−1, as counts on the tensors' device (2 × (K−1): right, asked):
    position k is asked when the drafts before it were all accepted and its label is supervised, and right when
    the drafter's greedy token there is the label. `rates_from_counts` turns them into the conditional accuracy
    `expected_acceptance_length` reads. Counts, not rates, so a step reads them from the device once."""
    weights_NK = to_device(weights_NK, predicted_NK.device)
    correct = (predicted_NK == to_device(labels_NK, predicted_NK.device)) | (weights_NK == 0)
    prefix = torch.cumprod(correct[:, 1:].int(), dim=1).bool()  # N × (K−1): accepted through k
    alive = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=1)  # accepted before k
    asked = alive & (weights_NK[:, 1:] > 0)
    return torch.stack([(prefix & asked).sum(0), asked.sum(0)])


def rates_from_counts(right: list, asked: list) -> list[float]:
    """Per block position, right / asked; NaN where no block was asked (no sample reached that position)."""
    return [r / a if a else math.nan for r, a in zip(right, asked, strict=True)]
