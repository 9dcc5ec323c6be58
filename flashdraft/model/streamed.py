"""The target's hidden states for a short sequence, computed from its own checkpoint one decoder layer at a time:
how a trainer that holds only the embedding, final norm and LM head (the target's layers serve in a vLLM fleet)
proves what the fleet returns is the target's (train/fleet_proof.py).

    states_TNH = streamed_states(target_dir, embedding_and_norm, [0, 3], [1, 2, 3, 5], "cpu")

transformers' own decoder runs the sequence — its masks, rotary embedding and layer kinds (a hybrid's Gated-DeltaNet
layers included) — built on the meta device, so it holds no weights: before each layer runs, that layer's tensors are
read from the checkpoint's safetensors into it (float32), and after, they are dropped. At most one layer is in memory
(Qwen3.6-27B: 1.7 GB in float32); the checkpoint is read once (54 GB for the 27B: its cost is the disk's, `estimate`
says it). Layer i's state is decoder layer i's output, before the final norm (transformers' `hidden_states[i + 1]`),
as the trainer's hooks and vLLM's extraction number it.

The checkpoint's names: the decoder's prefix is the one before `embed_tokens.weight` (`model.` for a causal LM,
`model.language_model.` for a VLM-wrapped Qwen3.5/3.6), and layer i's tensors are that prefix + `layers.{i}.` + the
module's own names. A mixture-of-experts layer whose experts transformers fuses (`experts.gate_up_proj`,
`experts.down_proj`) is read from the per-expert tensors checkpoints store, stacked as transformers stacks them.
Anything else a layer needs and the checkpoint lacks is refused in one line, not guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashdraft.errors import BadInput
from flashdraft.model.families import language_model


class Checkpoint:
    """A safetensors checkpoint's tensors by name, across its shards, read only when asked for."""

    def __init__(self, directory: str) -> None:
        root = Path(directory)
        if not root.is_dir():  # a hub id: its copy in this machine's hub cache (the trainer loaded its head from it)
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(directory, local_files_only=True))
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: root / file for name, file in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(root / "model.safetensors"), framework="pt") as f:
                self.files = {name: root / "model.safetensors" for name in f.keys()}
        else:
            raise BadInput(f"target {directory}: no model.safetensors (nor its index): the fleet's states are proven "
                           "against the target's own safetensors weights")
        self.root = root

    def names(self) -> list[str]:
        return list(self.files)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in wanted})
        return tensors


def decoder_prefix(checkpoint: Checkpoint) -> str:
    """The checkpoint's name prefix of the language model's decoder: what comes before `embed_tokens.weight`."""
    found = sorted((n[: -len("embed_tokens.weight")] for n in checkpoint.names() if n.endswith("embed_tokens.weight")),
                   key=len)
    if not found:
        raise BadInput(f"target {checkpoint.root}: no embed_tokens.weight among its tensors: cannot tell where its "
                       "decoder layers are stored")
    return next((p for p in found if "language_model" in p), found[0])


def layer_tensors(checkpoint: Checkpoint, prefix: str, index: int, wanted: dict[str, torch.Size]) -> dict:
    """Layer `index`'s tensors, named as the layer module names them (`wanted`: its state dict's names and shapes)."""
    stored = f"{prefix}layers.{index}."
    have = set(checkpoint.names())
    direct = {name: stored + name for name in wanted if stored + name in have}
    tensors = {name: t for name, t in zip(direct, checkpoint.read(list(direct.values())).values(), strict=True)}
    for name, shape in wanted.items():
        if name in tensors:
            continue
        experts, _, fused = name.rpartition(".")
        if fused in ("gate_up_proj", "down_proj") and experts.endswith("experts"):
            parts = ["gate_proj", "up_proj"] if fused == "gate_up_proj" else ["down_proj"]
            names = [[f"{stored}{experts}.{e}.{part}.weight" for part in parts] for e in range(shape[0])]
            if all(n in have for per in names for n in per):
                read = checkpoint.read([n for per in names for n in per])
                tensors[name] = torch.stack([torch.cat([read[n] for n in per]) for per in names])
                continue
        raise BadInput(f"target {checkpoint.root}: layer {index}'s {name} is not in its checkpoint (looked for "
                       f"{stored}{name}): the fleet's states cannot be proven against it")
    return tensors


@torch.no_grad()
def streamed_states(target_dir: str, target_model: torch.nn.Module, layer_ids: list[int], input_ids: list[int],
                    device: str | torch.device) -> torch.Tensor:
    """T × n × H float32: the target's states after decoder layers `layer_ids` for `input_ids`, one layer of its
    checkpoint in memory at a time. `target_model`: the trainer's target without decoder layers (model/target.py
    `load_without_layers`), whose embedding the sequence enters through."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Checkpoint(target_dir)
    prefix = decoder_prefix(checkpoint)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target_dir), dtype=torch.float32)
    decoder, _, _ = language_model(skeleton)
    ours, _, _ = language_model(target_model)
    ids = torch.tensor([input_ids], device=ours.embed_tokens.weight.device)
    embedded = ours.embed_tokens(ids).to(device, torch.float32)  # the trainer's own embedding: not copied
    decoder.norm = _float32(ours.norm, device)  # applied after the last layer; its output is not what is compared
    decoder.rotary_emb = ours.rotary_emb  # the trainer's (built from the same config, its buffers real)
    captured: dict[int, torch.Tensor] = {}

    def load(index: int):
        def before(layer, args, kwargs):
            wanted = {name: t.shape for name, t in layer.state_dict().items()}
            tensors = layer_tensors(checkpoint, prefix, index, wanted)
            layer.to_empty(device=device)
            layer.load_state_dict({name: t.float() for name, t in tensors.items()}, strict=True)
        return before

    def drop(index: int):
        def after(layer, args, output):
            if index in layer_ids:
                captured[index] = (output[0] if isinstance(output, tuple) else output)[0].float().cpu()
            layer.to("meta")  # its weights go: the next layer's take their place
        return after

    hooks = []
    for index, layer in enumerate(decoder.layers):
        hooks.append(layer.register_forward_pre_hook(load(index), with_kwargs=True))
        hooks.append(layer.register_forward_hook(drop(index)))
    try:
        decoder(inputs_embeds=embedded, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([captured[i] for i in layer_ids], dim=1)


def _float32(module: torch.nn.Module, device) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module).to(device=device, dtype=torch.float32)
