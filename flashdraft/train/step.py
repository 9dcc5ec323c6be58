"""One training step: a batch of sequences, each with its anchors and blocks, through the drafter in one pass under
the block mask; the loss of each sequence by its architecture's objective (objectives.py), and the statistics all
read back from the device at once, at the step's end (`read_results`).
"""

from __future__ import annotations

import warnings

import torch
from torch.profiler import record_function

from flashdraft.config import TrainConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.objective import (
    block_masks,
    rates_from_counts,
)
from flashdraft.model.target import Target
from flashdraft.model.transfer import to_device
from flashdraft.train.objectives import bf16_matmuls, dspark_result, sequence_result
from flashdraft.train.plan import Planned, build_batch_blocks, plan_batch

# Under CPU autocast (`train.bf16`) a norm gets bfloat16 input and keeps its float32 weight; torch then computes
# it unfused and says so once per process. Harmless, and the step is still 1.9x faster (benchmarks/RESULTS.md).
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


def sequence_step(model, target: Target, ids_T, mask_T, cfg: TrainConfig, generator, device,
                  features_TF: torch.Tensor | None = None, teacher: tuple | None = None) -> dict | None:
    """Loss (with grad) and accuracy stats of all blocks of one sequence; None if it has no anchor."""
    return batch_step(model, target, [(ids_T, mask_T)], cfg, [generator], device, [features_TF], teachers=[teacher])[0]


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
    bf16 = bf16_matmuls(cfg, device)
    with torch.autocast("cuda" if on_cuda else "cpu", dtype=torch.bfloat16, enabled=bf16), \
            record_function("flashdraft.forward"):
        hidden = model(block_embeds, features_BCF, to_device(blocks.positions_BNK.view(len(live), -1), device),
                       torch.arange(context_len, device=device)[None].expand(len(live), -1), allowed)
    # The loss outside autocast, as the dense loss was: the LM head's logits in bfloat16 under `train.bf16`
    # (head_terms), every small head (DSpark's Markov and confidence heads, DFlash2's selector) and every term in
    # float32 — in bfloat16 those heads' outputs tie and their gradients move (measured: 5.8 % of markov_w2's).
    hidden = hidden.float()
    # the LM head beside the drafter (a bfloat16 target without autocast: a float32 copy)
    head_dtype = None if bf16 or embed.weight.dtype == hidden.dtype else hidden.dtype
    heads = target.heads_beside(drafter, device, head_dtype)
    with record_function("flashdraft.loss"):
        dspark = is_dspark(drafter)
        for b, (i, *_) in enumerate(live):
            results[i] = (dspark_result(drafter, cfg, plan, blocks, b, heads, hidden, device) if dspark
                          else sequence_result(drafter, cfg, plan, blocks, b, heads, hidden, device))
    return read_results(results)[0] if read else results


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
