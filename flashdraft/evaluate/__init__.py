"""eval: lossless DFlash speculative decoding, and the acceptance-length report users judge a drafter by.

    flashdraft eval --drafter work/train/drafter --prompts builtin:chat-heldout --out work/eval

One decoding step (`SpecDecoder.generate`): the drafter proposes K−1 tokens in one pass from
[anchor, MASK…] over its cached context; the target verifies [anchor, drafts] in one pass; the longest
matching prefix is accepted plus the target's own next token (the bonus, the next anchor); the target's KV
cache is cropped to what was accepted and the accepted positions' features are appended to the drafter's
context cache. Greedy output is checked against target-only greedy decoding, token for token or, where
the two first differ, at a near-tie of the target's own logits (`divergence`: bfloat16 rounding); with
temperature > 0, drafts are accepted with probability min(1, p/q) and rejections resampled from (p − q)+, so
every emitted token is a sample of the target's distribution.

Report (`report.json`, PNG plots, manifest stats): `acceptance_length` τ (tokens per target verify pass),
acceptance rate by block position, τ histogram, tokens/s and `speedup` against target-only decoding and
against prompt-lookup decoding, per prompt category.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import (
    MANIFEST,
    Lineage,
    check_done,
    commit_dir,
    identity,
    read_manifest,
    require_verified,
    sha256_json,
)
from flashdraft.artifact.ownership import hold_output
from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate.decode import SpecDecoder, divergence, target_only
from flashdraft.evaluate.report import plot, summarize
from flashdraft.model.export import load_drafter
from flashdraft.model.target import Target


def run(
    cfg: EvalConfig,
    drafter_dir: Path,
    out: Path,
    *,
    target_ref: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from flashdraft.generate.prompts import load_prompts
    from flashdraft.model.resolve import resolve_model, stop_token_ids

    drafter_dir, out = Path(drafter_dir), Path(out)
    if not (drafter_dir / "config.json").is_file():
        raise BadInput(f"{drafter_dir} holds no drafter (config.json): run `flashdraft train` first")
    prompts = load_prompts(cfg.prompts).prompts[: cfg.max_prompts]
    if not prompts:
        raise BadInput(f"no usable prompts in {cfg.prompts}: nothing to measure τ on")
    target_path = resolve_model(target_ref or cfg.target, log=log)
    lineage = Lineage(
        inputs=[identity(drafter_dir)], config=sha256_json({"eval": cfg.model_dump(), "target": target_path})
    )
    # Locked for the run; refused unless it is an eval report (or empty) outside the drafter and the target.
    with hold_output(out, "eval", inputs=[drafter_dir, target_path]):
        decision = check_done(out, lineage)
        log(decision.line("eval", out))
        if decision.done:
            return read_manifest(out).stats
        if (drafter_dir / MANIFEST).exists():  # re-hashed only now that it is about to be used
            require_verified(drafter_dir, "drafter", "re-export it (rerun `flashdraft train`) or pull it again")
        else:
            log(f"eval: {drafter_dir} has no manifest (a drafter from elsewhere): its files are not verified")

        device = "cuda" if torch.cuda.is_available() else "cpu"
        target = Target(target_path, device, log, cfg.target_dtype)
        drafter = load_drafter(drafter_dir, device=device, dtype=target.model.dtype)
        if drafter.config.num_target_layers != target.config.num_hidden_layers:
            raise BadInput(
                f"the drafter was trained for a {drafter.config.num_target_layers}-layer target; "
                f"{target_path} has {target.config.num_hidden_layers} layers"
            )
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        decoder = SpecDecoder(target, drafter, stop_token_ids(tokenizer, target.model.generation_config.eos_token_id))

        # transformers < 5.25 marks hybrid linear-attention models stateful and its assisted generation refuses
        # them; 5.25 rolls their state back itself and runs prompt lookup on them.
        stateful = getattr(target.model, "_is_stateful", False)
        if stateful:
            log("eval: the prompt-lookup baseline is skipped: this transformers' assisted generation refuses stateful "
                "(hybrid linear-attention) models (5.25 and later run it)")
        per_prompt = []
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        log(f"eval: {len(prompts)} prompts, {cfg.max_new_tokens} new tokens each, temperature {cfg.temperature}")
        for prompt in prompts:
            rendered = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, enable_thinking=cfg.thinking)
            ids = list(rendered["input_ids"])
            # Interleaved per prompt, so drift in machine load hits every method alike.
            spec = decoder.generate(ids, cfg.max_new_tokens, cfg.temperature, generator)
            base, base_s, _ = target_only(target, ids, cfg.max_new_tokens)
            pld, pld_s, pld_calls = ([], None, None) if stateful else target_only(target, ids, cfg.max_new_tokens,
                                                                                  lookup=cfg.prompt_lookup_tokens)
            diverged = divergence(target, ids, base, spec.tokens, cfg.near_tie_ulps) if cfg.temperature <= 0 else None
            per_prompt.append({
                "id": prompt.id, "category": prompt.category or "all", "tokens": len(spec.tokens),
                "accepted": spec.accepted, "spec_seconds": spec.seconds, "target_seconds": base_s,
                "target_tokens": len(base), "lookup_seconds": pld_s, "lookup_tokens": len(pld),
                "lookup_forwards": pld_calls,
                # a baseline is only worth its speedup if it is lossless too: greedy lookup must emit target-only's
                "lookup_lossless": pld == base if pld_s is not None and cfg.temperature <= 0 else None,
                "lossless": (diverged is None or diverged["near_tie"]) if cfg.temperature <= 0 else None,
                "divergence": diverged,
            })

        report = summarize(per_prompt, drafter.block_size, cfg)
        # the type greedy output was compared in
        report["target_dtype"] = str(target.model.dtype).removeprefix("torch.")
        stats = {key: report[key] for key in ("acceptance_length", "lossless", "speedup", "speedup_per_prompt",
                                              "lookup_acceptance_length", "lookup_speedup", "lookup_lossless",
                                              "prompts", "tokens_per_s", "target_dtype", "near_ties")}
        with commit_dir(out, "eval", stats=stats, lineage=lineage) as building:  # its own files, renamed in whole
            atomic_write_text(building / "report.json", json.dumps({**report, "prompts": per_prompt}, indent=1))
            plot(report, building)
    per = report["speedup_per_prompt"]
    checked = (f"lossless {report['lossless']} ({report['target_dtype']} target{lossless_detail(report, per_prompt)})"
               if report["lossless"] is not None else
               f"lossless not checked (sampled at temperature {cfg.temperature}: drafts pass by rejection sampling)")
    log(
        f"eval: done, verified — {out}: τ {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}× vs "
        f"target-only (per prompt: median {per['median']:.2f}×, 10–90 % {per['p10']:.2f}–{per['p90']:.2f}×), "
        f"{checked}; prompt lookup "
        + (f"τ {report['lookup_acceptance_length']:.2f}, {report['lookup_speedup']:.2f}×"
           if report["lookup_speedup"] is not None else "not measured")
    )
    return stats


def lossless_detail(report: dict[str, Any], per_prompt: list[dict]) -> str:
    """What the lossless verdict rests on, when it is not token for token on every prompt."""
    ties, failed = report["near_ties"], sum(1 for row in per_prompt if row["lossless"] is False)
    detail = (f", {ties} of {report['prompts']} prompts diverge at a near-tie within "
              f"{report['config']['near_tie_ulps']} units in the last place" if ties else "")
    if failed:
        detail += f", {failed} of {report['prompts']} differ beyond one: see `divergence` in report.json"
    return detail
