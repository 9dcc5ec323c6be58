"""The pipeline commands: status, run, demo, estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
from flashdraft.errors import ExpectedFailure
from flashdraft.layout import stage_dir


@app.command()
def status(
    store: Annotated[str | None, typer.Option(help="Also check the artifacts in this store.")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Also write the table as markdown to this file (status "
                                                        "writes nothing unless asked).")] = None,
    config: ConfigFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Show each stage's artifact and whether it verifies (checked now, not remembered). Read-only: it writes
    nothing but the --markdown file it is asked for."""
    from flashdraft.artifact.atomic import atomic_write_text
    from flashdraft.status import pipeline_status, status_markdown, status_table

    cfg = load_config(config, {"store": store})
    rows = pipeline_status(cfg, cfg.store)
    human(json_out).print(status_table(rows))
    if markdown is not None:
        atomic_write_text(markdown, status_markdown(rows))
    if json_out:
        emit_json({"stages": rows, "all_verified": all(r["verified"] for r in rows)})
    if unchecked := [r for r in rows if r["verified"] is None]:  # the table is out; the exit says it is incomplete
        raise ExpectedFailure(f"status: {len(unchecked)} artifact(s) could not be checked — "
                              f"{unchecked[0]['reason']}")


@app.command()
def run(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="Pipeline config.")],
    from_stage: Annotated[str | None, typer.Option("--from", help="First stage to run.")] = None,
    until: Annotated[str | None, typer.Option(help="Last stage to run.")] = None,
    store: Annotated[str | None, typer.Option(help="Push each artifact here and verify it there.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Check the config and print the plan.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Run generate → tokenize → train → eval, skipping stages whose output verifies."""
    from flashdraft.pipeline import run_pipeline, selected
    from flashdraft.preflight import pipeline_checks

    cfg = load_config(config_file, {"store": store})
    stages = selected(from_stage, until)
    # Before any stage: a wrong store or endpoint is found now, not hours in.
    checks = pipeline_checks(cfg, stages, every=dry_run)
    out = human(json_out)
    if dry_run:
        from flashdraft.artifact.manifest import verify_dir

        planned = {}
        for stage in stages:
            path = stage_dir(cfg.workdir, stage)
            problems = verify_dir(path)
            state = "verified (will be checked for lineage)" if not problems else f"to build ({problems[0]})"
            if stage == "train" and cfg.train.nproc_per_node > 1:
                state += f"; {cfg.train.nproc_per_node} processes on this node (train.nproc_per_node)"
            planned[stage] = {"path": str(path), "verified": not problems}
            out.print(f"{stage}: {path} — {state}")
        out.print("preflight:")
        for check in checks:
            out.print(f"  {check.line()}", soft_wrap=True, markup=False, highlight=False)
        if "train" in stages and cfg.train.engine_urls:  # what to start before train, and in which order
            from flashdraft.train.fleet import fleet_layers, fleet_recipe, key_path

            out.print("the fleet, started in this order before train:")
            try:
                made = False if key_path(cfg.train).exists() else None  # None: made by the first train
                for line in fleet_recipe(cfg.train, fleet_layers(cfg.train), made):
                    out.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)
            except (OSError, ValueError, ExpectedFailure) as e:  # a target not here: said, not a traceback
                out.print(f"  cannot name the layers: the target's config is not readable here ({e})")
        if json_out:
            emit_json({"dry_run": True, "stages": planned,
                       "preflight": [{"ok": c.ok, "line": c.line()} for c in checks]})
        if failed := [c for c in checks if not c.ok]:
            fail(f"preflight: {len(failed)} of {len(checks)} checks failed; nothing was started")
        return
    require(checks)
    results = run_pipeline(cfg, from_stage=from_stage, until=until, console=err_console, log=out.print)
    if json_out:
        emit_json({"stages": {stage: {"path": str(stage_dir(cfg.workdir, stage)), **(stats or {})}
                              for stage, stats in results.items()}})


@app.command()
def demo(
    workdir: Annotated[Path | None, typer.Option(
        help="Where the demo's artifacts go (default: flashdraft-work, or flashdraft-work-full with --full).")] = None,
    full: Annotated[bool, typer.Option(
        help="The τ-chasing settings: 3,349 prompts and 3,600 steps, about 47 min on 2 cores (τ 1.83).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """The whole pipeline on this CPU machine, offline, on the embedded SmolLM2-135M-Instruct target: about 6 min
    on 2 cores with bfloat16 in hardware, about 19 min on 2 AVX2 cores (--full: about 47 min on the first). It
    prints its plan first and a line with the ETA every 15 s."""
    from flashdraft.demo import run_demo

    stats = run_demo(workdir, human(json_out), full)
    if json_out:
        emit_json(stats)


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
    mean_new_tokens: Annotated[
        int | None, typer.Option(help="Mean completion length to give generation hours at (a similar run's "
                                      "completion_tokens / records); default: the worst case only.")
    ] = None,
    train_hours: Annotated[
        float | None, typer.Option(help="Training budget in hours: says whether the config fits, else the "
                                        "train.max_steps that does.")
    ] = None,
    step_seconds: Annotated[
        float | None, typer.Option(help="A training step's seconds measured on your own node (train's log gives it "
                                        "after its first steps) to plan with, instead of the scaled reference step.")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Tokens, disk and hours the pipeline will need, before anything runs."""
    from flashdraft.estimate import describe
    from flashdraft.estimate import estimate as compute

    cfg = load_config(config_file, {})
    est = compute(cfg, num_prompts=num_prompts, target_config=target_config, tokens_per_s=tokens_per_s,
                  mean_new_tokens=mean_new_tokens, train_hours=train_hours, step_seconds=step_seconds)
    for line in describe(est, cfg):
        human(json_out).print(line)
    if json_out:
        emit_json(est)
