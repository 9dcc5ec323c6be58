"""The demo's own training step, timed on a demo workdir: as `train` runs it (eager, fused AdamW), with torch's
unfused AdamW loop instead (what `train` used before 2026-12-04), and under `torch.compile`; and where the eager
step's time goes (issue 31's 15-minute budget: is the step compute-bound, or is there overhead to fuse away?).

    .venv/bin/python benchmarks/demo_step_bench.py --workdir /tmp/demo5 [--steps 100]

One process holds a copy of the demo's drafter per variant (the same start) and steps them in turn on the same
batch, step after step: this machine's speed drifts by ±10 % over minutes, so variants timed minutes apart (or in
separate runs) cannot be compared, and variants timed side by side can. The workdir's dataset and offline feature
cache are read, never written (the cache is linked into a scratch output); the demo's train settings, the real
optimizer step. Reported per variant: the first 10 steps (where compilation happens), the median step after
them and its optimizer part, the median per-step ratio to `train`, and the loss at the last step (other kernels
round differently in the last bits, and many steps amplify that); then the operators that take the most of five
profiled `train` steps.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 10
VARIANTS = ("train", "unfused-adamw", "compile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True, help="a demo workdir with dataset/ and train/features/")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from flashdraft.demo import demo_config
    from flashdraft.model.resolve import resolve_model
    from flashdraft.train import accumulate, prepare, setup
    from flashdraft.train.distributed import place
    from flashdraft.train.optim import Optimizers, build_optimizers

    cfg = demo_config(args.workdir, full=True).train
    quiet = lambda s: None  # noqa: E731
    scratch = Path(tempfile.mkdtemp())
    os.symlink(args.workdir / "train" / "features", scratch / "features")  # the workdir's cache, verified by setup
    s = setup(cfg, args.workdir / "dataset", scratch, resolve_model(cfg.target, log=quiet), place(cfg), None, quiet)

    def unfused(drafter) -> Optimizers:  # torch's per-parameter AdamW loop, train's settings and schedule
        (fused,) = build_optimizers(cfg, drafter, s.total_steps).all
        settings = {key: fused.defaults[key] for key in ("lr", "betas", "eps", "weight_decay")}
        loop = torch.optim.AdamW(drafter.parameters(), **settings)
        warmup = math.ceil(cfg.warmup_ratio * s.total_steps)
        return Optimizers([loop], [get_cosine_schedule_with_warmup(loop, warmup, s.total_steps)])

    runs = {}  # variant: (drafter, the module stepped, optimizers)
    for variant in VARIANTS:
        drafter = s.drafter if variant == "train" else copy.deepcopy(s.drafter)
        module = torch.compile(drafter, dynamic=True) if variant == "compile" else drafter  # shapes vary by step
        runs[variant] = (drafter, module, unfused(drafter) if variant == "unfused-adamw"
                         else s.optimizers if variant == "train" else build_optimizers(cfg, drafter, s.total_steps))

    def one(step: int, variant: str) -> tuple[float, float, float]:
        s.drafter, s.model, s.optimizers = runs[variant]
        batch = s.train_ids[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        t0 = time.perf_counter()
        _, loss = accumulate(cfg, s, prepare(cfg, s, batch, 0))
        torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), cfg.grad_clip)
        t1 = time.perf_counter()
        s.optimizers.step()
        s.optimizers.zero_grad()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, loss

    timed = {variant: [] for variant in VARIANTS}
    for step in range(args.steps):
        for variant in VARIANTS:
            timed[variant].append(one(step, variant))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(args.steps, args.steps + 5):
            one(step, "train")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]

    base = [t for t, _, _ in timed["train"][WARMUP:]]
    lines = [f"### the demo's training step: fused AdamW, torch.compile — {datetime.now(UTC):%Y-%m-%d} — "
             f"{args.workdir}, {args.steps} steps of each variant, interleaved, CPU, {os.cpu_count()} cores", "",
             f"Command: `.venv/bin/python benchmarks/demo_step_bench.py --workdir {args.workdir} --steps {args.steps}`",
             "",
             f"| variant | first {WARMUP} steps s | median step s (after them) | of it the optimizer ms | "
             "step ÷ train's step (median per step) | loss at the last step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for variant, steps in timed.items():
        seconds = [t for t, _, _ in steps]
        ratio = statistics.median(t / b for t, b in zip(seconds[WARMUP:], base, strict=True))
        lines.append(f"| {variant} | {sum(seconds[:WARMUP]):.1f} | {statistics.median(seconds[WARMUP:]):.3f} | "
                     f"{1000 * statistics.median(o for _, o, _ in steps[WARMUP:]):.1f} | {ratio:.2f} | "
                     f"{steps[-1][2]:.4f} |")
    lines += ["", "`train`'s step, share of self CPU time (5 profiled steps): "
              + ", ".join(f"`{e.key}` {100 * e.self_cpu_time_total / total:.1f} %" for e in top)]
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()
