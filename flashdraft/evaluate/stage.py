"""eval's run: load the sets → check the engines → decode each prompt (eval's own speculative decoding, unless
`engine_only`) → measure in each engine → the report, committed and verified. A committed report is reused
(already done); one whose engine failed has only that engine measured again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import (
    MANIFEST,
    Lineage,
    check_done,
    identity,
    read_manifest,
    require_verified,
    sha256_json,
)
from flashdraft.artifact.ownership import commit_dir, hold_output
from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate.in_engines import measure_engines
from flashdraft.evaluate.prepare import prepare_decoding, served_only
from flashdraft.evaluate.report import markdown_report, plot, tau_cell
from flashdraft.evaluate.sets import load_eval_sets
from flashdraft.evaluate.turns import decode_prompts, engine_only_report, eval_report
from flashdraft.model.drafter_config import DrafterConfig, read_drafter_config


def run(
    cfg: EvalConfig,
    drafter_dir: Path,
    out: Path,
    *,
    target_ref: str | None = None,
    console=None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Load the sets → check the engines → decode each prompt (eval's own speculative decoding, unless
    `engine_only`) → measure in each engine → report, committed and verified. A committed report is reused
    (already done); one whose engine failed has only that engine measured again."""
    from flashdraft.model.resolve import resolve_model

    drafter_dir, out = Path(drafter_dir), Path(out)
    drafter = read_drafter_config(drafter_dir)  # read once, checked: what the steps below are handed
    sets = load_sets(cfg)  # read once, before the target: a file with no usable prompt fails in seconds
    check_engines(cfg, drafter, log)
    target_path = resolve_model(target_ref or cfg.target, log=log)
    cfg = one_mode_if_the_template_has_none(cfg, target_path, log)  # before the prompts are put in each mode
    prompts, rejected = in_each_mode(cfg, sets)
    check_engines_hold(cfg, target_path)
    lineage = eval_lineage(cfg, drafter_dir, target_path, prompts)
    # Locked for the run; refused unless it is an eval report (or empty) outside the drafter and the target.
    with hold_output(out, "eval", inputs=[drafter_dir, target_path]):
        decision = check_done(out, lineage)
        done = read_manifest(out).stats if decision.done else None
        failed = failed_engines(done) if done is not None else []
        if not failed:
            log(decision.line("eval", out))
        if done is not None and not failed:
            return done
        decoded = None  # eval's own measurement, when a report holds it but an engine failed there
        measured = {}  # the engines that did not fail there: their measurement stands, they are not served again
        if failed:
            committed = json.loads((out / "report.json").read_text())  # verified with the manifest
            decoded = committed["prompts"]
            measured = {name: served for name, served in committed.get("engines", {}).items() if name not in failed}
            log(f"eval: {out} holds eval's own measurement, but {', '.join(failed)} failed there: measuring "
                f"{'it' if len(failed) == 1 else 'them'} again on it (eval's decoding is not redone)")
        if (drafter_dir / MANIFEST).exists():  # re-hashed only now that it is about to be used
            require_verified(drafter_dir, "drafter", "re-export it (rerun `flashdraft train`) or pull it again")
        else:
            log(f"eval: {drafter_dir} has no manifest (a drafter from elsewhere): its files are not verified")

        if cfg.engine_only:
            decoding, per_prompt = served_only(cfg, drafter, target_path, log), []
            report, stats = engine_only_report(cfg, prompts, decoding)
        else:
            decoding = prepare_decoding(cfg, drafter_dir, target_path, prompts, sets, log)
            per_prompt = decode_prompts(cfg, decoding, prompts, decoded, console)
            report, stats = eval_report(cfg, decoding, per_prompt, rejected)
        with commit_dir(out, "eval", stats=stats, lineage=lineage) as building:  # its own files, renamed in whole
            if cfg.engines:  # the engines' logs are part of the report: what each said while it served
                measure_engines(cfg, decoding, prompts, report, stats, per_prompt, drafter_dir, target_path,
                                building, out, log, measured)
            table = markdown_report(report)
            atomic_write_text(building / "report.json", json.dumps({**report, "prompts": per_prompt}, indent=1))
            atomic_write_text(building / "report.md", table)
            if rejected:
                atomic_write_text(building / "rejected.jsonl", "".join(json.dumps(r) + "\n" for r in rejected))
            if not cfg.engine_only:
                plot(report, building)
    for line in table.rstrip("\n").split("\n"):
        log(line)
    say_done(cfg, out, report, stats, per_prompt, rejected, log)
    return stats


# ---------------------------------------------------------------------------------------------- the steps


def load_sets(cfg: EvalConfig) -> list:
    """Every set named; a set with no usable prompt is refused (nothing to measure τ on)."""
    sets = load_eval_sets(cfg.sources, cfg.max_prompts)
    unreadable = [(each.name, r) for each in sets for r in each.rejected if r.unreadable]
    if unreadable and not cfg.skip_unreadable:  # half a prompt file must not go missing with exit 0
        name, first = unreadable[0]
        raise BadInput(f"{name}: line {first.line} is not a record ({first.reason})"
                       + (f", and {len(unreadable) - 1} more line(s)" if len(unreadable) > 1 else "")
                       + ": fix the file, or set eval.skip_unreadable: true (--skip-unreadable) to measure without "
                         "them (they go to rejected.jsonl with the reason)")
    for each in sets:
        if not each.prompts:
            raise BadInput(f"no usable prompts in {each.name}"
                           + (f" ({len(each.rejected)} rejected: {each.rejected[0].reason})" if each.rejected else "")
                           + ": nothing to measure τ on")
    return sets


def in_each_mode(cfg: EvalConfig, sets: list) -> tuple[list, list[dict]]:
    """Every set's prompts in every thinking mode asked for, and the records none could be made of (with their set).
    With two modes each set is measured twice, as `NAME · thinking on` and `NAME · thinking off`."""
    modes = cfg.thinking_modes
    prompts = [replace(prompt, dataset=prompt.dataset if len(modes) == 1 else f"{prompt.dataset} · thinking "
                       f"{'on' if mode else 'off'}", prompt=replace(prompt.prompt, thinking=mode))
               for each in sets for mode in modes for prompt in each.prompts]
    rejected = [{**r.to_json(), "set": each.name} for each in sets for r in each.rejected]
    return prompts, rejected


def check_engines(cfg: EvalConfig, drafter: DrafterConfig, log: Callable[[str], None]) -> None:
    """Before any decoding: each engine can be had, and can serve this drafter here."""
    if not cfg.engines:
        return
    from flashdraft.evaluate.engine_commands import check_engine
    if drafter.dspark \
            and "vllm" in cfg.engines and cfg.engine_url is None and not torch.cuda.is_available():
        # vLLM 0.32 drafts DSpark on its V2 GPU model runner only; its CPU build's V1 runner refuses it at start
        raise BadInput("vLLM serves DSpark drafters on its GPU model runner only (its CPU build says \"Model "
                       "Runner V1 does not support: dspark speculative decoding\"): measure with --engine llamacpp "
                       "here, or with vLLM on a GPU host (--engine-url)")
    for engine in cfg.engines:
        log(f"eval: engine {check_engine(engine, cfg.engine_url, cfg.engine_python)}")


def one_mode_if_the_template_has_none(cfg: EvalConfig, target_path: str, log: Callable[[str], None]) -> EvalConfig:
    """Both thinking modes asked for, and a chat template that never reads `enable_thinking` (it renders a prompt
    the same either way): the two rows would be the same prompts measured twice. Measured once, thinking off, and
    said; the report's heading gives the one mode."""
    if len(cfg.thinking_modes) < 2:
        return cfg
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    probe = [{"role": "user", "content": "What is 2 + 2?"}]
    on, off = (tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, enable_thinking=mode)
               for mode in (True, False))
    if on != off:
        return cfg
    log(f"eval: {target_path}'s chat template has no thinking mode (it never reads enable_thinking): thinking on "
        "and off would be the same prompts, so they are measured once, thinking off")
    return cfg.model_copy(update={"thinking": False})


def check_engines_hold(cfg: EvalConfig, target_path: str) -> None:
    """Before any decoding: an engine eval would start here can hold the target (a 27B cannot run in the CPU builds
    engines.sh installs)."""
    from flashdraft.evaluate.engine_commands import cpu_engine_too_small

    for engine in cfg.engines:
        if why := cpu_engine_too_small(engine, cfg.engine_url, cfg.engine_python, target_path):
            raise BadInput(why)


def eval_lineage(cfg: EvalConfig, drafter_dir: Path, target_path: str, prompts: list) -> Lineage:
    """What a report measured: the drafter's content, the prompts as loaded (their content: a prompts file rewritten
    in place under the same name is other prompts), the target's identity (its manifest or its files' content, as
    train computes it) and the settings (how an engine is reached is not what is measured)."""
    engine_keys = {"engine", "engine_url", "engine_python", "engine_baseline", "engine_only"}
    # settings added later keep a report made before them current while they are at their defaults
    later = {key for key, default in (("engine_only", False), ("seeds", 1)) if getattr(cfg, key) == default}
    if cfg.temperature == 0:  # every draft is the argmax at temperature 0, whatever the rule
        later.add("draft_sampling")
    measured = cfg.model_dump(exclude=(engine_keys if not cfg.engines else {"engine_url", "engine_python"}) | later)
    return Lineage(inputs=[identity(drafter_dir), sha256_json([asdict(prompt) for prompt in prompts])],
                   config=sha256_json({"eval": measured, "target": identity(target_path)}))


def say_done(cfg: EvalConfig, out: Path, report: dict, stats: dict, per_prompt: list[dict], rejected: list,
             log: Callable[[str], None]) -> None:
    """The run's last line: what was measured and verified; an engine that failed is the command's failure."""
    if failed := failed_engines(stats):
        from flashdraft.served import EngineFailed

        raise EngineFailed(f"eval: {failed[0]} failed: {stats['engines'][failed[0]]['failed']} — eval's own "
                           f"measurement (τ {report['acceptance_length']:.2f}) is committed at {out} with the engine's "
                           "failure beside it; rerun the same command to measure the engine again")
    if rejected:
        log(f"eval: {len(rejected)} records could not be formatted; reasons in {out / 'rejected.jsonl'}")
    if cfg.engine_only:
        measured = "; ".join(
            f"{name} τ {tau_cell(served['overall'], 3)}, {served['tokens_per_s']:g} tokens/s"
            + (f" ({served['speedup']:.2f}× without the drafter)" if served.get("speedup") else "")
            for name, served in report["engines"].items()
            if (served.get("overall") or {}).get("acceptance_length") is not None)
        log(f"eval: done, verified — {out}: engine only, {report['prompts']} prompts: {measured or 'no τ counted'}")
        return
    per = report["speedup_per_prompt"]
    checked = (f"lossless {report['lossless']} ({report['target_dtype']} target{lossless_detail(report, per_prompt)})"
               if report["lossless"] is not None else
               f"lossless not checked (sampled at temperature {cfg.temperature}: drafts pass by rejection sampling)")
    log(
        f"eval: done, verified — {out}: τ {tau_cell(report, 3)}"
        + (f" ({cfg.draft_sampling} draft rule)" if cfg.temperature > 0 else "")
        + f", speedup {report['speedup']:.2f}× vs "
        f"target-only (per prompt: median {per['median']:.2f}×, 10–90 % {per['p10']:.2f}–{per['p90']:.2f}×), "
        f"{checked}; prompt lookup "
        + (f"τ {report['lookup_acceptance_length']:.2f}, {report['lookup_speedup']:.2f}×"
           if report["lookup_speedup"] is not None else "not measured")
    )


def failed_engines(stats: dict[str, Any]) -> list[str]:
    """The engines a committed report records as failed (its own measurement stands beside them)."""
    return [name for name, served in (stats.get("engines") or {}).items() if served.get("failed")]


def lossless_detail(report: dict[str, Any], per_prompt: list[dict]) -> str:
    """What the lossless verdict rests on, when it is not token for token on every prompt."""
    ties, failed = report["near_ties"], sum(1 for row in per_prompt if row["lossless"] is False)
    detail = (f", {ties} of {report['prompts']} prompts diverge at a near-tie within "
              f"{report['config']['near_tie_ulps']} units in the last place" if ties else "")
    if failed:
        detail += f", {failed} of {report['prompts']} differ beyond one: see `divergence` in report.json"
    return detail
