"""train: the DFlash drafter on the target's hidden states — resumable, distributed with torchrun.

    flashdraft train --data work/dataset --out work/train [--target REF] [--epochs 6] [--max-steps N]
    torchrun --nproc-per-node 4 -m flashdraft train --data … --out …      # DDP (gloo on CPU, nccl on GPU)

Each step: for every sequence, the frozen target runs once with forward hooks on `target_layer_ids` (their
outputs = hidden_states[id + 1]); anchors are drawn from supervised positions; all blocks of the sequence
go through the drafter in one pass under the block mask; the target's LM head scores the block positions;
the loss is CE weighted by exp(−(k−1)/γ) × loss mask. AdamW, cosine schedule with warmup, grad clipping.

Output (`--out`): checkpoints/step-NNNNNNN/ (each an artifact: weights, optimizer, scheduler, data position;
the newest that verifies is resumed, incomplete ones are ignored), metrics.jsonl, and drafter/ — the exported
drafter (z-lab format, `drafter` artifact), the stage's output.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flashdraft.artifact import (
    INTERNAL_PREFIX,
    MANIFEST,
    Lineage,
    atomic_write_text,
    build_manifest,
    check_done,
    identity,
    manifest_digest,
    read_manifest,
    sha256_json,
    verify_dir,
    write_manifest,
)
from flashdraft.blocks import (
    block_attention_mask,
    build_blocks,
    expected_acceptance_length,
    flex_block_mask,
    per_position_accuracy,
    sample_anchors,
    weighted_loss,
)
from flashdraft.config import TrainConfig
from flashdraft.drafter import DFlashDrafter, draft_config
from flashdraft.export import save_drafter
from flashdraft.progress import progress


class BadTrainingInput(ValueError):
    """The dataset, target or settings cannot train a drafter; said before any compute."""


# ---------------------------------------------------------------------------------------------- target


class Target:
    """The frozen target: features from chosen layers via forward hooks, plus its embedding and LM head."""

    def __init__(self, path: str, device: str, log: Callable[[str], None]) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        many = "," in device  # "cuda:0,cuda:1": spread the target's layers over those devices
        kwargs = {"device_map": "auto", "max_memory": _memory_map(device)} if many else {}
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, **kwargs).eval()
        if not many:
            self.model.to(device)
        self.model.requires_grad_(False)
        self.config = self.model.config
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def watch(self, layer_ids: list[int]) -> None:
        for handle in self._hooks:
            handle.remove()
        layers = self.model.model.layers
        for i in layer_ids:
            self._hooks.append(layers[i].register_forward_hook(self._capture(i)))
        self.layer_ids = list(layer_ids)

    def _capture(self, index: int):
        def hook(module, inputs, output):
            self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def forward(self, input_ids_BT: torch.Tensor, **kwargs):
        """The base model (no LM head) over tokens, with any cache kwargs: (its output, the watched layers'
        outputs concatenated, B × T × n·D)."""
        output = self.model.model(input_ids=input_ids_BT.to(self.model.device), **kwargs)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return output, features

    @torch.no_grad()
    def features(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids_BT)[1]

    def head_weight(self, drafter: DFlashDrafter) -> torch.Tensor:
        """The LM head rows the drafter scores with (all of them, or its reduced draft vocabulary)."""
        if getattr(self, "_head_for", None) is not drafter:
            self._head, self._head_for = drafter.head_weight(self.model.lm_head.weight), drafter
        return self._head

    def discard_features(self) -> None:
        """Forget what the hooks captured during a pass whose features are not needed (e.g. `generate`)."""
        self._captured.clear()


def _memory_map(devices: str) -> dict:
    return {int(d.split(":")[1]): "1000GiB" for d in devices.split(",")}


# ---------------------------------------------------------------------------------------------- data


def load_dataset_checked(data: Path, block_size: int, vocab_size: int, max_length: int):
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(str(data))
    except FileNotFoundError as e:
        raise BadTrainingInput(f"{data} is not a tokenize output (datasets.save_to_disk layout): {e}") from None
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise BadTrainingInput(f"{data} has no {', '.join(sorted(missing))} column: run `flashdraft tokenize` first")
    import pyarrow.compute as pc

    ids = dataset.data.column("input_ids")  # checked on the Arrow columns: no Python loop over samples
    longest = pc.max(pc.list_value_length(ids)).as_py() or 0
    if longest < block_size + 1:
        raise BadTrainingInput(f"block size {block_size} is larger than every sample (longest: {longest} tokens)")
    top = pc.max(pc.list_flatten(ids)).as_py()
    if top >= vocab_size:
        raise BadTrainingInput(
            f"token id {top} is outside the target's vocabulary ({vocab_size}): the dataset was tokenized with "
            "another tokenizer than this target's"
        )
    return dataset.with_format("numpy", columns=["input_ids", "loss_mask"])


def pick_mask_token(cfg: TrainConfig, target_config, target_path: str, dataset) -> int:
    """An id the target never sees in use: a padded embedding row if there is one, else the highest id
    that the training data never contains."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    tokenizer_len = target_config.vocab_size  # no tokenizer beside the weights: decide from the data
    if any((Path(target_path) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        tokenizer_len = len(AutoTokenizer.from_pretrained(target_path))
    if tokenizer_len < target_config.vocab_size:
        return tokenizer_len
    seen = np.zeros(target_config.vocab_size, dtype=bool)
    for row in dataset:
        seen[row["input_ids"]] = True
    unused = np.flatnonzero(~seen)
    if len(unused) == 0:
        raise BadTrainingInput("every token id occurs in the data: set train.mask_token_id explicitly")
    return int(unused[-1])


# ---------------------------------------------------------------------------------------------- one sequence


def sequence_step(model, target: Target, ids_T, mask_T, cfg: TrainConfig, generator, device,
                  features_TF: torch.Tensor | None = None) -> dict | None:  # fmt: skip
    """Loss (with grad) and accuracy stats of all blocks of one sequence; None if it has no anchor.
    `features_TF`: the sequence's cached target features (offline mode); else the target runs now."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    ids_T, mask_T = torch.as_tensor(ids_T[: cfg.max_length]).long(), torch.as_tensor(mask_T[: cfg.max_length])
    anchors = sample_anchors(mask_T, drafter.block_size, cfg.max_anchors, generator)
    if len(anchors) == 0:
        return None
    context_len = int(anchors.max())  # no block sees a position at or after its anchor
    if features_TF is None:
        features_TF = target.features(ids_T[None, :context_len])[0]
    # The target is causal: a prefix of the whole sequence's cached features is the prefix's features.
    features = features_TF[None, :context_len].to(device=device, dtype=torch.float32)
    block_ids, positions, labels, weights = build_blocks(
        ids_T, mask_T, anchors, drafter.block_size, drafter.mask_token_id
    )
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        block_embeds = embed(block_ids.view(1, -1).to(embed.weight.device)).to(device, torch.float32)
    if str(device).startswith("cuda"):  # block-sparse FlexAttention; SDPA with the dense mask elsewhere
        allowed = flex_block_mask(anchors, drafter.block_size, context_len, device)
    else:
        allowed = block_attention_mask(anchors, drafter.block_size, context_len)[None].to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
        hidden = model(block_embeds, features, positions.view(1, -1).to(device),
                       torch.arange(context_len, device=device)[None], allowed)  # fmt: skip
        head = target.head_weight(drafter)
        logits = (hidden.to(head.device) @ head.T).to(device)
    loss_weights = weights
    if drafter.draft_vocab_size:  # labels into the draft vocabulary; a token outside it cannot be proposed
        labels, inside = drafter.draft_labels(labels)
        loss_weights = weights * inside
    n, k = labels.shape
    loss = weighted_loss(logits.view(n * k, -1), labels.view(-1).clamp(min=0).to(device),
                         loss_weights.view(-1).to(device))  # fmt: skip
    with torch.no_grad():
        rates = per_position_accuracy(logits.view(n, k, -1).cpu(), labels, weights)
    return {"loss": loss, "rates": rates, "tokens": int(ids_T.shape[0]), "anchors": n}


def split_heldout(n: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices. The held-out ones are a seeded random pick, not the tail: datasets
    often come sorted (by prompt category, by source), and a tail would measure one kind of text only."""
    n_eval = min(eval_samples, max(0, n // 10))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def choose_draft_vocab(dataset, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most often supervised in the training data (ties: lower id first)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in dataset:
        counts += np.bincount(row["input_ids"][row["loss_mask"].astype(bool)], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:size]))


def mean_rates(rows: list[list[float]]) -> list[float]:
    """Mean over sequences of per-position rates; NaN where no sequence reached a position."""
    import warnings

    arr = np.array(rows, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns are expected: they stay NaN
        return [float(x) for x in np.nanmean(arr, axis=0)] if len(arr) else []


# ---------------------------------------------------------------------------------------------- metrics


class MetricSinks:
    """metrics.jsonl always; TensorBoard (`<out>/tensorboard`) when `tensorboard` is installed; Weights &
    Biases when `wandb` is installed and WANDB_PROJECT is set (so nothing ever waits on a login prompt)."""

    def __init__(self, out: Path, enabled: bool, config: dict) -> None:
        self.path, self.sinks, self.enabled = out / "metrics.jsonl", [], enabled
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.sinks.append(("tensorboard", SummaryWriter(str(out / "tensorboard"))))
        except ImportError:
            pass
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb

                self.sinks.append(("wandb", wandb.init(project=os.environ["WANDB_PROJECT"], config=config)))
            except ImportError:
                pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        _append(self.path, record)
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("step", "epoch")}
        if "heldout" in record and record["heldout"].get("simulated_acceptance_length") is not None:
            scalars["heldout_simulated_acceptance_length"] = record["heldout"]["simulated_acceptance_length"]
        for name, sink in self.sinks:
            if name == "tensorboard":
                for key, value in scalars.items():
                    sink.add_scalar(key, value, record["step"])
            else:
                sink.log(scalars, step=record["step"])

    def close(self) -> None:
        for name, sink in self.sinks:
            if name == "tensorboard":
                sink.close()
            else:
                sink.finish()


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / "checkpoints"
    return sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []


def save_checkpoint(out: Path, step: int, model, optimizer, scheduler, position: dict, lineage: Lineage) -> Path:
    """A checkpoint is an artifact: files into a temp dir, manifest last, then one rename."""
    final = out / "checkpoints" / f"step-{step:07d}"
    tmp = final.with_name(f"{INTERNAL_PREFIX}tmp-{os.getpid()}-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    drafter = getattr(model, "module", model)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "drafter.safetensors")
    )
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    atomic_write_text(tmp / "position.json", json.dumps(position))
    write_manifest(tmp, build_manifest(tmp, kind="checkpoint", stats=position, lineage=lineage))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def prune_checkpoints(out: Path, keep: int, upto: str | None = None) -> list[str]:
    """Delete all but the newest `keep` checkpoints (complete or not): disk stays bounded on long runs.
    With `upto`, only checkpoints no newer than that one are candidates (newer ones may not be pushed yet)."""
    removed = []
    for path in checkpoint_dirs(out)[max(1, keep) :]:
        if upto is None or path.name <= upto:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


class CheckpointShipper:
    """Pushes each checkpoint to `train.push_to` (verified there) and prunes old local ones, in one
    background thread so training does not wait on the network. FIFO: after checkpoint N is pushed, every
    checkpoint up to N has been, so only those are pruned; newer ones may still wait for their push."""

    def __init__(self, out: Path, cfg: TrainConfig, log: Callable[[str], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.cfg, self.log = out, cfg, log
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-push")
        self.pending: list = []

    def _push(self, local: Path, name: str) -> None:
        from flashdraft.store import open_store
        from flashdraft.sync import push

        self.log(push(local, open_store(f"{self.cfg.push_to.rstrip('/')}/{name}"), log=self.log).line())

    def checkpoint(self, path: Path) -> None:
        def ship() -> None:
            if self.cfg.push_to:
                self._push(path, f"checkpoints/{path.name}")
            prune_checkpoints(self.out, self.cfg.keep_checkpoints, upto=path.name)

        self.pending.append(self.pool.submit(ship))

    def drafter(self, path: Path) -> None:
        if self.cfg.push_to:
            self.pending.append(self.pool.submit(self._push, path, "drafter"))

    def wait(self) -> None:
        """Block until every push is done; the first failure (e.g. VerifyFailed) is raised here."""
        try:
            for future in self.pending:
                future.result()
        finally:
            self.pool.shutdown(wait=True)


def latest_checkpoint(out: Path, lineage: Lineage, log: Callable[[str], None]) -> Path | None:
    for path in checkpoint_dirs(out):
        problems = verify_dir(path)
        if problems:
            log(f"train: ignoring incomplete checkpoint {path.name} ({problems[0]})")
            continue
        if not read_manifest(path).lineage.same_work(lineage):
            log(f"train: ignoring checkpoint {path.name} (made from other data or settings)")
            continue
        return path
    return None


# ---------------------------------------------------------------------------------------------- run


def for_rank(spec: str | None, local_rank: int) -> str | None:
    """Device settings per process: "a;b;c" gives local rank i the i-th entry (the 2 + 2 split under
    `torchrun --nproc-per-node 2`: target_device "cuda:0;cuda:1", device "cuda:2;cuda:3"); within an entry,
    "cuda:0,cuda:1" spreads one process's target over both."""
    if spec is None or ";" not in spec:
        return spec
    entries = [e.strip() for e in spec.split(";")]
    if local_rank >= len(entries):
        raise BadTrainingInput(f"device setting {spec!r} has {len(entries)} entries; local rank {local_rank} has none")
    return entries[local_rank]


def setup_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    return (torch.distributed.get_rank() if world > 1 else 0), world


def wrap(model: torch.nn.Module, cfg: TrainConfig, world: int, device: str) -> torch.nn.Module:
    """DDP by default; FSDP for drafters too large to replicate. One function, two branches."""
    if world == 1:
        return model
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def run(
    cfg: TrainConfig,
    data: Path,
    out: Path,
    *,
    require_checkpoint: bool = False,
    console=None,
    log: Callable[[str], None] = print,
) -> dict:
    from transformers import get_cosine_schedule_with_warmup

    data, out = Path(data), Path(out)
    rank, world = setup_distributed()
    say = log if rank == 0 else (lambda s: None)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = for_rank(cfg.device, local_rank) or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
    target_device = for_rank(cfg.target_device, local_rank) or device

    if not (data / MANIFEST).is_file():
        raise BadTrainingInput(f"{data} is not a verified dataset (no manifest): run `flashdraft tokenize` first")
    from flashdraft.models import resolve_model

    target_path = resolve_model(cfg.target, log=say)
    lineage = Lineage(
        inputs=[manifest_digest(data)],
        config=sha256_json(
            {
                "train": cfg.model_dump(exclude={"device", "target_device", "push_to", "keep_checkpoints"}),
                "world": world,
                "target": identity(target_path),
            }
        ),  # fmt: skip
    )
    decision = check_done(out / "drafter", lineage)
    say(decision.line("train", out / "drafter"))
    if decision.done:
        if cfg.push_to and rank == 0:  # done here; make sure the store holds it too (a no-op when it does)
            shipper = CheckpointShipper(out, cfg, say)
            shipper.drafter(out / "drafter")
            shipper.wait()
        return read_manifest(out / "drafter").stats
    if require_checkpoint and latest_checkpoint(out, lineage, say) is None:
        raise BadTrainingInput(f"--resume: {out} has no complete checkpoint of this run to resume from")
    target = Target(target_path, target_device, say)

    dataset = load_dataset_checked(data, cfg.block_size, target.config.vocab_size, cfg.max_length)
    config = draft_config(target.config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                          mask_token_id=pick_mask_token(cfg, target.config, target.path, dataset),
                          target_layer_ids=cfg.target_layer_ids, draft_vocab_size=cfg.draft_vocab_size)  # fmt: skip
    target.watch(config.dflash_config["target_layer_ids"])
    train_ids, heldout_ids = split_heldout(len(dataset), cfg.eval_samples, cfg.seed)
    n_train, n_eval = len(train_ids), len(heldout_ids)

    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(config).to(device)
    if cfg.init_from_target:
        drafter.init_from_target(target.model)
    if cfg.draft_vocab_size:
        drafter.set_draft_vocab(choose_draft_vocab(dataset.select(train_ids), cfg.draft_vocab_size,
                                                   target.config.vocab_size))  # fmt: skip
    cache = None
    if cfg.features == "offline":
        cache = offline_features(cfg, data, out, target, target_path, dataset, rank, world, console, say)
    model = wrap(drafter, cfg, world, device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    per_rank = n_train // world
    steps_per_epoch = max(1, per_rank // cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(cfg.warmup_ratio * total_steps), total_steps)

    step, position = 0, {"step": 0, "epoch": 0, "batch": 0}
    resume = latest_checkpoint(out, lineage, say)
    if resume is not None:
        drafter.load_state_dict(load_file(str(resume / "drafter.safetensors")))
        state = torch.load(resume / "optimizer.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        position = json.loads((resume / "position.json").read_text())
        step = position["step"]
        say(f"train: resuming from {resume.name} (step {step}, epoch {position['epoch']})")
    if rank == 0:
        _truncate_metrics(out / "metrics.jsonl", step)
    sinks = MetricSinks(out, rank == 0, cfg.model_dump())
    say(f"train: {n_train} training / {n_eval} held-out samples, {world} process(es), {total_steps} steps, "
        f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params, "
        f"mask token {drafter.mask_token_id}, target layers {drafter.target_layer_ids}")  # fmt: skip

    shipper = CheckpointShipper(out, cfg, say)
    model.train()
    started, last = time.perf_counter(), {}
    text = "train loss {task.fields[loss]} τ≈{task.fields[tau]} {task.fields[tps]} tok/s"
    shown = console if rank == 0 else None
    with progress(shown, text, total=total_steps, completed=step, loss="–", tau="–", tps="–") as update:
        while step < total_steps:
            epoch, first_batch = position["epoch"], position["batch"]
            shuffled = torch.randperm(n_train, generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
            order = [train_ids[i] for i in shuffled]
            mine = order[rank : per_rank * world : world]
            for b in range(first_batch, steps_per_epoch):
                if step >= total_steps:
                    break
                batch = mine[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                t0 = time.perf_counter()
                results = []
                for i, index in enumerate(batch):
                    row = dataset[index]
                    # Anchors depend only on (seed, epoch, sample): a resumed run draws the same ones.
                    gen = torch.Generator().manual_seed(hash((cfg.seed, epoch, index)) & 0x7FFFFFFF)
                    last_micro = i == len(batch) - 1
                    sync = nullcontext() if last_micro or not hasattr(model, "no_sync") else model.no_sync()
                    with sync:
                        result = sequence_step(model, target, row["input_ids"], row["loss_mask"], cfg, gen, device,
                                               None if cache is None else cache[index])  # fmt: skip
                        if result is not None:
                            (result["loss"] / len(batch)).backward()
                            results.append(result)
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                position = {"step": step, "epoch": epoch, "batch": b + 1}
                tokens = sum(r["tokens"] for r in results)
                rates = mean_rates([r["rates"] for r in results])
                last = {
                    "step": step, "epoch": epoch,
                    "loss": float(np.mean([r["loss"].item() for r in results])) if results else math.nan,
                    "accuracy_by_position": _json_rates(rates),
                    "simulated_acceptance_length": round(expected_acceptance_length(rates), 4),
                    "tokens_per_s": round(tokens * world / max(time.perf_counter() - t0, 1e-9), 1),
                    "lr": scheduler.get_last_lr()[0],
                }  # fmt: skip
                sinks.log(last)
                update(advance=1, loss=f"{last['loss']:.3f}", tau=f"{last['simulated_acceptance_length']:.2f}",
                       tps=f"{last['tokens_per_s']:,.0f}")  # fmt: skip
                if step % cfg.checkpoint_every == 0 or b + 1 == steps_per_epoch or step == total_steps:
                    if b + 1 == steps_per_epoch:
                        position = {"step": step, "epoch": epoch + 1, "batch": 0}
                    # Every rank evaluates (collectives stay in step); rank 0 records and saves.
                    held = evaluate_heldout(model, target, dataset, heldout_ids, cfg, device, cache)
                    sinks.log({"step": step, "heldout": held})
                    if rank == 0:
                        shipper.checkpoint(save_checkpoint(out, step, model, optimizer, scheduler, position, lineage))
                    _barrier(world)
            else:
                position = {"step": step, "epoch": epoch + 1, "batch": 0}

    held = evaluate_heldout(model, target, dataset, heldout_ids, cfg, device, cache)
    sinks.close()
    if rank != 0:
        shipper.wait()
        _barrier(world)
        return {}
    stats = {
        "steps": step,
        "epochs": position["epoch"],
        "train_samples": n_train,
        "final_loss": last.get("loss"),
        "heldout": held,
        "seconds": round(time.perf_counter() - started, 1),
        "world_size": world,
    }
    shipper.drafter(save_drafter(drafter, out / "drafter", stats=stats, lineage=lineage))
    shipper.wait()
    say(f"train: done, verified — {out / 'drafter'}: {step} steps, held-out simulated τ "
        f"{held.get('simulated_acceptance_length', math.nan):.2f}")  # fmt: skip
    _barrier(world)
    return stats


def offline_features(cfg: TrainConfig, data: Path, out: Path, target: Target, target_path: str, dataset,
                     rank: int, world: int, console, log):  # fmt: skip
    """The offline cache under `out/features`: rank 0 builds (or reuses) it, the other ranks then read it."""
    from flashdraft.features import FeatureCache, build_or_reuse

    lineage = Lineage(
        inputs=[manifest_digest(data)],
        config=sha256_json({"target": identity(target_path), "layers": target.layer_ids, "max_length": cfg.max_length}),
    )
    if rank == 0:
        cache = build_or_reuse(out / "features", target, dataset, cfg.max_length, lineage, console=console, log=log)
    _barrier(world)
    return cache if rank == 0 else FeatureCache(out / "features")


@torch.no_grad()
def evaluate_heldout(model, target: Target, dataset, indices, cfg: TrainConfig, device, cache=None) -> dict[str, Any]:
    """Per-position accuracy and simulated τ on held-out samples, with fixed anchors."""
    model.eval()
    rows = []
    for index in indices:
        row = dataset[index]
        result = sequence_step(model, target, row["input_ids"], row["loss_mask"], cfg,
                               torch.Generator().manual_seed(index), device,
                               None if cache is None else cache[index])  # fmt: skip
        if result is not None:
            rows.append(result["rates"])
    model.train()
    rates = mean_rates(rows)
    return {
        "samples": len(rows),
        "accuracy_by_position": _json_rates(rates),
        "simulated_acceptance_length": round(expected_acceptance_length(rates), 4) if rows else None,
    }


def _json_rates(rates: list[float]) -> list[float | None]:
    """Rates for JSON: None where no sample reached a position (NaN is not JSON)."""
    return [None if math.isnan(x) else round(x, 4) for x in rates]


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines past the checkpoint so the curve has no duplicate steps."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))
