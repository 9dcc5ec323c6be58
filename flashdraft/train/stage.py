"""train's run, top to bottom: decide (done? resume?) → set up (target, data, drafter, optimizer) → loop (loop.py) →
export, verified. Rank 0 holds the output locked for the whole run; under torchrun every rank runs `run`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from flashdraft.artifact.manifest import Lineage, check_done, read_manifest
from flashdraft.artifact.ownership import adopt, claim_output, mark_output, now_iso, output_lock, refuse_overlap
from flashdraft.artifact.verified import InputArtifact
from flashdraft.config import TrainConfig
from flashdraft.cpu_bfloat16 import bfloat16_notice
from flashdraft.errors import BadTrainingInput
from flashdraft.layout import CHECKPOINTS, DRAFTER
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.dspark import is_dspark
from flashdraft.model.export import save_drafter
from flashdraft.model.target import Target, attention_layers
from flashdraft.tokenize.token_counts import count_rows
from flashdraft.train.checkpoint import (
    CheckpointShipper,
    latest_checkpoint,
    load_checkpoint,
    other_work,
    pull_newer_checkpoint,
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
    leave,
    once_a_node,
    place,
    wrap,
)
from flashdraft.train.drafters import import_drafter, new_drafter
from flashdraft.train.heldout import evaluate_heldout
from flashdraft.train.launch import die_with_launcher, run_launched, under_a_launcher, waiting_for_the_launchers_stop
from flashdraft.train.lineage import open_dataset, run_lineage
from flashdraft.train.loop import Diverged, Setup, all_finite, data_unchanged, divergence, loop
from flashdraft.train.metrics import MetricSinks, truncate_metrics
from flashdraft.train.objectives import bf16_matmuls
from flashdraft.train.optim import build_optimizers


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
    # read once, here: the lineage names these manifest bytes, the re-hash checks against them, the stats come from them
    dataset = open_dataset(data)
    from flashdraft.model.resolve import resolve_model

    target_path = resolve_model(cfg.target, log=say)
    lineage = run_lineage(cfg, dataset.digest, target_path, where.world)
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
    dataset = once_a_node(where.world, dataset.verified, dataset.identified)
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

    check_tokenizer(dataset.stats.get("tokenizer_vocab"), target_path)  # before any compute
    from transformers import AutoConfig

    check_against_target(cfg, AutoConfig.from_pretrained(target_path))  # its config only, not its weights
    if cfg.distill_topk and cfg.features != "offline":
        raise BadTrainingInput("train.distill_topk reads the target's top-k from the offline feature cache: "
                               "set train.features: offline (or distill_topk: 0)")
    if cfg.engine_urls:
        from flashdraft.train.fleet import check_fleet

        say(f"train: feature source {check_fleet(cfg)}")
    elif cfg.feature_source == "engine":
        from flashdraft.train.engine_features import check_engine_features

        say(f"train: feature source {check_engine_features(cfg)}")
    with ExitStack() as running:  # what the run started for itself (the feature engine) stops with it
        return train_from(cfg, dataset, out, target_path, where, lineage, resume, running, console, say)


def train_from(cfg: TrainConfig, data: InputArtifact, out: Path, target_path: str, where: Placement, lineage: Lineage,
               resume: InputArtifact | None, running: ExitStack, console, say) -> dict:
    """The run itself, once every input is checked: set up, resume, loop, evaluate, export."""
    drafter_dir = out / DRAFTER
    s = setup(cfg, data, out, target_path, where, console, say, running)
    position = {"step": 0, "epoch": 0, "batch": 0}
    if resume is not None:
        position = load_checkpoint(resume.root, s.model, s.optimizers)
        resume.require_unchanged()  # what was loaded is the checkpoint that verified
        say(f"train: resuming from {resume.root.name} (step {position['step']}, epoch {position['epoch']})")
    if where.rank == 0:
        truncate_metrics(out / "metrics.jsonl", position["step"])
        # What `flashdraft status` reads of a run in progress: its length, and where this start began.
        mark_output(out, "train", total_steps=s.total_steps, start_step=position["step"], started=now_iso(),
                    feature_source=cfg.feature_source)
    say(f"train: {len(s.train_ids)} training / {len(s.heldout_ids)} held-out samples, {where.world} process(es), "
        f"{s.total_steps} steps, drafter {sum(p.numel() for p in s.drafter.parameters()) / 1e6:.1f}M params, "
        f"mask token {s.drafter.mask_token_id}, target layers {s.drafter.target_layer_ids}")
    if bf16_matmuls(cfg, where.device) and (notice := bfloat16_notice(where.device)):
        say(f"train: train.bf16 — {notice}")

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
    data_unchanged(s, where.world, out, "before the export")  # the lineage it writes names the bytes hashed
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
    if source is not None and getattr(source, "proof", None):  # the fleet's last proof, before the last checkpoint
        stats["feature_proof"] = source.proof
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


def setup(cfg: TrainConfig, data: InputArtifact, out: Path, target_path: str, where: Placement, console, say,
          running: ExitStack | None = None) -> Setup:
    """Everything the loop needs; what the run starts for itself (the feature engine) is entered on `running`."""
    # with the engine as the feature source the target's decoder layers stay there: embedding, norm and head here
    target = Target(target_path, where.target_device, say, cfg.target_dtype, layers=cfg.feature_source != "engine")
    imported = import_drafter(cfg, target.config, say) if cfg.init_from else None
    block_size = imported.block_size if imported is not None else cfg.block_size
    dataset = load_dataset_checked(data.root, block_size, target.config.vocab_size, cfg.max_length)
    counts = token_counts(data.root, dataset, where.world)
    data.require_unchanged()  # what was loaded (memory-mapped) and counted is what was hashed
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
        from flashdraft.train.fleet import fleet_features

        assert running is not None, "the engine is stopped with the run: setup needs the run's ExitStack"
        devices = [d for d in where.target_device.split(",") if d.startswith("cuda")]
        log_name = "engine-vllm.log" if where.world == 1 else f"engine-vllm-{where.rank}.log"
        layers, width = target.source_layers(), target.config.hidden_size
        if cfg.engine_urls:  # a fleet on other hosts: proven against the target's own weights before any work
            source = fleet_features(cfg, target_path, layers, width, devices, out / log_name, say, rank=where.rank,
                                    judge=target.top_next_tokens, reference=target.streamed_states)
        else:
            source = engine_features(cfg, target_path, layers, width, devices, out / log_name, say, rank=where.rank,
                                     judge=target.top_next_tokens)
        target.use(running.enter_context(source))
    cache = None
    if cfg.features == "offline":
        from flashdraft.train.feature_cache import offline_features

        cache = offline_features(cfg, data.digest, out, target, target_path, dataset, where, console, say)
    model = wrap(drafter, cfg, where.world, where.device)
    steps_per_epoch = max(1, len(train_ids) // where.world // cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    optimizers = build_optimizers(cfg, drafter, total_steps)
    return Setup(where, target, dataset, train_ids, heldout_ids, drafter, model, optimizers, cache,
                 steps_per_epoch, total_steps, data)
