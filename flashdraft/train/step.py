"""One sequence through the drafter: anchors, blocks, the block mask, the weighted loss and accuracy by position.

All blocks of a sequence go through the drafter in one forward pass under the block mask; the target's LM
head scores them. `evaluate_heldout` runs the same step without gradients on fixed anchors.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from flashdraft.config import TrainConfig
from flashdraft.model.dflash2 import is_dflash2
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.objective import (
    acceptance_length,
    block_masks,
    build_blocks,
    build_dspark_blocks,
    dpace_weights,
    expected_acceptance_length,
    position_counts,
    rates_from_counts,
    sample_anchors,
)
from flashdraft.model.target import Target
from flashdraft.model.transfer import to_device
from flashdraft.train.loss import chunk_rows_for, head_terms, target_probs_from_hidden, target_probs_from_topk
from flashdraft.train.metrics import json_rates, mean_rates, selector_metrics

# Under CPU autocast (`train.bf16`) a norm gets bfloat16 input and keeps its float32 weight; torch then computes
# it unfused and says so once per process. Harmless, and the step is still 1.9x faster (benchmarks/RESULTS.md).
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


def sequence_step(model, target: Target, ids_T, mask_T, cfg: TrainConfig, generator, device,
                  features_TF: torch.Tensor | None = None, teacher: tuple | None = None) -> dict | None:
    """Loss (with grad) and accuracy stats of all blocks of one sequence; None if it has no anchor."""
    return batch_step(model, target, [(ids_T, mask_T)], cfg, [generator], device, [features_TF], teachers=[teacher])[0]


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
        features_BCF = torch.stack([_padded(f[0], context_len) for f, _, _ in passes])
        labels = [lab[0] for _, lab, _ in passes] if want_labels else None
        hidden = [h[0] for _, _, h in passes] if want_hidden else None
    else:  # a prefix of the whole sequence's cached features is the prefix's features
        features_BCF = torch.stack([_padded(features[i][:context_len], context_len) for i, *_ in live])
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


def batch_step(model, target: Target, rows: list, cfg: TrainConfig, generators: list, device,
               features: list | None = None, planned: Planned | None = None,
               teachers: list | None = None, read: bool = True) -> list[dict | None]:
    """Every block of several sequences in one forward pass: per sequence (in order) its loss (with grad),
    accuracy stats and sizes, or None if it has no anchor.

    Sequences are padded to the batch's longest context and most anchors: padding context is never attended
    (a block sees only positions before its anchor), and a padding block (anchor 0) sees only itself and has
    no loss weight. Each sequence's loss is normalised by its own weights, exactly as one at a time (the
    equality is tested). `planned`: the micro-batch already planned (anchors, features), e.g. prefetched.

    Nothing here waits for the device: the stats stay device tensors until `read_results` reads them all at once
    (`read=False` leaves that to the caller, which reads them with the step's loss and gradient norm)."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    k = drafter.block_size
    plan = planned or plan_batch(target, rows, cfg, generators, k, features, teachers, from_anchor=is_dspark(drafter))
    results: list[dict | None] = [None] * plan.count
    if not plan.live:
        return results
    live, context_len = plan.live, plan.context_len
    blocks = plan.blocks or build_batch_blocks(plan, k, drafter.mask_token_id, cfg.loss_decay_gamma)
    features_BCF = to_device(plan.features_BCF, device).float()
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        block_ids = to_device(blocks.ids_BNK.view(len(live), -1), embed.weight.device)
        block_embeds = to_device(embed(block_ids), device).float()
    anchors_BN = blocks.anchors_BN
    with record_function("flashdraft.mask"):
        allowed = block_masks(anchors_BN if len(live) > 1 else anchors_BN[0], k, context_len,
                              drafter.sliding_window, device)
    on_cuda = str(device).startswith("cuda")
    bf16 = on_cuda if cfg.bf16 is None else cfg.bf16
    with torch.autocast("cuda" if on_cuda else "cpu", dtype=torch.bfloat16, enabled=bf16), \
            record_function("flashdraft.forward"):
        hidden = model(block_embeds, features_BCF, to_device(blocks.positions_BNK.view(len(live), -1), device),
                       torch.arange(context_len, device=device)[None].expand(len(live), -1), allowed)
        # the LM head beside the drafter (a bfloat16 target without autocast: a float32 copy)
        head_dtype = None if bf16 or embed.weight.dtype == hidden.dtype else hidden.dtype
        heads = target.heads_beside(drafter, device, head_dtype)
        with record_function("flashdraft.loss"):
            dspark = is_dspark(drafter)
            for b, (i, *_) in enumerate(live):
                results[i] = (dspark_result(drafter, cfg, plan, blocks, b, heads, hidden, device) if dspark
                              else sequence_result(drafter, cfg, plan, blocks, b, heads, hidden, device))
    return read_results(results)[0] if read else results


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
                       top_c=drafter.selector_top_k if is_dflash2(drafter) else 0)
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
                       target_probs=q)
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


def _halves(v: list) -> list[float]:
    return rates_from_counts(v[: len(v) // 2], v[len(v) // 2 :])


# What a step result holds on the device until it is read: its key, the name it is read as, and how.
READ_AS = {
    "weight": ("weight", lambda v: v[0]),
    "counts": ("rates", _halves),
    "unary_counts": ("unary_rates", _halves),
    "accepted": ("accepted", lambda v: [int(x) for x in v]),
    "recall": ("recall", lambda v: (int(v[0]), int(v[1]))),
    "selector": ("selector", lambda v: (int(v[0]), int(v[1]))),
    "calibration": ("calibration", lambda v: (float(v[0]), float(v[1]), int(v[2]))),
}


def read_results(results: list[dict | None], also: tuple = ()) -> tuple[list[dict | None], list[list[float]]]:
    """The step results' device stats as Python numbers (`weight` a float, `counts` as `rates`, `accepted` a list
    …), and the values of the tensors in `also`, in one read from the device. Every read of a GPU tensor waits for
    the GPU to finish what was queued before it, and the host queues nothing meanwhile: one read a step, not one a
    number, is what keeps a step at the GPU's pace."""
    keyed = [(i, key) for i, r in enumerate(results) if r for key in READ_AS if key in r]
    values = read_once([results[i][key] for i, key in keyed] + list(also))
    read = [dict(r) if r else r for r in results]
    for (i, key), v in zip(keyed, values[: len(keyed)], strict=True):
        name, convert = READ_AS[key]
        del read[i][key]
        read[i][name] = convert(v)
    return read, values[len(keyed) :]


def read_once(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values, flattened, from one device-to-host copy (float64 holds every count and float32 exactly)."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([to_device(t.detach().reshape(-1), device).double() for t in tensors]).tolist()
    values, at = [], 0
    for t in tensors:
        values.append(flat[at : at + t.numel()])
        at += t.numel()
    return values


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


def _padded(features_CF: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - features_CF.shape[0]
    return features_CF if pad == 0 else torch.cat([features_CF, features_CF.new_zeros(pad, features_CF.shape[1])])


def accepted_drafts(predicted_NK, labels_NK, weights_NK) -> torch.Tensor:
    """Per block (a device tensor): how many drafts greedy verification would accept — the leading block positions
    1..K−1 whose greedy token is the label, stopping at the first wrong one or the first label not supervised."""
    device = predicted_NK.device
    good = (predicted_NK == to_device(labels_NK, device)) & (to_device(weights_NK, device) > 0)
    return good[:, 1:].int().cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def serving_walk(model, target: Target, ids_T, mask_T, cfg: TrainConfig, device,
                 features_TF: torch.Tensor | None = None, teacher: tuple | None = None) -> list[int]:
    """Drafts accepted at each block as greedy speculative decoding walks this sequence: a block at the first
    supervised position, accept the longest prefix of drafts equal to the target's greedy tokens, the bonus
    token, the next block right after it (a new supervised span starts a new walk; a block at a span's last
    token, the end of the turn, is not one decoding runs). On a sequence that is the target's own greedy output
    this is what `flashdraft eval` measures, without decoding: every block's drafts depend only on the context
    before it, so all candidate blocks are scored in a few passes and then walked.

    The labels are the target's argmax (the cache's top-1 in `teacher`, else one target pass), not the
    sequence's tokens: on sampled data those are not what verification accepts. A label is the target's token
    only while the sequence follows the target's argmax, so a block accepts at most up to the first position
    where the sequence departs from it (its label there is still the target's; the next one is conditioned on a
    token decoding would not have seen); past it the walk goes on in the sequence's context, the nearest
    stand-in for the target's own continuation the data holds. Labels past the sequence's end count as not
    accepted (eval would compare them with the target's continuation, which the data does not hold)."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    k = drafter.block_size
    ids_T, mask_T = torch.as_tensor(ids_T[: cfg.max_length]).long(), torch.as_tensor(mask_T[: cfg.max_length])
    # An anchor with a supervised token after it: at a span's last token (the end of the turn) decoding stops.
    candidates = torch.nonzero(mask_T[:-1].bool() & mask_T[1:].bool(), as_tuple=True)[0]
    if not len(candidates):
        return []
    if teacher is not None and features_TF is not None:  # the offline cache holds both
        greedy_T = cached_labels(ids_T, teacher)
    else:  # one pass gives both: a prefix's features are the whole sequence's, the target being causal
        features_1TF, labels_1T, _ = target_pass(target, ids_T[None], len(ids_T), True)
        greedy_T = labels_1T[0, : len(ids_T)]
        features_TF = features_1TF[0] if features_TF is None else features_TF
    # departs[q]: the first position ≥ q where the sequence is not the target's argmax (len(ids_T) if none)
    positions = torch.arange(len(ids_T))
    departed = torch.where(ids_T != greedy_T, positions, len(ids_T))
    departs = departed.flip(0).cummin(0).values.flip(0)
    # Room for a last block that runs past the end: its labels there are unsupervised, so never accepted (K, for
    # DSpark's slots, which reach one position further than DFlash's).
    ids_pad = torch.cat([ids_T, ids_T.new_zeros(k)])
    mask_pad = torch.cat([mask_T, mask_T.new_zeros(k)])
    greedy_pad = torch.cat([greedy_T, greedy_T.new_zeros(k)])
    accepted: dict[int, int] = {}
    # Passes of at least 512 blocks (training's default anchor count, so no more memory than a GPU step): a CPU
    # run's few anchors a step would make the walk dozens of small passes.
    for chunk in candidates.split(max(cfg.max_anchors, 512)):
        context_len = int(chunk.max())
        plan = Planned(1, [(0, ids_pad, mask_pad, chunk)], context_len,
                       _padded(features_TF[:context_len], context_len)[None], labels=[greedy_pad],
                       from_anchor=is_dspark(drafter))
        result = batch_step(model, target, [], cfg, [], device, planned=plan)[0]
        trusted = (departs[chunk + 1] - chunk).tolist()  # drafts whose label is the target's token
        accepted.update((p, min(a, t)) for p, a, t in zip(chunk.tolist(), result["accepted"], trusted, strict=True))
    walk, starts = [], sorted(accepted)
    position = starts[0]
    while position is not None:
        walk.append(accepted[position])
        after = position + accepted[position] + 1  # where the bonus token sits: the next block's anchor
        later = bisect.bisect_right(starts, after)  # else the next supervised span's first anchor
        position = after if after in accepted else (starts[later] if later < len(starts) else None)
    return walk


@torch.no_grad()
@record_function("flashdraft.heldout")  # its passes are batch_step's too: a profile tells them apart by this
def evaluate_heldout(model, target: Target, dataset, indices, cfg: TrainConfig, device, cache=None) -> dict[str, Any]:
    """On held-out samples: per-position accuracy and the simulated τ they imply at fixed random anchors (the
    per-anchor view training has always reported), and the serving-walk τ (`serving_walk`), which is what
    serving measures: a walk restarts after every accepted prefix, so it meets the drafter's hard positions
    more often than random anchors do."""
    model.eval()
    rows, walked, results = [], [], []
    for index in indices:
        row = dataset[index]
        features, teacher = (None, None) if cache is None else (cache[index], cache.teacher(index))
        result = sequence_step(model, target, row["input_ids"], row["loss_mask"], cfg,
                               torch.Generator().manual_seed(index), device, features, teacher)
        if result is not None:
            rows.append(result["rates"])
            results.append(result)
        walked.extend(serving_walk(model, target, row["input_ids"], row["loss_mask"], cfg, device, features, teacher))
    model.train()
    rates = mean_rates(rows)
    return {
        "samples": len(rows),
        "accuracy_by_position": json_rates(rates),
        "simulated_acceptance_length": round(expected_acceptance_length(rates), 4) if rows else None,
        "serving_acceptance_length": round(acceptance_length(walked), 4) if walked else None,
        "serving_blocks": len(walked),
        **selector_metrics(results),
    }
