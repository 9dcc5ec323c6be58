"""The `flashdraft` command: thin wrappers over the stage modules (≤ 3 calls from a command to the work).

    flashdraft --help
    flashdraft verify DIR --json

Every command exits non-zero on failure. An expected failure (`flashdraft.errors.ExpectedFailure`: bad input,
a failed verification, an unreachable store) is one line on stderr and exit 1; anything else is a bug and keeps
its traceback. With `--json`, stdout holds only one JSON object; human-readable output goes to stderr.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from flashdraft import __version__
from flashdraft.config import load_config
from flashdraft.errors import ExpectedFailure
from flashdraft.layout import DRAFTER, generate_dir, stage_dir, train_dir
from flashdraft.preflight import generate_checks, require, train_checks
from flashdraft.redact import redact


class PlainConsole(Console):
    """flashdraft's output: plain text (no console markup, so a reason holding `[/…]`, such as a bucket name, is
    printed as it is) with URL credentials redacted from every line, on a terminal and in a log file alike."""

    def __init__(self, **kwargs) -> None:
        super().__init__(highlight=False, soft_wrap=True, markup=False, **kwargs)

    def print(self, *objects, **kwargs) -> None:
        super().print(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)


console = PlainConsole()
err_console = PlainConsole(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(Text.assemble(("error:", "red"), " ", redact(message)))
    raise typer.Exit(code)


class App(typer.Typer):
    """Every command's expected failures become one `error:` line and exit 1; other exceptions stay bugs. Every
    stage option's help shows its effective default, read from the config schema (where the defaults live)."""

    def __call__(self, *args, **kwargs):
        command = typer.main.get_command(self)
        show_config_defaults(command)
        return command(*args, **kwargs)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def decorator(fn):
            @functools.wraps(fn)
            def wrapped(*a, **kw):
                try:
                    return fn(*a, **kw)
                except ExpectedFailure as e:
                    fail(str(e))
                except OSError as e:  # the machine said no (disk full, read-only, not a directory): not a bug
                    fail(f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e))

            register(wrapped)
            return fn

        return decorator


# A stage command's options that set its config section under another name than the option's.
OPTION_KEYS = {"base_url": "base_urls"}


def show_config_defaults(command) -> None:
    """Append `(default: …)` to the help of each stage command's options, from the config schema's defaults (the
    options themselves default to None, meaning "from --config, else the schema")."""
    from flashdraft.config import PipelineConfig

    defaults = PipelineConfig()
    for name, sub in getattr(command, "commands", {}).items():
        section = getattr(defaults, name, None) if name in ("generate", "tokenize", "train", "eval") else None
        if section is None:
            continue
        for param in sub.params:
            key = OPTION_KEYS.get(param.name, param.name)
            if (name, key) == ("generate", "prompts"):
                param.help += " (required, or generate.prompts in --config)"
            elif key in type(section).model_fields and param.help and "(default:" not in param.help:
                param.help += f" (default: {shown_default(getattr(section, key))})"  # () not []: rich markup


def shown_default(value) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


app = App(
    name="flashdraft",
    help="Train DFlash speculative-decoding drafters end to end. Every stage's output is an artifact "
    "(data files + manifest.json, written last) that counts as done only when it verifies where it lives.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout (human output goes to stderr).")
]
ConfigFlag = Annotated[
    Path | None, typer.Option("--config", help="Pipeline YAML; its section for this stage gives defaults.")
]


def human(json_out: bool) -> Console:
    """Where human-readable output goes: stdout, or stderr when stdout is reserved for --json."""
    return err_console if json_out else console


def emit_json(obj: dict[str, Any]) -> None:
    print(redact(json.dumps(obj, sort_keys=True)))


def _version(value: bool) -> None:
    if value:
        print(f"flashdraft {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Train DFlash drafters: generate → tokenize → train → eval, with verified artifacts and sync."""
    if not sys.stderr.isatty():  # a log file: library progress bars (weights loading, shards) would fill it
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm's own (GGUF conversion, datasets): \r-lines in a log


# ---------------------------------------------------------------------------------------------- stages


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
    from flashdraft import generate as stage

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
                                      "with --architecture dflash2 a DFlash drafter is warm-started as DFlash2's "
                                      "backbone.")
    ] = None,
    architecture: Annotated[
        str | None, typer.Option(help="dflash (default) or dflash2: DFlash plus block convolutions and a candidate "
                                      "selector (train.conv_* and train.selector_* in the config).")
    ] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Train the DFlash (or DFlash2) block-diffusion drafter on the target's hidden states (torchrun for DDP)."""
    from flashdraft import train as stage

    overrides = {"train.target": target, "train.max_steps": max_steps, "train.epochs": epochs,
                 "train.push_to": push_to, "train.features": features, "train.init_from": init_from,
                 "train.architecture": architecture}
    cfg = load_config(config, overrides)
    data = data or stage_dir(cfg.workdir, "tokenize")
    out = out or train_dir(cfg.workdir)
    require(train_checks(cfg.train))  # target, devices, the --push-to store: before any compute
    stats = stage.run(cfg.train, data, out, require_checkpoint=resume, console=err_console, log=human(json_out).print)
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
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (checked lossless).")] = None,
    max_prompts: Annotated[int | None, typer.Option(help="Prompts per --prompts set.")] = None,
    thinking: Annotated[str | None, typer.Option(help="on | off: enable_thinking in the chat template.")] = None,
    decoding: Annotated[str | None, typer.Option(
        help="auto | static | dynamic: auto is a static KV cache with CUDA graphs on a GPU, the growing cache on "
             "a CPU.")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Measure acceptance length with lossless speculative decoding, per prompt set."""
    from flashdraft import evaluate as stage

    overrides = {
        "eval.prompts": (prompts[0] if len(prompts) == 1 else list(prompts)) if prompts else None,
        "eval.target": target,
        "eval.max_new_tokens": max_new_tokens,
        "eval.temperature": temperature,
        "eval.max_prompts": max_prompts,
        "eval.thinking": {"on": True, "off": False}.get(thinking, thinking),
        "eval.decoding": decoding,
    }
    cfg = load_config(config, overrides)
    drafter = drafter or stage_dir(cfg.workdir, "train")
    out = out or stage_dir(cfg.workdir, "eval")
    stats = stage.run(cfg.eval, drafter, out, log=human(json_out).print)
    if json_out:
        emit_json({"path": str(out), **stats})


class ExportFormat(StrEnum):
    speculators = "speculators"


@app.command()
def export(
    drafter: Annotated[Path | None, typer.Option(help="An exported (z-lab format) drafter directory.")] = None,
    target: Annotated[str | None, typer.Option(help="The target REF the drafter was trained for.")] = None,
    format: Annotated[ExportFormat, typer.Option("--format", help="speculators: vLLM's speculators checkpoint.")] = (
        ExportFormat.speculators),
    out: Annotated[Path | None, typer.Option(help="Output directory (default: WORKDIR/train/drafter-FORMAT).")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Write a trained drafter in another serving format (train already writes the z-lab DFlash format that
    SGLang and vLLM load directly)."""
    from flashdraft.model.speculators import export_speculators

    cfg = load_config(config, {})
    drafter = drafter or stage_dir(cfg.workdir, "train")
    out = out or train_dir(cfg.workdir) / f"{DRAFTER}-{format.value}"
    stats = export_speculators(drafter, target or cfg.train.target, out, log=human(json_out).print)
    if json_out:
        emit_json({"path": str(out), **stats})


# ---------------------------------------------------------------------------------------------- artifacts


@app.command()
def manifest(
    directory: Annotated[Path, typer.Argument(help="Directory of files to describe.")],
    kind: Annotated[str, typer.Option(help="Artifact kind recorded in the manifest.")] = "files",
    json_out: JsonFlag = False,
) -> None:
    """Build manifest.json (size + sha256 of every file) for an existing directory."""
    from flashdraft.artifact.manifest import KINDS, describe_directory, write_manifest

    if kind not in KINDS:
        fail(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    if not directory.is_dir():
        fail(f"{directory} is not a directory")
    if (existing := _artifact_kind(directory)) not in (None, "files"):
        fail(f"{directory} is a {existing} artifact whose stage wrote its manifest (stats, lineage); "
             f"check it with `flashdraft verify {directory}` rather than replacing it")
    built = describe_directory(directory, kind=kind)
    digest = write_manifest(directory, built)
    summary = f"{len(built.files)} files, {built.total_bytes:,} bytes"
    human(json_out).print(f"manifest: {directory}/manifest.json — {summary}")
    if json_out:
        emit_json({"path": str(directory), "files": len(built.files), "bytes": built.total_bytes, "sha256": digest})


def _artifact_kind(directory: Path) -> str | None:
    from flashdraft.artifact.manifest import ManifestError, read_manifest

    try:
        return read_manifest(directory).kind
    except ManifestError:
        return None


ProfileFlag = Annotated[str | None, typer.Option(help="AWS profile (credentials stay in ~/.aws, never in flags).")]
EndpointFlag = Annotated[str | None, typer.Option(help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS).")]


def _open_store(location: str, profile: str | None, endpoint_url: str | None, jobs: int = 8):
    from flashdraft.artifact.store import open_store

    return open_store(location, profile=profile, endpoint_url=endpoint_url, jobs=jobs)


def _report_problems(where: str, problems: list, json_out: bool) -> None:
    for p in problems:
        err_console.print(Text.assemble(("✗", "red"), " ", redact(str(p))))
    verdict = f"NOT verified, {len(problems)} problem(s)" if problems else "verified"
    human(json_out).print(f"verify: {where} — {verdict}", soft_wrap=True)
    if json_out:
        emit_json({"ok": not problems, "problems": [{"path": p.path, "problem": p.problem} for p in problems]})
    if problems:
        raise typer.Exit(1)


@app.command()
def verify(
    path: Annotated[str, typer.Argument(help="Artifact directory or s3://bucket/prefix.")],
    deep: Annotated[
        bool, typer.Option(help="Stores: download and re-hash every object. Local directories are always re-hashed.")
    ] = False,
    profile: ProfileFlag = None,
    endpoint_url: EndpointFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Check an artifact against its manifest: every file present, same size and hash, nothing unlisted."""
    from flashdraft.artifact.manifest import verify_dir
    from flashdraft.artifact.store import is_url
    from flashdraft.artifact.sync import verify_store

    if is_url(path):
        store = _open_store(path, profile, endpoint_url)
        problems = verify_store(store, deep=deep)
    elif Path(path).is_dir():
        problems = verify_dir(path)
    else:
        fail(f"{path} is not a directory")
    _report_problems(path, problems, json_out)


class Direction(StrEnum):
    push = "push"
    pull = "pull"


@app.command()
def sync(
    direction: Annotated[Direction, typer.Argument(help="push (directory → store) or pull (store → directory).")],
    src: Annotated[str, typer.Argument(help="Source artifact: directory (push) or s3://bucket/prefix (pull).")],
    dst: Annotated[str, typer.Argument(help="Destination: s3://bucket/prefix or directory (push), directory (pull).")],
    delete: Annotated[bool, typer.Option(help="Remove destination files the manifest does not list.")] = False,
    jobs: Annotated[int, typer.Option(help="Parallel transfers.")] = 8,
    part_size_mb: Annotated[int | None, typer.Option(
        help="Multipart part size; larger files go multipart. Default: each file whole when there are at "
             "least --jobs files to send, else 8 MB parts.")] = None,
    force: Annotated[bool, typer.Option(
        help="push: replace an artifact of another kind or lineage at DST (refused without it).")] = False,
    profile: ProfileFlag = None,
    endpoint_url: EndpointFlag = None,
    verbose: Annotated[bool, typer.Option(help="Debug logging (credentials are redacted).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Copy an artifact by content (hash), manifest last, and verify it at the destination."""
    from flashdraft.artifact.store import is_url
    from flashdraft.artifact.sync import VerifyFailed, pull, push

    if direction is Direction.push and is_url(src):
        fail("push copies a local directory to a store: SRC must be a directory (did you mean pull?)")
    if direction is Direction.pull and is_url(dst):
        fail("pull copies a store artifact into a local directory: DST must be a directory")
    remote = dst if direction is Direction.push else src
    store = _open_store(remote, profile, endpoint_url, jobs)
    if verbose:
        _debug_logging(store.redactor if hasattr(store, "redactor") else None)
    try:
        if direction is Direction.push:
            result = push(
                Path(src),
                store,
                delete=delete,
                jobs=jobs,
                part_size=part_size_mb << 20 if part_size_mb else None,
                force=force,
                console=err_console,
                log=human(json_out).print,
            )
        else:
            result = pull(store, Path(dst), delete=delete, jobs=jobs, console=err_console)
    except VerifyFailed as e:  # a refusal or a failed check: one line, the problems (paths) named in it
        if json_out:
            emit_json({"ok": False, "problems": [{"path": p.path, "problem": p.problem} for p in e.problems]})
        fail(f"{direction.value}: {e}")
    human(json_out).print(result.line(), soft_wrap=True)
    if json_out:
        emit_json(result.to_json())


def _debug_logging(redactor) -> None:
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    if redactor is not None:
        handler.addFilter(redactor)
    logging.basicConfig(level=logging.DEBUG, handlers=[handler], force=True)


# ---------------------------------------------------------------------------------------------- pipeline


@app.command()
def status(
    store: Annotated[str | None, typer.Option(help="Also check the artifacts in this store.")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Show each stage's artifact and whether it verifies (checked now, not remembered); writes STATUS.md."""
    from flashdraft.artifact.atomic import atomic_write_text
    from flashdraft.status import pipeline_status, status_markdown, status_table

    cfg = load_config(config, {"store": store})
    rows = pipeline_status(cfg, cfg.store)
    human(json_out).print(status_table(rows))
    atomic_write_text(Path(cfg.workdir) / "STATUS.md", status_markdown(rows))
    if json_out:
        emit_json({"stages": rows, "all_verified": all(r["verified"] for r in rows)})


@app.command()
def run(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="Pipeline config.")],
    from_stage: Annotated[str | None, typer.Option("--from", help="First stage to run.")] = None,
    until: Annotated[str | None, typer.Option(help="Last stage to run.")] = None,
    store: Annotated[str | None, typer.Option(help="Push each artifact here and verify it there.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Check the config and print the plan.")] = False,
) -> None:
    """Run generate → tokenize → train → eval, skipping stages whose output verifies."""
    from flashdraft.pipeline import run_pipeline, selected
    from flashdraft.preflight import pipeline_checks

    cfg = load_config(config_file, {"store": store})
    stages = selected(from_stage, until)
    # Before any stage: a wrong store or endpoint is found now, not hours in.
    checks = pipeline_checks(cfg, stages, every=dry_run)
    if dry_run:
        from flashdraft.artifact.manifest import verify_dir

        for stage in stages:
            path = stage_dir(cfg.workdir, stage)
            problems = verify_dir(path)
            state = "verified (will be checked for lineage)" if not problems else f"to build ({problems[0]})"
            console.print(f"{stage}: {path} — {state}")
        console.print("preflight:")
        for check in checks:
            console.print(f"  {check.line()}", soft_wrap=True)
        if failed := [c for c in checks if not c.ok]:
            fail(f"preflight: {len(failed)} of {len(checks)} checks failed; nothing was started")
        return
    require(checks)
    run_pipeline(cfg, from_stage=from_stage, until=until, console=err_console, log=console.print)


@app.command()
def demo(
    workdir: Annotated[Path | None, typer.Option(
        help="Where the demo's artifacts go (default: flashdraft-work, or flashdraft-work-full with --full).")] = None,
    full: Annotated[bool, typer.Option(
        help="The τ-chasing settings: 3,349 prompts and 3,600 steps, about 47 minutes on 2 cores (τ 1.83).")] = False,
) -> None:
    """The whole pipeline on this CPU machine, offline, on the embedded SmolLM2-135M-Instruct target: about 10
    minutes on 2 cores (--full: about 47). It prints its plan first and a line with the ETA every 15 s."""
    from flashdraft.demo import run_demo

    run_demo(workdir, console, full)


@app.command()
def estimate(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="Pipeline config.")],
    num_prompts: Annotated[
        int | None, typer.Option(help="Prompt count, when the prompt file is not on this machine.")
    ] = None,
    target_config: Annotated[
        Path | None, typer.Option(help="The target's config.json, when the model is not on this machine.")
    ] = None,
    tokens_per_s: Annotated[
        float | None, typer.Option(help="Total generation rate to plan with (default: per backend, stated).")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Tokens, disk and hours the pipeline will need, before anything runs."""
    from flashdraft.estimate import describe
    from flashdraft.estimate import estimate as compute

    cfg = load_config(config_file, {})
    est = compute(cfg, num_prompts=num_prompts, target_config=target_config, tokens_per_s=tokens_per_s)
    for line in describe(est, cfg):
        human(json_out).print(line)
    if json_out:
        emit_json(est)
