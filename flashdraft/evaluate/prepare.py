"""What eval's decoding needs, set up once: the target and drafter on this machine's device, checked against each
other, the prompts' rendering with the target's chat template, and the decoder (`eval.decoding`, the draft rule)
with the words the report says it with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate.decode import SpecDecoder
from flashdraft.evaluate.static import StaticSpecDecoder, cuda_graphs, static_unsupported
from flashdraft.model.drafter_config import DrafterConfig
from flashdraft.model.dspark import is_dspark
from flashdraft.model.export import load_drafter
from flashdraft.model.target import Target


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


def served_only(cfg: EvalConfig, drafter: DrafterConfig, target_path: str, log: Callable[[str], None]) -> Decoding:
    """`engine_only`: no target or drafter here — the target's chat template renders the prompts, and the drafter's
    config (read once, at the start of eval) gives its block."""
    from transformers import AutoTokenizer

    log(f"eval: engine only — {', '.join(cfg.engines)} on the prompts; eval's own decoding is not run")
    return Decoding(render=renderer(AutoTokenizer.from_pretrained(target_path)), block_size=drafter.block_size,
                    dspark=drafter.dspark)


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
