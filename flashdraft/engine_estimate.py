"""`estimate`'s figures for a target served by vLLM (`train.feature_source: engine`): what the shared directory must
carry, and, for a fleet (`train.engine_urls`), what proving the servers costs each training process.

    shared, probe = engine_load(cfg.train, layers, hidden, tokens_per_sample, layer_ids, step_s, steps, ...)
"""

from __future__ import annotations

from typing import Any

from flashdraft.config import PipelineConfig, TrainConfig
from flashdraft.progress import human_bytes


def engine_load(tr: TrainConfig, num_layers: int, hidden: int, tokens_per_sample: float, layer_ids: list[int],
                step_s: float, steps: int, checkpoint_bytes: int,
                largest_layer_params: int) -> tuple[dict | None, dict | None]:
    """(the shared directory's load, the fleet proof's cost), each None where it does not apply."""
    if tr.feature_source != "engine":
        return None, None
    # the engine writes the drafter's layers and the target's last (whose state the trainer's norm and head read),
    # in bfloat16; the trainer reads each file once and deletes it, at the pace of the steps
    written = len(set(layer_ids) | {num_layers - 1})
    per_sequence = int(tokens_per_sample * written * hidden * 2)
    processes = tr.nproc_per_node * max(1, tr.nnodes)
    shared = {"layers_written": written, "bytes_per_sequence": per_sequence,
              "bytes_per_s": int(per_sequence * tr.batch_size * processes / step_s),
              # each process has a step's sequences in flight and, prefetching, the next step's; a killed process
              # leaves as much until it starts again (train/engine_features.py clear_leftovers)
              "bytes_in_flight": per_sequence * tr.batch_size * 2 * processes,
              "hours": round(steps * step_s / 3600, 1)}
    if not tr.engine_urls:
        return shared, None
    # the fleet's proof: each training process computes the probe's states from the target's checkpoint (bfloat16,
    # as published) one layer at a time (model/streamed.py): it reads the checkpoint once, holds one layer in float32
    probe = {"bytes_read": checkpoint_bytes, "seconds_at_2gb_s": round(checkpoint_bytes / 2e9),
             "layer_bytes": 4 * largest_layer_params}
    return shared, probe


def engine_lines(est: dict[str, Any], cfg: PipelineConfig) -> list[str]:
    """With the engine as the feature source: what the shared directory must sustain for the whole run, and what a
    fleet's proof costs each training process at its start."""
    shared = est.get("shared_directory")
    if not shared:
        return []
    lines = [f"shared directory (train.engine_storage): {human_bytes(shared['bytes_per_sequence'])} a sequence "
             f"(its tokens × {shared['layers_written']} layers × {est['target']['hidden']:,} × 2 bytes: the drafter's "
             f"{len(est['target_layer_ids'])} and the target's last), written by the engine and read by the trainer "
             f"at ≈ {human_bytes(shared['bytes_per_s'])}/s each way (the filesystem carries it twice) for ≈ "
             f"{shared['hours']:,} hours; ≈ {human_bytes(shared['bytes_in_flight'])} in it at a time (each training "
             "process's step in flight and the next prefetched; a killed process leaves as much until it restarts). "
             + ("A fleet on other hosts needs a parallel filesystem (Lustre, GPFS, WEKA) mounted at the same path on "
                "the servers and the trainers that sustains it; run each server as the user that owns the fleet's "
                "key (mode 0600)" if cfg.train.engine_urls else
                "A local NVMe directory beside the engine train starts carries it")]
    if probe := est.get("fleet_probe"):
        lines.append(f"fleet proof: each training process reads the target's checkpoint once at its start "
                     f"({human_bytes(probe['bytes_read'])}, ≈ {probe['seconds_at_2gb_s']:,} s at 2 GB/s, seconds from "
                     f"the page cache) to compute the probe's states one layer at a time "
                     f"({human_bytes(probe['layer_bytes'])} in float32 on its target device); before each "
                     "checkpoint the servers answer the probe again (one short request each)")
    return lines
