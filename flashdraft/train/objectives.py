"""Each architecture's loss over one sequence's blocks, from the LM head's chunked terms (loss.py): DFlash's
weighted cross-entropy (decay or D-PACE, labels or the target's), DFlash2's selector on top, DSpark's DeepSpec loss
(CE, L1 to the target's distribution, the confidence head's BCE); and the accepted drafts greedy verification
would take.
"""

from __future__ import annotations

import torch

from flashdraft.config import TrainConfig
from flashdraft.model.dflash2 import is_dflash2
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.objective import (
    dpace_weights,
    position_counts,
)
from flashdraft.model.transfer import to_device
from flashdraft.train.loss import head_terms, target_probs_from_hidden, target_probs_from_topk
from flashdraft.train.plan import Blocks, Planned


def bf16_matmuls(cfg: TrainConfig, device) -> bool:
    """`train.bf16`: the drafter's matmuls and the LM head's logits in bfloat16 (autocast); default on CUDA only."""
    return str(device).startswith("cuda") if cfg.bf16 is None else cfg.bf16


def sequence_result(drafter: DFlashDrafter, cfg: TrainConfig, plan: Planned, blocks: Blocks, b: int,
                    heads: tuple, hidden: torch.Tensor, device) -> dict:
    """Live sequence `b` of a micro-batch: its loss (with grad) and its stats, device tensors not yet read. The
    logits are computed a chunk of rows at a time and never kept (train/loss.py)."""
    _, ids_T, _, anchors = plan.live[b]
    k = drafter.block_size
    labels, weights = blocks.targets[b]
    labels, weights = to_device(labels, device), to_device(weights, device)
    n = len(anchors)
    hard_weights = weights
    if drafter.draft_vocab_size:  # labels into the draft vocabulary; a token outside it cannot be proposed
        labels, inside = drafter.draft_labels(labels)
        hard_weights = weights * inside
    distill = plan.teachers is not None and cfg.distill_weight > 0
    hidden_SD = hidden[b, : n * k]
    terms = head_terms(hidden_SD, heads[0], labels_S=labels.reshape(-1), transform=drafter.unary_logits,
                       teacher=teacher_rows(drafter, plan.teachers[b], anchors, k, device) if distill else None,
                       top_c=drafter.selector_top_k if is_dflash2(drafter) else 0, bf16=bf16_matmuls(cfg, device))
    ce = terms.ce
    if cfg.loss == "dpace":  # the weights follow the draft's own (detached) confidence in each label
        weights = hard_weights = dpace_weights(ce.view(n, k), hard_weights > 0, cfg.dpace_alpha).to(weights.dtype)
    weights_S, hard_S = weights.reshape(-1), hard_weights.reshape(-1)
    weighted_ce = (ce * hard_S).sum()
    if distill:
        weighted_ce = (1 - cfg.distill_weight) * weighted_ce + cfg.distill_weight * (terms.soft_ce * weights_S).sum()
    predicted = terms.predicted.view(n, k)  # the drafter's greedy tokens
    weight = weights_S.sum()
    extra = {}
    if is_dflash2(drafter):  # the selector's loss; its path is what decoding proposes
        selector = selector_step(drafter, terms.candidates, terms.candidate_logits, hidden_SD,
                                 blocks.ids_BNK[b, :n, 0], labels, hard_S)
        weighted_ce = weighted_ce + cfg.selector_loss_weight * selector.pop("weighted_ce")
        extra = {"recall": selector["recall"], "selector": selector["selector"],
                 "unary_counts": position_counts(predicted, labels, weights)}
        predicted = selector["path"]
    with torch.no_grad():
        counts = position_counts(predicted, labels, weights)
        accepted = accepted_drafts(predicted, labels, weights)
    # `weighted_ce` and `weight` are summed over the whole optimizer step before dividing (train.accumulate);
    # `loss` is this sequence's own ratio, for tests and benchmarks that step one sequence.
    return {"loss": weighted_ce / weight.clamp(min=1e-8), "weighted_ce": weighted_ce, "weight": weight,
            "counts": counts, "accepted": accepted, "tokens": int(ids_T.shape[0]), "anchors": n, **extra}


def dspark_result(drafter, cfg: TrainConfig, plan: Planned, blocks: Blocks, b: int, heads: tuple,
                  hidden: torch.Tensor, device) -> dict:
    """Live sequence `b` under DSpark's loss (DeepSpec loss.py): per slot k, weight w_k = exp(−k/γ) over the leading
    supervised slots; the Markov-corrected logits (the token before each slot teacher-forced: the anchor, then
    the labels) give CE against the label and an L1 distance Σ_v |p_v − q_v| to the target's next-token
    distribution q there; the confidence head is fitted (BCE) to the overlap Σ_v min(p_v, q_v) = 1 − L1 / 2,
    detached. Loss = ce_weight·CE + l1_weight·L1 + confidence_weight·BCE, each Σ·w, normalised as the DFlash loss
    is (by Σ w over the whole optimizer step). Without the target's distribution (the serving walk's plans) only
    the CE is computed. Stats as for DFlash, the slots counted as block positions 1 … K."""
    _, ids_T, _, anchors = plan.live[b]
    k = drafter.block_size
    n = len(anchors)
    labels, weights = (to_device(t, device) for t in blocks.targets[b])
    anchor_ids = to_device(blocks.ids_BNK[b, :n, 0], device)
    previous = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)  # the token before each slot, target ids
    hidden_NKD = hidden[b, : n * k].view(n, k, -1)
    bias = None
    if drafter.markov_head is not None:  # its low-rank codes are small (N × K × r); their V-wide bias is per chunk
        codes_SR = drafter.markov_head.block_codes(hidden_NKD, previous).reshape(n * k, -1)
        bias = lambda start, stop: drafter.markov_head.markov_w2(codes_SR[start:stop])  # noqa: E731 — a chunk's rows
    confidence = drafter.confidence_logits(hidden_NKD, previous)
    draft_labels, inside = drafter.draft_labels(labels)
    hard = weights * inside
    q = target_probs(drafter, plan, b, blocks.positions_BNK[b, :n], heads, device)
    terms = head_terms(hidden_NKD.reshape(n * k, -1), heads[0], labels_S=draft_labels.reshape(-1), bias=bias,
                       target_probs=q, bf16=bf16_matmuls(cfg, device))
    ce = terms.ce.view(n, k)
    weighted = cfg.dspark_ce_weight * (ce * hard).sum()
    extra = {}
    if q is not None:
        l1 = terms.l1.view(n, k)
        overlap = (1 - l1 / 2).clamp(0.0, 1.0).detach()  # Σ min(p, q): the chance the slot's draft is accepted
        weighted = weighted + cfg.dspark_l1_weight * (l1 * weights).sum()
        if confidence is not None:
            bce = torch.nn.functional.binary_cross_entropy_with_logits(confidence, overlap, reduction="none")
            weighted = weighted + cfg.dspark_confidence_weight * (bce * weights).sum()
            with torch.no_grad():  # calibration: the head's mean estimate beside the mean overlap, supervised slots
                live_slots = weights > 0
                extra["calibration"] = torch.stack([torch.sigmoid(confidence)[live_slots].sum(),
                                                    overlap[live_slots].sum(), live_slots.sum()])
    with torch.no_grad():  # the slots as block positions 1 … K behind a given anchor column, as DFlash counts them
        predicted = terms.predicted.view(n, k)
        zero = torch.zeros_like(predicted[:, :1])
        predicted, draft_labels = torch.cat([zero, predicted], 1), torch.cat([zero, draft_labels], 1)
        padded_weights = torch.cat([torch.zeros_like(weights[:, :1]), hard], 1)
        counts = position_counts(predicted, draft_labels, padded_weights)
        accepted = accepted_drafts(predicted, draft_labels, padded_weights)
    weight = weights.sum()
    return {"loss": weighted / weight.clamp(min=1e-8), "weighted_ce": weighted, "weight": weight, "counts": counts,
            "accepted": accepted, "tokens": int(ids_T.shape[0]), "anchors": n, **extra}


def target_probs(drafter, plan: Planned, b: int, positions_NK: torch.Tensor, heads: tuple, device):
    """`target_probs` for `head_terms`: the target's next-token distribution at each block slot (after position
    p + k), over the draft vocabulary (its mass outside it left out), or None when the plan holds none. Online: the
    softmax of the target's LM head (its copy beside the drafter) on its kept last hidden states, a chunk of rows at
    a time. Offline: the cache's top-k log-probabilities, renormalised (the mass outside the top-k is taken as 0,
    DSpark's L1 on an offline cache is the top-k's)."""
    if plan.hidden is not None:
        hidden_TD = plan.hidden[b]
        rows = to_device(hidden_TD[to_device(positions_NK, hidden_TD.device)].reshape(-1, hidden_TD.shape[-1]), device)
        ids = drafter.draft_ids()
        return target_probs_from_hidden(rows, heads[1], None if ids is None else to_device(ids, device))
    if plan.teachers is None:
        return None
    teacher_ids, teacher_logprobs = plan.teachers[b]
    rows = positions_NK.reshape(-1)
    ids, inside = drafter.draft_labels(to_device(teacher_ids[rows], device))
    return target_probs_from_topk(ids, inside, to_device(teacher_logprobs[rows], device),
                                  drafter.draft_vocab_size or drafter.config.vocab_size)


def selector_step(drafter, candidates_SC, candidate_logits_SC, hidden_SD, anchor_ids_N, labels_NK, weights_S) -> dict:
    """DFlash2's candidate selector over one sequence's blocks: Σ CE·w over the unary top-K′ at each slot (the
    candidates and their unary logits, from `head_terms`), the token before it teacher-forced to its label (the
    anchor before slot 1), so while a greedy walk is still right its path is exactly this one. A label outside the
    top-K′ adds nothing (SpecForge's choice; speculators swaps it in for the K′-th candidate instead): decoding could
    not propose it either. Counted: `recall` (labels inside the top-K′, of the supervised ones) and `selector` (the
    selector's pick right, of those inside)."""
    n, k = labels_NK.shape
    device = candidates_SC.device
    anchor = to_device(anchor_ids_N, device)[:, None]
    labels_NK = to_device(labels_NK, device)
    previous = torch.cat([anchor, anchor, labels_NK[:, 1:-1]], dim=1).reshape(-1)  # N × K
    scores = drafter.candidate_selector.scores_of(candidates_SC, candidate_logits_SC, hidden_SD, previous)
    gold = candidates_SC == labels_NK.reshape(-1, 1)
    inside = gold.any(-1)
    ce = torch.nn.functional.cross_entropy(scores.float(), gold.int().argmax(-1), reduction="none")
    weighted_ce = (ce * inside * weights_S).sum()
    with torch.no_grad():  # counts as device tensors: the step reads them with everything else (read_results)
        path = candidates_SC.gather(-1, scores.argmax(-1, keepdim=True)).view(n, k)
        supervised = to_device(weights_S, device) > 0
        inside, right = inside & supervised, (path.view(-1) == labels_NK.reshape(-1)) & supervised
    return {"weighted_ce": weighted_ce, "path": path, "recall": torch.stack([inside.sum(), supervised.sum()]),
            "selector": torch.stack([(right & inside).sum(), inside.sum()])}


def teacher_rows(drafter: DFlashDrafter, teacher: tuple, anchors_N: torch.Tensor, k: int, device) -> tuple:
    """The target's top-k for each block position (S × k ids in the draft vocabulary, −1 outside it; log-probs),
    for distillation (`head_terms`' soft cross-entropy). Block position j of the block at anchor a predicts the token
    at a + j: the target's distribution for it is the one after position a + j − 1."""
    teacher_ids, teacher_logprobs = teacher
    before = (anchors_N[:, None] + torch.arange(k)[None, :] - 1).clamp(min=0).view(-1)  # S
    # the cache's rows go to the drafter's device first: the draft vocabulary's map lives there
    ids, logprobs = to_device(teacher_ids[before], device), to_device(teacher_logprobs[before], device)  # S × topk
    if drafter.draft_vocab_size:
        ids, _ = drafter.draft_labels(ids)
    return ids, logprobs


def accepted_drafts(predicted_NK, labels_NK, weights_NK) -> torch.Tensor:
    """Per block (a device tensor): how many drafts greedy verification would accept — the leading block positions
    1..K−1 whose greedy token is the label, stopping at the first wrong one or the first label not supervised."""
    device = predicted_NK.device
    good = (predicted_NK == to_device(labels_NK, device)) & (to_device(weights_NK, device) > 0)
    return good[:, 1:].int().cumprod(dim=1).sum(dim=1)
