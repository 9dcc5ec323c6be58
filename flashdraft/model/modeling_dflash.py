"""The DFlash drafter as a transformers model, shipped inside every exported drafter directory so that

    AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)

gives a model that computes what flashdraft trained. This file is copied next to `config.json` (whose
`auto_map` names it) and must stay self-contained: torch and transformers only — no flashdraft import — and
working under every transformers version flashdraft supports (4.57, which the z-lab reference pins, and 5.x).

Its interface is the z-lab reference's (`forward(position_ids, noise_embedding, target_hidden,
past_key_values)` → hidden states, `compute_logits(hidden, output_head)`, and `spec_generate(input_ids, target,
max_new_tokens, stop_token_ids, temperature)`, z-lab's README call), so code written for the published drafters
runs on ours. What it computes is flashdraft's: `tests/model/test_remote_code.py` checks the forward
pass equals `flashdraft.model.drafter.DFlashDrafter` on the same weights.

DFlash2 (`DFlash2DraftModel`, z-lab / Inco AI, 2026) is the same model plus, in every layer, a grouped dynamic
causal convolution around the attention and the MLP (`BlockConv`), and a candidate selector that re-ranks the
LM head's top-K for each block slot with the token drafted before it (`CandidateSelector`, `propose`, called as
z-lab's decoding loop calls it: the rows after the anchor, the anchor ids, the output head, the temperature).

Attention: queries come from the block (`noise_embedding`); keys/values are the projected target context
followed by the block. A `full_attention` layer sees every key; a `sliding_attention` layer sees keys
within `sliding_window` positions and is causal (the convention the engines share). Key positions are the
indices into [cached context, new context, block], so a cache must hold the context from position 0.
"""

from __future__ import annotations

import inspect

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


class BlockConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the positions of each block (never the target context):
    out[i, c] = Σ_t (base[t, c] + δ[i, t, g(c)]) · x[i − t, c], for taps t < kernel_size, where δ is predicted
    from the sublayer's input by `kernel_projection` (one projection gives both the input-side kernel, side 0,
    and the output-side one, side 1) and is shared by `group_size` channels. A tap that would reach before the
    block's first position reads zero, so blocks never mix. Identity at initialisation: base tap 0 is 1, the
    other taps and the projection 0."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, x, delta, side: int) -> torch.Tensor:
        """x: (B, S, D) with S whole blocks; delta: (B, S, taps, groups)."""
        b, s, d = x.shape
        k = self.block_size
        blocks = x.reshape(b, s // k, k, self.groups, self.group_size)
        delta = delta.reshape(b, s // k, k, self.kernel_size, self.groups, 1)
        out = torch.zeros((), dtype=x.dtype, device=x.device)
        for tap in range(self.kernel_size):
            # x[i − tap] within the block: shifted down by `tap` positions, zeros in front
            shifted = blocks if tap == 0 else F.pad(blocks[:, :, : k - tap], (0, 0, 0, 0, tap, 0))
            base = self.base_kernel[side, tap].view(self.groups, self.group_size)
            out = out + shifted * (base + delta[:, :, :, tap])
        return out.reshape(b, s, d)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the output-side kernel predicted from that same input."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, delta, 1)


class CandidateSelector(nn.Module):
    """DFlash2's re-ranking of the LM head's top-K at each block slot: score(c) = unary[c] + ⟨E_p[previous] ⊙ P·h,
    E_s[c]⟩ with rank-r codebooks (bare parameters, no `.weight`). The successor codebook starts at zero, so a
    fresh selector keeps the LM head's order."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)
        self.successor_codebook.zero_()

    def transition(self, hidden, previous_ids, candidate_ids) -> torch.Tensor:
        """hidden (…, D), previous_ids (…), candidate_ids (…, K) → the pairwise term of each candidate (…, K)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        context = self.predecessor_codebook[previous_ids] * projected
        return (context.unsqueeze(-2) * self.successor_codebook[candidate_ids]).sum(-1)

    def scores(self, unary, hidden, previous_ids, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the unary top-K ids, their scores) at each slot: unary logits (…, V) and hidden (…, D)."""
        candidates = unary.topk(top_k, dim=-1).indices
        return candidates, self.scores_of(candidates, unary.gather(-1, candidates), hidden, previous_ids)

    def scores_of(self, candidates, unary_at_candidates, hidden, previous_ids) -> torch.Tensor:
        """The scores of given candidates (…, K) from their unary logits (…, K): what training computes, whose
        unary logits are never whole (flashdraft's loss reduces them a chunk of rows at a time)."""
        pairwise = self.transition(hidden, previous_ids, candidates)
        # in float32 whatever the logits' type: K′ scores a slot are cheap, and bfloat16 would tie them
        return unary_at_candidates.float() + pairwise.float()


class MarkovHead(nn.Module):
    """DSpark's sequential head: a low-rank logit bias from the token before each slot, added to the block's base
    logits left to right after the one parallel pass. `markov_w1` embeds the previous token (target vocabulary,
    V × r), `markov_w2` projects it to the draft vocabulary (r → V′). `gated` scales the embedding by a gate
    from [hidden ; embedding]; `rnn` carries a recurrent state over the block's slots (DeepSpec's three types;
    the engines serve `vanilla`)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":  # [state ; embedding ; hidden] → [gate ; candidate ; output]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def embed(self, previous_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(previous_ids.long())

    def step(self, hidden: torch.Tensor, previous_ids: torch.Tensor, state: torch.Tensor | None = None):
        """One slot: hidden (…, D), the token before it (…) and the recurrent state (`rnn`; zeros at the block's
        first slot) → (the bias (…, V′), the next state)."""
        code, state = self.code(hidden, previous_ids, state)
        return self.markov_w2(code), state

    def code(self, hidden: torch.Tensor, previous_ids: torch.Tensor, state: torch.Tensor | None = None):
        """One slot's rank-r code, the bias before its projection `markov_w2` to the vocabulary, and the next state."""
        embedding = self.embed(previous_ids).to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return embedding, state
        hidden = hidden.to(embedding.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding], dim=-1)))
            return gate * embedding, state
        if state is None:
            state = torch.zeros_like(embedding)
        gate, candidate, output = self.joint_proj(torch.cat([state, embedding, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(output), state

    def block_codes(self, hidden: torch.Tensor, previous_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced, as training runs it: hidden (N, K, D), the token before each slot (N, K) → the codes
        (N, K, r), whose projection `markov_w2` is the bias (training projects them a chunk of rows at a time)."""
        if self.head_type != "rnn":
            return self.code(hidden, previous_ids)[0]
        state, codes = None, []
        for slot in range(hidden.shape[1]):
            code, state = self.code(hidden[:, slot], previous_ids[:, slot], state)
            codes.append(code)
        return torch.stack(codes, dim=1)

    def block_bias(self, hidden: torch.Tensor, previous_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: (N, K, D) hidden and (N, K) previous tokens → the bias (N, K, V′)."""
        return self.markov_w2(self.block_codes(hidden, previous_ids))


class ConfidenceHead(nn.Module):
    """DSpark's estimate that a slot's draft is accepted: σ(w · [hidden ; markov_w1[previous]] + b), or from the
    hidden state alone without `with_markov`. Returns the logit; the probability is its sigmoid."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)


def logit_transform(logits: torch.Tensor, multiplier: float, softcap: float) -> torch.Tensor:
    """The target's own scaling of its LM head output (DFlash2's `output_multiplier`, `final_logit_softcapping`)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


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


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with a `BlockConv` around its attention and around its MLP (inside the residual)."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        c = config.dflash_config
        shape = (config.hidden_size, c["conv_kernel_size"], c["conv_group_size"], _block_size(config))
        self.attention_conv, self.mlp_conv = BlockConv(*shape), BlockConv(*shape)

    def forward(self, hidden, context, cos, sin, past_key_values=None) -> torch.Tensor:
        x, kernel = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn(x, context, cos, sin, past_key_values), kernel)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(x), kernel)


def _crop(cache, keep: int) -> None:
    """Cut a DynamicCache to its first `keep` positions: a negative crop (the tokens to remove) means the same in
    transformers 4.57 and 5.x, where a positive one is a length in 4.57 and refused in 5.25."""
    if (drop := cache.get_seq_length() - keep) > 0:
        cache.crop(-drop)


def _pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Token ids from logits (B × S × V): the argmax, or a sample of softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def _block_size(config) -> int:
    return (getattr(config, "dflash_config", None) or {}).get("block_size") or config.block_size


def _drafting(config) -> dict:
    """The mask token and the watched target layers: in `dflash_config` (DFlash, DFlash2) or at the top level
    (DSpark's native config, as DeepSpec writes it)."""
    return getattr(config, "dflash_config", None) or {"mask_token_id": config.mask_token_id,
                                                       "target_layer_ids": config.target_layer_ids}


class DFlashDraftModel(Qwen3PreTrainedModel):
    """Draft layers only: the token embedding and (full-vocabulary) LM head are the target's."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    layer_class = DFlashDecoderLayer

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = _drafting(config)
        self.block_size = _block_size(config)
        self.mask_token_id = dflash["mask_token_id"]
        self.target_layer_ids = list(dflash["target_layer_ids"])
        d = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
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

    def draft_block(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module,
                    temperature: float) -> torch.Tensor:
        """The drafts of one block (B × (K − 1)): the rows after the anchor's, argmax or sampled."""
        return _pick(self.compute_logits(hidden[:, 1:], output_head), temperature)

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      return_stats: bool = False):
        """Speculative decoding with `target` (a transformers causal LM holding its KV cache in a DynamicCache:
        Llama, Qwen3, Qwen3-MoE), called as z-lab's reference model is: the prompt's ids (1 × T) → the prompt
        and the generated ids (1 × (T + n)), stopped after the first of `stop_token_ids` or `max_new_tokens`.
        Each step drafts a block from the anchor and the target's features, and the target verifies it in one
        pass: greedy (temperature 0) gives target-only greedy output exactly; above it, the target's own samples
        (a draft counts while it equals the target's sample). `return_stats`: also the tokens each step added."""
        from transformers import DynamicCache

        self.eval()
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        layers = [i + 1 for i in self.target_layer_ids]  # hidden_states[0] is the embedding output

        def features(output) -> torch.Tensor:
            return torch.cat([output.hidden_states[i] for i in layers], dim=-1)

        prompt, device = input_ids.shape[1], input_ids.device
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        # transformers 5.25 renamed the cache argument (`past_key_values` is deprecated there); 4.57 knows the old
        renamed = "cache" in inspect.signature(target.forward).parameters
        cached = {"cache" if renamed else "past_key_values": target_cache}
        output = target(input_ids, **cached, use_cache=True, output_hidden_states=True)
        tokens = torch.cat([input_ids, _pick(output.logits[:, -1:], temperature)], dim=1)
        context, steps = features(output), []
        stops = set(stop_token_ids or [])
        while tokens.shape[1] - prompt < max_new_tokens and not stops & set(tokens[0, prompt:].tolist()):
            start = tokens.shape[1] - 1  # the anchor: the newest token, which the target has not seen yet
            block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
            block[:, 0] = tokens[:, -1]
            positions = torch.arange(draft_cache.get_seq_length(), start + self.block_size, device=device)
            hidden = self(position_ids=positions[None], noise_embedding=embed(block), target_hidden=context,
                          past_key_values=draft_cache, use_cache=True)
            _crop(draft_cache, start)  # keep the context only: the block is drafted afresh next step
            verify = torch.cat([block[:, :1], self.draft_block(hidden, block[:, 0], head, temperature)], dim=1)
            output = target(verify, position_ids=torch.arange(start, start + verify.shape[1], device=device)[None],
                            **cached, use_cache=True, output_hidden_states=True)
            posterior = _pick(output.logits, temperature)
            matches = (verify[:, 1:] == posterior[:, :-1]).long().cumprod(dim=1)
            accepted = int(matches.sum())
            tokens = torch.cat([tokens, verify[:, 1 : accepted + 1], posterior[:, accepted : accepted + 1]], dim=1)
            _crop(target_cache, start + accepted + 1)
            context = features(output)[:, : accepted + 1]
            steps.append(accepted + 1)
        new = tokens[0, prompt : prompt + max_new_tokens].tolist()
        ends = [i for i, t in enumerate(new) if t in stops]
        tokens = tokens[:, : prompt + (ends[0] + 1 if ends else len(new))]
        return (tokens, steps) if return_stats else tokens


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: `forward` gives the hidden state of every block slot, as for DFlash; `compute_logits` scales the
    target head's logits as the target does; `propose` walks the block from the anchor, re-ranking each slot's
    top-K with the token chosen before it (greedy, or sampled at a temperature)."""

    _no_split_modules = ["DFlash2DecoderLayer"]
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        c = config.dflash_config
        self.top_k = c["selector_top_k"]
        self.output_multiplier = float(c.get("output_multiplier", 1.0))
        self.final_logit_softcapping = float(c.get("final_logit_softcapping") or 0.0)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, c["selector_rank"])
        self.post_init()  # again, now that the selector exists

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        return logit_transform(output_head(hidden), self.output_multiplier, self.final_logit_softcapping)

    def draft_block(self, hidden, anchor_ids, output_head, temperature):
        return self.propose(hidden[:, 1:], anchor_ids, output_head, temperature)[0]

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module,
                temperature: float = 0.0):
        """z-lab's calling convention, as its decoding loop calls it: hidden (B, P, D) = the block's rows *after*
        the anchor's (P = K − 1), anchor_ids (B), the target's output head, the sampling temperature →
        (proposals B × P, the top-K candidates of each slot B × P × top_k, and at temperature > 0 the selector's
        distribution over them B × P × top_k for lossless rejection sampling, else None). Each slot re-ranks the
        LM head's top-K with the token chosen at the slot before (the anchor for the first): the greedy walk at
        temperature 0, a sample from softmax(scores / T) above."""
        logits = self.compute_logits(hidden, output_head)
        previous, path, candidates, distributions = anchor_ids, [], [], []
        for slot in range(hidden.shape[1]):
            ids, scores = self.candidate_selector.scores(logits[:, slot], hidden[:, slot], previous, self.top_k)
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                choice = torch.multinomial(q, 1).squeeze(-1)
                distributions.append(q)
            else:
                choice = scores.argmax(-1)
            previous = ids.gather(-1, choice[:, None]).squeeze(-1)
            path.append(previous)
            candidates.append(ids)
        q = torch.stack(distributions, dim=1) if distributions else None
        return torch.stack(path, dim=1), torch.stack(candidates, dim=1), q


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark (deepseek-ai/DeepSpec, 2026): the DFlash backbone over an anchor-first block — [anchor, mask × (K − 1)]
    at positions p … p + K − 1, where every slot predicts the token after its own position, the anchor's
    included — plus the Markov head (a low-rank bias from the token before each slot, applied left to right) and
    the confidence head (the estimated chance each slot's draft is accepted). `forward` gives the K hidden
    states; `propose` drafts the block from them as the engines do."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        rank = int(getattr(config, "markov_rank", 0) or 0)
        vocab = self.draft_vocab_size or config.vocab_size
        self.markov_head = (MarkovHead(config.vocab_size, vocab, rank, config.hidden_size,
                                       getattr(config, "markov_head_type", "vanilla")) if rank else None)
        self.with_markov = bool(getattr(config, "confidence_head_with_markov", False)) and rank > 0
        self.confidence_head = (ConfidenceHead(config.hidden_size + (rank if self.with_markov else 0))
                                if getattr(config, "enable_confidence_head", False) else None)
        self.post_init()  # again, now that the heads exist

    def base_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """The backbone's logits in the draft vocabulary (the target's head, or this model's own rows)."""
        return self.lm_head(hidden) if self.draft_vocab_size else output_head(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.draft_vocab_size else draft_ids

    def draft_block(self, hidden, anchor_ids, output_head, temperature):
        """K drafts: every slot, the anchor's included, predicts the token after its own position."""
        return self.propose(hidden, anchor_ids, output_head, temperature)[0]

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module,
                temperature: float = 0.0):
        """hidden (B, K, D) = every slot's row, anchor_ids (B), the target's output head, the temperature →
        (drafts B × K as target ids, the Markov-corrected logits B × K × V′ each draft was picked from, and the
        confidence σ(c_k) B × K or None). Slot k's bias comes from the token before it: the anchor for the first,
        then the draft just picked (argmax at temperature 0, else a sample of softmax(logits / T))."""
        base = self.base_logits(hidden, output_head)
        previous, state, drafts, corrected, confidence = anchor_ids, None, [], [], []
        for slot in range(hidden.shape[1]):
            logits = base[:, slot]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(hidden[:, slot], previous, state)
                logits = logits + bias.to(logits.dtype)
            if self.confidence_head is not None:
                features = hidden[:, slot]
                if self.with_markov:
                    features = torch.cat([features, self.markov_head.embed(previous).to(features.dtype)], dim=-1)
                confidence.append(torch.sigmoid(self.confidence_head(features).float()))
            if temperature > 0:
                picked = torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1).squeeze(-1)
            else:
                picked = logits.argmax(-1)
            previous = self.to_target_ids(picked)
            drafts.append(previous)
            corrected.append(logits)
        return (torch.stack(drafts, dim=1), torch.stack(corrected, dim=1),
                torch.stack(confidence, dim=1) if confidence else None)
