"""A batch's plan, made before the drafter runs: each sequence's anchors and blocks, the target's pass over the
batch (its features at the watched layers, and its own labels where the recipe distils), padded to one length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.config import TrainConfig
from flashdraft.model.objective import (
    build_blocks,
    build_dspark_blocks,
    sample_anchors,
)
from flashdraft.model.target import Target
from flashdraft.train.loss import chunk_rows_for


@dataclass
class Planned:
    """A micro-batch ready for the drafter: which sequences have anchors, where, and their target features
    (B × C × F, padded to the longest context). Built by `plan_batch`, possibly on a prefetch thread."""

    count: int  # sequences in the micro-batch, with or without anchors
    live: list  # (index in the micro-batch, ids, loss mask, anchors) of those with anchors
    context_len: int
    features_BCF: torch.Tensor | None
    teachers: list | None = None  # per live sequence: the target's top-k (ids, log-probs) after each position
    labels: list | None = None  # per live sequence (train.labels: target): the target's argmax at each position
    blocks: Blocks | None = None  # the drafter's input, when the plan was made knowing its mask token
    # DSpark (online features): per live sequence, the target's last hidden state at every position its blocks
    # cover — its next-token distribution there is what DSpark's L1 and confidence terms compare with
    hidden: list | None = None
    from_anchor: bool = False  # DSpark's layout: every slot predicts the token after its own position


@dataclass
class Blocks:
    """A planned micro-batch's blocks, built on the host (on the prefetch thread when there is one), every live
    sequence padded to the most anchors: a padding block has anchor 0 and no loss weight."""

    anchors_BN: torch.Tensor
    ids_BNK: torch.Tensor  # [anchor token, MASK × (K − 1)]
    positions_BNK: torch.Tensor
    targets: list  # per live sequence: (labels N × K, weights N × K)


def build_batch_blocks(plan: Planned, k: int, mask_token_id: int, gamma: float | None) -> Blocks:
    build = build_dspark_blocks if plan.from_anchor else build_blocks
    live = plan.live
    n_max = max(len(anchors) for *_, anchors in live)
    anchors_BN = torch.zeros(len(live), n_max, dtype=torch.long)
    block_ids = torch.full((len(live), n_max, k), mask_token_id, dtype=torch.long)
    positions = torch.zeros(len(live), n_max, k, dtype=torch.long)
    targets = []
    for b, (_, ids_T, mask_T, anchors) in enumerate(live):
        ids_b, pos_b, labels, weights = build(ids_T, mask_T, anchors, k, mask_token_id, gamma,
                                                label_ids_T=None if plan.labels is None else plan.labels[b])
        n = len(anchors)
        anchors_BN[b, :n], block_ids[b, :n], positions[b, :n] = anchors, ids_b, pos_b
        positions[b, n:] = torch.arange(k)  # padding blocks: any positions, they see only themselves
        targets.append((labels, weights))
    return Blocks(anchors_BN, block_ids, positions, targets)


def plan_batch(target: Target, rows: list, cfg: TrainConfig, generators: list, block_size: int,
               features: list | None = None, teachers: list | None = None,
               mask_token_id: int | None = None, from_anchor: bool = False) -> Planned:
    """Anchors of each sequence, and the target's features for the batch: from the cache (offline mode), or
    one target pass over the batch on a GPU (right padding: the target is causal, real positions are unchanged),
    one pass per sequence on a CPU. With `mask_token_id` (the drafter's), the blocks too, so the step itself
    does no host work. `from_anchor` (DSpark): an anchor needs a supervised token after it and its K labels
    inside the sequence, and online the target's last hidden states over the blocks are kept (`Planned.hidden`)."""
    live = []
    for i, ((ids_T, mask_T), generator) in enumerate(zip(rows, generators, strict=True)):
        ids_T, mask_T = torch.as_tensor(ids_T[: cfg.max_length]).long(), torch.as_tensor(mask_T[: cfg.max_length])
        # DSpark: anchors p with p and p + 1 supervised and p + K inside (DeepSpec's rule, blocks kept whole)
        eligible = (mask_T[:-1].bool() & mask_T[1:].bool()) if from_anchor else mask_T
        anchors = sample_anchors(eligible, block_size, cfg.max_anchors, generator)
        if len(anchors):
            live.append((i, ids_T, mask_T, anchors))
    if not live:
        return Planned(len(rows), [], 0, None)
    context_len = max(int(anchors.max()) for *_, anchors in live)  # no block sees a position at or after its anchor
    online = features is None or features[live[0][0]] is None
    want_labels = cfg.labels == "target"
    # DSpark online: its L1 and confidence terms need the target's distribution at every block position
    want_hidden = from_anchor and online and dspark_needs_target(cfg)
    # Target labels reach K − 1 positions past a sequence's last anchor (DSpark: K); features are needed only
    # before it.
    beyond = (block_size if from_anchor else block_size - 1) if want_labels or want_hidden else 0
    reach = context_len + beyond
    labels = hidden = None
    if online and target.lm_head.weight.is_cuda:
        ids_BC = torch.zeros(len(live), reach, dtype=torch.long)
        for b, (_, ids_T, _, _) in enumerate(live):
            ids_BC[b, : min(reach, len(ids_T))] = ids_T[:reach]
        features_BCF, labels_BC, hidden_BTD = target_pass(target, ids_BC, context_len, want_labels, want_hidden)
        labels = None if labels_BC is None else [labels_BC[b] for b in range(len(live))]
        hidden = None if hidden_BTD is None else [hidden_BTD[b] for b in range(len(live))]
    elif online:
        # On CPU the target is compute-bound and a padded batch is slower than its sequences one by one
        # (measured: 4 × ~2,000 tokens of SmolLM2, 15.9 s batched vs 12.7 s apart), so each runs alone.
        passes = [target_pass(target, ids_T[None, : int(anchors.max()) + beyond], int(anchors.max()), want_labels,
                              want_hidden) for _, ids_T, _, anchors in live]
        features_BCF = torch.stack([padded_to(f[0], context_len) for f, _, _ in passes])
        labels = [lab[0] for _, lab, _ in passes] if want_labels else None
        hidden = [h[0] for _, _, h in passes] if want_hidden else None
    else:  # a prefix of the whole sequence's cached features is the prefix's features
        features_BCF = torch.stack([padded_to(features[i][:context_len], context_len) for i, *_ in live])
    kept = [teachers[i] for i, *_ in live] if teachers is not None and teachers[live[0][0]] is not None else None
    if want_labels and labels is None:  # offline: the cache's top-1 after position p − 1 is the target's label at p
        labels = [cached_labels(ids_T, teacher) for (_, ids_T, _, _), teacher in zip(live, kept, strict=True)]
    plan = Planned(len(rows), live, context_len, features_BCF, kept, labels, hidden=hidden, from_anchor=from_anchor)
    if mask_token_id is not None:
        plan.blocks = build_batch_blocks(plan, block_size, mask_token_id, cfg.loss_decay_gamma)
    return plan


def cached_labels(ids_T: torch.Tensor, teacher: tuple) -> torch.Tensor:
    """The target's greedy label at every position of a sequence (at p: its argmax after p − 1; at 0 the token
    itself) from a cached top-k, whose first column is the argmax."""
    return torch.cat([ids_T[:1], teacher[0][: len(ids_T) - 1, 0]])


def dspark_needs_target(cfg: TrainConfig) -> bool:
    """Whether DSpark's loss compares with the target's next-token distribution (its L1 or confidence term)."""
    return cfg.dspark_l1_weight > 0 or (cfg.confidence_head and cfg.dspark_confidence_weight > 0)


@torch.no_grad()
def target_pass(target: Target, ids_BT: torch.Tensor, context_len: int, want_labels: bool, want_hidden: bool = False):
    """The target over `ids_BT`: its watched features before `context_len` (B × C × F); with `want_labels` its
    greedy label at every position up to T (B × (T + 1): at p, the argmax of its distribution after p − 1; at 0 the
    token itself); with `want_hidden` its last hidden state at every position (B × T × D, for DSpark's target
    distributions). The LM head is applied a slice of positions at a time, never to B × T × V at once."""
    output, features = target.forward(ids_BT)  # its own pass, or its feature source's (model/target.py)
    if not want_labels and not want_hidden:
        return features[:, :context_len], None, None
    hidden = output.last_hidden_state
    kept = hidden if want_hidden else None
    if not want_labels:
        return features[:, :context_len], None, kept
    span = max(1, chunk_rows_for(target.config.vocab_size) // hidden.shape[0])  # positions a slice: one loss chunk
    following = torch.cat([target.lm_head(hidden[:, i : i + span]).argmax(-1) for i in range(0, hidden.shape[1], span)],
                          dim=1).cpu()
    return features[:, :context_len], torch.cat([ids_BT[:, :1].cpu(), following], dim=1), kept


def padded_to(features_CF: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - features_CF.shape[0]
    return features_CF if pad == 0 else torch.cat([features_CF, features_CF.new_zeros(pad, features_CF.shape[1])])
