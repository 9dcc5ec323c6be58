"""train's loop: optimizer steps from a position to the last, each a batch cut into micro-batches (accumulated,
clipped, stepped), with held-out evaluation, checkpoints shipped as they are made, and a stop on a non-finite loss
or weight (`Diverged`).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from flashdraft.artifact.manifest import (
    Lineage,
)
from flashdraft.config import TrainConfig
from flashdraft.errors import ExpectedFailure
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.export import nonfinite_weights
from flashdraft.model.objective import expected_acceptance_length
from flashdraft.model.target import Target
from flashdraft.progress import progress
from flashdraft.train.checkpoint import (
    CheckpointShipper,
    checkpoint_dirs,
    full_state,
    save_checkpoint,
)
from flashdraft.train.distributed import (
    Placement,
    barrier,
    collective_device,
    on_every_rank,
    on_rank_zero,
)
from flashdraft.train.heldout import evaluate_heldout
from flashdraft.train.metrics import MetricSinks, json_rates, mean_rates, selector_metrics
from flashdraft.train.optim import Optimizers
from flashdraft.train.plan import Planned, plan_batch
from flashdraft.train.step import batch_step, read_results


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
    data: Any = None  # the dataset artifact as verified (InputArtifact): its files' identities, checked again


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
    pace = Pace(step, s.total_steps, shipper.log if rank == 0 else None)
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
                pace.stepped(step, time.perf_counter() - t0)
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
                    # the bytes trained on are still the bytes hashed, and a fleet's servers still the target: a
                    # checkpoint only on data and states proven since the last one
                    data_unchanged(s, world, out, f"before the checkpoint at step {step}")
                    proof = features_proven(s, step, world, out)
                    state = full_state(s.model, s.optimizers)  # every rank: FSDP gathers its shards
                    if rank == 0:
                        saved = save_checkpoint(out, step, state, s.optimizers, position, lineage, proof)
                        shipper.checkpoint(saved)
                    barrier(world)
            else:
                position = {"step": step, "epoch": epoch + 1, "batch": 0}
    if prefetcher is not None:
        prefetcher.shutdown(wait=True)
    return position, last, held_at


class Pace:
    """After the first PACE_STEPS steps of a start (the first one's warm-up left out), one line: the measured seconds a
    step and what they make of the rest of the run — the figure `estimate --step-seconds` plans with."""

    PACE_STEPS = 10

    def __init__(self, first_step: int, total_steps: int, log) -> None:
        self.first, self.total, self.log, self.seconds = first_step, total_steps, log, []

    def stepped(self, step: int, seconds: float) -> None:
        if self.log is None or step - self.first > self.PACE_STEPS:
            return
        if step - self.first > 1:  # the first step of a start compiles, allocates and fills caches
            self.seconds.append(seconds)
        if step - self.first == self.PACE_STEPS:
            median = sorted(self.seconds)[len(self.seconds) // 2]
            left = self.total - step
            self.log(f"train: measured {median:.2f} s a step (median of steps {self.first + 2}–{step}); the {left:,} "
                     f"steps left take ≈ {left * median / 3600:,.1f} hours at this pace (flashdraft estimate CONFIG "
                     f"--step-seconds {median:.2f} plans the whole run with it)")


def data_unchanged(s: Setup, world: int, out: Path, where: str) -> None:
    """The dataset's files are the ones hashed at the start (memory-mapped, they are read all run long): one rewritten
    since — even in place with its modification time put back — stops the run here, on every rank, in one line naming
    the file; the newest checkpoint stays the last one trained on the hashed bytes."""
    if s.data is None:
        return

    def check() -> None:
        newest = next(iter(checkpoint_dirs(out)), None)
        s.data.require_unchanged(f"while it was trained on; stopped {where}" + (
            f", {newest.name} stays the newest checkpoint" if newest else ""))

    on_every_rank(world, check, "the dataset's check")


def features_proven(s: Setup, step: int, world: int, out: Path) -> dict | None:
    """Before a checkpoint: where the target's states come from a fleet (train/fleet.py), every server answers the
    probe with the target's states again, checked once (rank 0) for every rank; the proof, for the checkpoint's
    manifest. A server that no longer does stops the run here, and the last checkpoint stays the last good one."""
    source = getattr(s.target, "source", None)
    if source is None or not hasattr(source, "prove"):
        return None

    def prove() -> dict:
        try:
            return source.prove(step)
        except ExpectedFailure as e:
            newest = next(iter(checkpoint_dirs(out)), None)
            raise type(e)(f"{e} — stopped before the checkpoint at step {step}" + (
                f"; {newest.name}, trained on proven states, stays the newest" if newest else "")) from None

    return on_rank_zero(world, prove, "the fleet's proof before the checkpoint")


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
