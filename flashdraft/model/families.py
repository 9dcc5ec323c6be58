"""Where a causal LM's language model lives, for every family flashdraft trains against: one function, used by the
trainer's target (model/target.py) and by the layer-at-a-time reference the fleet is proven against
(model/streamed.py).
"""

from __future__ import annotations

import torch

from flashdraft.errors import BadInput


def language_model(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(decoder, LM head, text config) of a causal LM, wherever its language model lives: `model.model`
    (Llama, Qwen3, MoE, and what AutoModelForCausalLM makes of a Qwen3.5/3.6 checkpoint) or
    `model.model.language_model` / `model.language_model` (VLM wrappers). The decoder has `.layers` and is
    called with `input_ids`; the text config has the hidden size, layers, heads, vocab and RoPE."""
    inner = getattr(model, "model", None)
    candidates = [getattr(inner, "language_model", None), inner, getattr(model, "language_model", None)]
    decoder = next((m for m in candidates if m is not None and hasattr(m, "layers")), None)
    head = model.get_output_embeddings()
    if decoder is None or head is None:
        missing = "decoder layers (model.layers, model.language_model.layers)" if decoder is None else "LM head"
        raise BadInput(f"{type(model).__name__}: cannot find its {missing}; flashdraft handles causal LMs such "
                       "as Llama, Qwen3, Qwen3-MoE and Qwen3.5/3.6 (text-only or VLM-wrapped)")
    return decoder, head, model.config.get_text_config()
