"""train benchmark: DFlash training steps on CPU with the embedded SmolLM2 target and a demo-sized drafter.

    .venv/bin/python benchmarks/train_bench.py [--lengths 512,1024,2048] [--anchors 32] [--layers 2]
                                               [--modes online-full,offline-4096]
    .venv/bin/python benchmarks/train_bench.py --batching 4 --lengths 300,2000 --anchors 16 --block 8

`--batching B` compares instead the optimizer step over B sequences (lengths jittered ±25 % around each
length, like real data) done one sequence per forward pass (`train.micro_batch: 1`) against all B in one
padded forward pass (`train.micro_batch: B`, flashdraft's default; grouped as training groups them, padding
at most 25 % of the real tokens), same anchors, same math.

For each mode and sequence length: tokens/s and peak RSS of full training steps (drafter forward and
backward, LM head, AdamW step; with `online-full` also the target's forward for the features and the full
49,152-token LM head; with `offline-V` features from the cache and a V-token draft vocabulary), with every
block of the sequence in one pass under the block mask — and the naive way, each block run as its own
forward pass with its own context slice (same anchors, same math). The block layout only changes the
drafter's share of the step, so the speedup is largest where the target and the LM head cost least. Each
variant runs in its own process, so peak RSS is its own. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def worker(length: int, anchors: int, layers: int, naive: bool, steps: int, mode: str) -> dict:
    """One variant in its own process. mode: `online-full` (the target runs inside the step, full-vocabulary
    LM head) or `offline-V` (cached target features, a V-token draft vocabulary)."""
    import torch

    from flashdraft.config import TrainConfig
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.objective import block_attention_mask, build_blocks, sample_anchors, weighted_loss
    from flashdraft.model.resolve import resolve_model
    from flashdraft.model.target import Target
    from flashdraft.train.step import sequence_step

    torch.manual_seed(0)
    offline = mode.startswith("offline")
    vocab = int(mode.split("-")[1]) if offline else None
    target = Target(resolve_model("embedded", log=lambda s: None), "cpu", lambda s: None)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=layers, block_size=16, mask_token_id=0,
                                         draft_vocab_size=vocab))
    if vocab:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size)[:vocab])
    target.watch(drafter.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    ids = torch.randint(0, 49000, (length,))
    mask = torch.ones(length, dtype=torch.long)
    mask[:32] = 0
    cfg = TrainConfig(block_size=16, max_anchors=anchors, max_length=length)
    embed = target.model.get_input_embeddings()
    head = drafter.head_weight(target.lm_head.weight)
    cached = target.features(ids[None])[0] if offline else None  # the offline cache, read outside the clock

    def one_pass():
        result = sequence_step(drafter, target, ids, mask, cfg, torch.Generator().manual_seed(0), "cpu", cached)
        result["loss"].backward()

    def per_block():
        chosen = sample_anchors(mask, 16, anchors, torch.Generator().manual_seed(0))
        features = cached[None] if offline else target.features(ids[None, : int(chosen.max())])
        for a in chosen.tolist():  # each block alone: its own context slice, its own pass
            block_ids, positions, labels, weights = build_blocks(ids, mask, torch.tensor([a]), 16, 0)
            if vocab:  # same mapping as sequence_step
                labels, inside = drafter.draft_labels(labels)
                labels, weights = labels.clamp(min=0), weights * inside
            with torch.no_grad():
                embeds = embed(block_ids.view(1, -1))
            hidden = drafter(embeds, features[:, :a], positions.view(1, -1), torch.arange(a)[None],
                             block_attention_mask(torch.tensor([a]), 16, a)[None])
            loss = weighted_loss((hidden @ head.T).view(16, -1), labels.view(-1), weights.view(-1)) / len(chosen)
            loss.backward()

    return timed_steps(per_block if naive else one_pass, optimizer, steps, length)


def mode_name(mode: str) -> str:
    """A report's words for a --modes entry."""
    if mode == "online-full":
        return "online (target in the step), 49,152 tokens"
    return f"offline cache, {mode.split('-')[1]}-token draft vocab"


def timed_steps(step, optimizer, steps: int, tokens: int) -> dict:
    """Seconds per optimizer step (after one warm-up), tokens/s and this process's peak RSS."""
    step()
    optimizer.zero_grad()
    start = time.perf_counter()
    for _ in range(steps):
        step()
        optimizer.step()
        optimizer.zero_grad()
    seconds = (time.perf_counter() - start) / steps
    return {"seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def batch_worker(length: int, batch: int, anchors: int, layers: int, block: int, batched: bool, steps: int,
                 mode: str) -> dict:
    """One optimizer step over `batch` sequences: all in one padded pass, or one sequence per pass."""
    import torch

    from flashdraft.config import TrainConfig
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.resolve import resolve_model
    from flashdraft.model.target import Target
    from flashdraft.train.loop import micro_batches
    from flashdraft.train.step import batch_step, sequence_step

    torch.manual_seed(0)
    offline = mode.startswith("offline")
    vocab = int(mode.split("-")[1]) if offline else None
    target = Target(resolve_model("embedded", log=lambda s: None), "cpu", lambda s: None)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=layers, block_size=block, mask_token_id=0,
                                         draft_vocab_size=vocab))
    if vocab:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size)[:vocab])
    target.watch(drafter.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    lengths = [int(length * (0.75 + 0.5 * torch.rand(1, generator=g).item())) for _ in range(batch)]
    rows = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 3] = 0  # a prompt, then the answer
        rows.append((torch.randint(0, 49000, (n,), generator=g), mask))
    cfg = TrainConfig(block_size=block, max_anchors=anchors, max_length=max(lengths))
    cached = [target.features(ids[None])[0] for ids, _ in rows] if offline else None  # read outside the clock

    def step():
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        if batched:  # grouped as training groups them (padding bounded by MAX_PADDING)
            for group in micro_batches(list(range(batch)), lengths, batch):
                results = batch_step(drafter, target, [rows[i] for i in group], cfg, [gens[i] for i in group], "cpu",
                                     cached and [cached[i] for i in group])
                (sum(r["loss"] for r in results if r is not None) / batch).backward()
        else:
            for i, ((ids, mask), gen) in enumerate(zip(rows, gens, strict=True)):
                result = sequence_step(drafter, target, ids, mask, cfg, gen, "cpu", cached and cached[i])
                (result["loss"] / batch).backward()

    return timed_steps(step, optimizer, steps, sum(lengths))


def batching(args) -> None:
    rows = []
    for mode in args.modes.split(","):
        for length in [int(x) for x in args.lengths.split(",")]:
            result = {}
            for variant in ("batched", "one-at-a-time"):
                cmd = [sys.executable, __file__, "--worker", f"{length}:{variant}:{mode}", "--batching",
                       str(args.batching), "--anchors", str(args.anchors), "--layers", str(args.layers), "--steps",
                       str(args.steps), "--block", str(args.block)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
                result[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((mode, length, result["batched"], result["one-at-a-time"]))
            print(mode, length, result, flush=True)
    lines = [
        f"### train batching — {datetime.now(UTC).date()} — SmolLM2-135M target, {args.layers}-layer drafter, "
        f"block {args.block}, {args.anchors} anchors/sequence, {args.batching} sequences/step, CPU, "
        f"{os.cpu_count()} cores",
        "",
        f"Command: `.venv/bin/python benchmarks/train_bench.py --batching {args.batching} --lengths {args.lengths} "
        f"--anchors {args.anchors} --layers {args.layers} --block {args.block} --steps {args.steps} "
        f"--modes {args.modes}`",
        "",
        "| target features, LM head | sample length (±25 %) | batched tokens/s | batched peak RSS MB | "
        "one-at-a-time tokens/s | one-at-a-time peak RSS MB | batched speedup |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, length, fast, slow in rows:
        name = mode_name(mode)
        lines.append(f"| {name} | {length} | {fast['tokens_per_s']:.0f} | {fast['peak_rss_mb']:.0f} | "
                     f"{slow['tokens_per_s']:.0f} | {slow['peak_rss_mb']:.0f} | "
                     f"{slow['seconds_per_step'] / fast['seconds_per_step']:.2f}× |")
    record(lines, keep=not args.no_record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="online-full,offline-4096",
                    help="online-full: target inside the step, full vocab; offline-V: cached features, V-token vocab")
    ap.add_argument("--batching", type=int, default=0, help="compare B sequences per pass with one at a time")
    ap.add_argument("--block", type=int, default=16, help="block size (--batching)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker and args.batching:
        length, variant, mode = args.worker.split(":")
        print(json.dumps(batch_worker(int(length), args.batching, args.anchors, args.layers, args.block,
                                      variant == "batched", args.steps, mode)))
        return
    if args.batching:
        return batching(args)
    if args.worker:
        length, naive, mode = args.worker.split(":")
        print(json.dumps(worker(int(length), args.anchors, args.layers, naive == "naive", args.steps, mode)))
        return

    rows = []
    for mode in args.modes.split(","):
        for length in [int(x) for x in args.lengths.split(",")]:
            result = {}
            for variant in ("one-pass", "naive"):
                cmd = [sys.executable, __file__, "--worker", f"{length}:{variant}:{mode}", "--anchors",
                       str(args.anchors), "--layers", str(args.layers), "--steps", str(args.steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
                result[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((mode, length, result["one-pass"], result["naive"]))
            print(mode, length, result, flush=True)

    lines = [
        f"### train — {datetime.now(UTC).date()} — SmolLM2-135M target, {args.layers}-layer drafter, block 16, "
        f"{args.anchors} anchors/sequence, CPU, {os.cpu_count()} cores",
        "",
        f"Command: `.venv/bin/python benchmarks/train_bench.py --lengths {args.lengths} --anchors {args.anchors} "
        f"--layers {args.layers} --steps {args.steps} --modes {args.modes}`",
        "",
        "| target features, LM head | sequence length | one-pass tokens/s | one-pass peak RSS MB | "
        "naive per-block tokens/s | naive peak RSS MB | one-pass speedup |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, length, fast, naive in rows:
        name = mode_name(mode)
        lines.append(
            f"| {name} | {length} | {fast['tokens_per_s']:.0f} | {fast['peak_rss_mb']:.0f} | "
            f"{naive['tokens_per_s']:.0f} | "
            f"{naive['peak_rss_mb']:.0f} | {naive['seconds_per_step'] / fast['seconds_per_step']:.1f}× |"
        )
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()
