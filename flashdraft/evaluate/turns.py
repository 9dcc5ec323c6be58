"""eval's own measurement: every prompt's turns decoded speculatively, target-only and by prompt lookup, interleaved
per prompt (drift in machine load hits every method alike), once a seed; and the report and stats made of them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate.decode import divergence, target_only, until_stop
from flashdraft.evaluate.prepare import Decoding
from flashdraft.evaluate.report import dspark_summary, summarize
from flashdraft.evaluate.spread import over_seeds_spread
from flashdraft.evaluate.static import StaticSpecDecoder
from flashdraft.model.objective import acceptance_length
from flashdraft.progress import progress


def decode_prompts(cfg: EvalConfig, d: Decoding, prompts: list, decoded: list | None, console) -> list[dict]:
    """Every prompt's turns, speculative and target-only (and prompt lookup), interleaved per prompt so that drift
    in machine load hits every method alike; `decoded`: the rows a committed report already holds."""
    per_prompt = list(decoded or [])
    turns = sum(1 + len(p.follow_ups) for p in prompts) * cfg.seeds
    # one line every FLASHDRAFT_PROGRESS_SECONDS in a log file (a bar on a terminal): turns done, τ so far, ETA
    with progress(console, "eval: turns decoded, τ so far {task.fields[tau]},", total=turns, unit="turns",
                  tau="–") as advance:
        for seed in (seeds_of(cfg) if decoded is None else []):  # every prompt once a seed (temperature > 0)
            d.generator.manual_seed(seed)
            for item in prompts:
                messages, answer = list(item.prompt.messages), ""
                for turn, follow_up in enumerate((None, *item.follow_ups), start=1):
                    if follow_up is not None:  # asked after the target's own answer to the turn before
                        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
                    ids = d.render(messages, item.prompt.thinking)
                    row = decode_turn(cfg, d, ids)
                    answer = d.tokenizer.decode(row.pop("token_ids"), skip_special_tokens=True)
                    per_prompt.append({"id": item.prompt.id, "dataset": item.dataset, "turn": turn,
                                       "prompt_tokens": len(ids), "category": item.prompt.category or "all",
                                       **({"seed": seed} if cfg.seeds > 1 else {}), **row})
                    advance(1, tau=f"{acceptance_length([n for row in per_prompt for n in row['accepted']]):.2f}")
    if not any(row["accepted"] for row in per_prompt):  # τ would be 0/0: not a measurement, not a success
        raise BadInput(f"eval: no turn reached a verify step (each of the {len(per_prompt)} ended at its first "
                       "token), so τ was not measured and nothing was written; give prompts the target answers "
                       "at more length")
    return per_prompt


def seeds_of(cfg: EvalConfig) -> list[int]:
    """The seeds a measurement is repeated over: seed, seed + 1, … (one, at temperature 0)."""
    return [cfg.seed + i for i in range(cfg.seeds)]


def decode_turn(cfg: EvalConfig, d: Decoding, ids: list[int]) -> dict[str, Any]:
    """One turn: speculative decoding, target-only (timed alike), prompt lookup, and the lossless verdict."""
    spec = d.decoder.generate(ids, cfg.max_new_tokens, cfg.temperature, d.generator)
    whole = d.uncut.generate(ids, cfg.max_new_tokens, cfg.temperature, d.generator) if d.uncut is not None else None
    if isinstance(d.decoder, StaticSpecDecoder):
        base, base_s = d.decoder.target_only(ids, cfg.max_new_tokens)
    else:
        base, base_s, _ = target_only(d.target, ids, cfg.max_new_tokens)
    pld, pld_s, pld_calls = ([], None, None) if d.stateful else target_only(
        d.target, ids, cfg.max_new_tokens, lookup=cfg.prompt_lookup_tokens)
    diverged = divergence(d.target, ids, base, spec.tokens, cfg.near_tie_ulps) if cfg.temperature <= 0 else None
    return {
        "token_ids": spec.tokens, "tokens": len(spec.tokens), "accepted": spec.accepted,
        "spec_seconds": spec.seconds, "target_seconds": base_s, "target_tokens": len(base), "lookup_seconds": pld_s,
        "lookup_tokens": len(pld), "lookup_forwards": pld_calls,
        # a baseline is only worth its speedup if it is lossless too: greedy lookup must emit target-only's
        # tokens (up to the first stop token, where the baseline stops)
        "lookup_lossless": (until_stop(pld, d.stop_ids) == until_stop(base, d.stop_ids)
                            if pld_s is not None and cfg.temperature <= 0 else None),
        "lossless": (diverged is None or diverged["near_tie"]) if cfg.temperature <= 0 else None,
        "divergence": diverged,
        **({"proposed": spec.proposed, "confidence": spec.confidence} if d.dspark else {}),
        **({"accepted_uncut": whole.accepted, "proposed_uncut": whole.proposed, "confidence_uncut": whole.confidence}
           if whole is not None else {}),
    }


STATS = ("acceptance_length", "lossless", "speedup", "speedup_per_prompt", "lookup_acceptance_length",
         "lookup_speedup", "lookup_lossless", "prompts", "tokens_per_s", "target_dtype", "near_ties", "decoding",
         "rejected")


def eval_report(cfg: EvalConfig, d: Decoding, per_prompt: list[dict], rejected: list) -> tuple[dict, dict]:
    """The report of eval's own decoding and the manifest's stats of it."""
    # positions a step can accept: K − 1 drafts (DFlash, DFlash2), K (DSpark, whose anchor slot drafts too)
    report = summarize(per_prompt, d.block_size + int(d.dspark), cfg)
    if d.dspark:
        report["dspark"] = dspark_summary(per_prompt, d.block_size, cfg)
    # the type greedy output was compared in, and the machinery both decodings ran on
    report["target_dtype"] = str(d.target.model.dtype).removeprefix("torch.")
    report["decoding"] = d.machinery
    report["rejected"] = len(rejected)
    if cfg.seeds > 1:  # τ at temperature > 0 is a random variable: each seed's, and their spread
        by_seed = defaultdict(list)
        for row in per_prompt:
            by_seed[row["seed"]].extend(row["accepted"])
        report["tau_over_seeds"] = over_seeds_spread({seed: acceptance_length(steps) if steps else None
                                                      for seed, steps in by_seed.items()})
    stats = {key: report[key] for key in STATS}
    if report.get("tau_over_seeds"):
        stats["tau_over_seeds"] = report["tau_over_seeds"]
    kept = ("acceptance_length", "standard_error", "speedup", "lossless", "prompts")
    if "standard_error" in report:
        stats["standard_error"] = report["standard_error"]
    stats["by_dataset"] = {name: {key: block[key] for key in kept if key in block}
                           for name, block in report["by_dataset"].items()}
    return report, stats


def engine_only_report(cfg: EvalConfig, prompts: list, d: Decoding) -> tuple[dict, dict]:
    """`engine_only`: a report the engines fill in, with eval's own columns empty."""
    datasets = sorted({p.dataset for p in prompts})
    report = {"engine_only": True, "acceptance_length": None, "prompts": len(prompts),
              "by_dataset": {name: {"acceptance_length": None} for name in datasets},
              "config": cfg.model_dump(mode="json"), "block_size": d.block_size}
    return report, {"engine_only": True, "prompts": len(prompts)}
