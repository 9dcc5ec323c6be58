"""Lossless DFlash / DFlash2 speculative decoding of one prompt, and the target-only / prompt-lookup baselines.

One step (`SpecDecoder.step`): the drafter proposes K−1 tokens in one pass from [anchor, MASK…] over its
cached context (DFlash2: then walks the block from the anchor, re-ranking each slot's top-K′ with the token
before it); the target verifies [anchor, drafts] in one pass; the longest matching prefix is accepted plus
the target's own next token (the bonus, the next anchor); the target's KV cache is cropped to what was accepted
and the accepted positions' features are appended to the drafter's context cache.

At temperature > 0 a draft rule (`draft_sampling`) says how the drafts are made, and verification follows from it:
- `greedy` (the default; vLLM's `draft_sample_method: greedy` and llama.cpp, the engines' only or default rule):
  each draft is the drafter's argmax x̂, accepted with the target's probability p(x̂) and, when rejected, replaced by
  a draw from p with x̂ removed. That is rejection sampling against a one-hot q, so it is lossless as well.
- `sample` (vLLM's `probabilistic`): each draft is drawn from the drafter's own distribution q, accepted with
  min(1, p/q) and, when rejected, replaced by a draw from (p − q)+.
The two accept a draft with different probabilities (p(x̂), against Σ min(p, q) = 1 − TV(p, q) on average), so
their τ differ: eval measures with the rule the engine a user serves with will use.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field

import torch

from flashdraft.model.dflash2 import is_dflash2
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import is_dspark
from flashdraft.model.objective import acceptance_length, block_attention_mask
from flashdraft.model.target import Target

DRAFT_RULES = ("greedy", "sample")  # how drafts are made at temperature > 0: the argmax, or a draw from q


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verify step (0..K−1)
    seconds: float = 0.0
    proposed: list[int] = field(default_factory=list)  # DSpark: drafts sent for verification at each step
    confidence: list[list[float]] = field(default_factory=list)  # DSpark: the head's σ(c_k) of every slot, a step

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.accepted)


class TargetCache:
    """The target's cache, kept at exactly the accepted prefix after every verify pass.

    Attention layers' KV caches are cropped. A hybrid's linear-attention layers (Gated DeltaNet: a recurrent
    state and a short convolution state, Qwen3.5/3.6) cannot be cropped by slicing: their state after the rejected
    drafts has no inverse. Two ways back, by what the installed transformers offers:
    - transformers ≥ 5.25 records them itself (`activate_past_recording(recurrent_states_to_keep=K)`): during a
      verify pass of K tokens each layer keeps its recurrent state after every one of them (the last K tokens go
      through the token-by-token kernel instead of the chunked one) and its whole convolution input, and `crop`
      picks the state after the accepted prefix. No extra target pass. Recording starts after the prefill, as
      transformers' own assisted generation does.
    - Before 5.25 the states are snapshotted before each verify pass (a few small fixed-size tensors) and, after a
      partial acceptance, restored and re-advanced over the accepted tokens with one more target pass.
    Both are exact with transformers' own kernels (tests/evaluate/test_targets.py runs the hybrids on each). The
    snapshot way does not restore the token count that 5.25 added to each linear-attention layer (the model reads
    its positions from it), so it serves only releases without that count: asserted, not assumed.
    """

    def __init__(self, config) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=config)
        self.linear = linear_layers(self.cache)
        self.records_states = bool(self.linear) and _records_recurrent_states(self.linear[0])
        assert self.records_states or not any(hasattr(layer, "cumulative_length_linear") for layer in self.linear)

    def snapshot(self, block_size: int) -> list | None:
        """Called before a verify pass of `block_size` tokens: what `keep` needs to roll it back."""
        if not self.linear:
            return None
        if self.records_states:
            if not self.linear[0].record_past:  # from the first verify pass on, not during the prefill
                self.cache.activate_past_recording(recurrent_states_to_keep=block_size)
            return None
        return [(layer, {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                 {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None}) for layer in self.linear]

    def keep(self, block: torch.Tensor, accepted: int, snapshot: list | None, advance) -> None:
        """After verifying `block` (1 × K tokens), keep its first `accepted` tokens."""
        drop = block.shape[1] - accepted
        if self.records_states:  # crop(0) too: it trims the recorded history back to what the next pass needs
            self.cache.crop(-drop)
            return
        if drop == 0:
            return
        if snapshot is None:  # attention only: a negative crop removes that many trailing tokens
            self.cache.crop(-drop)
            return
        for layer in self.cache.layers:
            if layer not in self.linear:
                layer.crop(-block.shape[1])  # back to before the block; re-advanced below
        for layer, conv, recurrent in snapshot:
            for i, t in conv.items():
                layer.conv_states[i] = t
            for i, t in recurrent.items():
                layer.recurrent_states[i] = t
        advance(block[:, :accepted], self.cache)


def _records_recurrent_states(layer) -> bool:
    """Whether this transformers' linear-attention cache can keep per-token recurrent states (≥ 5.25)."""
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters


def linear_layers(cache) -> list:
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # transformers 4.x: no hybrid targets
        return []
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


class Sampler:
    """Decoding's randomness, as its two kinds of draw: a token from a distribution, and an acceptance with a given
    probability. Kept behind one object so that a test can replace it with one that walks every outcome of a step
    with its exact probability (tests/evaluate/test_sampling.py), instead of sampling and hoping."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def token(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.float(), 1, generator=self.generator))

    def accept(self, probability: float) -> bool:
        device = self.generator.device if self.generator is not None else "cpu"
        return float(torch.rand((), generator=self.generator, device=device)) < probability


@dataclass
class Decoding:
    """One prompt's decoding state between steps: the target's cache and the drafter's context keys/values hold
    exactly the accepted tokens; `anchor` (the last one emitted) sits at `position`."""

    cache: TargetCache
    ctx_kv: list
    anchor: int
    position: int
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    confidence: list[list[float]] = field(default_factory=list)

    def emit(self, emitted: list[int]) -> list[int]:
        """A step's accepted drafts and the target's own next token, the new anchor."""
        self.tokens.extend(emitted)
        self.accepted.append(len(emitted) - 1)
        self.position, self.anchor = self.position + len(emitted), emitted[-1]
        return emitted


class SpecDecoder:
    """Speculative decoding of one prompt at a time with a DFlash, DFlash2 or DSpark drafter over the frozen target.

    DSpark: the block [anchor, MASK × (K − 1)] drafts K tokens (every slot predicts the token after its position),
    walked left to right through the Markov head. With `confidence_threshold` the block sent for verification stops
    where the confidence head says to: `first`, at the first slot whose σ(c_k) is below the threshold (DeepSpec's
    evaluator, llama.cpp's `--spec-draft-p-min`), or `product`, where the running product Π σ(c_j) falls below it
    (vLLM, SGLang)."""

    def __init__(self, target: Target, drafter: DFlashDrafter, stop_ids: set[int],
                 confidence_threshold: float | None = None, confidence_rule: str = "first",
                 draft_sampling: str = "greedy") -> None:
        assert draft_sampling in DRAFT_RULES, draft_sampling
        self.target, self.drafter, self.stop_ids = target, drafter.eval(), stop_ids
        self.confidence_threshold, self.confidence_rule = confidence_threshold, confidence_rule
        self.draft_sampling = draft_sampling
        target.watch(drafter.target_layer_ids)
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.lm_head
        self.draft_head = target.head_weight(drafter)  # the LM head rows the drafter scores with, selected once
        # transformers ≥ 5.2x names the cache argument `cache`; earlier releases `past_key_values`.
        params = inspect.signature(target.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _target_pass(self, ids_BT: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and watched-layer features of new tokens, extending the target's KV cache."""
        out, features = self.target.forward(ids_BT, **{self.cache_kwarg: cache}, use_cache=True)
        return self.lm_head(out.last_hidden_state), features

    def _masks(self, anchor_position: int, device):
        """None (every layer sees the whole context and its block) unless the drafter has sliding-window layers."""
        window = self.drafter.sliding_window
        if window is None:
            return None
        anchors = torch.tensor([anchor_position])
        swa = block_attention_mask(anchors, self.drafter.block_size, anchor_position, window=window)[None]
        return {"full_attention": None, "sliding_attention": swa.to(device)}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, generator=None,
                 sampler: Sampler | None = None) -> Decoded:
        started, sampler = time.perf_counter(), sampler or Sampler(generator)
        state = self.start(prompt_ids, temperature, sampler)
        while len(state.tokens) < max_new_tokens and state.anchor not in self.stop_ids:
            if self.stop_ids & set(self.step(state, temperature, sampler)):
                break
        tokens = until_stop(state.tokens, self.stop_ids)[:max_new_tokens]
        return Decoded(tokens, state.accepted, time.perf_counter() - started, state.proposed, state.confidence)

    def start(self, prompt_ids: list[int], temperature: float, sampler: Sampler) -> Decoding:
        """The prompt through the target (its cache and the drafter's context filled) and the first token."""
        device = self.lm_head.weight.device
        state = TargetCache(self.target.config)
        logits, features = self._target_pass(torch.tensor([prompt_ids], device=device), state.cache)
        ctx_kv = self.drafter.context_kv(features, torch.arange(len(prompt_ids), device=device)[None])
        anchor = pick_token(logits[0, -1], temperature, sampler)
        return Decoding(state, ctx_kv, anchor, len(prompt_ids), [anchor])

    def step(self, state: Decoding, temperature: float, sampler: Sampler) -> list[int]:
        """One draft-and-verify step: the tokens it emits (the accepted drafts, then the target's own next one)."""
        k, device = self.drafter.block_size, self.lm_head.weight.device
        block = torch.full((1, k), self.drafter.mask_token_id, device=device)
        block[0, 0] = state.anchor
        positions = torch.arange(state.position, state.position + k, device=device)[None]
        hidden = self.drafter.decode(self.embed(block), positions, self._masks(state.position, device),
                                     ctx_kv=state.ctx_kv)
        if is_dspark(self.drafter):
            drafts, q = self._draft_dspark(hidden[0], state, temperature, sampler)
        else:
            drafts, q = self._draft(hidden[0], state.anchor, temperature, sampler)
        block = torch.cat([block[:, :1], drafts[None].to(block.dtype)], dim=1)  # [anchor, drafts]: verified
        snapshot = state.cache.snapshot(block.shape[1])
        target_logits, features = self._target_pass(block, state.cache.cache)
        emitted = verify_drafts(drafts, q, target_logits[0], temperature, sampler)
        n = len(emitted) - 1
        state.cache.keep(block, n + 1, snapshot, self._target_pass)  # the anchor and the accepted drafts
        accepted_positions = torch.arange(state.position, state.position + n + 1, device=device)[None]
        new_kv = self.drafter.context_kv(features[:, : n + 1], accepted_positions)
        state.ctx_kv = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2))
                        for (k0, v0), (k1, v1) in zip(state.ctx_kv, new_kv, strict=True)]
        return state.emit(emitted)

    def sampled(self, temperature: float) -> bool:
        """Whether drafts are drawn from the drafter's distribution (the `sample` rule at T > 0); otherwise each is
        its argmax, and verification treats q as one-hot on it (None)."""
        return temperature > 0 and self.draft_sampling == "sample"

    def _draft(self, hidden_KD, anchor: int, temperature: float, sampler: Sampler):
        """The K−1 drafts of a block, and under the `sample` rule the distribution q each was drawn from (for
        verification; None for argmax drafts).
        DFlash: each slot from its own logits. DFlash2: a walk from the anchor through the selector's re-ranked
        top-K′ — q is softmax(score / T) over those K′ candidates and 0 elsewhere, still an exact distribution,
        so rejection sampling against it stays lossless (tests/evaluate/test_sampling.py enumerates it)."""
        logits = self.drafter.unary_logits(hidden_KD[1:].to(self.draft_head.dtype) @ self.draft_head.T)
        logits = self.drafter.to_target_vocab(logits, self.target.config.vocab_size)  # each slot its own position
        if not is_dflash2(self.drafter):
            if not self.sampled(temperature):
                return logits.argmax(-1), None
            q = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.tensor([sampler.token(row) for row in q], device=logits.device), q
        if not self.sampled(temperature):
            drafts, _, _ = self.drafter.walk(logits, hidden_KD[1:], anchor, lambda score: score.argmax())
            return drafts, None
        drafts, candidates, scores = self.drafter.walk(
            logits, hidden_KD[1:], anchor, lambda score: sampler.token(torch.softmax(score.float() / temperature, -1)))
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        q.scatter_(1, candidates, torch.softmax(scores.float() / temperature, dim=-1))
        return drafts, q


    def _draft_dspark(self, hidden_KD, state: Decoding, temperature: float, sampler: Sampler):
        """DSpark's K drafts, walked through the Markov head from the anchor (at T > 0 each drawn from its
        Markov-corrected distribution, which is then the q it is verified against: the walk is a chain of exact
        conditional draws, so rejection sampling stays lossless), cut where the confidence rule says."""
        base = hidden_KD.to(self.draft_head.dtype) @ self.draft_head.T

        def pick(logits):
            if not self.sampled(temperature):
                return logits.argmax(-1)
            return sampler.token(torch.softmax(logits.float() / temperature, dim=-1))

        drafts, rows, confidence = self.drafter.walk(base, hidden_KD, state.anchor, pick)
        length = len(drafts)
        if confidence is not None:
            values = confidence.float().tolist()
            state.confidence.append(values)
            if self.confidence_threshold is not None:
                length = proposal_length(values, self.confidence_threshold, self.confidence_rule)
        state.proposed.append(length)
        drafts, rows = drafts[:length], rows[:length]
        if not self.sampled(temperature):
            return drafts, None
        rows = self.drafter.to_target_vocab(rows, self.target.config.vocab_size)
        return drafts, torch.softmax(rows.float() / temperature, dim=-1)


def proposal_length(confidence: list[float], threshold: float, rule: str) -> int:
    """How many of a block's drafts go to verification: `first`, up to the first slot whose confidence is below
    the threshold; `product`, up to where the running product of the confidences falls below it."""
    running = 1.0
    for slot, c in enumerate(confidence):
        running = running * c if rule == "product" else c
        if running < threshold:
            return slot
    return len(confidence)


def until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """Tokens up to and including the first stop token, where decoding stops."""
    at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return tokens if at is None else tokens[: at + 1]


def pick_token(logits: torch.Tensor, temperature: float, sampler: Sampler) -> int:
    if temperature <= 0:
        return int(logits.argmax(-1))
    return sampler.token(torch.softmax(logits.float() / temperature, dim=-1))


def verify_drafts(drafts, q, target_logits, temperature: float, sampler: Sampler) -> list[int]:
    """The tokens a step emits: the accepted drafts, then the bonus token. target_logits[j] is the target's
    distribution for block position j+1; q[j] the distribution draft j was drawn from (T > 0, the `sample` rule),
    or None for argmax drafts (the `greedy` rule: q one-hot on the draft). Greedy decoding (T 0), the host
    waits on the device once: the accepted count and the target's own tokens come back in one read (the accepted
    drafts are the target's own tokens up to the first mismatch)."""
    if temperature <= 0:
        predicted = target_logits.argmax(-1)
        n = (drafts == predicted[:-1]).int().cumprod(0).sum()
        read = torch.cat([n[None], predicted]).tolist()
        return read[1 : read[0] + 2]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    for j, token in enumerate(drafts.tolist()):
        if sampler.accept(min(1.0, float(p[j, token] / (q[j, token] if q is not None else 1.0)))):
            continue
        # rejected: resample from where the target wants more than q gave (one-hot q: p without the draft)
        if q is not None:
            residual = (p[j] - q[j]).clamp(min=0)
        else:
            residual = p[j].clone()
            residual[token] = 0
        return drafts[:j].tolist() + [sampler.token(residual / residual.sum() if residual.sum() > 0 else p[j])]
    return drafts.tolist() + [sampler.token(p[-1])]


# ------------------------------------------------------------------------------------- the lossless check


@torch.inference_mode()
def divergence(target: Target, prompt_ids: list[int], reference: list[int], tokens: list[int],
               tie_ulps: int) -> dict | None:
    """Where greedy speculative output first differs from target-only output, and whether the target itself could
    have chosen either token there; None when the two are the same token for token.

    A verify pass scores several tokens at once and a one-token pass one; outside float32 the two round
    differently, and where the target's two best tokens are a unit in the last place apart either may win
    (measured in bfloat16 on the demo: 21 of 40 prompts diverge, every time 0 or 1 unit apart). So a fresh target
    pass over the shared prefix decides: the divergence is a near-tie when both tokens' logits are within
    `tie_ulps` units in the last place (of the logits' type, at the top logit's magnitude) of the top logit.
    A decoding bug scores tokens against a wrong context (measured with the verify pass's rejected drafts left in
    the cache, bfloat16: all 40 prompts differ, 35 by 6 units or more), so the eval, which needs every prompt to
    pass, fails it."""
    at = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if at is None:
        # the same tokens but one output longer: a truncation bug, not rounding
        return None if len(reference) == len(tokens) else {"at": min(len(reference), len(tokens)), "near_tie": False}
    prefix = torch.tensor([prompt_ids + reference[:at]], device=target.lm_head.weight.device)
    output, _ = target.forward(prefix)
    logits = target.lm_head(output.last_hidden_state[0, -1])
    top = float(logits.max())
    _, exponent = math.frexp(abs(top) or 1.0)  # |top| = m · 2^exponent, m in [0.5, 1)
    ulp = torch.finfo(logits.dtype).eps * 2.0 ** (exponent - 1)
    behind = [round((top - float(logits[token])) / ulp, 2) for token in (reference[at], tokens[at])]
    return {"at": at, "target_token": reference[at], "spec_token": tokens[at], "ulps_behind_top": behind,
            "near_tie": max(behind) <= tie_ulps}


# ---------------------------------------------------------------------------------------------- baselines


def counted_forwards(target: Target):
    """Count the target's forward passes (for prompt lookup's τ)."""
    calls = [0]
    handle = target.decoder.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


@torch.inference_mode()
def target_only(target: Target, prompt_ids: list[int], max_new_tokens: int, lookup: int = 0) -> tuple[list, float, int]:
    """Greedy target-only (or prompt-lookup) decoding: (new tokens, seconds, target forwards)."""
    device = target.lm_head.weight.device
    calls, handle = counted_forwards(target)
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    started = time.perf_counter()
    out = target.model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    seconds = time.perf_counter() - started
    handle.remove()
    target.discard_features()
    return out[0, len(prompt_ids) :].tolist(), seconds, calls[0]
