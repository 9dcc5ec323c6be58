"""eval: lossless DFlash speculative decoding, and the acceptance-length report users judge a drafter by.

    flashdraft eval --drafter work/train/drafter --prompts builtin:demo-heldout --out work/eval

One decoding step (`SpecDecoder.generate`): the drafter proposes K−1 tokens in one pass from
[anchor, MASK…] over its cached context; the target verifies [anchor, drafts] in one pass; the longest
matching prefix is accepted plus the target's own next token (the bonus, the next anchor); the target's KV
cache is cropped to what was accepted and the accepted positions' features are appended to the drafter's
context cache. Greedy output is checked token for token against target-only greedy decoding; with
temperature > 0, drafts are accepted with probability min(1, p/q) and rejections resampled from (p − q)+, so
every emitted token is a sample of the target's distribution.

Report (`report.json`, PNG plots, manifest stats): `acceptance_length` τ (tokens per target verify pass),
acceptance rate by block position, τ histogram, tokens/s and `speedup` against target-only decoding and
against prompt-lookup decoding, per prompt category.
"""

from __future__ import annotations

import inspect
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdraft.artifact import (
    Lineage,
    atomic_write_text,
    build_manifest,
    check_done,
    identity,
    read_manifest,
    sha256_json,
    write_manifest,
)
from flashdraft.blocks import expected_acceptance_length
from flashdraft.config import EvalConfig
from flashdraft.drafter import DFlashDrafter
from flashdraft.export import load_drafter
from flashdraft.train import Target


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verify step (0..K−1)
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return sum(n + 1 for n in self.accepted) / max(1, len(self.accepted))


class SpecDecoder:
    """Speculative decoding of one prompt at a time with a DFlash drafter over the frozen target."""

    def __init__(self, target: Target, drafter: DFlashDrafter, stop_ids: set[int]) -> None:
        self.target, self.drafter, self.stop_ids = target, drafter.eval(), stop_ids
        target.watch(drafter.target_layer_ids)
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.lm_head
        self.draft_head = target.head_weight(drafter)  # the LM head rows the drafter scores with, selected once
        # transformers ≥ 5.2x names the cache argument `cache`; earlier releases `past_key_values`.
        params = inspect.signature(target.model.model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _target_pass(self, ids_BT: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and watched-layer features of new tokens, extending the target's KV cache."""
        out, features = self.target.forward(ids_BT, **{self.cache_kwarg: cache}, use_cache=True)
        return self.lm_head(out.last_hidden_state), features

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, generator=None) -> Decoded:
        from transformers import DynamicCache

        k, started = self.drafter.block_size, time.perf_counter()
        device = self.lm_head.weight.device
        cache = DynamicCache(config=self.target.config)
        logits, features = self._target_pass(torch.tensor([prompt_ids], device=device), cache)
        ctx_kv = self.drafter.context_kv(features, torch.arange(len(prompt_ids), device=device)[None])
        anchor = int(_pick(logits[0, -1], temperature, generator))
        tokens, accepted, position = [anchor], [], len(prompt_ids)  # position: where the anchor sits
        while len(tokens) < max_new_tokens and anchor not in self.stop_ids:
            block = torch.full((1, k), self.drafter.mask_token_id, device=device)
            block[0, 0] = anchor
            positions = torch.arange(position, position + k, device=device)[None]
            hidden = self.drafter.decode(self.embed(block), positions, None, ctx_kv=ctx_kv)
            draft_logits = self.drafter.to_target_vocab(  # K−1 proposals, each for its own position
                hidden[0, 1:].to(self.draft_head.dtype) @ self.draft_head.T, self.target.config.vocab_size
            )
            drafts = _pick(draft_logits, temperature, generator)
            block[0, 1:] = drafts
            target_logits, features = self._target_pass(block, cache)
            n, bonus = _verify(drafts, draft_logits, target_logits[0], temperature, generator)
            # Keep the anchor and the accepted drafts. A negative crop removes that many trailing tokens
            # in every transformers release (newer ones accept nothing else).
            if k - n - 1 > 0:
                cache.crop(-(k - n - 1))
            new_kv = self.drafter.context_kv(features[:, : n + 1], positions[:, : n + 1])
            ctx_kv = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2))
                      for (k0, v0), (k1, v1) in zip(ctx_kv, new_kv, strict=True)]  # fmt: skip
            emitted = drafts[:n].tolist() + [bonus]
            tokens.extend(emitted)
            accepted.append(n)
            position, anchor = position + n + 1, bonus
            if self.stop_ids & set(emitted):
                first_stop = next(i for i, t in enumerate(tokens) if t in self.stop_ids)
                tokens = tokens[: first_stop + 1]
                break
        return Decoded(tokens[:max_new_tokens], accepted, time.perf_counter() - started)


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def _verify(drafts, draft_logits, target_logits, temperature: float, generator) -> tuple[int, int]:
    """(accepted drafts n, bonus token). target_logits[j] is the target's distribution for block position j+1."""
    if temperature <= 0:
        predicted = target_logits.argmax(-1)
        matches = (drafts == predicted[:-1]).int()
        n = int(matches.cumprod(0).sum())
        return n, int(predicted[n])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    for j, token in enumerate(drafts.tolist()):
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[j, token] <= p[j, token]:  # accept with probability min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


# ---------------------------------------------------------------------------------------------- baselines


def counted_forwards(target: Target):
    """Count the target's forward passes (for prompt lookup's τ)."""
    calls = [0]
    handle = target.model.model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


@torch.inference_mode()
def target_only(target: Target, prompt_ids: list[int], max_new_tokens: int, lookup: int = 0) -> tuple[list, float, int]:
    """Greedy target-only (or prompt-lookup) decoding: (new tokens, seconds, target forwards)."""
    device = target.model.lm_head.weight.device
    calls, handle = counted_forwards(target)
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    started = time.perf_counter()
    out = target.model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)  # fmt: skip
    seconds = time.perf_counter() - started
    handle.remove()
    target.discard_features()
    return out[0, len(prompt_ids) :].tolist(), seconds, calls[0]


# ---------------------------------------------------------------------------------------------- stage


def run(
    cfg: EvalConfig,
    drafter_dir: Path,
    out: Path,
    *,
    target_ref: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from flashdraft.models import resolve_model
    from flashdraft.prompts import load_prompts

    drafter_dir, out = Path(drafter_dir), Path(out)
    if not (drafter_dir / "config.json").is_file():
        raise FileNotFoundError(f"{drafter_dir} holds no drafter (config.json): run `flashdraft train` first")
    target_path = resolve_model(target_ref or cfg.target, log=log)
    lineage = Lineage(
        inputs=[identity(drafter_dir)], config=sha256_json({"eval": cfg.model_dump(), "target": target_path})
    )
    decision = check_done(out, lineage)
    log(decision.line("eval", out))
    if decision.done:
        return read_manifest(out).stats

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Target(target_path, device, log)
    drafter = load_drafter(drafter_dir, device=device, dtype=target.model.dtype)
    if drafter.config.num_target_layers != target.config.num_hidden_layers:
        raise ValueError(
            f"the drafter was trained for a {drafter.config.num_target_layers}-layer target; "
            f"{target_path} has {target.config.num_hidden_layers} layers"
        )
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    eos = target.model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    stop_ids.discard(None)
    decoder = SpecDecoder(target, drafter, stop_ids)
    prompts = load_prompts(cfg.prompts).prompts[: cfg.max_prompts]

    per_prompt = []
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    log(f"eval: {len(prompts)} prompts, {cfg.max_new_tokens} new tokens each, temperature {cfg.temperature}")
    for prompt in prompts:
        rendered = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, enable_thinking=cfg.thinking)  # fmt: skip
        ids = list(rendered["input_ids"])
        # Interleaved per prompt, so drift in machine load hits every method alike.
        spec = decoder.generate(ids, cfg.max_new_tokens, cfg.temperature, generator)
        base, base_s, _ = target_only(target, ids, cfg.max_new_tokens)
        pld, pld_s, pld_calls = target_only(target, ids, cfg.max_new_tokens, lookup=cfg.prompt_lookup_tokens)
        per_prompt.append({
            "id": prompt.id, "category": prompt.category or "all", "tokens": len(spec.tokens),
            "accepted": spec.accepted, "spec_seconds": spec.seconds, "target_seconds": base_s,
            "target_tokens": len(base), "lookup_seconds": pld_s, "lookup_tokens": len(pld),
            "lookup_forwards": pld_calls,
            "lossless": spec.tokens == base[: len(spec.tokens)] and len(spec.tokens) == len(base)
            if cfg.temperature <= 0 else None,
        })  # fmt: skip

    report = summarize(per_prompt, drafter.block_size, cfg)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps({**report, "prompts": per_prompt}, indent=1))
    plot(report, out)
    stats = {key: report[key] for key in ("acceptance_length", "lossless", "speedup", "lookup_acceptance_length",
                                          "lookup_speedup", "prompts", "tokens_per_s")}  # fmt: skip
    write_manifest(out, build_manifest(out, kind="eval", stats=stats, lineage=lineage))
    log(
        f"eval: done, verified — {out}: τ {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}× vs "
        f"target-only, lossless {report['lossless']}; prompt lookup τ {report['lookup_acceptance_length']:.2f}, "
        f"{report['lookup_speedup']:.2f}×"
    )
    return stats


def summarize(per_prompt: list[dict], block_size: int, cfg: EvalConfig) -> dict[str, Any]:
    def block(rows: list[dict]) -> dict[str, Any]:
        steps = [n for r in rows for n in r["accepted"]]
        reach = [sum(n >= k for n in steps) for k in range(block_size)]  # reach[k]: steps with ≥ k accepted
        by_position = [reach[k] / len(steps) if steps else 0.0 for k in range(1, block_size)]
        conditional = [reach[k] / reach[k - 1] if reach[k - 1] else float("nan") for k in range(1, block_size)]
        spec_s, base_s = sum(r["spec_seconds"] for r in rows), sum(r["target_seconds"] for r in rows)
        pld_s = sum(r["lookup_seconds"] for r in rows)
        pld_tokens = sum(r["lookup_tokens"] - 1 for r in rows)
        pld_forwards = sum(r["lookup_forwards"] - 1 for r in rows)
        lossless = [r["lossless"] for r in rows if r["lossless"] is not None]
        return {
            "prompts": len(rows),
            "acceptance_length": sum(n + 1 for n in steps) / max(1, len(steps)),
            "acceptance_length_from_rates": expected_acceptance_length(conditional),
            "acceptance_by_position": [round(x, 4) for x in by_position],
            "tau_histogram": dict(sorted(Counter(n + 1 for n in steps).items())),
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(spec_s, 1e-9),
            "target_tokens_per_s": sum(r["target_tokens"] for r in rows) / max(base_s, 1e-9),
            "speedup": base_s / max(spec_s, 1e-9),
            "lookup_acceptance_length": pld_tokens / max(1, pld_forwards),
            "lookup_speedup": base_s / max(pld_s, 1e-9),
            "lossless": all(lossless) if lossless else None,
        }

    report = block(per_prompt)
    categories = defaultdict(list)
    for row in per_prompt:
        categories[row["category"]].append(row)
    if len(categories) > 1:
        report["by_category"] = {name: block(rows) for name, rows in sorted(categories.items())}
    report["config"] = cfg.model_dump()
    return report


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashdraft.artifact import atomic_open

    fig, ax = plt.subplots(figsize=(6, 3.5))
    rates = report["acceptance_by_position"]
    ax.bar(range(1, len(rates) + 1), rates, color="#3b7dd8")
    ax.set(xlabel="block position k", ylabel="P(≥ k drafts accepted)", ylim=(0, 1),
           title=f"acceptance by position — τ = {report['acceptance_length']:.2f}")  # fmt: skip
    fig.tight_layout()
    with atomic_open(out / "acceptance_by_position.png") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    hist = report["tau_histogram"]
    ax.bar([int(k) for k in hist], list(hist.values()), color="#2a9d8f")
    ax.set(xlabel="tokens emitted per target pass", ylabel="steps", title="τ per decoding step")
    fig.tight_layout()
    with atomic_open(out / "tau_histogram.png") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
