"""Each engine's τ beside eval's: measured on the same prompts (engines.py), with its standard error at
temperature > 0 and the judgement against eval's (spread.py); a failed engine recorded beside the rest.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.evaluate.prepare import Decoding
from flashdraft.evaluate.report import tau_cell
from flashdraft.evaluate.spread import add_engine_errors, judged
from flashdraft.evaluate.turns import seeds_of


def measure_engines(cfg: EvalConfig, d: Decoding, prompts: list, report: dict, stats: dict, per_prompt: list[dict],
                    drafter_dir: Path, target_path: str, building: Path, out: Path,
                    log: Callable[[str], None], measured: dict[str, dict] | None = None) -> None:
    """Each engine's τ on the same prompts into the report and stats; an engine's failure is recorded beside the
    rest (eval's own measurement is kept). `measured`: engines a committed report already measured — their
    entries and logs are carried into the new report, and they are not served again."""
    passes = sum(len(p["accepted"]) for p in per_prompt) if not cfg.engine_only else None  # eval's verify passes
    report["engines"] = {}
    for engine in cfg.engines:
        if engine in (measured or {}):
            log(f"eval: {engine} measured there already: kept")
            report["engines"][engine] = measured[engine]
            for name in (f"engine-{engine}.log", f"engine-{engine}-target-only.log"):
                if (out / name).is_file() and not (out / name).is_symlink():  # its own, verified with the report
                    shutil.copyfile(out / name, building / name)
            continue
        try:
            report["engines"][engine] = engine_report(cfg, engine, prompts, d.render, target_path, drafter_dir,
                                                      d.block_size, report, passes, building, out, log, d.dspark)
        except ExpectedFailure as e:  # eval's own measurement is kept, committed beside the failure
            if cfg.engine_only:  # nothing else was measured: the failure is the run's
                raise
            log(f"eval: {engine} failed: {e}")
            report["engines"][engine] = {"engine": engine, "failed": str(e)}
    stats["engines"] = {engine: {k: v for k, v in served.items() if k not in ("by_dataset", "prompts")}
                        for engine, served in report["engines"].items()}


def engine_report(cfg: EvalConfig, name: str, prompts: list, render: Callable, target_path: str, drafter_dir: Path,
                  block_size: int, report: dict[str, Any], passes: int | None, logs: Path, out: Path,
                  log: Callable[[str], None], dspark: bool = False) -> dict[str, Any]:
    """The engine's τ on the same prompts and token budget (greedy; a later turn after the engine's own answer),
    beside eval's own, per dataset (`passes` None: engine only, no eval measurement to compare)."""
    from flashdraft.evaluate.engines import Conversation, measure

    turns = [Conversation(p.dataset, list(p.prompt.messages), p.follow_ups, p.prompt.thinking,
                          p.prompt.category or "all", p.prompt.id) for p in prompts]
    longest = max(len(render(p.prompt.messages, p.prompt.thinking)) for p in prompts)
    log(f"eval: measuring τ in {name} on the same {len(prompts)} prompts")
    sampled = cfg.temperature > 0
    engine = measure(name, turns, render, target_dir=Path(target_path), drafter_dir=drafter_dir,
                     block_size=block_size, max_new_tokens=cfg.max_new_tokens, longest_prompt=longest, logs=logs,
                     shown_log=out, url=cfg.engine_url, python=cfg.engine_python, baseline=cfg.engine_baseline,
                     dspark=dspark, temperature=cfg.temperature, draft_sampling=cfg.draft_sampling,
                     seeds=tuple(seeds_of(cfg)) if sampled else (None,), log=log)
    tau = (engine["overall"] or {}).get("acceptance_length")
    if sampled:  # a sampled τ is a random variable: each comes with its standard error, and is judged by it
        judge_sampled(name, cfg.draft_sampling, engine, report)
    engine["flashdraft_acceptance_length"] = report["acceptance_length"]
    if tau is None:
        if passes:  # eval verified drafts, the engine counted none: it is not speculating with this drafter
            raise BadInput(f"{name} drafted nothing on {len(prompts)} prompts where eval verified {passes} drafts: "
                           "its counters show no drafts (is it serving this drafter?)")
        if passes is None:  # engine only: nothing to say it could have drafted, and no τ is no measurement
            raise BadInput(f"{name} drafted nothing on {len(prompts)} prompts: its counters show no drafts (is it "
                           "serving this drafter? are the answers long enough to speculate on?)")
        log(f"eval: {name} drafted nothing, as eval did not: the token budget leaves no step to speculate")
        return engine
    overall = engine["overall"]
    if passes is None:
        log(f"eval: {name} τ {tau:.2f} ({overall['accepted_tokens']} accepted tokens in {overall['drafts']} drafts)")
        return engine
    engine["difference"] = round(tau - report["acceptance_length"], 4)
    log(f"eval: {name} τ {tau_cell(overall, 3)} ({overall['accepted_tokens']} accepted tokens in {overall['drafts']} "
        f"drafts) beside eval's τ {tau_cell(report, 3)}" + (f": {verdict_words(engine['judged'])}"
                                                           if engine.get("judged") else ""))
    return engine


def judge_sampled(name: str, draft_sampling: str, engine: dict[str, Any], report: dict[str, Any]) -> None:
    """An engine's τ at T > 0: each of its τ with a standard error, the rule it drafted by, and its judgement against
    eval's — or, where it cannot draft by eval's rule (llama.cpp under `sample`), why it is not judged."""
    add_engine_errors(engine)
    engine["draft_rule"] = engine_draft_rule(name, draft_sampling)
    if name == "llamacpp" and draft_sampling == "sample":
        engine["not_comparable"] = ("llama.cpp drafts greedily (the argmax, accepted with the target's probability of "
                                    "it); eval drafted with the sample rule: measure with --draft-sampling greedy to "
                                    "compare")
    elif verdict := judged((engine["overall"] or {}).get("acceptance_length"),
                           (engine["overall"] or {}).get("standard_error"), report["acceptance_length"],
                           report.get("standard_error")):
        engine["judged"] = verdict  # the two τ agree when within their spread, not to a constant


def engine_draft_rule(engine: str, draft_sampling: str) -> str:
    """The rule an engine drafted with: vLLM's is set to match eval's; llama.cpp has only the greedy one."""
    if engine == "llamacpp":
        return "greedy (llama.cpp's only rule)"
    return f"{draft_sampling} (draft_sample_method {'probabilistic' if draft_sampling == 'sample' else 'greedy'})"


def verdict_words(verdict: dict[str, Any]) -> str:
    return (f"difference {verdict['difference']:+.3f}, {'within' if verdict['agrees'] else 'BEYOND'} "
            f"{verdict['bound']:.3f} (2 combined standard errors over prompts × seeds, at least 0.04)")
