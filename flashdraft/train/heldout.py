"""The held-out evaluation the training log reports: the step's statistics without gradients on fixed anchors, and
the serving walk (greedy speculative decoding walked over each held-out sequence: the τ the log predicts).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch.profiler import record_function

from flashdraft.config import TrainConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.objective import (
    acceptance_length,
    expected_acceptance_length,
)
from flashdraft.model.target import Target
from flashdraft.train.metrics import json_rates, mean_rates, selector_metrics
from flashdraft.train.plan import Planned, cached_labels, padded_to, target_pass
from flashdraft.train.step import batch_step, sequence_step


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
                       padded_to(features_TF[:context_len], context_len)[None], labels=[greedy_pad],
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
