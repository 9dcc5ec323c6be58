"""The DFlash drafter: a few non-causal decoder layers of the target's shape, conditioned on target features.

    drafter = DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=...))
    hidden_BSD = drafter(block_embeds_BSD, features_BCF, block_pos_BS, ctx_pos_BC, allowed_BSX)
    logits = target.lm_head(hidden_BSD)                          # the target's own (frozen) LM head

The target features are projected by `fc` (n·D → D, no bias) and an RMSNorm into the context.

KV injection: in every layer the projected context goes through that layer's own k/v projections (k-norm,
RoPE at the context positions) and is prepended to the block's keys and values; queries come only from the
blocks. Attention is non-causal; which block may see what is entirely the caller's `allowed` mask. The
layers follow Qwen3's shape (q/k RMSNorm per head), which is what the z-lab checkpoint format and the SGLang
and vLLM DFlash implementations load, whatever the target family.

Shape legend: B batch, S block positions (every block of a sequence, flattened), C context positions,
X = C + S keys, D hidden, H query heads, G key/value heads, E head dim, F = n·D concatenated target features.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from flashdraft.errors import BadInput
from flashdraft.model.modeling_dflash import DFlashMLP as MLP  # the file shipped with exports: one MLP for both
from flashdraft.model.transfer import to_device


def uniform_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n target layers spread uniformly from 1 to L−3 (Qwen3-8B, L=36, n=5: [1, 9, 17, 25, 33])."""
    if n == 1:
        return [num_target_layers // 2]
    last = min(max(num_target_layers - 3, n), num_target_layers - 1)  # tiny targets: still n distinct layers
    return [round(1 + i * (last - 1) / (n - 1)) for i in range(n)]


def draft_config(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    sliding_window: int | None = None,
) -> Qwen3Config:
    """A Qwen3-shaped config with the target's hidden size, heads, MLP, norms and RoPE base (read from its text
    config: a VLM wrapper's `text_config`). The drafter rotates the whole head dimension, so a target's
    `partial_rotary_factor` (Qwen3.5/3.6) is not copied: the export states only what the drafter computes.

    `sliding_window`: every draft layer but the last attends to context within that many positions, as the
    published Qwen3.6 drafters do for long contexts (`layer_types`, `use_sliding_window`, `sliding_window` in
    the config, the standard transformers fields the engines read)."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 1e4)}
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    layer_ids = target_layer_ids or uniform_layer_ids(t.num_hidden_layers, num_layers)
    if sliding_window is not None and sliding_window < block_size:
        raise BadInput(f"sliding_window {sliding_window} is smaller than the block size {block_size}: a block "
                       "must see its own anchor's context")
    layer_types = ["full_attention"] * num_layers
    if sliding_window is not None:
        layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    config = Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
        head_dim=head_dim,
        hidden_act=getattr(t, "hidden_act", "silu"),
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        rope_theta=rope["rope_theta"],  # what transformers 4.x reads (5.x folds it into rope_parameters)
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=layer_types,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = t.num_hidden_layers
    config.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)}
    if draft_vocab_size:
        config.draft_vocab_size = draft_vocab_size
    return config


@functools.cache
def flex_attention(device_type: str):
    """FlexAttention: compiled (fused, block-sparse kernels) on CUDA; eager on CPU, where it serves only to
    check the CUDA path's numbers against SDPA."""
    from torch.nn.attention.flex_attention import flex_attention as eager

    if device_type == "cuda":
        return torch.compile(eager)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    return eager


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, heads, positions, E) with cos/sin (B, positions, E)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def context_kv(self, ctx_BCD: torch.Tensor, rope_ctx: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the injected context (B, G, C, E): cacheable, they depend on context alone."""
        b, c, _ = ctx_BCD.shape
        k = self.k_norm(self.k_proj(ctx_BCD).view(b, c, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(ctx_BCD).view(b, c, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, *rope_ctx), v

    def forward(self, x_BSD, ctx_kv, rope_block, allowed_BSX) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        q = self.q_norm(self.q_proj(x_BSD).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSD).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSD).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *rope_block), rotate(k, *rope_block)
        if len(ctx_kv) == 3:  # eval's preallocated buffers: the block written in place right after the context
            k_buf, v_buf, slots = ctx_kv
            k_buf.index_copy_(2, slots, k)
            v_buf.index_copy_(2, slots, v)
            k, v = k_buf, v_buf  # the mask hides what lies past the block (evaluate/static.py)
        else:
            k_ctx, v_ctx = ctx_kv
            k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
        gqa = self.heads != self.kv_heads
        if allowed_BSX is not None and not isinstance(allowed_BSX, torch.Tensor):  # a FlexAttention BlockMask
            out = flex_attention(q.device.type)(q, k, v, block_mask=allowed_BSX, enable_gqa=gqa)
        else:
            mask = None if allowed_BSX is None else allowed_BSX.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x_BSD, ctx_BCD, rope_block, rope_ctx, allowed_BSX, ctx_kv=None) -> torch.Tensor:
        if ctx_kv is None:
            ctx_kv = self.self_attn.context_kv(ctx_BCD, rope_ctx)
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), ctx_kv, rope_block, allowed_BSX)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class DFlashDrafter(nn.Module):
    """Trainable parts only: the shared embedding and LM head stay in the (frozen) target."""

    layer_class = DraftLayer  # DFlash2 (model/dflash2.py) wraps each sublayer in a convolution

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.block_size: int = config.block_size
        self.mask_token_id: int = config.dflash_config["mask_token_id"]
        self.target_layer_ids: list[int] = list(config.dflash_config["target_layer_ids"])
        d = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        self.layer_types: list[str] = list(getattr(config, "layer_types", None) or
                                           ["full_attention"] * config.num_hidden_layers)
        sliding = "sliding_attention" in self.layer_types
        self.sliding_window: int | None = config.sliding_window if sliding else None
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.apply(self._init)
        # A reduced draft vocabulary (DESIGN §2 cost note): the drafter scores only `draft_vocab_size` target
        # tokens. Stored EAGLE-3 style: d2t[i] = target id − i for draft id i; t2d[t] = t is in the draft vocab.
        self.draft_vocab_size: int | None = getattr(config, "draft_vocab_size", None)
        if self.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The target ids (ascending) the drafter may propose."""
        ids = torch.sort(target_ids.to(self.d2t.device)).values
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor | None:
        """Target id of each draft-vocabulary entry; None with the full vocabulary."""
        if not self.draft_vocab_size:
            return None
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's (frozen) LM head this drafter scores with."""
        ids = self.draft_ids()
        return lm_head_weight if ids is None else lm_head_weight[to_device(ids, lm_head_weight.device)]

    def draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(target ids as draft-vocabulary ids, −1 where a token is outside it; which are inside). With the
        full vocabulary, the labels themselves."""
        if not self.draft_vocab_size:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        t2d = to_device(self.t2d, labels.device)
        inside = t2d[labels]
        return torch.where(inside, t2d.cumsum(0)[labels] - 1, -1), inside

    def to_target_vocab(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Logits over the draft vocabulary as logits over the target's (−inf outside it), for decoding."""
        ids = self.draft_ids()
        if ids is None:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
        full[..., to_device(ids, full.device)] = draft_logits
        return full

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits as this drafter scores them: as they are (DFlash2 applies the target's scaling)."""
        return logits

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def project_context(self, features_BCF: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features_BCF))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, positions)

    def forward(self, block_embeds_BSD, features_BCF, block_pos_BS, ctx_pos_BC, allowed_BSX):
        """Training: every block of the batch in one pass. `allowed_BSX[b, s, x]`: may block position s
        attend to key x (keys: the context first, then the block positions)? One mask for every layer, or a
        dict by layer type (`full_attention`, `sliding_attention`; see `objective.block_masks`)."""
        ctx_BCD = self.project_context(features_BCF)
        rope_ctx = self.rope(ctx_BCD, ctx_pos_BC)
        return self.decode(block_embeds_BSD, block_pos_BS, allowed_BSX, ctx_BCD=ctx_BCD, rope_ctx=rope_ctx)

    def decode(self, block_embeds_BSD, block_pos_BS, allowed_BSX, ctx_kv=None, ctx_BCD=None, rope_ctx=None):
        """The layers over the blocks, with context keys/values either cached (`ctx_kv`, one per layer,
        as eval keeps them) or computed from `ctx_BCD`."""
        rope_block = self.rope(block_embeds_BSD, block_pos_BS)
        x = block_embeds_BSD
        for i, layer in enumerate(self.layers):
            allowed = allowed_BSX[self.layer_types[i]] if isinstance(allowed_BSX, dict) else allowed_BSX
            x = layer(x, ctx_BCD, rope_block, rope_ctx, allowed, None if ctx_kv is None else ctx_kv[i])
        return self.norm(x)

    def context_kv(self, features_BCF: torch.Tensor, ctx_pos_BC: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Every layer's context keys/values for new target features (eval appends them to its cache)."""
        ctx_BCD = self.project_context(features_BCF)
        rope_ctx = self.rope(ctx_BCD, ctx_pos_BC)
        return [layer.self_attn.context_kv(ctx_BCD, rope_ctx) for layer in self.layers]

    def init_from_target(self, target_layers: list[nn.Module]) -> None:
        """Start from the target (a lever for small data, measured in benchmarks/RESULTS.md): the draft layers
        from its last attention layers, and the context wired in as their input — `fc` passes the deepest watched
        layer's hidden state through (the other layers enter at a tenth of their random scale) and `hidden_norm`
        scales it as the first copied layer's input norm does. When that watched layer feeds the first copied
        one (the demo: layer 27 of 30, two draft layers from 28 and 29), the context's keys and values start as
        that target layer's own. A hybrid's linear-attention layers have no q/k/v to copy."""
        pairs = min(len(self.layers), len(target_layers))  # a hybrid may have fewer attention layers than we do
        if pairs == 0:
            return
        for mine, theirs in zip(self.layers[-pairs:], target_layers[-pairs:], strict=True):
            own = mine.state_dict()
            for name, tensor in theirs.state_dict().items():
                if name in own and own[name].shape == tensor.shape:
                    own[name] = tensor.detach().clone()
            mine.load_state_dict(own)
            modules = dict(theirs.named_modules())
            for name, norm in mine.named_modules():  # norms by what they compute, not how they store it
                other = modules.get(name)
                weights = list(other.parameters()) if other is not None else []
                if isinstance(norm, nn.RMSNorm) and len(weights) == 1 and weights[0].shape == norm.weight.shape:
                    norm.weight.data.copy_(norm_scale(other, norm.weight.shape[0]))
        d = self.config.hidden_size
        deepest = self.target_layer_ids.index(max(self.target_layer_ids))
        with torch.no_grad():
            self.fc.weight.mul_(0.1)
            self.fc.weight[:, deepest * d : (deepest + 1) * d] += torch.eye(d)
            self.hidden_norm.weight.copy_(self.layers[-pairs].input_layernorm.weight)


@torch.no_grad()
def norm_scale(norm: nn.Module, size: int) -> torch.Tensor:
    """The per-channel scale an RMS norm applies, whatever its parametrization: Llama/Qwen3 store it (`w`),
    Qwen3.5/Qwen3-Next store `w − 1` (zero-centred). A vector of ones has RMS 1, so the norm returns its scale
    (divided by √(1 + eps), undone here)."""
    weight = next(norm.parameters())
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None) or 0.0)
    ones = torch.ones(1, size, dtype=torch.float32, device=weight.device)
    return (norm(ones.to(weight.dtype)).float()[0] * math.sqrt(1.0 + eps)).cpu()
