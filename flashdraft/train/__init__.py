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

`run` reads top to bottom: decide (done? resume?) → set up (target, data, drafter, optimizer) → loop →
export. The pieces live beside it: `drafters` (a new one, or `--init-from`), `data` (checks, held-out pick, mask
token, draft vocabulary), `step` (one sequence), `checkpoint` (save/load/latest/prune/ship), `feature_cache`
(offline features), `distributed` (ranks, devices, DDP/FSDP), `metrics` (metrics.jsonl, TensorBoard, W&B).

Output (`--out`): checkpoints/step-NNNNNNN/ (each an artifact; the newest that verifies is resumed, incomplete
ones are ignored), metrics.jsonl, and drafter/ — the exported drafter (z-lab format, `drafter` artifact),
the stage's output.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from flashdraft.artifact.manifest import (
    MANIFEST,
    Lineage,
    check_done,
    read_manifest,
    require_verified,
)
from flashdraft.artifact.ownership import adopt, claim_output, mark_output, now_iso, output_lock, refuse_overlap
from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput, ExpectedFailure
from flashdraft.layout import CHECKPOINTS, DRAFTER
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.dspark import is_dspark
from flashdraft.model.export import nonfinite_weights, save_drafter
from flashdraft.model.objective import expected_acceptance_length
from flashdraft.model.target import Target, attention_layers
from flashdraft.progress import progress
from flashdraft.tokenize.token_counts import count_rows
from flashdraft.train.checkpoint import (
    CheckpointShipper,
    checkpoint_dirs,
    full_state,
    latest_checkpoint,
    load_checkpoint,
    other_work,
    pull_newer_checkpoint,
    save_checkpoint,
    store_other_work,
)
from flashdraft.train.data import (
    check_against_target,
    check_token_ids,
    check_tokenizer,
    choose_draft_vocab,
    load_dataset_checked,
    pick_mask_token,
    require_a_block,
    run_split,
    token_counts,
)
from flashdraft.train.distributed import (
    Placement,
    barrier,
    checked_once_a_node,
    collective_device,
    leave,
    place,
    wrap,
)
from flashdraft.train.drafters import import_drafter, new_drafter
from flashdraft.train.launch import die_with_launcher, run_launched, under_a_launcher, waiting_for_the_launchers_stop
from flashdraft.train.lineage import run_lineage
from flashdraft.train.metrics import MetricSinks, json_rates, mean_rates, selector_metrics, truncate_metrics
from flashdraft.train.optim import Optimizers, build_optimizers
from flashdraft.train.step import Planned, batch_step, evaluate_heldout, plan_batch, read_results

__all__ = ["BadTrainingInput", "import_drafter", "run"]

def run(
    cfg: TrainConfig,
    data: Path,
    out: Path,
    *,
    require_checkpoint: bool = False,
    console=None,
    log: Callable[[str], None] = print,
) -> dict:
    """Train into `out`; rank 0, the one process that writes there, holds it locked for the whole run."""
    out = Path(out)
    if (cfg.nproc_per_node > 1 or cfg.nnodes > 1) and not under_a_launcher():  # it starts this node's processes
        return run_launched(cfg, Path(data), out, require_checkpoint, log)
    die_with_launcher()
    with waiting_for_the_launchers_stop():
        if int(os.environ.get("RANK", "0")) != 0:
            return _run(cfg, Path(data), out, require_checkpoint, console, log)
        return _run_rank_0(cfg, Path(data), out, require_checkpoint, console, log)


def _run_rank_0(cfg: TrainConfig, data: Path, out: Path, require_checkpoint: bool, console, log) -> dict:
    refuse_overlap(out, [data, cfg.init_from, cfg.target])
    with output_lock(out):
        made = any((out / name).is_dir() for name in (CHECKPOINTS, DRAFTER, "features"))  # train's own layout
        adopt(out, "train", made_before_markers=made)
        claim_output(out, "train", mark=True)  # refuses a directory that is not a train output
        return _run(cfg, Path(data), out, require_checkpoint, console, log)


def _run(cfg: TrainConfig, data: Path, out: Path, require_checkpoint: bool, console, log) -> dict:
    where = place(cfg)
    say = log if where.rank == 0 else (lambda s: None)
    if not (data / MANIFEST).is_file():
        raise BadTrainingInput(f"{data} is not a verified dataset (no manifest): run `flashdraft tokenize` first")
    from flashdraft.model.resolve import resolve_model

    target_path = resolve_model(cfg.target, log=say)
    lineage = run_lineage(cfg, data, target_path, where.world)
    drafter_dir = out / DRAFTER
    decision = check_done(drafter_dir, lineage)
    say(decision.line("train", drafter_dir))
    if decision.done:
        if cfg.push_to and where.rank == 0:  # done here; make sure the store holds it too (a no-op when it does)
            shipper = CheckpointShipper(out, cfg, say, lineage)
            shipper.drafter(drafter_dir)
            shipper.wait()
        leave(where.world)
        return read_manifest(drafter_dir).stats
    if cfg.push_to and where.rank == 0 and (theirs := store_other_work(cfg.push_to, lineage)):
        raise BadTrainingInput(f"{theirs} was trained from other data or settings; pushing this run there would "
                               "replace it (and its replacement node would start over). Use another --push-to")
    # The input is re-hashed only when it is about to be used, not on an "already done" rerun.
    # Each node's first process re-hashes the dataset (the others wait): one pass a node, not one a rank.
    checked_once_a_node(where.world, lambda: require_verified(data, "dataset",
                                                               "re-run `flashdraft tokenize`, or pull it again"))
    dataset_manifest = read_manifest(data)
    resume = latest_checkpoint(out, lineage, say)
    if cfg.push_to:  # the store may hold a newer checkpoint of this run (this machine replaces a dead one)
        first_on_node = int(os.environ.get("LOCAL_RANK", 0)) == 0  # each node pulls onto its own disk
        pulled = pull_newer_checkpoint(out, cfg.push_to, lineage, resume, say) if first_on_node else None
        barrier(where.world)
        if pulled is not None or not first_on_node:
            resume = latest_checkpoint(out, lineage, say)
    if resume is None and (other := other_work(out, lineage)):
        raise BadTrainingInput(f"{out} holds {other} trained from other data or settings; training here would "
                               f"discard it. Use another --out, or delete {out / DRAFTER} and {out / CHECKPOINTS} "
                               "to retrain here (a feature cache there is reused when it still fits)")
    if require_checkpoint and resume is None:
        raise BadTrainingInput(f"--resume: {out} has no complete checkpoint of this run to resume from")

    check_tokenizer(dataset_manifest.stats.get("tokenizer_vocab"), target_path)  # before any compute
    from transformers import AutoConfig

    check_against_target(cfg, AutoConfig.from_pretrained(target_path))  # its config only, not its weights
    if cfg.distill_topk and cfg.features != "offline":
        raise BadTrainingInput("train.distill_topk reads the target's top-k from the offline feature cache: "
                               "set train.features: offline (or distill_topk: 0)")
    if cfg.feature_source == "engine":
        from flashdraft.train.engine_features import check_engine_features

        say(f"train: feature source {check_engine_features(cfg)}")
    with ExitStack() as running:  # what the run started for itself (the feature engine) stops with it
        return train_from(cfg, data, out, target_path, where, lineage, resume, running, console, say)


def train_from(cfg: TrainConfig, data: Path, out: Path, target_path: str, where: Placement, lineage: Lineage,
               resume: Path | None, running: ExitStack, console, say) -> dict:
    """The run itself, once every input is checked: set up, resume, loop, evaluate, export."""
    drafter_dir = out / DRAFTER
    s = setup(cfg, data, out, target_path, where, console, say, running)
    position = {"step": 0, "epoch": 0, "batch": 0}
    if resume is not None:
        position = load_checkpoint(resume, s.model, s.optimizers)
        say(f"train: resuming from {resume.name} (step {position['step']}, epoch {position['epoch']})")
    if where.rank == 0:
        truncate_metrics(out / "metrics.jsonl", position["step"])
        # What `flashdraft status` reads of a run in progress: its length, and where this start began.
        mark_output(out, "train", total_steps=s.total_steps, start_step=position["step"], started=now_iso(),
                    feature_source=cfg.feature_source)
    say(f"train: {len(s.train_ids)} training / {len(s.heldout_ids)} held-out samples, {where.world} process(es), "
        f"{s.total_steps} steps, drafter {sum(p.numel() for p in s.drafter.parameters()) / 1e6:.1f}M params, "
        f"mask token {s.drafter.mask_token_id}, target layers {s.drafter.target_layer_ids}")

    started = time.perf_counter()
    shipper = CheckpointShipper(out, cfg, say, lineage)
    sinks = MetricSinks(out, where.rank == 0, cfg.model_dump())
    position, last, held_at = loop(cfg, s, position, sinks, shipper, lineage, out, console)
    sinks.close()
    if not all_finite(s.drafter, where.world):  # the last steps' update, if no checkpoint followed it
        raise Diverged(divergence(cfg, position["step"], "its update left weights that are not finite", out))
    # The last step is always a checkpoint, evaluated there: the same weights need no second pass over the
    # held-out samples (only a run resumed at its end, which trained nothing here, evaluates now).
    held = held_at[1] if held_at and held_at[0] == position["step"] else evaluate_heldout(
        s.model, s.target, s.dataset, s.heldout_ids, cfg, where.device, s.cache)
    final = whole_drafter(s)  # every rank: under FSDP the weights are gathered from the shards
    if where.rank != 0:
        shipper.wait()
        barrier(where.world)
        leave(where.world)
        return {}
    stats = {
        "steps": position["step"],
        "epochs": position["epoch"],
        "train_samples": len(s.train_ids),
        "final_loss": last.get("loss"),
        "heldout": held,
        "seconds": round(time.perf_counter() - started, 1),
        "world_size": where.world,
    }
    if (source := getattr(s.target, "source", None)) is not None and source.reported:  # which models gave the states
        stats["feature_servers"] = source.reported
    shipper.drafter(save_drafter(final, drafter_dir, stats=stats, lineage=lineage, dtype=cfg.export_dtype,
                                 target_lm_head=s.target.lm_head.weight))
    shipper.wait()
    tau, walked = held["simulated_acceptance_length"], held["serving_acceptance_length"]
    say(f"train: done, verified — {drafter_dir}: {position['step']} steps, held-out "
        + (f"serving-walk τ {walked:.2f} (what eval measures; per-anchor simulated τ {tau:.2f})"
           if walked is not None and tau is not None else "τ – (no held-out sample)"))
    barrier(where.world)
    leave(where.world)
    return stats


def whole_drafter(s: Setup) -> DFlashDrafter:
    """The trained drafter with all its weights in one place, to export: itself, or under FSDP (whose module
    holds only this rank's shards) a copy loaded from the gathered weights (on rank 0)."""
    if not hasattr(s.model, "reshard"):  # not FSDP (fully_shard adds `reshard`): the module holds whole tensors
        return s.drafter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # The weights only (not the optimizer state a checkpoint also gathers); every rank takes part, rank 0 gets them.
    weights = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    whole = type(s.drafter)(s.drafter.config)
    if s.where.rank == 0:
        whole.load_state_dict(weights)
    return whole


@dataclass
class Setup:
    """Everything the loop needs, built once."""

    where: Placement
    target: Target
    dataset: Any
    train_ids: list[int]
    heldout_ids: list[int]
    drafter: DFlashDrafter
    model: torch.nn.Module  # the drafter, wrapped for DDP/FSDP under torchrun
    optimizers: Optimizers  # AdamW, or Muon + AdamW (train.optimizer), with their schedules
    cache: Any  # FeatureCache (offline features) or None (the target runs in each step)
    steps_per_epoch: int
    total_steps: int


def setup(cfg: TrainConfig, data: Path, out: Path, target_path: str, where: Placement, console, say,
          running: ExitStack | None = None) -> Setup:
    """Everything the loop needs; what the run starts for itself (the feature engine) is entered on `running`."""
    # with the engine as the feature source the target's decoder layers stay there: embedding, norm and head here
    target = Target(target_path, where.target_device, say, cfg.target_dtype, layers=cfg.feature_source != "engine")
    imported = import_drafter(cfg, target.config, say) if cfg.init_from else None
    block_size = imported.block_size if imported is not None else cfg.block_size
    dataset = load_dataset_checked(data, block_size, target.config.vocab_size, cfg.max_length)
    counts = token_counts(data, dataset, where.world)
    check_token_ids(counts, target.config.vocab_size)
    train_ids, heldout_ids, free = run_split(dataset, cfg)
    dspark = is_dspark(imported) if imported is not None else cfg.architecture == "dspark"
    require_a_block(dataset, train_ids, block_size, cfg.max_length, from_anchor=dspark)
    if free is not None and heldout_ids:
        say(f"train: held out {len(heldout_ids)} samples, {int(free[heldout_ids].sum())} of them without kin in "
            "training (no other prompt opens with their first three words), as eval's held-out prompts are written")
    torch.manual_seed(cfg.seed)
    if imported is not None:
        drafter = imported
    else:
        config = draft_config(target.config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                              mask_token_id=pick_mask_token(cfg, target.config, target.path, counts),
                              target_layer_ids=cfg.target_layer_ids, draft_vocab_size=cfg.draft_vocab_size,
                              sliding_window=cfg.sliding_window)
        drafter = new_drafter(cfg, config, target.config)
        if cfg.init_from_target:
            drafter.init_from_target(attention_layers(target.decoder))
        if cfg.draft_vocab_size:
            # the training rows' counts: the whole dataset's less the (few) held-out rows'
            training = counts.minus(count_rows(dataset, heldout_ids))
            vocab = choose_draft_vocab(training, cfg.draft_vocab_size, target.config.vocab_size)
            drafter.set_draft_vocab(vocab)
    drafter = drafter.to(where.device, torch.float32)
    target.watch(drafter.target_layer_ids)
    if cfg.feature_source == "engine":  # its features come from vLLM from here on, online and offline alike
        from flashdraft.train.engine_features import engine_features

        assert running is not None, "the engine is stopped with the run: setup needs the run's ExitStack"
        devices = [d for d in where.target_device.split(",") if d.startswith("cuda")]
        log_name = "engine-vllm.log" if where.world == 1 else f"engine-vllm-{where.rank}.log"
        target.use(running.enter_context(engine_features(cfg, target_path, target.source_layers(),
                                                         target.config.hidden_size, devices, out / log_name, say,
                                                         rank=where.rank, judge=target.top_next_tokens)))
    cache = None
    if cfg.features == "offline":
        from flashdraft.train.feature_cache import offline_features

        cache = offline_features(cfg, data, out, target, target_path, dataset, where, console, say)
    model = wrap(drafter, cfg, where.world, where.device)
    steps_per_epoch = max(1, len(train_ids) // where.world // cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    optimizers = build_optimizers(cfg, drafter, total_steps)
    return Setup(where, target, dataset, train_ids, heldout_ids, drafter, model, optimizers, cache,
                 steps_per_epoch, total_steps)


def loop(cfg: TrainConfig, s: Setup, position: dict, sinks: MetricSinks, shipper: CheckpointShipper,
         lineage: Lineage, out: Path, console) -> tuple[dict, dict, tuple | None]:
    """Optimizer steps from `position` to `s.total_steps`; returns the final position, the last metrics and the
    last held-out evaluation with its step (None if no step ran)."""
    rank, world, device = s.where.rank, s.where.world, s.where.device
    per_rank = len(s.train_ids) // world
    step, last = position["step"], {}
    s.model.train()
    # Overlap: while the drafter trains on this step, a thread prepares the next one (target features). Worth it
    # when the target runs on other devices than the drafter; `train.prefetch` forces it either way.
    overlap = cfg.prefetch if cfg.prefetch is not None else (
        s.cache is None and s.where.target_device != s.where.device)
    prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") if overlap else None
    pending = None  # (epoch, batch index, future of its plans)
    held_at = None  # (step, the held-out evaluation there)
    text = "train loss {task.fields[loss]} τ≈{task.fields[tau]} {task.fields[tps]} tok/s"
    with progress(console if rank == 0 else None, text, total=s.total_steps, completed=step, unit="steps", loss="–",
                  tau="–", tps="–") as update:
        while step < s.total_steps:
            epoch, first_batch = position["epoch"], position["batch"]
            shuffled = torch.randperm(len(s.train_ids), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            mine = [s.train_ids[i] for i in shuffled.tolist()][rank : per_rank * world : world]
            for b in range(first_batch, s.steps_per_epoch):
                if step >= s.total_steps:
                    break
                t0 = time.perf_counter()
                batch = mine[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                with record_function("flashdraft.plan"):  # the phases a profile shows (benchmarks/gpu_eval.py)
                    if pending is not None and pending[:2] == (epoch, b):
                        plans = pending[2].result()
                    else:
                        plans = prepare(cfg, s, batch, epoch)
                pending = None
                if prefetcher is not None and b + 1 < s.steps_per_epoch and step + 1 < s.total_steps:
                    upcoming = mine[(b + 1) * cfg.batch_size : (b + 2) * cfg.batch_size]
                    pending = (epoch, b + 1, prefetcher.submit(prepare, cfg, s, upcoming, epoch))
                results, loss, grad_norm = optimizer_step(cfg, s, plans)
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the same on every rank
                    raise Diverged(divergence(cfg, step + 1, f"its loss is {loss}" if not math.isfinite(loss)
                                              else f"its gradient norm is {grad_norm}", out))
                step += 1
                position = {"step": step, "epoch": epoch, "batch": b + 1}
                with record_function("flashdraft.bookkeeping"):
                    last = step_metrics(step, epoch, results, loss, world, time.perf_counter() - t0, s.optimizers,
                                        s.drafter.block_size)
                    sinks.log(last)
                    shipper.raise_if_failed()  # a checkpoint that could not be pushed stops the run now
                    update(advance=1, loss=f"{last['loss']:.3f}", tau=f"{last['simulated_acceptance_length']:.2f}",
                           tps=f"{last['tokens_per_s']:,.0f}")
                if step % cfg.checkpoint_every == 0 or b + 1 == s.steps_per_epoch or step == s.total_steps:
                    if b + 1 == s.steps_per_epoch:
                        position = {"step": step, "epoch": epoch + 1, "batch": 0}
                    # Every rank evaluates (collectives stay in step); rank 0 records and saves.
                    if pending is not None:
                        pending[2].result()  # the target is free again before held-out evaluation uses it
                    held = evaluate_heldout(s.model, s.target, s.dataset, s.heldout_ids, cfg, device, s.cache)
                    held_at = (step, held)
                    sinks.log({"step": step, "heldout": held})
                    if not all_finite(s.drafter, world):  # never a checkpoint to resume into NaN from
                        raise Diverged(divergence(cfg, step, "its update left weights that are not finite", out))
                    state = full_state(s.model, s.optimizers)  # every rank: FSDP gathers its shards
                    if rank == 0:
                        saved = save_checkpoint(out, step, state, s.optimizers, position, lineage)
                        shipper.checkpoint(saved)
                    barrier(world)
            else:
                position = {"step": step, "epoch": epoch + 1, "batch": 0}
    if prefetcher is not None:
        prefetcher.shutdown(wait=True)
    return position, last, held_at


class Diverged(ExpectedFailure):
    """The loss, a gradient or the weights stopped being finite: the run stops there and exports nothing."""


def divergence(cfg: TrainConfig, step: int, what: str, out: Path) -> str:
    """The one line a diverged run ends with: which step, which settings drive the update's size, what is kept."""
    newest = next(iter(checkpoint_dirs(out)), None)
    rates = f"lr {cfg.lr:g}" + (f", muon_lr {cfg.muon_lr:g}" if cfg.optimizer == "muon" else "")
    return (f"training diverged at step {step}: {what} ({rates}, grad_clip {cfg.grad_clip:g}); stopped — nothing "
            f"was exported" + (f", the newest finite checkpoint is {newest.name}" if newest else "")
            + ": lower the learning rate and rerun")


def all_finite(drafter: torch.nn.Module, world: int) -> bool:
    """Whether every rank's weights (its shards, under FSDP) are finite: one answer, the same on every rank."""
    device = collective_device() if world > 1 else "cpu"
    finite = torch.tensor([0.0 if nonfinite_weights(drafter) else 1.0], device=device)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


# A micro-batch pads its sequences to the longest: on a compute-bound device (CPU) the padding costs more
# than batching saves once it passes about a quarter of the real tokens (benchmarks/RESULTS.md, train batching).
MAX_PADDING = 0.25


def micro_batches(batch: list[int], lengths: list[int], size: int) -> list[list[int]]:
    """The step's sequences, shortest first, in groups of at most `size` whose padding to the group's longest
    stays within MAX_PADDING of their real tokens. Grouping changes no number: each sequence's loss is its own."""
    order = sorted(range(len(batch)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and len(group) < size:
            real = sum(lengths[j] for j in group) + lengths[i]
            if (len(group) + 1) * lengths[i] <= (1 + MAX_PADDING) * real:
                group.append(i)
                continue
        groups.append([i])
    return [[batch[i] for i in group] for group in groups]


def prepare(cfg: TrainConfig, s: Setup, batch: list[int], epoch: int) -> list[Planned]:
    """One optimizer step's micro-batches (up to `train.micro_batch` sequences each), planned: anchors drawn
    and the target's features computed. Runs on the prefetch thread when the target and drafter overlap."""
    rows = {index: s.dataset[index] for index in batch}
    lengths = [min(len(rows[index]["input_ids"]), cfg.max_length) for index in batch]
    plans = []
    for chunk in micro_batches(batch, lengths, cfg.micro_batch):
        # Anchors depend only on (seed, epoch, sample): a resumed run draws the same ones.
        gens = [torch.Generator().manual_seed(hash((cfg.seed, epoch, index)) & 0x7FFFFFFF) for index in chunk]
        features = None if s.cache is None else [s.cache[index] for index in chunk]
        teachers = None if s.cache is None else [s.cache.teacher(index) for index in chunk]
        plans.append(plan_batch(s.target, [(rows[i]["input_ids"], rows[i]["loss_mask"]) for i in chunk], cfg, gens,
                                s.drafter.block_size, features, teachers, s.drafter.mask_token_id,
                                from_anchor=is_dspark(s.drafter)))
    return plans


def optimizer_step(cfg: TrainConfig, s: Setup, plans: list[Planned]) -> tuple[list[dict], float, float]:
    """One optimizer step — gradients, clipping, the update (and the schedules) — then everything it reports
    (loss, gradient norm, each sequence's stats) in one read from the device, its only one: the host queues the
    whole step before it waits. So a step that is not finite is found after its update; the run stops right
    there (Diverged) and nothing from that update is saved."""
    pending, totals = accumulate(cfg, s, plans)
    with record_function("flashdraft.optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), cfg.grad_clip)
        s.optimizers.step()
        s.optimizers.zero_grad()
    loss = totals[1] / totals[0].clamp(min=1e-8)
    if hasattr(grad_norm, "full_tensor"):  # under FSDP the norm is a DTensor (already summed over the shards)
        grad_norm = grad_norm.full_tensor()
    with record_function("flashdraft.read"):
        results, (loss_value, norm_value) = read_results(pending, also=(loss, grad_norm))
    return [r for r in results if r], loss_value[0], norm_value[0]


def accumulate(cfg: TrainConfig, s: Setup, plans: list[Planned]) -> tuple[list[dict], torch.Tensor]:
    """Gradients of one optimizer step, one forward pass per planned micro-batch (DDP syncs on the last one
    only), and the step's totals (Σ w, Σ CE·w; on the device, unread). The loss is Σ CE·w / Σ w over every block
    of the step — all micro-batches and all ranks — so no update depends on how the sequences were split: each
    micro-batch backpropagates its Σ CE·w, and once the step's weight total is known (summed across ranks) the
    gradients are divided by it (times the world size, undoing DDP's mean over ranks)."""
    device = s.where.device
    results = []
    for c, plan in enumerate(plans):
        sync = nullcontext() if c == len(plans) - 1 or not hasattr(s.model, "no_sync") else s.model.no_sync()
        with sync:
            done = [r for r in batch_step(s.model, s.target, [], cfg, [], device, planned=plan, read=False) if r]
            if done:
                with record_function("flashdraft.backward"):
                    sum(r["weighted_ce"] for r in done).backward()
            results.extend(done)
    # In float64, one sequence after another (the order the loss and the gradients' divisor have always had).
    zero = torch.zeros((), dtype=torch.float64, device=device)
    totals = torch.stack([sum((r[key].detach().double() for r in results), zero) for key in ("weight", "weighted_ce")])
    if s.where.world > 1:  # on the training device: nccl sends only GPU tensors
        import torch.distributed as dist

        dist.all_reduce(totals)
    scale = s.where.world / totals[0].clamp(min=1e-8)
    for p in s.drafter.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return results, totals


def step_metrics(step: int, epoch: int, results: list[dict], loss: float, world: int, seconds: float,
                 optimizers: Optimizers, block_size: int) -> dict:
    """One step's line of metrics.jsonl. `tokens_per_s` counts the sequences' tokens (the data's pace);
    `block_tokens_per_s` the drafter's block positions (anchors × block size), the unit its compute scales with
    and the one an isolated step (benchmarks/gpu_check.py) is measured in."""
    rates = mean_rates([r["rates"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    block_tokens = sum(r["anchors"] for r in results) * block_size
    return {
        "step": step,
        "epoch": epoch,
        "loss": loss if results else math.nan,
        "accuracy_by_position": json_rates(rates),
        "simulated_acceptance_length": round(expected_acceptance_length(rates), 4),
        "tokens_per_s": round(tokens * world / max(seconds, 1e-9), 1),
        "block_tokens_per_s": round(block_tokens * world / max(seconds, 1e-9), 1),
        "lr": optimizers.last_lr(),
        **selector_metrics(results),
    }
