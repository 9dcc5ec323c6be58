"""DFlash2: the DFlash drafter plus two small modules (z-lab / Inco AI, August 2026).

    config = dflash2_config(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=…),
                            target.config, conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
    drafter = DFlash2Drafter(config)                 # or DFlash2Drafter.warm_start(dflash_drafter, …)
    hidden_BSD = drafter(block_embeds_BSD, features_BCF, block_pos_BS, ctx_pos_BC, allowed_BSX)   # as DFlash
    unary_BSV = drafter.unary_logits(hidden_BSD @ target_lm_head.T)
    candidates, scores = drafter.selector_scores(unary_BSV, hidden_BSD, previous_ids_BS)

- Every draft layer convolves the block positions around its attention and its MLP (`BlockConv`, in the shipped
  modeling file so training and every reader share one implementation): only block tokens, never the context,
  and no tap crosses a block boundary.
- The candidate selector re-ranks the LM head's top-K at each block slot with the token before it; decoding walks
  the block from the anchor (greedy at T = 0, sampled from softmax(score / T) over the K candidates at T > 0).

Both start as identities (conv tap 0 = 1, projection 0, successor codebook 0): a fresh DFlash2 computes exactly
what its DFlash backbone computes, which is what makes a warm start from a trained DFlash drafter free.

Shape legend as in drafter.py; K′ = selector_top_k candidates, V the target vocabulary.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from flashdraft.errors import BadInput
from flashdraft.model.drafter import DFlashDrafter, DraftLayer
from flashdraft.model.modeling_dflash import BlockConv, CandidateSelector, logit_transform

ARCHITECTURE = "DFlash2DraftModel"
SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def target_logit_scaling(target_config) -> tuple[float, float]:
    """(output_multiplier, final_logit_softcapping) of the target's LM head output: Granite divides its logits by
    `logits_scaling`, Gemma caps them with `final_logit_softcapping`; neutral (1.0, 0) for the rest."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    scaling = getattr(t, "logits_scaling", None)
    multiplier = getattr(t, "output_multiplier", None) or (1.0 / scaling if scaling else 1.0)
    return float(multiplier), float(getattr(t, "final_logit_softcapping", None) or 0.0)


def dflash2_config(config, target_config, *, conv_kernel_size: int, conv_group_size: int, selector_rank: int,
                   selector_top_k: int):
    """A DFlash draft config (`draft_config`) made DFlash2's, in the published contract: `DFlash2DraftModel`, its
    settings in `dflash_config` beside the block size and the target's logit scaling, `is_causal: false`."""
    config = copy.deepcopy(config)
    if config.hidden_size % conv_group_size:
        raise BadInput(f"conv_group_size {conv_group_size} does not divide the hidden size {config.hidden_size}")
    if conv_kernel_size > config.block_size:
        raise BadInput(f"conv_kernel_size {conv_kernel_size} is longer than a block ({config.block_size})")
    if selector_top_k > config.vocab_size:
        raise BadInput(f"selector_top_k {selector_top_k} is more than the vocabulary ({config.vocab_size})")
    if getattr(config, "draft_vocab_size", None):
        raise BadInput("DFlash2 scores the full vocabulary (its codebooks are indexed by target ids, and the "
                       "engines load it so): drop draft_vocab_size")
    if getattr(config, "use_sliding_window", False):
        raise BadInput("DFlash2 with sliding-window draft layers is not supported yet: readers disagree on whether a "
                       "sliding DFlash2 layer is causal within the block (speculators: not), so drop sliding_window")
    multiplier, softcap = target_logit_scaling(target_config)
    config.architectures = [ARCHITECTURE]
    config.dflash_config = {**config.dflash_config, "block_size": config.block_size,
                            "conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
                            "selector_rank": selector_rank, "selector_top_k": selector_top_k,
                            "output_multiplier": multiplier, "final_logit_softcapping": softcap}
    config.is_causal = False  # stated: readers differ on the default (z-lab's published DFlash2 config states it)
    return config


class DFlash2Layer(DraftLayer):
    def __init__(self, config) -> None:
        super().__init__(config)
        c = config.dflash_config
        shape = (config.hidden_size, c["conv_kernel_size"], c["conv_group_size"], config.block_size)
        self.attention_conv, self.mlp_conv = BlockConv(*shape), BlockConv(*shape)

    def forward(self, x_BSD, ctx_BCD, rope_block, rope_ctx, allowed_BSX, ctx_kv=None) -> torch.Tensor:
        if ctx_kv is None:
            ctx_kv = self.self_attn.context_kv(ctx_BCD, rope_ctx)  # the context is never convolved
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x_BSD))
        x_BSD = x_BSD + self.attention_conv.finish(self.self_attn(h, ctx_kv, rope_block, allowed_BSX), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x_BSD))
        return x_BSD + self.mlp_conv.finish(self.mlp(h), kernel)


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2Layer

    def __init__(self, config) -> None:
        super().__init__(config)
        c = config.dflash_config
        self.selector_top_k: int = c["selector_top_k"]
        self.output_multiplier = float(c.get("output_multiplier", 1.0))
        self.final_logit_softcapping = float(c.get("final_logit_softcapping") or 0.0)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, c["selector_rank"])
        for layer in self.layers:  # the base class drew every Linear at random: back to the identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()

    @classmethod
    def warm_start(cls, dflash: DFlashDrafter, target_config, **settings) -> DFlash2Drafter:
        """DFlash2 on a trained DFlash drafter: its weights as the backbone, convolutions and selector at identity,
        so before any step it proposes exactly what the DFlash drafter proposes (tested)."""
        drafter = cls(dflash2_config(dflash.config, target_config, **settings))
        missing, unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False)
        new = [name for name in missing if "_conv." not in name and not name.startswith("candidate_selector.")]
        assert not new and not unexpected, (new, unexpected)
        return drafter.to(next(dflash.parameters()).device)

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logit_transform(logits, self.output_multiplier, self.final_logit_softcapping)

    def selector_scores(self, unary, hidden, previous_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(the unary top-K′ ids, their scores) at each slot, given the token before each slot."""
        return self.candidate_selector.scores(unary, hidden, previous_ids, self.selector_top_k)

    def walk(self, unary_JV, hidden_JD, anchor: int, pick) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoding's walk over the J = K − 1 draft slots of one block: each slot's candidates are scored with the
        token chosen at the slot before (the anchor for the first), and `pick(scores)` chooses one (its index).
        Returns (the drafts J, the candidates J × K′, their scores J × K′)."""
        previous = torch.tensor(anchor, device=unary_JV.device)
        drafts, candidates, scores = [], [], []
        for j in range(unary_JV.shape[0]):
            ids, score = self.selector_scores(unary_JV[j], hidden_JD[j], previous)
            previous = ids[pick(score)]
            drafts.append(previous)
            candidates.append(ids)
            scores.append(score)
        return torch.stack(drafts), torch.stack(candidates), torch.stack(scores)


def is_dflash2(drafter: nn.Module) -> bool:
    return isinstance(getattr(drafter, "module", drafter), DFlash2Drafter)
