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

What it decodes (evaluate/sets.py): one or more prompt sources — built-in sets, prompt files, and the public
benchmark sets the anchors report τ on (gsm8k, math500, humaneval, mbpp, mt-bench, formatted as z-lab's benchmark
formats them; mt-bench's second turn follows the target's own first answer). How (evaluate/static.py): on a
static KV cache with CUDA graphs where the device and target allow, both the speculative decoding and the
target-only baseline it is timed against.

Report (`report.json`, `report.md`, PNG plots, manifest stats): per dataset and overall, `acceptance_length` τ
(tokens per target verify pass), acceptance rate by block position, τ histogram, tokens/s and `speedup` against
target-only decoding and against prompt-lookup decoding, lossless; per prompt category; the thinking mode,
temperature and decoding machinery they were measured with. `report.md` (also printed) is the table of it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
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
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.evaluate.decode import SpecDecoder, divergence, target_only, until_stop
from flashdraft.evaluate.report import dspark_summary, markdown_report, plot, summarize
from flashdraft.evaluate.sets import load_eval_sets
from flashdraft.evaluate.spread import add_engine_errors, judged, over_seeds_spread
from flashdraft.evaluate.static import StaticSpecDecoder, cuda_graphs, static_unsupported
from flashdraft.layout import require_drafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.export import load_drafter
from flashdraft.model.objective import acceptance_length
from flashdraft.model.target import Target
from flashdraft.progress import progress


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
    require_drafter(drafter_dir)
    prompts, rejected, sets = load_prompts(cfg)
    check_engines(cfg, drafter_dir, log)
    target_path = resolve_model(target_ref or cfg.target, log=log)
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
            decoding, per_prompt = served_only(cfg, drafter_dir, target_path, log), []
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


def load_prompts(cfg: EvalConfig) -> tuple[list, list[dict], list]:
    """Every set's prompts in every thinking mode asked for, the records none could be made of (with their set), and
    the sets; a set with no usable prompt is refused (nothing to measure τ on). With two modes each set is measured
    twice, as `NAME · thinking on` and `NAME · thinking off`."""
    sets = load_eval_sets(cfg.sources, cfg.max_prompts)
    for each in sets:
        if not each.prompts:
            raise BadInput(f"no usable prompts in {each.name}"
                           + (f" ({len(each.rejected)} rejected: {each.rejected[0].reason})" if each.rejected else "")
                           + ": nothing to measure τ on")
    modes = cfg.thinking_modes
    prompts = [replace(prompt, dataset=prompt.dataset if len(modes) == 1 else f"{prompt.dataset} · thinking "
                       f"{'on' if mode else 'off'}", prompt=replace(prompt.prompt, thinking=mode))
               for each in sets for mode in modes for prompt in each.prompts]
    rejected = [{**r.to_json(), "set": each.name} for each in sets for r in each.rejected]
    return prompts, rejected, sets


def check_engines(cfg: EvalConfig, drafter_dir: Path, log: Callable[[str], None]) -> None:
    """Before any decoding: each engine can be had, and can serve this drafter here."""
    if not cfg.engines:
        return
    from flashdraft.evaluate.engines import check_engine
    from flashdraft.model.gguf_export import served_spec_type

    if served_spec_type(json.loads((drafter_dir / "config.json").read_text()), drafter_dir) == "draft-dspark" \
            and "vllm" in cfg.engines and cfg.engine_url is None and not torch.cuda.is_available():
        # vLLM 0.32 drafts DSpark on its V2 GPU model runner only; its CPU build's V1 runner refuses it at start
        raise BadInput("vLLM serves DSpark drafters on its GPU model runner only (its CPU build says \"Model "
                       "Runner V1 does not support: dspark speculative decoding\"): measure with --engine llamacpp "
                       "here, or with vLLM on a GPU host (--engine-url)")
    for engine in cfg.engines:
        log(f"eval: engine {check_engine(engine, cfg.engine_url, cfg.engine_python)}")


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


@dataclass
class Decoding:
    """What decoding needs, set up once: the target and drafter, the prompts' rendering, the decoder chosen and the
    words the report says it with (with `engine_only`, the rendering and the drafter's block only)."""

    render: Callable[[list[dict], bool], list[int]]  # (messages, thinking) → token ids
    block_size: int
    dspark: bool
    target: Target | None = None
    drafter: Any = None
    tokenizer: Any = None
    stop_ids: set[int] = field(default_factory=set)
    decoder: Any = None
    machinery: str = ""
    uncut: SpecDecoder | None = None  # DSpark with a confidence threshold: the same drafter, its blocks uncut
    stateful: bool = False  # transformers < 5.25 refuses prompt lookup on hybrid targets
    generator: Any = None


def renderer(tokenizer) -> Callable[[list[dict], bool], list[int]]:
    """The target's chat template: messages in a thinking mode → the token ids decoded after them."""
    def render(messages: list[dict], thinking: bool) -> list[int]:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, enable_thinking=thinking)
        return list(rendered["input_ids"])

    return render


def prepare_decoding(cfg: EvalConfig, drafter_dir: Path, target_path: str, prompts: list, sets: list,
                     log: Callable[[str], None]) -> Decoding:
    """The target and drafter on this machine's device, checked against each other, and the decoder for them."""
    from transformers import AutoTokenizer

    from flashdraft.model.resolve import stop_token_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Target(target_path, device, log, cfg.target_dtype)
    drafter = load_drafter(drafter_dir, device=device, dtype=target.model.dtype)
    if drafter.config.num_target_layers != target.config.num_hidden_layers:
        raise BadInput(
            f"the drafter was trained for a {drafter.config.num_target_layers}-layer target; "
            f"{target_path} has {target.config.num_hidden_layers} layers"
        )
    check_confidence(cfg, drafter, drafter_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    stop_ids = stop_token_ids(tokenizer, target.model.generation_config.eos_token_id)
    decoder, machinery = choose_decoder(cfg, target, drafter, stop_ids, log)
    uncut = SpecDecoder(target, drafter, stop_ids, draft_sampling=cfg.draft_sampling) \
        if cfg.confidence_threshold is not None else None
    # transformers < 5.25 marks hybrid linear-attention models stateful and its assisted generation refuses
    # them; 5.25 rolls their state back itself and runs prompt lookup on them.
    stateful = getattr(target.model, "_is_stateful", False)
    if stateful:
        log("eval: the prompt-lookup baseline is skipped: this transformers' assisted generation refuses stateful "
            "(hybrid linear-attention) models (5.25 and later run it)")
    turns = sum(1 + len(p.follow_ups) for p in prompts)
    modes = " and ".join("on" if mode else "off" for mode in cfg.thinking_modes)
    log(f"eval: {len(prompts)} prompts ({turns} turns) from {len(sets)} set(s), {cfg.max_new_tokens} new tokens "
        f"a turn, temperature {cfg.temperature}"
        + (f" ({cfg.draft_sampling} draft rule, {cfg.seeds} seed{'s' if cfg.seeds > 1 else ''})"
           if cfg.temperature > 0 else "")
        + f", thinking {modes}; decoding: {machinery}")
    render = renderer(tokenizer)
    if isinstance(decoder, StaticSpecDecoder):
        # Buffers for the whole run, reserved once: new buffers mid-run would mean new graphs, captured while
        # a prompt is timed. A later turn holds the earlier ones and their answers (+ room for its own text).
        longest = max(len(render(p.prompt.messages, p.prompt.thinking)) for p in prompts)
        turns_most = max(1 + len(p.follow_ups) for p in prompts)
        context = getattr(target.config, "max_position_embeddings", None)
        if isinstance(context, int) and longest + cfg.max_new_tokens > context:  # before any buffer is asked for
            raise BadInput(f"eval.max_new_tokens {cfg.max_new_tokens:,} after a {longest:,}-token prompt is past "
                           f"the target's context ({context:,} positions): the static cache cannot hold it; use "
                           f"at most {max(1, context - longest):,}")
        decoder.reserve(longest + turns_most * (cfg.max_new_tokens + 512) + 2 * drafter.block_size)
        if decoder.compiled:
            decoder, machinery = warm_up(decoder, render(prompts[0].prompt.messages, prompts[0].prompt.thinking),
                                         target, drafter, stop_ids, log)
    return Decoding(render=render, block_size=drafter.block_size, dspark=is_dspark(drafter), target=target,
                    drafter=drafter, tokenizer=tokenizer, stop_ids=stop_ids, decoder=decoder, machinery=machinery,
                    uncut=uncut, stateful=stateful,
                    generator=torch.Generator(device=device).manual_seed(cfg.seed))


def served_only(cfg: EvalConfig, drafter_dir: Path, target_path: str, log: Callable[[str], None]) -> Decoding:
    """`engine_only`: no target or drafter here — the target's chat template renders the prompts, and the drafter's
    config gives its block."""
    from transformers import AutoTokenizer

    from flashdraft.model.gguf_export import served_spec_type

    config = json.loads((drafter_dir / "config.json").read_text())
    block_size = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise BadInput(f"{drafter_dir}/config.json gives no block size (block_size, dflash_config.block_size)")
    log(f"eval: engine only — {', '.join(cfg.engines)} on the prompts; eval's own decoding is not run")
    return Decoding(render=renderer(AutoTokenizer.from_pretrained(target_path)), block_size=block_size,
                    dspark=served_spec_type(config, drafter_dir) == "draft-dspark")


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
            f"{name} τ {with_error(served['overall'])}, {served['tokens_per_s']:g} tokens/s"
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
        f"eval: done, verified — {out}: τ {with_error(report)}"
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
        add_engine_errors(engine)
        engine["draft_rule"] = engine_draft_rule(name, cfg.draft_sampling)
        if name == "llamacpp" and cfg.draft_sampling == "sample":
            engine["not_comparable"] = ("llama.cpp drafts greedily (the argmax, accepted with the target's "
                                        "probability of it); eval drafted with the sample rule: measure with "
                                        "--draft-sampling greedy to compare")
        elif verdict := judged(tau, (engine["overall"] or {}).get("standard_error"), report["acceptance_length"],
                               report.get("standard_error")):
            engine["judged"] = verdict  # the two τ agree when within their spread, not to a constant
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
    log(f"eval: {name} τ {with_error(overall)} ({overall['accepted_tokens']} accepted tokens in {overall['drafts']} "
        f"drafts) beside eval's τ {with_error(report)}" + (f": {verdict_words(engine['judged'])}"
                                                           if engine.get("judged") else ""))
    return engine


def engine_draft_rule(engine: str, draft_sampling: str) -> str:
    """The rule an engine drafted with: vLLM's is set to match eval's; llama.cpp has only the greedy one."""
    if engine == "llamacpp":
        return "greedy (llama.cpp's only rule)"
    return f"{draft_sampling} (draft_sample_method {'probabilistic' if draft_sampling == 'sample' else 'greedy'})"


def with_error(block: dict[str, Any]) -> str:
    """τ as printed: with its standard error where it was sampled."""
    if "standard_error" not in block:
        return f"{block['acceptance_length']:.2f}"
    se = block["standard_error"]
    return f"{block['acceptance_length']:.3f} ± {se:.3f}" if se is not None else \
        f"{block['acceptance_length']:.3f} (one draw: no spread)"


def verdict_words(verdict: dict[str, Any]) -> str:
    return (f"difference {verdict['difference']:+.3f}, {'within' if verdict['agrees'] else 'BEYOND'} "
            f"{verdict['bound']:.3f} (2 combined standard errors over prompts × seeds, at least 0.04)")


def check_confidence(cfg: EvalConfig, drafter, drafter_dir: Path) -> None:
    """A confidence threshold needs a drafter with a confidence head to read."""
    if cfg.confidence_threshold is None:
        return
    if not is_dspark(drafter):
        raise BadInput(f"eval.confidence_threshold cuts a DSpark block at its confidence head; {drafter_dir} is not "
                       "a DSpark drafter")
    if drafter.confidence_head is None:
        raise BadInput(f"eval.confidence_threshold reads the confidence head, and {drafter_dir} has none "
                       "(enable_confidence_head: false)")


def choose_decoder(cfg: EvalConfig, target: Target, drafter, stop_ids: set[int],
                   log: Callable[[str], None]) -> tuple[SpecDecoder, str]:
    """The decoder `eval.decoding` asks for and the target allows, and the words the report says it with."""
    rule = cfg.draft_sampling
    if is_dspark(drafter):  # the static cache and its CUDA graphs are written for DFlash's K − 1 drafts
        if cfg.decoding == "static":
            raise BadInput("eval.decoding static is not written for DSpark drafters yet: use auto or dynamic")
        return (SpecDecoder(target, drafter, stop_ids, cfg.confidence_threshold, cfg.confidence_rule, rule),
                "growing KV cache (DSpark: the static cache is written for DFlash and DFlash2)")
    if cfg.decoding == "dynamic":
        return SpecDecoder(target, drafter, stop_ids, draft_sampling=rule), "growing KV cache (eval.decoding: dynamic)"
    why = static_unsupported(target)
    if why is not None:
        if cfg.decoding == "static":
            raise BadInput(f"eval.decoding is static, but the static KV cache cannot hold {target.path}: {why}")
        log(f"eval: decoding on the growing KV cache, without CUDA graphs: {why}")
        return SpecDecoder(target, drafter, stop_ids, draft_sampling=rule), f"growing KV cache ({why})"
    if target.lm_head.weight.device.type == "cuda":
        return (StaticSpecDecoder(target, drafter, stop_ids, compiler=cuda_graphs, draft_sampling=rule),
                "static KV cache, CUDA graphs")
    if cfg.decoding == "auto":  # on a CPU, every pass attending over all reserved positions is slower (RESULTS.md)
        return SpecDecoder(target, drafter, stop_ids, draft_sampling=rule), \
            "growing KV cache (on a CPU, where it is the faster)"
    return (StaticSpecDecoder(target, drafter, stop_ids, draft_sampling=rule),
            "static KV cache (CUDA graphs only on a GPU)")


def warm_up(decoder: StaticSpecDecoder, ids: list[int], target: Target, drafter, stop_ids: set[int],
            log: Callable[[str], None]) -> tuple[SpecDecoder, str]:
    """Capture every graph before anything is timed (a first prompt would otherwise pay for compilation). Where
    capture fails, the static cache runs without graphs and the report says so."""
    started = time.perf_counter()
    try:
        decoder.generate(ids, 3 * drafter.block_size)
        decoder.target_only(ids, 4)
    except Exception as e:  # a torch.compile failure has many types; none may cost the eval
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        log(f"eval: capturing CUDA graphs failed ({why}); decoding on the static cache without them")
        return (StaticSpecDecoder(target, drafter, stop_ids, draft_sampling=decoder.draft_sampling),
                f"static KV cache (CUDA graphs failed: {why})")
    log(f"eval: CUDA graphs captured in {time.perf_counter() - started:.0f} s")
    return decoder, "static KV cache, CUDA graphs"


def lossless_detail(report: dict[str, Any], per_prompt: list[dict]) -> str:
    """What the lossless verdict rests on, when it is not token for token on every prompt."""
    ties, failed = report["near_ties"], sum(1 for row in per_prompt if row["lossless"] is False)
    detail = (f", {ties} of {report['prompts']} prompts diverge at a near-tie within "
              f"{report['config']['near_tie_ulps']} units in the last place" if ties else "")
    if failed:
        detail += f", {failed} of {report['prompts']} differ beyond one: see `divergence` in report.json"
    return detail
