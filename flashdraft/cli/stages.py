"""The stage commands: generate, tokenize, train, eval, export."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from flashdraft.artifact.manifest import MANIFEST
from flashdraft.checks import require
from flashdraft.cli.app import (
    ConfigFlag,
    JsonFlag,
    app,
    emit_json,
    err_console,
    fail,
    human,
)
from flashdraft.config import load_config
from flashdraft.layout import DRAFTER, generate_dir, require_drafter, stage_dir, stage_url, train_dir
from flashdraft.pipeline import fetch_verified, train_settings
from flashdraft.preflight import check_dataset, generate_checks, train_checks


@app.command()
def generate(
    prompts: Annotated[Path | None, typer.Option(help="JSONL / Parquet / save_to_disk directory of prompts.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output artifact directory (batch files + manifest).")] = None,
    backend: Annotated[str | None, typer.Option(help="hf | openai | vllm.")] = None,
    model: Annotated[str | None, typer.Option(help="Target REF: directory, hub id, GGUF file or 'embedded'.")] = None,
    base_url: Annotated[list[str] | None, typer.Option(help="OpenAI-compatible endpoint (repeatable).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Token budget per response.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Records per committed batch file.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy.")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="hf backend: auto | bfloat16 | float32, the target's weights while generating (auto: bfloat16 on "
        "CUDA, float32 on CPU; bfloat16 is ~2x faster on a CPU with AVX512-BF16).")] = None,
    thinking: Annotated[str | None, typer.Option(
        help="on | off | mixed: enable_thinking in the chat template; mixed draws each prompt's mode by its id "
        "(generate.thinking_ratio on). A prompt record's own `thinking` wins.")] = None,
    turns: Annotated[str | None, typer.Option(
        help="final: regenerate the last assistant turn | all: every assistant turn, each from the regenerated "
        "history.")] = None,
    shard_index: Annotated[int | None, typer.Option(help="This machine's slice of the prompts (0-based).")] = None,
    num_shards: Annotated[int | None, typer.Option(help="How many machines split the prompts.")] = None,
    upload_to: Annotated[
        str | None, typer.Option(help="Push each committed batch to this store URL as it lands; verify at the end.")
    ] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Regenerate responses with the target model into committed batch files (resumable, shardable)."""
    if thinking not in (None, "on", "off", "mixed"):
        fail("--thinking takes on, off or mixed")
    if turns not in (None, "final", "all"):
        fail("--turns takes final or all")
    overrides = {
        "generate.prompts": str(prompts) if prompts else None,
        "generate.backend": backend,
        "generate.model": model,
        "generate.base_urls": base_url or None,
        "generate.max_new_tokens": max_new_tokens,
        "generate.batch_size": batch_size,
        "generate.temperature": temperature,
        "generate.dtype": dtype,
        "generate.thinking": {"on": True, "off": False}.get(thinking, thinking),
        "generate.turns": turns,
        "generate.shard_index": shard_index,
        "generate.num_shards": num_shards,
    }
    cfg = load_config(config, overrides)
    if "prompts" not in cfg.generate.model_fields_set:  # no silent 404 built-in prompts: `run`/`demo` keep those
        fail("--prompts is required (a JSONL / Parquet file, a save_to_disk directory, or builtin:NAME), or "
             "generate.prompts in --config", code=2)
    if not 0 <= cfg.generate.shard_index < cfg.generate.num_shards:
        fail(f"--shard-index must be in 0..{cfg.generate.num_shards - 1}")
    out = out or generate_dir(cfg.workdir, cfg.generate.shard_index, cfg.generate.num_shards)
    require(generate_checks(cfg.generate, upload_to))  # prompts, endpoints or model, upload store: before any batch
    from flashdraft import generate as stage  # after the checks: its imports take seconds, a refusal does not

    stats = stage.run(cfg.generate, out, upload_to=upload_to, console=err_console, log=human(json_out).print)
    if json_out:
        emit_json({"path": str(out), **stats})


@app.command()
def tokenize(
    input: Annotated[
        list[Path] | None,
        typer.Option(help="A generate artifact (or a directory of generate shards), or JSONL/Parquet "
                     "conversations; repeat to merge several inputs into one dataset (duplicates dropped by id)."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output dataset directory (Arrow shards + manifest).")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer REF (default: the target's).")] = None,
    max_length: Annotated[int | None, typer.Option(help="Truncate samples to this many tokens.")] = None,
    workers: Annotated[int | None, typer.Option(help="Processes (0 = all cores).")] = None,
    min_loss_fraction: Annotated[float | None, typer.Option(help="Quality gate on supervised tokens.")] = None,
    block_size: Annotated[int | None, typer.Option(help="DFlash block size, for the anchor statistic.")] = None,
    show: Annotated[int, typer.Option(help="Print N samples of --out with supervised tokens highlighted.")] = 0,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Render completions with the target's chat template into Arrow shards with token-exact loss masks."""
    from flashdraft import tokenize as stage

    overrides = {
        "tokenize.tokenizer": tokenizer,
        "tokenize.max_length": max_length,
        "tokenize.workers": workers,
        "tokenize.min_loss_fraction": min_loss_fraction,
        "tokenize.block_size": block_size,
    }
    cfg = load_config(config, overrides)
    out = out or stage_dir(cfg.workdir, "tokenize")
    if not input and show:
        return stage.show(out, show, human(json_out), cfg.tokenize.tokenizer)
    if not input:  # the workdir's generate artifact, or all its shards (each must verify)
        from flashdraft.pipeline import require_shards

        require_shards(cfg.workdir, cfg.generate.num_shards)
    source = list(input) if input else stage_dir(cfg.workdir, "generate")
    stats = stage.run(cfg.tokenize, source, out, console=err_console, log=human(json_out).print)
    if show:
        stage.show(out, show, human(json_out), cfg.tokenize.tokenizer)
    if json_out:
        emit_json({"path": str(out), **{k: v for k, v in stats.items() if k != "shards"}})


@app.command()
def train(
    data: Annotated[Path | None, typer.Option(help="A tokenize artifact (dataset directory).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (checkpoints + exported drafter).")] = None,
    target: Annotated[str | None, typer.Option(help="Target REF.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many optimizer steps.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Passes over the data.")] = None,
    resume: Annotated[
        bool, typer.Option(help="Require a checkpoint to resume from (a rerun into the same --out always resumes).")
    ] = False,
    push_to: Annotated[
        str | None, typer.Option(help="Local dir or s3:// URL: each checkpoint and the drafter pushed, verified.")
    ] = None,
    features: Annotated[
        str | None,
        typer.Option(help="online: target runs in each step; offline: its features are cached once (small runs)."),
    ] = None,
    init_from: Annotated[
        str | None, typer.Option(help="Start from this z-lab-format drafter (e.g. a published one) and fine-tune it; "
                                      "with --architecture dflash2 or dspark a DFlash drafter is warm-started as "
                                      "its backbone.")
    ] = None,
    architecture: Annotated[
        str | None, typer.Option(help="dflash (default); dflash2: DFlash plus block convolutions and a candidate "
                                      "selector (train.conv_*, train.selector_*); dspark: anchor-first blocks with a "
                                      "Markov head and a confidence head (train.markov_*, train.confidence_*, "
                                      "train.dspark_*).")
    ] = None,
    node_rank: Annotated[int | None, typer.Option(
        help="This node's rank when train.nnodes > 1 (each node runs the same command with its own rank).")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Train the DFlash (DFlash2, DSpark) block-diffusion drafter on the target's hidden states (torchrun for DDP).

    Every other setting (block_size, lr, num_layers, draft_vocab_size, markov_rank, feature_source …) is a key of
    the config's train: section, each with its default, bounds and meaning in docs/config-keys.md."""
    overrides = {"train.target": target, "train.max_steps": max_steps, "train.epochs": epochs,
                 "train.push_to": push_to, "train.features": features, "train.init_from": init_from,
                 "train.architecture": architecture, "train.node_rank": node_rank}
    cfg = load_config(config, overrides)
    data = data or stage_dir(cfg.workdir, "tokenize")
    out = out or train_dir(cfg.workdir)
    train_cfg = train_settings(cfg)  # the config's store holds the checkpoints, as under `run`
    # target, devices, the store checkpoints go to, the dataset: before any compute, and before nodes meet
    require([*train_checks(train_cfg), check_dataset(Path(data), cfg.store)])
    if cfg.store and not (Path(data) / MANIFEST).is_file():  # a node joining the run: the dataset from the store
        fetch_verified(Path(data), stage_url(cfg.store, "tokenize"), human(json_out).print)
    from flashdraft import train as stage  # after the checks: its imports take seconds, a refusal does not

    stats = stage.run(train_cfg, data, out, require_checkpoint=resume, console=err_console,
                      log=human(json_out).print)
    if json_out and stats:
        emit_json({"path": str(out / DRAFTER), **stats})


@app.command("eval")
def evaluate(
    drafter: Annotated[Path | None, typer.Option(help="An exported drafter directory.")] = None,
    prompts: Annotated[
        list[str] | None, typer.Option(help="Held-out prompts, repeatable, each reported on its own: a JSONL / "
                                       "Parquet file, a built-in set (builtin:chat-heldout), or a standard "
                                       "benchmark: gsm8k, math500, humaneval, mbpp, mt-bench (from the hub) or "
                                       "NAME=PATH (a local copy in that dataset's schema).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (report.json, report.md, plots).")] = None,
    target: Annotated[str | None, typer.Option(help="Target REF.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to decode per prompt.")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="0 = greedy (checked lossless); above, lossless sampling (in the engines too).")] = None,
    seeds: Annotated[int | None, typer.Option(
        help="temperature > 0: repeat the measurement over this many seeds (eval's and each engine's τ with their "
             "spread).")] = None,
    draft_sampling: Annotated[str | None, typer.Option(
        help="temperature > 0: greedy (the drafter's argmax, accepted with the target's probability of it: vLLM's "
             "default and llama.cpp's rule, the τ a served user sees) or sample (drawn from the drafter, vLLM's "
             "probabilistic); default greedy.")] = None,
    max_prompts: Annotated[int | None, typer.Option(help="Prompts per --prompts set.")] = None,
    skip_unreadable: Annotated[bool | None, typer.Option(
        "--skip-unreadable", help="Skip prompt lines that are no record (not JSON), written to rejected.jsonl, "
                                  "instead of refusing the file.")] = None,
    thinking: Annotated[str | None, typer.Option(
        help="on | off | on,off: enable_thinking in the chat template; on,off measures every prompt in both modes "
             "in one run, a row per set and mode.")] = None,
    decoding: Annotated[str | None, typer.Option(
        help="auto | static | dynamic: auto is a static KV cache with CUDA graphs on a GPU, the growing cache on "
             "a CPU.")] = None,
    engine: Annotated[list[str] | None, typer.Option(
        help="vllm | llamacpp, repeatable: also serve the target with the drafter in that engine and report its "
             "τ beside eval's (scripts/engines.sh installs them).")] = None,
    engine_url: Annotated[str | None, typer.Option(
        help="An engine already serving the target with this drafter (its base URL): measured there instead.")] = None,
    engine_only: Annotated[bool | None, typer.Option(
        "--engine-only", help="Measure τ and tokens/s in the engine(s) alone, without eval's own in-process "
                              "decoding (minutes on a served engine instead of hours); nothing is checked "
                              "lossless.")] = None,
    confidence_threshold: Annotated[float | None, typer.Option(
        help="DSpark: cut each block where its confidence head falls below this (0 < t < 1); eval then reports the "
             "blocks cut and uncut, and the head's calibration.")] = None,
    confidence_rule: Annotated[str | None, typer.Option(
        help="first (DeepSpec, llama.cpp: the first slot below the threshold) or product (vLLM, SGLang: the running "
             "product of the confidences); default first.")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Measure acceptance length with lossless speculative decoding, per prompt set."""
    overrides = {
        "eval.prompts": (prompts[0] if len(prompts) == 1 else list(prompts)) if prompts else None,
        "eval.target": target,
        "eval.max_new_tokens": max_new_tokens,
        "eval.temperature": temperature,
        "eval.seeds": seeds,
        "eval.draft_sampling": draft_sampling,
        "eval.max_prompts": max_prompts,
        "eval.skip_unreadable": skip_unreadable,
        "eval.thinking": thinking_modes(thinking),
        "eval.decoding": decoding,
        "eval.engine": (engine[0] if len(engine) == 1 else list(engine)) if engine else None,
        "eval.engine_url": engine_url,
        "eval.engine_only": engine_only,
        "eval.confidence_threshold": confidence_threshold,
        "eval.confidence_rule": confidence_rule,
    }
    cfg = load_config(config, overrides)
    drafter = drafter or stage_dir(cfg.workdir, "train")
    out = out or stage_dir(cfg.workdir, "eval")
    require_drafter(drafter)
    from flashdraft import evaluate as stage  # after the checks: its imports take seconds, a refusal does not

    stats = stage.run(cfg.eval, drafter, out, console=err_console, log=human(json_out).print)
    if json_out:
        emit_json({"path": str(out), **stats})


def thinking_modes(flag: str | None) -> bool | list | None:
    """`--thinking on`, `off` or `on,off` → the config's value; any other word is one line naming the flag."""
    if flag is None:
        return None
    words = {"on": True, "off": False}
    parts = [part.strip() for part in flag.split(",")]
    if not 1 <= len(parts) <= 2 or any(part not in words for part in parts):
        fail(f"--thinking {flag}: on, off, or on,off (both modes, a row each)")
    modes = [words[part] for part in parts]
    return modes[0] if len(modes) == 1 else modes


class ExportFormat(StrEnum):
    speculators = "speculators"
    gguf = "gguf"


@app.command()
def export(
    drafter: Annotated[Path | None, typer.Option(help="An exported (z-lab format) drafter directory.")] = None,
    target: Annotated[str | None, typer.Option(help="The target REF the drafter was trained for.")] = None,
    format: Annotated[ExportFormat, typer.Option("--format", help="speculators: vLLM's speculators checkpoint; "
                                                 "gguf: llama.cpp's (drafter and target, by llama.cpp's converter)."
                                                 )] = ExportFormat.speculators,
    out: Annotated[Path | None, typer.Option(help="Output directory (default: WORKDIR/train/drafter-FORMAT).")] = None,
    drafter_only: Annotated[bool, typer.Option(
        "--drafter-only", help="gguf: the drafter alone, to serve beside a target GGUF of your own (quantized "
                               "or not); the target's directory still gives the tokenizer and the check they fit."
    )] = False,
    outtype: Annotated[str, typer.Option(
        help="gguf: bf16, f16, f32 or q8_0 (llama.cpp's converter's types; quantize further with its "
             "llama-quantize).")] = "bf16",
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Write a trained drafter in another serving format (train already writes the z-lab DFlash format that
    SGLang and vLLM load directly)."""
    from flashdraft.model.gguf_export import export_gguf
    from flashdraft.model.speculators import export_speculators

    cfg = load_config(config, {})
    drafter = drafter or stage_dir(cfg.workdir, "train")
    out = out or train_dir(cfg.workdir) / f"{DRAFTER}-{format.value}"
    if format == ExportFormat.gguf:
        stats = export_gguf(drafter, target or cfg.train.target, out, outtype=outtype, drafter_only=drafter_only,
                            log=human(json_out).print)
    else:
        if drafter_only or outtype != "bf16":
            fail("--drafter-only and --outtype are options of --format gguf; the speculators checkpoint is one "
                 "directory in the drafter's own type")
        stats = export_speculators(drafter, target or cfg.train.target, out, log=human(json_out).print)
    if json_out:
        emit_json({"path": str(out), **stats})
