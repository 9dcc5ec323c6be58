"""DSpark: the DFlash backbone over an anchor-first block, plus a Markov head and a confidence head
(deepseek-ai/DeepSpec, 2026; served by vLLM `method: dspark`, SGLang and llama.cpp `--spec-type draft-dspark`).

    config = dspark_config(draft_config(target.config, num_layers=5, block_size=7, mask_token_id=…),
                           markov_rank=256, markov_head="vanilla", confidence_head=True, num_anchors=512)
    drafter = DSparkDrafter(config)                  # or DSparkDrafter.warm_start(dflash_drafter, …)
    hidden_BSD = drafter(block_embeds_BSD, features_BCF, block_pos_BS, ctx_pos_BC, allowed_BSX)   # as DFlash
    drafts, logits, confidence = drafter.walk(hidden_KD @ target_lm_head.T, hidden_KD, anchor, pick)

How it differs from DFlash:
- The block [anchor, MASK × (K − 1)] sits at positions p … p + K − 1 and **every** slot predicts the token after
  its own position (slot k → token p + k + 1), the anchor's included: one step drafts K tokens, not K − 1.
- Slot k's logits are the LM head's plus the Markov head's bias from the token before it (the anchor for slot 0,
  then each draft as it is picked, left to right after the one parallel pass); training teacher-forces those
  tokens with the labels.
- The confidence head estimates each slot's acceptance; decoding may stop a block at it (evaluate/decode.py).

The config is DeepSpec's native one (what the published checkpoints and the engines read): the draft fields at the
top level (`target_layer_ids`, `mask_token_id`, `num_anchors`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`), not in `dflash_config`. Inside flashdraft the DFlash
fields stay in `dflash_config` too, which the backbone reads; `export.py` writes the native form.

Shape legend as in drafter.py; V′ the draft vocabulary (the target's unless reduced).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from flashdraft.errors import BadInput
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.modeling_dflash import ConfidenceHead, MarkovHead

ARCHITECTURE = "Qwen3DSparkModel"
HEAD_TYPES = ("vanilla", "gated", "rnn")
ENGINE_HEAD_TYPES = ("vanilla",)  # what vLLM and llama.cpp serve (their loaders read markov_w1/w2 only)
NATIVE_FIELDS = ("target_layer_ids", "mask_token_id", "num_anchors", "markov_rank", "markov_head_type",
                 "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor")


def dspark_config(config, *, markov_rank: int, markov_head: str, confidence_head: bool, num_anchors: int,
                  confidence_with_markov: bool = True):
    """A DFlash draft config (`draft_config`) made DSpark's, in DeepSpec's native contract: `Qwen3DSparkModel`, the
    draft fields at the top level, `sample_from_anchor: true` stated (the layout every slot predicts in; an
    engine defaulting the other way would read the anchor as a bonus token)."""
    config = copy.deepcopy(config)
    if markov_head not in HEAD_TYPES:
        raise BadInput(f"markov_head {markov_head!r} is not one of {', '.join(HEAD_TYPES)}")
    if markov_rank < 0:
        raise BadInput(f"markov_rank {markov_rank} is negative")
    if markov_rank == 0 and confidence_head and confidence_with_markov:
        raise BadInput("markov_rank 0 has no Markov head, but the confidence head reads its embedding "
                       "(confidence_head_with_markov): set a markov_rank ≥ 1, or turn the confidence head off")
    if getattr(config, "use_sliding_window", False):
        raise BadInput("DSpark with sliding-window draft layers is not supported: drop sliding_window")
    config.architectures = [ARCHITECTURE]
    config.target_layer_ids = list(config.dflash_config["target_layer_ids"])
    config.mask_token_id = int(config.dflash_config["mask_token_id"])
    config.num_anchors = int(num_anchors)
    config.markov_rank = int(markov_rank)
    config.markov_head_type = markov_head
    config.enable_confidence_head = bool(confidence_head)
    config.confidence_head_with_markov = bool(confidence_head and confidence_with_markov and markov_rank > 0)
    config.sample_from_anchor = True
    return config


class DSparkDrafter(DFlashDrafter):
    """Trainable parts: the DFlash backbone, the Markov head and the confidence head (the embedding and the LM head
    stay the target's, frozen)."""

    predicts_from_anchor = True  # slot k predicts the token after its own position (objective.build_blocks)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.markov_rank: int = config.markov_rank
        self.markov_head_type: str = config.markov_head_type
        vocab = self.draft_vocab_size or config.vocab_size
        self.markov_head = (MarkovHead(config.vocab_size, vocab, self.markov_rank, config.hidden_size,
                                       self.markov_head_type) if self.markov_rank else None)
        self.with_markov: bool = config.confidence_head_with_markov
        self.confidence_head = (ConfidenceHead(config.hidden_size + (self.markov_rank if self.with_markov else 0))
                                if config.enable_confidence_head else None)
        self.reset_heads()

    @torch.no_grad()
    def reset_heads(self) -> None:
        """The Markov bias starts at zero (`markov_w2` = 0), so a fresh DSpark drafts what its backbone drafts: a warm
        start from a DFlash drafter loses nothing before its first step. The embedding starts small and random, so
        `markov_w2` has a gradient from the first step on."""
        if self.markov_head is not None:
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
            self.markov_head.markov_w2.weight.zero_()
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=0.02)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @classmethod
    def warm_start(cls, dflash: DFlashDrafter, **settings) -> DSparkDrafter:
        """DSpark on a trained DFlash drafter: its weights as the backbone, the heads fresh. The layouts differ (a
        DFlash slot k predicts the token at p + k, a DSpark slot the one at p + k + 1), so this is a start, not an
        equal drafter: the backbone's layers, projection and norms are what transfer."""
        drafter = cls(dspark_config(dflash.config, **settings))
        missing, unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False)
        new = [name for name in missing if not name.startswith(("markov_head.", "confidence_head."))]
        assert not new and not unexpected, (new, unexpected)
        return drafter.to(next(dflash.parameters()).device)

    def block_logits(self, base_NKV: torch.Tensor, hidden_NKD: torch.Tensor, previous_NK: torch.Tensor):
        """Training: the Markov-corrected logits (N × K × V′) and the confidence logits (N × K, or None) of every
        slot, the token before each slot teacher-forced (`previous_NK`, target ids)."""
        logits = base_NKV
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(hidden_NKD, previous_NK).to(base_NKV.dtype)
        return logits, self.confidence_logits(hidden_NKD, previous_NK)

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        features = hidden
        if self.with_markov:
            features = torch.cat([hidden, self.markov_head.embed(previous).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features).float()

    def walk(self, base_KV: torch.Tensor, hidden_KD: torch.Tensor, anchor: int, pick):
        """Decoding's walk over the K slots of one block: slot k's logits are its base logits plus the bias from the
        token before it (the anchor, then each draft as `pick(logits)` chooses it, a draft-vocabulary index).
        Returns (the drafts K as target ids, the corrected logits K × V′, the confidence σ(c_k) K or None)."""
        previous = torch.tensor(anchor, device=base_KV.device)
        state, drafts, rows, confidence = None, [], [], []
        ids = self.draft_ids()
        for slot in range(base_KV.shape[0]):
            logits = base_KV[slot]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(hidden_KD[slot], previous, state)
                logits = logits + bias.to(logits.dtype)
            c = self.confidence_logits(hidden_KD[slot], previous)
            if c is not None:
                confidence.append(torch.sigmoid(c))
            choice = torch.as_tensor(pick(logits), device=base_KV.device)
            previous = choice if ids is None else ids[choice]
            drafts.append(previous)
            rows.append(logits)
        return (torch.stack(drafts), torch.stack(rows), torch.stack(confidence) if confidence else None)


def is_dspark(drafter: nn.Module) -> bool:
    return isinstance(getattr(drafter, "module", drafter), DSparkDrafter)
