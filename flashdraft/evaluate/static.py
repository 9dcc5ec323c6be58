"""Decoding at the GPU's pace: a static KV cache, rollback by position, and CUDA graphs.

A plain cached loop over a target spends most of a token launching kernels from Python (measured on an H200 at
the 0.6B shape: 3,309 launches a token, the GPU idle three quarters of the time). Serving engines replay each
pass as a CUDA graph over fixed-size buffers; this module does the same for eval, the way gpt-fast does:

- the target's KV cache is transformers' `StaticCache`, one buffer of `capacity` positions reused for every
  prompt; a verify pass writes its K positions, and the rejected ones are rolled back by moving the cache's
  position (`crop`), not by copying: whatever lies past it is masked and overwritten by the next pass;
- the drafter's context keys/values live in preallocated buffers too (`ContextBuffer`): a verify pass's features
  are projected for all K positions and written in place, the valid length moves by what was accepted, and the
  drafter's block is written right after the context, so its attention reads one buffer instead of a
  concatenation;
- on CUDA, each fixed-shape pass — the target's one-token pass, its K-token verify pass, the drafter's block pass
  and its context projection — is `torch.compile(mode="reduce-overhead")`: captured once as a CUDA graph and
  replayed. The target-only baseline runs its one-token pass through the same compiled machinery, so the speedup
  compares like with like. On a CPU the same static buffers run eagerly (what the tests check, token for token).

A step waits on the device once, to read the accepted count and the target's tokens (decode.py `verify_drafts`).

What the static path cannot hold falls back to decode.py's growing cache, and the report says why: a hybrid's
linear-attention layers (their recurrent state has no position to roll back to), sliding-window target layers,
and a transformers whose static cache keeps its position on the host (its `cumulative_length` a tensor: 5.17 and
later; tested on 5.25, where the CPU tests run).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashdraft.evaluate.decode import Decoding, Sampler, SpecDecoder, linear_layers, pick_token, verify_drafts
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.target import Target

CAPACITY_STEP = 1024  # buffers grow in whole steps, so a new prompt rarely means new buffers (and new graphs)


def cuda_graphs(fn: Callable) -> Callable:
    """A fixed-shape pass captured as a CUDA graph and replayed (whole: a graph break is an error)."""
    return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)


def static_unsupported(target: Target) -> str | None:
    """Why the static path cannot decode this target; None when it can."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticLayer

    if linear_layers(DynamicCache(config=target.config)):
        return "a hybrid linear-attention target: its recurrent state rolls back only on the growing cache"
    if not isinstance(getattr(StaticLayer(1), "cumulative_length", None), torch.Tensor):
        return "this transformers' static cache keeps its position on the host"
    layers = StaticCache(config=target.config, max_cache_len=8).layers
    if any(type(layer) is not StaticLayer for layer in layers):
        return "sliding-window target layers: a static sliding cache cannot be rolled back by position"
    return None


class ContextBuffer:
    """The drafter's context keys/values for every layer, preallocated: positions [0, length) hold the accepted
    context; a block pass writes its own keys/values at [length, length + K)."""

    def __init__(self, drafter: DFlashDrafter, capacity: int, device, dtype) -> None:
        config = drafter.config
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.kv = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                   for _ in drafter.layers]
        if device.type == "cuda":  # fixed addresses: written in place inside captured graphs
            for k, v in self.kv:
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
        self.capacity, self.device = capacity, device
        self.block_size, self.window = drafter.block_size, drafter.sliding_window
        self.layer_types = drafter.layer_types
        self.keys = torch.arange(capacity, device=device)

    def for_block(self, position: int) -> tuple[list, torch.Tensor | dict]:
        """(each layer's buffers with the block's slots, the attention mask) for a block anchored at `position`:
        every layer sees the context and the whole block; a sliding layer only the last `window` context
        positions and, within the block, itself and what precedes it (objective.block_attention_mask's rule)."""
        k = self.block_size
        slots = torch.arange(position, position + k, device=self.device)
        full = (self.keys < position + k)[None, None, :].expand(1, k, -1)
        masks: torch.Tensor | dict = full
        if self.window is not None:
            query = slots[:, None]
            sliding = ((self.keys < position) & (query - self.keys < self.window)) | (
                (self.keys >= position) & (self.keys <= query))
            masks = {"full_attention": full, "sliding_attention": sliding[None]}
        return [(kb, vb, slots) for kb, vb in self.kv], masks

    def write(self, kv: list, position: int) -> None:
        """Context keys/values (one per layer, T positions) written at [position, position + T)."""
        slots = torch.arange(position, position + kv[0][0].shape[2], device=self.device)
        for (kb, vb), (k, v) in zip(self.kv, kv, strict=True):
            kb.index_copy_(2, slots, k)
            vb.index_copy_(2, slots, v)


class StaticCacheState:
    """decode.TargetCache's interface over the shared static cache: nothing to snapshot, and a verify pass's
    rejected positions are dropped by moving the cache's position back."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def snapshot(self, block_size: int) -> None:
        return None

    def keep(self, block: torch.Tensor, accepted: int, snapshot, advance) -> None:
        if drop := block.shape[1] - accepted:
            move_back(self.cache, drop)


def move_back(cache, positions: int | None = None) -> None:
    """Every layer's position — a tensor on the device (transformers ≥ 5.17), moved in place — back by
    `positions`, or to 0 for a new decoding. What lies past it is masked, and overwritten by the next pass."""
    for layer in cache.layers:
        if positions is None:
            layer.cumulative_length.zero_()
        else:
            layer.cumulative_length.sub_(positions)


class StaticSpecDecoder(SpecDecoder):
    """SpecDecoder over static buffers, its fixed-shape passes compiled into CUDA graphs on CUDA."""

    def __init__(self, target: Target, drafter: DFlashDrafter, stop_ids: set[int],
                 compiler: Callable[[Callable], Callable] | None = None, draft_sampling: str = "greedy") -> None:
        """`compiler`: what each fixed-shape pass is compiled with (`cuda_graphs` on CUDA; None runs them as
        they are; the tests trace them with dynamo's eager backend, which refuses a graph break as CUDA graphs
        would need)."""
        super().__init__(target, drafter, stop_ids, draft_sampling=draft_sampling)
        self.device = self.lm_head.weight.device
        self.dtype = next(drafter.parameters()).dtype
        self.compiled = compiler is not None
        self.capacity = 0
        compiler = compiler or (lambda fn: fn)
        # one compiled callable per fixed shape: each is captured once and replayed
        self.one_token = compiler(self._target_pass)
        self.verify = compiler(self._target_pass)
        self.block_pass = compiler(self._block_hidden)
        self.project = compiler(self.drafter.context_kv)

    def reserve(self, tokens: int) -> None:
        """Buffers for decodings that may reach `tokens` positions (the prompt, the new tokens, one block); the
        ones held are kept when they are large enough (new buffers would mean new graphs)."""
        from transformers import StaticCache

        if tokens <= self.capacity:
            return
        self.capacity = -(-tokens // CAPACITY_STEP) * CAPACITY_STEP
        self.cache = StaticCache(config=self.target.config, max_cache_len=self.capacity)
        self.context = ContextBuffer(self.drafter, self.capacity, self.device, self.dtype)

    def _block_hidden(self, block, positions, ctx_kv, masks):
        return self.drafter.decode(self.embed(block), positions, masks, ctx_kv=ctx_kv)

    def _call(self, fn: Callable, *args):
        """A compiled pass's outputs, copied out of the graph's memory before the next replay reuses it."""
        if not self.compiled:
            return fn(*args)
        torch.compiler.cudagraph_mark_step_begin()
        return _copied(fn(*args))

    def start(self, prompt_ids: list[int], temperature: float, sampler: Sampler) -> Decoding:
        # the prompt's length varies: prefilled eagerly, into the same buffers the graphs read
        self.reserve(len(prompt_ids) + 2 * self.drafter.block_size)  # (generate reserved its new tokens too)
        move_back(self.cache)
        ids = torch.tensor([prompt_ids], device=self.device)
        logits, features = self._target_pass(ids, self.cache)
        self.context.write(self.drafter.context_kv(features, torch.arange(len(prompt_ids), device=self.device)[None]),
                           0)
        anchor = pick_token(logits[0, -1], temperature, sampler)
        return Decoding(StaticCacheState(self.cache), None, anchor, len(prompt_ids), [anchor])

    def step(self, state: Decoding, temperature: float, sampler: Sampler) -> list[int]:
        k, p = self.drafter.block_size, state.position
        block = torch.full((1, k), self.drafter.mask_token_id, device=self.device)
        block[0, 0] = state.anchor
        positions = torch.arange(p, p + k, device=self.device)[None]
        ctx_kv, masks = self.context.for_block(p)
        hidden = self._call(self.block_pass, block, positions, ctx_kv, masks)
        drafts, q = self._draft(hidden[0], state.anchor, temperature, sampler)
        block[0, 1:] = drafts
        target_logits, features = self._call(self.verify, block, self.cache)
        # the context for all K positions, in place: those past the accepted ones lie beyond the new length
        self.context.write(self._call(self.project, features, positions), p)
        emitted = verify_drafts(drafts, q, target_logits[0], temperature, sampler)
        state.cache.keep(block, len(emitted), None, None)
        return state.emit(emitted)

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, generator=None, sampler=None):
        self.reserve(len(prompt_ids) + max_new_tokens + 2 * self.drafter.block_size)
        return super().generate(prompt_ids, max_new_tokens, temperature, generator, sampler)

    @torch.inference_mode()
    def target_only(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy target-only decoding through the same static cache and the same compiled one-token pass."""
        started = time.perf_counter()
        self.reserve(len(prompt_ids) + max_new_tokens + 2 * self.drafter.block_size)
        move_back(self.cache)
        logits, _ = self._target_pass(torch.tensor([prompt_ids], device=self.device), self.cache)
        tokens = [int(logits[0, -1].argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] not in self.stop_ids:
            logits, _ = self._call(self.one_token, torch.tensor([[tokens[-1]]], device=self.device), self.cache)
            tokens.append(int(logits[0, -1].argmax()))
        self.target.discard_features()
        return tokens, time.perf_counter() - started


def _copied(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, list | tuple):
        return type(out)(_copied(x) for x in out)
    return out
