"""train: the DFlash (DFlash2, DSpark) drafter on the target's hidden states — resumable, distributed with torchrun.

    flashdraft train --data work/dataset --out work/train [--target REF] [--epochs 6] [--max-steps N]
    torchrun --nproc-per-node 4 -m flashdraft train --data … --out …      # DDP (gloo on CPU, nccl on GPU)
    flashdraft train … --architecture dflash2 [--init-from work/train/drafter]   # DFlash2, warm-started
    flashdraft train … --architecture dspark [--init-from work/train/drafter]    # DSpark (docs/dspark.md)

Each step: for every sequence, the frozen target runs once with forward hooks on `target_layer_ids` (their
outputs = hidden_states[id + 1]); anchors are drawn from supervised positions; all blocks of the sequence
go through the drafter in one pass under the block mask; the target's LM head scores the block positions;
the loss is CE weighted by exp(−(k−1)/γ) × loss mask (or D-PACE's weights; DFlash2 adds its selector's CE;
DSpark's is DeepSpec's: CE, L1 to the target's distribution and the confidence head's BCE, step.dspark_result).
AdamW (or Muon for the matrices), cosine schedule with warmup, grad clipping.

`stage.run` reads top to bottom: decide (done? resume?) → set up (target, data, drafter, optimizer) → `loop` →
export. The pieces live beside it: `drafters` (a new one, or `--init-from`), `data` (checks, held-out pick, mask
token, draft vocabulary), `step` (one sequence), `checkpoint` (save/load/latest/prune/ship), `feature_cache`
(offline features), `distributed` (ranks, devices, DDP/FSDP), `metrics` (metrics.jsonl, TensorBoard, W&B).

Output (`--out`): checkpoints/step-NNNNNNN/ (each an artifact; the newest that verifies is resumed, incomplete
ones are ignored), metrics.jsonl, and drafter/ — the exported drafter (z-lab format, `drafter` artifact),
the stage's output.
"""

from flashdraft.train.stage import run

__all__ = ["run"]
