"""GPU check: drafter training throughput with compiled FlexAttention vs SDPA, and eval speed, on one GPU.

    bash benchmarks/gpu_check.sh            # one GPU, ≤ 8 minutes, nothing downloaded
    bash benchmarks/gpu_check.sh --tiny     # the same code on CPU with tiny shapes (what the tests run)

Targets are random-weight Qwen3 models built in memory from configs written here, shaped like Qwen3-0.6B and
Qwen3-8B (bf16). For each: a 5-layer drafter's full training step (forward, backward through the frozen LM
head, AdamW) over the blocks of one sequence, attention through compiled FlexAttention (block-sparse, what
CUDA training uses) and through SDPA with a dense mask; tokens/s, model FLOPs utilisation and peak memory.
Then the recipe's settings on the 8B-shaped target (its ~1.1B-parameter drafter is the size of SpecForge's
MFU anchor: 43.5–44 % on one H200 for its isolated trainer): a step with each loss (`decay`, `dpace`) and each
optimizer (`adamw`, `muon`, as `train` builds them), at a fixed anchor count (FlexAttention compiles again when
the block mask's shape changes, so every row has the same one). Then greedy speculative decoding against
target-only decoding on the 0.6B-shaped target. The drafter is untrained, so τ ≈ 1: the eval line measures what
a draft step costs, not a trained speedup.

FLOPs (per step, matmuls only): 6 × (drafter linear params) × block tokens for the layers, 6 × (fc + per-layer
k/v params) × context tokens for the injected context, 4 × D × V × block tokens for the frozen LM head (its
forward and the gradient into the hidden states), and 4 × heads × head_dim × visible keys per query for
attention, forward and backward (× 3). MFU divides by the bf16 dense peak given by --peak-tflops. The
optimizer's own arithmetic (Muon's Newton–Schulz iterations) is time spent, not model FLOPs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

SPECFORGE_MFU = (0.435, 0.44)  # SpecForge's isolated DFlash-family trainer, ~1.1B drafter, one H200
RECIPES = [("decay", "adamw"), ("dpace", "adamw"), ("decay", "muon"), ("dpace", "muon")]
DPACE_ALPHA = 0.5  # train.dpace_alpha's default; the weights' cost does not depend on it

SHAPES = {  # Qwen3's published configs, in the fields that decide cost; weights are random
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151_936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151_936),
}
TINY = {"tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512),
        "tiny-b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, vocab_size=512)}


def build_target(shape: dict, device: str, dtype, **config_fields):
    """A random-weight Qwen3 of `shape` (plus any other config fields, e.g. its tokenizer's special ids)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flashdraft.model.target import Target

    config = Qwen3Config(**shape, max_position_embeddings=40_960, rope_theta=1_000_000.0, tie_word_embeddings=False,
                         **config_fields)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return Target.from_model(model, name=f"random {shape['hidden_size']}-wide Qwen3")


def step_flops(drafter, context: int, block_tokens: int, visible_keys: float) -> float:
    c = drafter.config
    layer_params = sum(p.numel() for n, p in drafter.layers.named_parameters() if p.dim() == 2)
    kv_params = sum(layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
                    for layer in drafter.layers)
    heads, head_dim = c.num_attention_heads, c.head_dim
    attention = 4 * heads * head_dim * visible_keys * block_tokens * len(drafter.layers) * 3
    return (6 * layer_params * block_tokens + 6 * (drafter.fc.weight.numel() + kv_params) * context
            + 4 * c.hidden_size * c.vocab_size * block_tokens + attention)


def train_check(name: str, shape: dict, attention: str, args, device: str, dtype,
                recipes: list[tuple[str, str]] = RECIPES[:1]) -> list[dict]:
    """One row per (loss, optimizer) in `recipes`, each a fresh drafter on the same target, anchors and features."""
    torch.manual_seed(0)
    target = build_target(shape, device, dtype)
    rows = []
    for loss, optimizer in recipes:
        rows.append(train_step_check(name, target, attention, args, device, loss, optimizer))
        gc.collect()  # the previous drafter and its optimizer state, before the next is built
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def recipe_loss(logits_SV: torch.Tensor, labels_S: torch.Tensor, weights_S: torch.Tensor, loss: str,
                block_size: int) -> torch.Tensor:
    """`decay`: CE × the position decay, normalised; `dpace`: CE × D-PACE's weights (from the detached CE), as
    `train`'s step weighs them."""
    from flashdraft.model.objective import dpace_weights, weighted_loss

    if loss == "decay":
        return weighted_loss(logits_SV, labels_S, weights_S)
    ce = torch.nn.functional.cross_entropy(logits_SV.float(), labels_S, reduction="none")
    supervised = (weights_S > 0).view(-1, block_size)
    w = dpace_weights(ce.detach().view(-1, block_size), supervised, DPACE_ALPHA).view(-1)
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def train_step_check(name: str, target, attention: str, args, device: str, loss: str, optimizer_name: str) -> dict:
    from flashdraft.config import TrainConfig
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.objective import block_attention_mask, build_blocks, flex_block_mask, sample_anchors
    from flashdraft.train.optim import build_optimizers

    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=0)).to(device)
    target.watch(drafter.target_layer_ids)
    optimizers = build_optimizers(TrainConfig(optimizer=optimizer_name, lr=1e-4, warmup_ratio=0.0), drafter,
                                  args.warmup + args.steps)
    n = args.seq_len
    ids = torch.randint(1, target.config.vocab_size, (n,), device="cpu")
    mask = torch.ones(n, dtype=torch.long)
    anchors = sample_anchors(mask, 16, args.anchors, torch.Generator().manual_seed(0))
    context = int(anchors.max())
    features = target.features(ids[None, :context].to(device)).float()  # cached, as offline training reads them
    block_ids, positions, labels, weights = build_blocks(ids, mask, anchors, 16, 0)
    embeds = target.model.get_input_embeddings()(block_ids.view(1, -1).to(device)).float()
    if attention == "flex":
        allowed = flex_block_mask(anchors, 16, context, device)
    else:
        allowed = block_attention_mask(anchors, 16, context)[None].to(device)
    dense = block_attention_mask(anchors, 16, context)
    visible = dense.sum().item() / dense.shape[0]
    head = target.lm_head.weight
    labels, weights = labels.view(-1).to(device), weights.view(-1).to(device)
    pos, ctx_pos = positions.view(1, -1).to(device), torch.arange(context, device=device)[None]

    forward_only = attention == "flex" and device == "cpu"  # FlexAttention has no CPU backward (tiny mode)

    def step():
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"), \
                torch.set_grad_enabled(not forward_only):
            hidden = drafter(embeds, features, pos, ctx_pos, allowed)
            value = recipe_loss((hidden.to(head.dtype) @ head.T)[0], labels, weights, loss, 16)
        if not forward_only:
            value.backward()
            optimizers.step()
            optimizers.zero_grad()

    for _ in range(args.warmup):  # compiles FlexAttention on the first call
        step()
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - started) / args.steps
    flops = step_flops(drafter, context, embeds.shape[1], visible)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    label = attention + (" (forward only)" if forward_only else "")
    return {"shape": name, "attention": label, "loss": loss, "optimizer": optimizer_name,
            "tokens_per_s": embeds.shape[1] / seconds, "mfu": flops / seconds / (args.peak_tflops * 1e12),
            "peak_gib": peak, "step_ms": seconds * 1e3, "anchors": len(anchors),
            "params": sum(p.numel() for p in drafter.parameters())}


def eval_check(name: str, shape: dict, args, device: str, dtype) -> dict:
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate.decode import SpecDecoder, divergence, target_only
    from flashdraft.model.drafter import DFlashDrafter, draft_config

    torch.manual_seed(0)
    target = build_target(shape, device, dtype)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=0))
    drafter = drafter.to(device=device, dtype=dtype).eval()
    target.watch(drafter.target_layer_ids)
    decoder = SpecDecoder(target, drafter, stop_ids=set())
    prompt = torch.randint(1, shape["vocab_size"], (args.prompt_len,)).tolist()
    decoder.generate(prompt, 8)  # warm-up
    target_only(target, prompt, 8)
    spec = decoder.generate(prompt, args.new_tokens)
    base, base_s, _ = target_only(target, prompt, args.new_tokens)
    # in bfloat16 a near-tie may go either way between a verify pass and a one-token pass: eval's own check
    found = divergence(target, prompt, base, spec.tokens, EvalConfig().near_tie_ulps)
    return {"shape": name, "tau": spec.acceptance_length, "speedup": base_s / spec.seconds,
            "lossless": found is None or found["near_tie"], "divergence": found,
            "target_tokens_per_s": len(base) / base_s}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: the same code, in seconds")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 SXM: 989)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    args = ap.parse_args()
    if args.tiny:
        args.seq_len, args.anchors, args.steps, args.warmup = 96, 8, 2, 1
        args.prompt_len, args.new_tokens = 16, 12
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shapes = TINY if args.tiny else SHAPES
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"

    # The recipes run on the last (largest) shape, on the target already built for its attention row, whose
    # first recipe (decay, AdamW) is that row. FlexAttention has no backward on a CPU: the tiny form uses SDPA.
    last, recipe_attention = list(shapes)[-1], "flex" if device == "cuda" else "sdpa"
    rows, recipes = [], []
    for name, shape in shapes.items():
        for attention in ("flex", "sdpa"):
            here = name == last and attention == recipe_attention
            done = train_check(name, shape, attention, args, device, dtype, RECIPES if here else RECIPES[:1])
            rows.append(done[0])
            recipes = done if here else recipes
            gc.collect()  # the previous target and drafter, before the next is built
            if device == "cuda":
                torch.cuda.empty_cache()
    first = next(iter(shapes))
    ev = eval_check(first, shapes[first], args, device, dtype)

    print(f"\n{gpu}, torch {torch.__version__}, drafter 5 layers, block 16, sequence {args.seq_len}, "
          f"{args.anchors} anchors, {args.steps} timed steps")
    print("| target shape | attention | train tokens/s | MFU | peak GiB | step ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        print(f"| {r['shape']} | {r['attention']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {peak} | "
              f"{r['step_ms']:.1f} |")
    print(f"\nThe recipe's settings ({last}, {recipes[0]['attention']}, {recipes[0]['anchors']} anchors in every row):")
    print("| loss | optimizer | train tokens/s | MFU | × SpecForge's MFU anchor | peak GiB | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in recipes:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        anchor = f"{r['mfu'] / SPECFORGE_MFU[0]:.2f}–{r['mfu'] / SPECFORGE_MFU[1]:.2f}"
        print(f"| {r['loss']} | {r['optimizer']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {anchor} | {peak} | "
              f"{r['step_ms']:.1f} |")
    print(f"(SpecForge's isolated trainer: {SPECFORGE_MFU[0]:.1%}–{SPECFORGE_MFU[1]:.0%} MFU on one H200, ~1.1B "
          f"drafter; this one: {recipes[0]['params'] / 1e9:.2f}B)")
    print(f"eval ({ev['shape']}, untrained drafter): τ {ev['tau']:.2f}, speedup {ev['speedup']:.2f}× over "
          f"target-only ({ev['target_tokens_per_s']:.1f} tok/s), lossless {ev['lossless']}"
          + (f" (first difference at token {ev['divergence']['at']}: "
             f"{max(ev['divergence'].get('ulps_behind_top', [float('inf')])):g} units behind the top logit)"
             if ev["divergence"] else " (token for token)"))
    if args.json:
        print(json.dumps({"train": rows, "recipes": recipes, "eval": ev}))


if __name__ == "__main__":
    main()
