"""One sequence through the drafter: anchors, blocks, the block mask, the weighted loss and accuracy by position.

All blocks of a sequence go through the drafter in one forward pass under the block mask; the target's LM
head scores them. `evaluate_heldout` runs the same step without gradients on fixed anchors.
"""

from __future__ import annotations

from typing import Any

import torch

from flashdraft.config import TrainConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.objective import (
    block_masks,
    build_blocks,
    expected_acceptance_length,
    per_position_accuracy,
    sample_anchors,
    weighted_loss,
)
from flashdraft.model.target import Target
from flashdraft.train.metrics import json_rates, mean_rates


def sequence_step(model, target: Target, ids_T, mask_T, cfg: TrainConfig, generator, device,
                  features_TF: torch.Tensor | None = None) -> dict | None:
    """Loss (with grad) and accuracy stats of all blocks of one sequence; None if it has no anchor.
    `features_TF`: the sequence's cached target features (offline mode); else the target runs now."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    ids_T, mask_T = torch.as_tensor(ids_T[: cfg.max_length]).long(), torch.as_tensor(mask_T[: cfg.max_length])
    anchors = sample_anchors(mask_T, drafter.block_size, cfg.max_anchors, generator)
    if len(anchors) == 0:
        return None
    context_len = int(anchors.max())  # no block sees a position at or after its anchor
    if features_TF is None:
        features_TF = target.features(ids_T[None, :context_len])[0]
    # The target is causal: a prefix of the whole sequence's cached features is the prefix's features.
    features = features_TF[None, :context_len].to(device=device, dtype=torch.float32)
    block_ids, positions, labels, weights = build_blocks(
        ids_T, mask_T, anchors, drafter.block_size, drafter.mask_token_id
    )
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        block_embeds = embed(block_ids.view(1, -1).to(embed.weight.device)).to(device, torch.float32)
    allowed = block_masks(anchors, drafter.block_size, context_len, drafter.sliding_window, device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
        hidden = model(block_embeds, features, positions.view(1, -1).to(device),
                       torch.arange(context_len, device=device)[None], allowed)
        head = target.head_weight(drafter)
        logits = (hidden.to(head.device) @ head.T).to(device)
    loss_weights = weights
    if drafter.draft_vocab_size:  # labels into the draft vocabulary; a token outside it cannot be proposed
        labels, inside = drafter.draft_labels(labels)
        loss_weights = weights * inside
    n, k = labels.shape
    loss = weighted_loss(logits.view(n * k, -1), labels.view(-1).clamp(min=0).to(device),
                         loss_weights.view(-1).to(device))
    with torch.no_grad():
        rates = per_position_accuracy(logits.view(n, k, -1).cpu(), labels, weights)
    return {"loss": loss, "rates": rates, "tokens": int(ids_T.shape[0]), "anchors": n}


@torch.no_grad()
def evaluate_heldout(model, target: Target, dataset, indices, cfg: TrainConfig, device, cache=None) -> dict[str, Any]:
    """Per-position accuracy and simulated τ on held-out samples, with fixed anchors."""
    model.eval()
    rows = []
    for index in indices:
        row = dataset[index]
        result = sequence_step(model, target, row["input_ids"], row["loss_mask"], cfg,
                               torch.Generator().manual_seed(index), device,
                               None if cache is None else cache[index])
        if result is not None:
            rows.append(result["rates"])
    model.train()
    rates = mean_rates(rows)
    return {
        "samples": len(rows),
        "accuracy_by_position": json_rates(rates),
        "simulated_acceptance_length": round(expected_acceptance_length(rates), 4) if rows else None,
    }
