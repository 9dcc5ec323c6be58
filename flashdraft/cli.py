"""The `flashdraft` command: thin wrappers over the stage modules (≤ 3 calls from a command to the work).

    flashdraft --help
    flashdraft verify DIR --json

Every command exits non-zero on failure; with `--json` the last line of output is one JSON object.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from flashdraft import __version__
from flashdraft.config import ConfigError, load_config

app = typer.Typer(
    name="flashdraft",
    help="Train DFlash speculative-decoding drafters end to end. Every stage's output is an artifact "
    "(data files + manifest.json, written last) that counts as done only when it verifies where it lives.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line of output.")]
ConfigFlag = Annotated[
    Path | None, typer.Option("--config", help="Pipeline YAML; its section for this stage gives defaults.")
]


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def not_implemented(command: str) -> NoReturn:
    fail(f"`flashdraft {command}` is not implemented yet", code=2)


def emit_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=True))


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
    thinking: Annotated[str | None, typer.Option(help="on | off: enable_thinking in the chat template.")] = None,
    shard_index: Annotated[int | None, typer.Option(help="This machine's slice of the prompts (0-based).")] = None,
    num_shards: Annotated[int | None, typer.Option(help="How many machines split the prompts.")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Regenerate responses with the target model into committed batch files (resumable, shardable)."""
    not_implemented("generate")


@app.command()
def tokenize(
    input: Annotated[Path | None, typer.Option(help="A generate artifact, or JSONL/Parquet conversations.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output dataset directory (Arrow shards + manifest).")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer REF (default: the target's).")] = None,
    max_length: Annotated[int | None, typer.Option(help="Truncate samples to this many tokens.")] = None,
    workers: Annotated[int | None, typer.Option(help="Processes (0 = all cores).")] = None,
    min_loss_fraction: Annotated[float | None, typer.Option(help="Quality gate on supervised tokens.")] = None,
    block_size: Annotated[int | None, typer.Option(help="DFlash block size, for the anchor statistic.")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Render completions with the target's chat template into Arrow shards with token-exact loss masks."""
    not_implemented("tokenize")


@app.command()
def train(
    data: Annotated[Path | None, typer.Option(help="A tokenize artifact (dataset directory).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (checkpoints + exported drafter).")] = None,
    target: Annotated[str | None, typer.Option(help="Target REF.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many optimizer steps.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Passes over the data.")] = None,
    resume: Annotated[bool, typer.Option(help="Resume from the newest complete checkpoint.")] = False,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Train the DFlash block-diffusion drafter on the target's hidden states."""
    not_implemented("train")


@app.command("eval")
def evaluate(
    drafter: Annotated[Path | None, typer.Option(help="An exported drafter directory.")] = None,
    prompts: Annotated[Path | None, typer.Option(help="Held-out prompts (JSONL).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (report.json + plots).")] = None,
    target: Annotated[str | None, typer.Option(help="Target REF.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to decode per prompt.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (checked lossless).")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Measure acceptance length with lossless speculative decoding."""
    not_implemented("eval")


# ---------------------------------------------------------------------------------------------- artifacts


@app.command()
def manifest(
    directory: Annotated[Path, typer.Argument(help="Directory of files to describe.")],
    kind: Annotated[str, typer.Option(help="Artifact kind recorded in the manifest.")] = "files",
    json_out: JsonFlag = False,
) -> None:
    """Build manifest.json (size + sha256 of every file) for an existing directory."""
    from flashdraft.artifact import KINDS, build_manifest, write_manifest

    if kind not in KINDS:
        fail(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    if not directory.is_dir():
        fail(f"{directory} is not a directory")
    built = build_manifest(directory, kind=kind)
    digest = write_manifest(directory, built)
    console.print(f"manifest: {directory}/manifest.json — {len(built.files)} files, {built.total_bytes:,} bytes")
    if json_out:
        emit_json({"path": str(directory), "files": len(built.files), "bytes": built.total_bytes, "sha256": digest})


@app.command()
def verify(
    path: Annotated[str, typer.Argument(help="Artifact directory (or store URL).")],
    deep: Annotated[bool, typer.Option(help="Re-read every byte (local directories always do).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Check an artifact against its manifest: every file present, same size and hash, nothing unlisted."""
    from flashdraft.artifact import verify_dir

    if not Path(path).is_dir():
        fail(f"{path} is not a directory")
    problems = verify_dir(path)
    for p in problems:
        err_console.print(f"[red]✗[/red] {escape(str(p))}", soft_wrap=True)
    if problems:
        console.print(f"verify: {path} — NOT verified, {len(problems)} problem(s)")
    else:
        console.print(f"verify: {path} — verified")
    if json_out:
        emit_json({"ok": not problems, "problems": [{"path": p.path, "problem": p.problem} for p in problems]})
    if problems:
        raise typer.Exit(1)


class Direction(StrEnum):
    push = "push"
    pull = "pull"


@app.command()
def sync(
    direction: Annotated[Direction, typer.Argument(help="push (local → store) or pull (store → local).")],
    src: Annotated[str, typer.Argument(help="Source artifact: directory or s3://bucket/prefix.")],
    dst: Annotated[str, typer.Argument(help="Destination: directory or s3://bucket/prefix.")],
    delete: Annotated[bool, typer.Option(help="Remove destination files the manifest no longer lists.")] = False,
    jobs: Annotated[int, typer.Option(help="Parallel transfers.")] = 8,
    json_out: JsonFlag = False,
) -> None:
    """Copy an artifact by content (hash), manifest last, and verify it at the destination."""
    not_implemented("sync")


# ---------------------------------------------------------------------------------------------- pipeline


@app.command()
def status(
    store: Annotated[str | None, typer.Option(help="Also check the artifacts in this store.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Show each stage's artifact and whether it verifies (checked now, not remembered)."""
    not_implemented("status")


@app.command()
def run(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="Pipeline config.")],
    from_stage: Annotated[str | None, typer.Option("--from", help="First stage to run.")] = None,
    until: Annotated[str | None, typer.Option(help="Last stage to run.")] = None,
    store: Annotated[str | None, typer.Option(help="Push each artifact here and verify it there.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Check the config and print the plan.")] = False,
) -> None:
    """Run generate → tokenize → train → eval, skipping stages whose output verifies."""
    try:
        load_config(config_file, {"store": store})
    except ConfigError as e:
        fail(str(e))
    not_implemented("run")


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo's artifacts go.")] = Path("flashdraft-work"),
) -> None:
    """The whole pipeline on this CPU machine, offline, on the embedded SmolLM2-135M-Instruct target."""
    from flashdraft.demo import run_demo

    try:
        run_demo(workdir, console)
    except (FileNotFoundError, ConfigError) as e:
        fail(str(e))


@app.command()
def estimate(config_file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="Pipeline config.")]) -> None:
    """Tokens, disk and hours the pipeline will need, before anything runs."""
    try:
        load_config(config_file)
    except ConfigError as e:
        fail(str(e))
    not_implemented("estimate")
