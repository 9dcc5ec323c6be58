"""estimate: what a pipeline config will cost — tokens, disk, hours — before anything runs.

    flashdraft estimate examples/qwen3-8b.yaml [--num-prompts 800000] [--target-config config.json]

Counts the prompts (or takes `--num-prompts` when the prompt file lives elsewhere), measures their length
with the tokenizer when it is on this machine (else ≈ 4 characters per token, and says so), and reads the
target's shape from its config (local, the HF cache, or `--target-config`). Completion lengths are taken at
their bound (`max_new_tokens`): disk is planned for the worst case, and reasoning runs often come close; with
`--mean-new-tokens N` (what a run like it measured: generate's stats) the generation hours are also given at that mean.
Training hours are per node of `train.nproc_per_node` processes; `--train-hours H` says what fits in H hours.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.config import EMBEDDED_TARGET, PipelineConfig, TrainConfig
from flashdraft.engine_estimate import engine_lines, engine_load
from flashdraft.errors import BadInput
from flashdraft.model.drafter import uniform_layer_ids
from flashdraft.model.target import linear_attention_layers
from flashdraft.progress import human_bytes
from flashdraft.standard_sets import turns_per_prompt
from flashdraft.train.feature_cache import TEACHER_BYTES, feature_bytes

# A Gated-DeltaNet layer's shape: TargetShape's field ← the config's key (Qwen3.5/3.6)
LINEAR_ATTENTION_KEYS = {"linear_key_heads": "linear_num_key_heads", "linear_value_heads": "linear_num_value_heads",
                         "linear_key_dim": "linear_key_head_dim", "linear_value_dim": "linear_value_head_dim",
                         "linear_conv_kernel": "linear_conv_kernel_dim"}
CHARS_PER_TOKEN = 4.0  # fallback when the tokenizer is not on this machine
TEMPLATE_TOKENS_PER_MESSAGE = 5  # chat-template scaffolding (role header, end-of-turn) per message
JSON_BYTES_PER_TOKEN_ID = 7  # "123456, " in a completion record's token_ids list
RECORD_OVERHEAD_BYTES = 400  # ids, finish reason, sampling settings of one completion record
# Generation rates assumed when none is stated: the hf backend on the embedded target on a CPU machine
# (measured, benchmarks/RESULTS.md), and a typical vLLM/SGLang endpoint serving an 8B-class model on one GPU.
DEFAULT_TOKENS_PER_S = {"hf": 100.0, "openai": 2000.0, "vllm": 2000.0}
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments
DRAFTER_STATE_BYTES_PER_PARAM = 16  # in training: fp32 weights, gradients and AdamW's two moments
# The training step `flashdraft train` was measured at on one H200 (issue 47): 1.18 s for 4 sequences, online features,
# a 1.05B-parameter drafter of a Qwen3-8B-shaped target (36 layers, hidden 4096, MLP 12288, 32 q / 8 kv heads of
# 128). Other shapes are scaled by training FLOPs per token: the target's forward (2 × its layer parameters) plus
# the drafter's forward and backward (6 × its parameters), times the batch.
REFERENCE_STEP_S, REFERENCE_BATCH, REFERENCE_DRAFTER = 1.18, 4, 1.05e9
HYBRID_REFERENCE_LOOP = 1.7  # transformers #48718: a Qwen3.5-9B step 1.22 s on the reference loop, 0.70 s on kernels
REFERENCE_TARGET_LAYER_PARAMS = 36 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288)
# eval's decoding pace on an H200 (issue 47: HF decoding, host-bound; a 0.6B-shaped target measured 20.6 tok/s)
EVAL_TOKENS_PER_S = 20.0


class EstimateError(BadInput):
    """Something the estimate needs is not available here; the message says what to pass to `estimate`
    (`hint`, kept apart: a dry run's disk check, which has no such flag, says the reason alone)."""

    def __init__(self, reason: str, hint: str = "") -> None:
        super().__init__(f"{reason}; {hint}" if hint else reason)
        self.reason = reason


@dataclass(frozen=True)
class TargetShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    source: str
    linear_attention_layers: int = 0  # a hybrid's Gated-DeltaNet layers
    # a Gated-DeltaNet layer's shape (transformers' Qwen3.5 defaults where its config does not say)
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    linear_conv_kernel: int = 4
    gated_attention: bool = False  # Qwen3.5/3.6's full attention: q_proj also gives a gate (2 × heads × head_dim)

    @classmethod
    def from_config(cls, c, source: str) -> TargetShape:
        c = getattr(c, "text_config", None) or c  # multimodal configs keep the LM under text_config
        get = c.get if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        heads = get("num_attention_heads")
        hybrid = linear_attention_layers(c) > 0
        linear = {field: get(key) for field, key in LINEAR_ATTENTION_KEYS.items() if get(key) is not None}
        return cls(
            **linear,
            # Qwen3.5/3.6 gate their full attention unless the config says otherwise (`attn_output_gate`)
            gated_attention=bool(get("attn_output_gate", hybrid)),
            layers=get("num_hidden_layers"),
            hidden=get("hidden_size"),
            intermediate=get("intermediate_size"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            vocab=get("vocab_size"),
            source=source,
            linear_attention_layers=linear_attention_layers(c),
        )


def target_shape(ref: str, config_file: Path | None = None) -> TargetShape:
    if config_file is not None:
        try:
            raw = json.loads(Path(config_file).read_text())
            return TargetShape.from_config(raw.get("text_config", raw), str(config_file))
        except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
            raise EstimateError(f"--target-config {config_file} is not a model's config.json: {e}") from None
    from transformers import AutoConfig

    path, extra = _local_ref(ref)
    try:
        return TargetShape.from_config(AutoConfig.from_pretrained(path, local_files_only=True, **extra), path)
    except (OSError, ValueError) as e:
        raise EstimateError(
            f"the target's config ({ref}) is not on this machine ({type(e).__name__})",
            "pass --target-config PATH/config.json (the model's config.json from the hub)"
        ) from None


def _local_ref(ref: str) -> tuple[str, dict[str, str]]:
    """Where to read a model's config and tokenizer, as (path, extra from_pretrained arguments), without writing
    anything: the embedded target's converted copy when it is there, else its GGUF file itself (an estimate, and a
    dry run's disk check, never convert it: that writes half a gigabyte into the cache)."""
    if ref == EMBEDDED_TARGET:
        from flashdraft.artifact.manifest import MANIFEST
        from flashdraft.model.resolve import embedded_dir, embedded_gguf

        if (embedded_dir() / MANIFEST).is_file():
            return str(embedded_dir()), {}
        gguf = embedded_gguf()
        return str(gguf.parent), {"gguf_file": gguf.name}
    return ref, {}


def prompt_lengths(source: str, tokenizer_ref: str, sample: int = 2000) -> tuple[int, float, str]:
    """(prompts after dedupe, mean prompt tokens, how that mean was measured)."""
    import itertools

    from flashdraft.generate.prompts import PromptSet, iter_prompts

    def stream():
        return iter_prompts(source, PromptSet())

    # Two streaming passes (count, then every n-th prompt), so a 900K-prompt file is never held whole.
    try:
        count = sum(1 for _ in stream())
    except (OSError, BadInput) as e:
        raise EstimateError(f"cannot read the prompts ({source}): {e}", "pass --num-prompts N") from None
    if not count:
        raise EstimateError(f"no usable prompts in {source}")
    step = max(1, count // sample)
    picked = list(itertools.islice(stream(), 0, step * sample, step))  # prompts[::step][:sample], streamed
    try:
        from transformers import AutoTokenizer

        path, extra = _local_ref(tokenizer_ref)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
        # Rendered as generation will send them: chat template, default system prompt, generation prompt.
        texts = [tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False) for p in picked]
        tokens = sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
        how = f"{len(picked)} prompts rendered with the chat template and tokenized"
    except (OSError, ValueError):
        chars = sum(len(m["content"]) for p in picked for m in p.messages)
        tokens = chars / CHARS_PER_TOKEN + sum(len(p.messages) for p in picked) * TEMPLATE_TOKENS_PER_MESSAGE
        how = f"≈ {CHARS_PER_TOKEN:g} characters per token (tokenizer not on this machine)"
    return count, tokens / len(picked), how


def target_params(ref: str, config_file: Path | None, shape: TargetShape) -> tuple[int, str]:
    """The target's parameter count and how it was found: counted on a copy built on the meta device from its
    config (no memory, any architecture: MoE experts and Gated-DeltaNet layers included), or, where that config
    cannot be built here, from its shape (dense decoder layers and the embedding and head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if config_file is not None:
            config = AutoConfig.from_pretrained(str(config_file))
        else:
            path, extra = _local_ref(ref)
            config = AutoConfig.from_pretrained(path, local_files_only=True, **extra)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters()), "counted from its config"
    except Exception:  # noqa: BLE001 — any config this transformers cannot build: the shape's count instead
        return shape_params(shape), "from its layer shapes" + (
            f" ({shape.linear_attention_layers} Gated-DeltaNet, {shape.layers - shape.linear_attention_layers} gated "
            "full attention)" if shape.linear_attention_layers else "")


def shape_params(shape: TargetShape) -> int:
    """A (dense) target's parameters from its shape: each decoder layer as its kind is built (a hybrid's Gated-DeltaNet
    layers and its gated full attention, else q, k, v, o), the MLPs, the norms, the embedding and an untied head."""
    full = shape.layers - shape.linear_attention_layers
    return (full * target_layer_params(shape) + shape.linear_attention_layers * linear_layer_params(shape)
            + shape.hidden + 2 * shape.vocab * shape.hidden)


def layer_params(shape: TargetShape) -> int:
    """The matrices of one decoder layer of the target's shape: q, k, v, o and the gated MLP (a draft layer)."""
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    return attention + 3 * shape.hidden * shape.intermediate


def target_layer_params(shape: TargetShape) -> int:
    """One full-attention layer of the target as built: its q_proj twice as wide when gated, q/k norms, two norms."""
    gate = shape.hidden * shape.heads * shape.head_dim if shape.gated_attention else 0
    return layer_params(shape) + gate + 2 * shape.head_dim + 2 * shape.hidden


def linear_layer_params(shape: TargetShape) -> int:
    """One Gated-DeltaNet layer (transformers' Qwen3.5): in_proj_qkv, in_proj_z, in_proj_a/b, out_proj, the causal
    convolution over q, k and v, per-head A_log and dt_bias, the gated norm, the MLP and two norms."""
    keys = shape.linear_key_heads * shape.linear_key_dim
    values = shape.linear_value_heads * shape.linear_value_dim
    qkv = 2 * keys + values
    return (shape.hidden * (qkv + values + 2 * shape.linear_value_heads) + values * shape.hidden
            + qkv * shape.linear_conv_kernel + 2 * shape.linear_value_heads + shape.linear_value_dim
            + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden)


def drafter_step_bytes(shape: TargetShape, tr: TrainConfig, micro: int, n_features: int, cuda: bool,
                       context: int | None = None, rows: int | None = None) -> dict[str, int]:
    """What one training step adds to the drafter's device at its peak, over the weights: the draft layers'
    activations saved for the backward, the loss's chunk (train/loss.py), the target's features and the blocks.

    Per draft layer and scored row: the residual stream and both norms' outputs (4·D), q before and after its norm
    and rotation and the attention's output before o_proj (4·h·e), k (g·e), the MLP's gate, activation, up and
    product (4·I); per context position k (g·e); per key (context and blocks) k and v (2·g·e); on a CPU, SDPA also
    expands k and v to every head (2·h·e a key) and turns the boolean mask into a float one (4 bytes a row a key).
    CUDA trains in bfloat16 under FlexAttention's block mask: 2 bytes an element, no mask, no expansion. The loss
    holds three copies of a chunk's float32 logits in float32 (four under bfloat16). `context` and `rows`: a
    sequence's, by default the longest (max_length − block_size) and the most scored (max_anchors × block_size)."""
    context = tr.max_length - tr.block_size if context is None else context
    rows = tr.max_anchors * tr.block_size if rows is None else rows
    from flashdraft.train.loss import chunk_rows_for

    d, e, h, g, i = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate
    keys = context + rows
    width = 2 if cuda else 4  # bytes an activation element
    per_row = 4 * d + 4 * h * e + g * e + 4 * i
    per_key = 2 * g * e + (0 if cuda else 2 * h * e)
    layer = micro * (rows * per_row + context * g * e + keys * per_key) * width
    mask = 0 if cuda else micro * rows * keys * 4  # the float mask SDPA makes of the boolean one, a layer
    vocab = tr.draft_vocab_size or shape.vocab
    loss = (4 if cuda else 3) * min(rows, chunk_rows_for(vocab)) * vocab * 4
    # the blocks' embeddings, the final norm's input and output; the features (float32), fc's output, the context
    fixed = micro * (3 * rows * d * width + context * n_features * d * 4 + 3 * context * d * width
                     + rows * keys)  # the boolean mask
    activations = tr.num_layers * (layer + mask) + fixed
    return {"activations": activations, "loss": loss, "total": activations + loss}


def target_pass_bytes(shape: TargetShape, tokens: int, n_features: int, cuda: bool) -> int:
    """A target pass without gradients over `tokens` tokens (a micro-batch): at its peak the watched layers' features
    kept (n·D a token), the residual stream and the layer's norm and output (3·D), an MLP's gate, up and product (3·I)
    and attention's q, k, v and output (4·h·e + g·e); bfloat16 on CUDA, float32 on a CPU."""
    per_token = (n_features * shape.hidden + 3 * shape.hidden + 3 * shape.intermediate
                 + 4 * shape.heads * shape.head_dim + shape.kv_heads * shape.head_dim)
    return tokens * per_token * (2 if cuda else 4)


def drafter_params(shape: TargetShape, num_layers: int, n_features: int, tr: TrainConfig | None = None) -> int:
    """Trainable parameters: the draft layers (target-shaped, Qwen3 attention), `fc` and the norms; for DFlash2
    (`tr.architecture`) also two block convolutions a layer (base kernel 2·taps·D, kernel projection D ×
    2·taps·D/group) and the candidate selector (two V × r codebooks and an r × D projection); for DSpark its
    heads (`dspark_head_params`)."""
    layer = layer_params(shape) + 2 * shape.head_dim + 2 * shape.hidden  # + q/k norms and the layer's two norms
    total = num_layers * layer + n_features * shape.hidden * shape.hidden + 2 * shape.hidden
    if tr is not None and tr.architecture == "dflash2":
        taps, d = tr.conv_kernel_size, shape.hidden
        conv = 2 * taps * d + d * 2 * taps * (d // tr.conv_group_size)
        total += num_layers * 2 * conv + 2 * shape.vocab * tr.selector_rank + tr.selector_rank * d
    if tr is not None and tr.architecture == "dspark":
        total += dspark_head_params(shape, tr)
    return total


def dspark_head_params(shape: TargetShape, tr: TrainConfig) -> int:
    """DSpark's heads: the Markov head's V × r embedding and V′ × r projection (+ the gated head's (D + r) × r gate,
    or the rnn head's (2r + D) × 3r projection, with biases) and the confidence head's (D + r) → 1."""
    r, d = tr.markov_rank, shape.hidden
    total = 0
    if r:
        total += shape.vocab * r + (tr.draft_vocab_size or shape.vocab) * r
        total += {"vanilla": 0, "gated": (d + r) * r + r, "rnn": (2 * r + d) * 3 * r + 3 * r}[tr.markov_head]
    if tr.confidence_head:
        total += d + (r if tr.confidence_with_markov and r else 0) + 1
    return total


def estimate(
    cfg: PipelineConfig,
    *,
    num_prompts: int | None = None,
    target_config: Path | None = None,
    tokens_per_s: float | None = None,
    mean_new_tokens: int | None = None,
    train_hours: float | None = None,
    step_seconds: float | None = None,
) -> dict[str, Any]:
    g, t, tr = cfg.generate, cfg.tokenize, cfg.train
    if step_seconds is not None and not (math.isfinite(step_seconds) and step_seconds > 0):
        raise EstimateError(f"--step-seconds must be a number of seconds above 0 (got {step_seconds:g})")
    if num_prompts is not None and num_prompts < 1:
        raise EstimateError(f"--num-prompts must be at least 1 (got {num_prompts})")
    if tokens_per_s is not None and tokens_per_s <= 0:
        raise EstimateError(f"--tokens-per-s must be above 0 (got {tokens_per_s:g})")
    if mean_new_tokens is not None and not 1 <= mean_new_tokens <= g.max_new_tokens:
        raise EstimateError(f"--mean-new-tokens must be from 1 to generate.max_new_tokens {g.max_new_tokens:,} "
                            f"(got {mean_new_tokens:,})")
    if train_hours is not None and not (math.isfinite(train_hours) and train_hours > 0):
        raise EstimateError(f"--train-hours must be a number of hours above 0 (got {train_hours:g})")
    if num_prompts is None:
        count, prompt_tokens, how = prompt_lengths(g.prompts, t.tokenizer)
    else:
        count, prompt_tokens, how = num_prompts, 200.0, "assumed 200 tokens per prompt (--num-prompts given)"
    if g.max_prompts is not None:
        count = min(count, g.max_prompts * g.num_shards)
    shape = target_shape(tr.target, target_config)

    completion_tokens = count * g.max_new_tokens
    per_sample = min(prompt_tokens + g.max_new_tokens, t.max_length)
    dataset_tokens = int(count * per_sample)
    layer_ids = tr.target_layer_ids or uniform_layer_ids(shape.layers, tr.num_layers)
    params = drafter_params(shape, tr.num_layers, len(layer_ids), tr)
    procs = tr.nproc_per_node
    processes = procs * tr.nnodes  # train divides the data by every process of every node
    # each process takes batch_size sequences a step; max_steps, when set, is the run's length
    steps = tr.max_steps or math.ceil(count / (tr.batch_size * processes)) * tr.epochs
    rate = tokens_per_s if tokens_per_s is not None else DEFAULT_TOKENS_PER_S[g.backend] * max(1, len(g.base_urls))
    # A step is ceil(batch / micro_batch) passes; each is counted at the time of a full micro-batch (an upper bound:
    # the last pass may hold fewer sequences), from the reference step scaled by the training FLOPs — or the step
    # the user measured on their own node (--step-seconds; train's log prints it after its first steps).
    passes = math.ceil(tr.batch_size / min(tr.micro_batch, tr.batch_size))
    scaled_s = REFERENCE_STEP_S * (2 * shape.layers * layer_params(shape) + 6 * params) / (
        2 * REFERENCE_TARGET_LAYER_PARAMS + 6 * REFERENCE_DRAFTER) * (
        passes * min(tr.micro_batch, tr.batch_size)) / REFERENCE_BATCH
    step_s = step_seconds if step_seconds is not None else scaled_s
    # speculative, then target-only, on each prompt set; a two-turn set (mt-bench) decodes twice a prompt
    eval_turns = sum(cfg.eval.max_prompts * turns_per_prompt(source) for source in cfg.eval.sources)
    eval_tokens = 2 * eval_turns * cfg.eval.max_new_tokens
    # A sample is the prompt and its completion; tokenize keeps max_length of it and throws the rest away.
    longest_sample = prompt_tokens + g.max_new_tokens
    cut_share = max(0.0, (longest_sample - t.max_length) / g.max_new_tokens)
    hours = steps * step_s / 3600
    # GPU memory by device, from the shapes (the formula is held to measured peaks: tests/test_estimate.py)
    total_params, counted = target_params(tr.target, target_config, shape)
    head_params = 2 * shape.vocab * shape.hidden  # embedding and LM head (counted twice when tied: an upper bound)
    micro = min(tr.micro_batch, tr.batch_size)
    target_devices = len(tr.target_device.split(",")) if tr.target_device else 1
    step = drafter_step_bytes(shape, tr, micro, len(layer_ids), cuda=True)
    # bfloat16 on a GPU; with the engine as the feature source the trainer holds the embedding and head only
    target_bytes = 2 * (head_params if tr.feature_source == "engine" else total_params)
    target_pass = 0 if tr.feature_source == "engine" else target_pass_bytes(shape, micro * tr.max_length,
                                                                            len(layer_ids), cuda=True)
    # the LM head beside the drafter: the rows it scores, and the whole head where an objective reads the target's
    # distribution (DSpark's terms) and it is not the same tensor
    head_copy = 2 * shape.hidden * ((tr.draft_vocab_size or shape.vocab)
                                    + (shape.vocab if tr.draft_vocab_size and tr.architecture == "dspark" else 0))
    gpu = {
        "target_params": total_params,
        "target_params_from": counted,
        "target_bytes": target_bytes,
        "target_devices": target_devices,
        "target_pass_bytes": target_pass,
        # each of target_device's GPUs: its share of the weights and the pass's transient peak
        "target_device_bytes": target_bytes // target_devices + target_pass,
        "drafter_state_bytes": params * DRAFTER_STATE_BYTES_PER_PARAM,
        "head_copy_bytes": head_copy,
        "activation_bytes": step["activations"],
        "loss_bytes": step["loss"],
        # a drafter GPU (one per training process): state, the head's copy and the step's peak
        "drafter_device_bytes": params * DRAFTER_STATE_BYTES_PER_PARAM + head_copy + step["total"],
        "micro_batch": micro,
    }
    # train.feature_source: engine — every sequence's states at the watched layers cross the shared directory once
    # (the engine writes them in bfloat16, the trainer reads and deletes them), at the pace of the steps
    largest_layer = max(target_layer_params(shape), linear_layer_params(shape) if shape.linear_attention_layers else 0)
    shared, probe = engine_load(tr, shape.layers, shape.hidden, per_sample, layer_ids, step_s, steps,
                                2 * total_params, largest_layer)
    fits = None
    if train_hours is not None:
        fit_steps = int(train_hours * 3600 / step_s)
        fits = {"hours": train_hours, "max_steps": fit_steps,
                "epochs": round(fit_steps * tr.batch_size * processes / count, 2)}
    return {
        "prompts": count,
        "prompt_tokens_mean": round(prompt_tokens, 1),
        "prompt_tokens_measured": how,
        "completion_tokens_max": completion_tokens,
        "generation_hours": round(completion_tokens / rate / 3600, 2),
        "generation_tokens_per_s": rate,
        "generation_hours_at_mean": round(count * mean_new_tokens / rate / 3600, 2) if mean_new_tokens else None,
        "mean_new_tokens": mean_new_tokens,
        "longest_sample_tokens": round(longest_sample),
        "completion_share_cut_max": round(cut_share, 3),
        "completions_bytes": int(count * (RECORD_OVERHEAD_BYTES + prompt_tokens * CHARS_PER_TOKEN)
                                 + completion_tokens * (CHARS_PER_TOKEN + JSON_BYTES_PER_TOKEN_ID)),
        "dataset_tokens": dataset_tokens,
        "dataset_bytes": dataset_tokens * 5 + count * 40,  # int32 ids + uint8 mask; id, offsets, num_tokens
        "offline_features_bytes": feature_bytes(dataset_tokens, len(layer_ids), shape.hidden, tr.distill_topk),
        "drafter_params": params,
        "checkpoint_bytes": params * CHECKPOINT_BYTES_PER_PARAM,
        "checkpoints_kept": tr.keep_checkpoints,
        "checkpoints_bytes": params * CHECKPOINT_BYTES_PER_PARAM * tr.keep_checkpoints,
        "drafter_bytes": params * (2 if tr.export_dtype == "bfloat16" else 4),
        "gpu_memory": gpu,
        "train_processes": procs,
        "train_nodes": tr.nnodes,
        "train_steps": steps,
        "train_step_s": round(step_s, 3),
        "train_step_measured": step_seconds is not None,
        "train_passes_per_step": passes,
        "train_hours": round(hours, 1),
        # a hybrid target's Gated-DeltaNet layers on transformers' reference loop (no fast kernels): ~1.7× a step
        "train_hours_reference_loop": (round(hours * HYBRID_REFERENCE_LOOP, 1) if step_seconds is None and
                                       shape.linear_attention_layers and tr.feature_source != "engine" else None),
        "train_gpu_hours": round(hours * processes, 1),
        "train_fits": fits,
        "shared_directory": shared,
        "fleet_probe": probe,
        "eval_hours": round(eval_tokens / EVAL_TOKENS_PER_S / 3600, 2),
        "target": {"layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab, "from": shape.source,
                   "linear_attention_layers": shape.linear_attention_layers},
        "target_layer_ids": layer_ids,
    }


def describe(est: dict[str, Any], cfg: PipelineConfig) -> list[str]:
    """The estimate as lines a person reads before committing machines to it."""
    b, processes = human_bytes, est["train_processes"] * est["train_nodes"]
    features = ("offline" if cfg.train.features == "offline" else
                "online: computed in each step and never written; what a cache of them would take, "
                "train.features: offline") + (
        ", from vLLM (train.feature_source: engine)" if cfg.train.feature_source == "engine" else
        ", from the trainer's own transformers copy of the target")
    return [
        f"prompts: {est['prompts']:,} (mean {est['prompt_tokens_mean']:,.0f} prompt tokens; "
        f"{est['prompt_tokens_measured']})",
        f"generate: up to {est['completion_tokens_max']:,} completion tokens "
        f"({cfg.generate.max_new_tokens:,} max new tokens each) ≈ {est['generation_hours']:,} hours at "
        f"{est['generation_tokens_per_s']:,.0f} tokens/s in total (--tokens-per-s to change); "
        + (f"at a mean of {est['mean_new_tokens']:,} new tokens ≈ {est['generation_hours_at_mean']:,} hours"
           if est["mean_new_tokens"] else "the worst case: --mean-new-tokens N gives the hours at a measured mean"),
        cut_line(est, cfg),
        f"disk, completions: {b(est['completions_bytes'])}",
        f"disk, dataset: {b(est['dataset_bytes'])} ({est['dataset_tokens']:,} tokens at max length "
        f"{cfg.tokenize.max_length:,})",
        f"disk, target features {features}: {b(est['offline_features_bytes'])} "
        f"(tokens × {len(est['target_layer_ids'])} layers × {est['target']['hidden']:,} × 2 bytes"
        + (f" + tokens × top {cfg.train.distill_topk} × {TEACHER_BYTES} bytes for distillation"
           if cfg.train.distill_topk else "")
        + ")",
        f"disk, checkpoints: {b(est['checkpoints_bytes'])} ({est['checkpoints_kept']} kept × "
        f"{b(est['checkpoint_bytes'])}: {est['drafter_params'] / 1e6:,.1f}M drafter params with AdamW state)",
        f"disk, exported drafter: {b(est['drafter_bytes'])} ({cfg.train.export_dtype})",
        *gpu_lines(est, cfg),
        f"train: {est['train_steps']:,} optimizer steps of {processes} process(es) × batch "
        f"{cfg.train.batch_size} ("
        + (f"max_steps, ≈ {est['train_steps'] * cfg.train.batch_size * processes / est['prompts']:,.2f} "
           "epochs" if cfg.train.max_steps else f"{cfg.train.epochs} epoch(s)")
        + f", train.nproc_per_node {est['train_processes']} × train.nnodes {est['train_nodes']})",
        f"train: ≈ {est['train_hours']:,} hours ({est['train_gpu_hours']:,} drafter GPU-hours) at ≈ "
        + (f"{est['train_step_s']:.2f} s a step (--step-seconds: measured on your node)" if est["train_step_measured"]
           else f"{est['train_step_s']:.2f} s a step (the step measured on one H200 — 1.18 s, batch 4, a 1.05B drafter "
           "of a Qwen3-8B-shaped target, online — scaled by this target's and drafter's training FLOPs and the batch"
           + (f", {est['train_passes_per_step']} passes of micro_batch {est['gpu_memory']['micro_batch']} each counted "
              "as full" if est["train_passes_per_step"] > 1 else "")
           + (f"; its {est['target']['linear_attention_layers']} Gated-DeltaNet layers assumed on fast kernels "
              "(flash-linear-attention, or vLLM with train.feature_source: engine): on transformers' reference loop "
              f"≈ {est['train_hours_reference_loop']:,} hours" if est["train_hours_reference_loop"] else "")
           + "; measure yours: train's log gives the pace after its first steps, then --step-seconds S)"),
        *fit_line(est),
        *engine_lines(est, cfg),
        f"eval: ≈ {est['eval_hours']} hours ({len(cfg.eval.sources)} prompt set(s) × {cfg.eval.max_prompts} prompts "
        f"× {cfg.eval.max_new_tokens} tokens a turn, "
        f"speculative and target-only, at ~{EVAL_TOKENS_PER_S:.0f} tokens/s: eval's HF decoding measured on an H200)",
        f"target: {est['target']['layers']} layers, hidden {est['target']['hidden']:,}, vocab "
        f"{est['target']['vocab']:,} (from {est['target']['from']}); features from layers {est['target_layer_ids']}",
    ]


def gpu_lines(est: dict[str, Any], cfg: PipelineConfig) -> list[str]:
    """GPU memory per device at a training step's peak, by part."""
    b, g, tr = human_bytes, est["gpu_memory"], cfg.train
    target = ("its embedding and LM head only (the engine holds the layers)" if tr.feature_source == "engine" else
              f"{g['target_params'] / 1e9:,.1f}B parameters, {g['target_params_from']}")
    spread = (f"over the {g['target_devices']} GPUs target_device lists" if g["target_devices"] > 1 else
              "on one GPU (target_device may list several)")
    return [
        f"GPU memory, each target GPU: ≈ {b(g['target_device_bytes'])} — {b(g['target_bytes'])} of bfloat16 weights "
        f"({target}) {spread}"
        + (f", and {b(g['target_pass_bytes'])} for its pass over a micro-batch of {g['micro_batch']} × "
           f"{tr.max_length:,} tokens" if g["target_pass_bytes"] else ""),
        f"GPU memory, each drafter GPU (one a training process): ≈ {b(g['drafter_device_bytes'])} — "
        f"{b(g['drafter_state_bytes'])} of weights, gradients and AdamW state, {b(g['head_copy_bytes'])} for its copy "
        f"of the LM head, {b(g['activation_bytes'])} of activations at micro_batch {g['micro_batch']} × "
        f"{tr.max_anchors * tr.block_size:,} scored rows (micro_batch scales them), {b(g['loss_bytes'])} for the loss "
        "(a chunk of rows at a time, whatever the rows); bfloat16, FlexAttention (the formula is held to peaks "
        "measured on a CPU; written, not yet checked against a GPU)",
    ]


def cut_line(est: dict[str, Any], cfg: PipelineConfig) -> str:
    """Whether tokenize keeps what generate writes: tokens generated past max_length are GPU time thrown away."""
    longest, keep = est["longest_sample_tokens"], cfg.tokenize.max_length
    if not est["completion_share_cut_max"]:
        return (f"tokenize: a sample is at most ≈ {longest:,} tokens (mean prompt + max_new_tokens); max_length "
                f"{keep:,} keeps all of it")
    return (f"tokenize: WARNING a sample may reach ≈ {longest:,} tokens (mean prompt + max_new_tokens) and max_length "
            f"{keep:,} keeps the first {keep:,}: up to {est['completion_share_cut_max']:.0%} of a completion is "
            f"generated, then thrown away. Set generate.max_new_tokens ≈ "
            f"{max(1, keep - est['prompt_tokens_mean']):,.0f} (max_length − the mean prompt), or raise "
            "tokenize.max_length and train.max_length")


def fit_line(est: dict[str, Any]) -> list[str]:
    fits = est["train_fits"]
    if fits is None:
        return []
    slow = est.get("train_hours_reference_loop")
    if est["train_hours"] <= fits["hours"]:
        if slow and slow > fits["hours"]:
            return [f"train: fits in {fits['hours']:,g} hours on fast Gated-DeltaNet kernels, not on transformers' "
                    f"reference loop (≈ {slow:,} hours): install flash-linear-attention and causal-conv1d "
                    "(FLASHDRAFT_GPU=1 ./install.sh), or use train.feature_source: engine"]
        return [f"train: fits in {fits['hours']:,g} hours"]
    return [f"train: to fit in {fits['hours']:,g} hours, set train.max_steps: {fits['max_steps']:,} (≈ "
            f"{fits['epochs']:,} epochs of these prompts), or add processes (train.nproc_per_node, torchrun nodes)"]
