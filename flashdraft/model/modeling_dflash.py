"""The DFlash drafter as a transformers model, shipped inside every exported drafter directory so that

    AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)

gives a model that computes what flashdraft trained. This file is copied next to `config.json` (whose
`auto_map` names it) and must stay self-contained: torch and transformers only — no flashdraft import — and
working under every transformers version flashdraft supports (4.57, which the z-lab reference pins, and 5.x).

Its interface is the z-lab reference's (`forward(position_ids, noise_embedding, target_hidden,
past_key_values)` → hidden states, `compute_logits(hidden, output_head)`), so code written for the published
drafters runs on ours. What it computes is flashdraft's: `tests/model/test_remote_code.py` checks the forward
pass equals `flashdraft.model.drafter.DFlashDrafter` on the same weights.

Attention: queries come from the block (`noise_embedding`); keys/values are the projected target context
followed by the block. A `full_attention` layer sees every key; a `sliding_attention` layer sees keys
within `sliding_window` positions and is causal (the convention the engines share). Key positions are the
indices into [cached context, new context, block], so a cache must hold the context from position 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RotaryEmbedding


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None

    def _mask(self, queries: int, keys: int, device) -> torch.Tensor | None:
        if self.sliding_window is None:
            return None
        q = torch.arange(keys - queries, keys, device=device)[:, None]
        k = torch.arange(keys, device=device)[None, :]
        return (k <= q) & (q - k < self.sliding_window)

    def forward(self, hidden, context, cos, sin, past_key_values=None) -> torch.Tensor:
        b, s, _ = hidden.shape
        both = torch.cat([context, hidden], dim=1)  # keys/values: the context, then the block
        q = self.q_norm(self.q_proj(hidden).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos[..., -s:, :], sin[..., -s:, :]), _rotate(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.heads != self.kv_heads:  # spelled out: SDPA's enable_gqa is newer than some torch builds
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(s, k.shape[2], q.device))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden, context, cos, sin, past_key_values=None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin, past_key_values)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """Draft layers only: the token embedding and (full-vocabulary) LM head are the target's."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = config.dflash_config
        self.block_size = config.block_size
        self.mask_token_id = dflash["mask_token_id"]
        self.target_layer_ids = list(dflash["target_layer_ids"])
        d = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # A reduced draft vocabulary (vLLM's convention): its own LM head of `draft_vocab_size` rows and
        # d2t (target id = draft id + d2t); t2d marks the target ids inside it.
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None)
        if self.draft_vocab_size:
            self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.post_init()

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs) -> torch.Tensor:
        """Hidden states of the block (`noise_embedding`: the target's embeddings of [anchor, mask, …]) given
        the new target features (`target_hidden`: the target layers' hidden states concatenated), with
        `position_ids` covering both, context first. `attention_mask` is not used: which keys each layer sees
        follows from its layer type."""
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, past_key_values if use_cache else None)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """Logits over the target vocabulary: the target's head, or with a reduced draft vocabulary this
        model's own rows, scattered to their target ids (−inf elsewhere)."""
        if not self.draft_vocab_size:
            return output_head(hidden)
        draft = self.lm_head(hidden)
        ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., ids] = draft
        return full
