"""The frozen target: where its language model, embedding and LM head live, and its features by forward hooks.

    target = Target(resolve_model("embedded"), "cpu", log=print)
    target.watch([1, 8, 14]); features_BTF = target.features(input_ids_BT)

Features of watched layer i are that decoder layer's output, i.e. `hidden_states[i + 1]` in HF indexing,
concatenated over the watched layers (B × T × n·D).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers.modeling_outputs import BaseModelOutput

from flashdraft.cpu_bfloat16 import bfloat16_notice
from flashdraft.errors import BadInput
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.families import language_model
from flashdraft.model.transfer import to_device


def attention_layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers with softmax attention (all of them, except a hybrid's linear-attention layers)."""
    return [layer for layer in decoder.layers if hasattr(layer, "self_attn")]


# transformers runs Gated-DeltaNet (linear-attention) layers on these packages' kernels when they import, else on its
# pure-PyTorch reference loop (transformers #48718: a Qwen3.5-9B training step 1.22 s on the loop, 0.70 s on them)
LINEAR_ATTENTION_KERNELS = (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d"))


def linear_attention_layers(text_config) -> int:
    """How many of a target's layers are linear attention (Gated DeltaNet: Qwen3.5/3.6's hybrids); 0 for the rest."""
    get = text_config.get if isinstance(text_config, dict) else (lambda k, d=None: getattr(text_config, k, d))
    kinds, layers, interval = get("layer_types") or [], get("num_hidden_layers"), get("full_attention_interval")
    if isinstance(layers, int) and len(kinds) != layers and isinstance(interval, int) and interval > 0:
        # a config that gives the pattern, not every layer: every interval-th layer is full attention (Qwen3.5's rule)
        return sum(1 for i in range(layers) if (i + 1) % interval)
    return sum(1 for kind in kinds if kind == "linear_attention")


def linear_attention_path(text_config) -> str | None:
    """For a hybrid target, what its linear-attention layers run on in transformers (None: it has none)."""
    import importlib.util

    layers = linear_attention_layers(text_config)
    if not layers:
        return None
    missing = [package for module, package in LINEAR_ATTENTION_KERNELS if importlib.util.find_spec(module) is None]
    if not missing:
        return f"{layers} Gated-DeltaNet layers on flash-linear-attention's kernels"
    return (f"{layers} Gated-DeltaNet layers on transformers' reference loop ({' and '.join(missing)} not installed: "
            "about 1.7× slower a training step on a GPU, transformers #48718); FLASHDRAFT_GPU=1 ./install.sh installs "
            "the kernels on a GPU machine, or train.feature_source: engine computes the features in vLLM")


def without_layers(config):
    """A copy of a target's config with no decoder layers (and no per-layer lists that would have to match them)."""
    import copy

    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = 0
    for per_layer in ("layer_types", "mlp_only_layers"):
        if isinstance(getattr(text, per_layer, None), list):
            setattr(text, per_layer, [])
    return config


def load_without_layers(path: str, whole, dtype: torch.dtype) -> torch.nn.Module:
    """The target's model without decoder layers, its other weights from the checkpoint; every layer weight is an
    expected unused key (not reported), and a weight it does need missing from the checkpoint is an error."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the load report would list every layer weight as unexpected
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, config=without_layers(whole), dtype=dtype,
                                                           output_loading_info=True)
    finally:
        transformers_logging.set_verbosity(verbosity)
    if missing := sorted(info.get("missing_keys") or []):
        raise BadInput(f"target {path}: its checkpoint lacks {', '.join(missing[:3])}, which the trainer needs "
                       "beside an engine's features (the embedding, final norm and LM head)")
    return model


def weight_dtype(setting: str, device: str) -> torch.dtype:
    """The target's weight type for a `dtype` setting: `auto` is bfloat16 on CUDA (what serving runs) and float32
    on a CPU; `bfloat16` on a CPU with AVX512-BF16 or AMX runs about twice as fast (benchmarks/RESULTS.md)."""
    if setting == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if device.startswith("cpu") and setting == "bfloat16":
        # transformers warns that a GGUF-packed model (the embedded target) is fastest in float32; on a CPU with
        # AVX512-BF16 bfloat16 is ~2x faster, which is why it was asked for.
        logging.getLogger("transformers.quantizers.quantizer_gguf").setLevel(logging.ERROR)
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[setting]


class Target:
    """The frozen target: features from chosen layers via forward hooks, plus its embedding and LM head. `dtype`
    is a weight-type setting (`auto`, `bfloat16`, `float32`; see `weight_dtype`).

    `layers=False` loads its embedding, final norm and LM head only — what a trainer whose features come from a
    serving engine needs (`use`): a 400B target's decoder layers stay in the engine. transformers loads it from a
    copy of the config with no decoder layers, so the checkpoint's key names are its business, as for the whole."""

    def __init__(self, path: str, device: str, log: Callable[[str], None], dtype: str = "auto",
                 layers: bool = True) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = path
        many = "," in device and layers  # "cuda:0,cuda:1": spread the target's layers over those devices
        device = device if many else device.split(",")[0]
        kwargs = {"device_map": "auto", "max_memory": _memory_map(device)} if many else {}
        whole = AutoConfig.from_pretrained(self.path)
        if layers:
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=weight_dtype(dtype, device), **kwargs)
        else:
            self.model = load_without_layers(self.path, whole, weight_dtype(dtype, device))
        self.model.eval()
        if not many:
            self.model.to(device)
        self._adopt(self.model)
        self.config = whole.get_text_config()  # the target as it is, layers included (the drafter's shape)
        if weight_dtype(dtype, device) == torch.bfloat16 and (notice := bfloat16_notice(device)):
            log(f"target: bfloat16 — {notice}")
        path_taken = linear_attention_path(self.config)
        if path_taken and "reference loop" in path_taken and device.startswith("cuda"):  # a CPU has no other path
            log(f"target: {path_taken}")

    @classmethod
    def from_model(cls, model: torch.nn.Module, name: str = "(in memory)") -> Target:
        """A target around a model already built (benchmarks/gpu_check.py builds random-weight ones in GPU
        memory instead of writing tens of GB to disk)."""
        target = cls.__new__(cls)
        target.path, target.model = name, model.eval()
        target._adopt(model)
        return target

    def _adopt(self, model: torch.nn.Module) -> None:
        model.requires_grad_(False)
        self.decoder, self.lm_head, self.config = language_model(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def watch(self, layer_ids: list[int]) -> None:
        for handle in self._hooks:
            handle.remove()
        layers = self.decoder.layers
        for i in layer_ids:
            if len(layers):  # a target loaded without its layers has its features from a source (`use`)
                self._hooks.append(layers[i].register_forward_hook(self._capture(i)))
        self.layer_ids = list(layer_ids)

    def source_layers(self) -> list[int]:
        """The layers a feature source gives: the watched ones and the last (before the final norm), from which the
        target's own final norm and LM head make its next-token distribution (labels: target, distillation,
        DSpark's target terms, the held-out walk's greedy labels) exactly as its full pass would."""
        last = self.config.num_hidden_layers - 1
        return self.layer_ids + ([] if last in self.layer_ids else [last])

    def _capture(self, index: int):
        def hook(module, inputs, output):
            self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def use(self, source) -> None:
        """Take the watched layers' features from `source` (an object with `features(ids_BT)`: the serving engine,
        train/engine_features.py) instead of running this copy: `forward` then returns no output of its own, and
        whoever reads features does not know which source gave them."""
        self.source = source

    def forward(self, input_ids_BT: torch.Tensor, **kwargs):
        """The base model (no LM head) over tokens, with any cache kwargs: (its output, the watched layers'
        outputs concatenated, B × T × n·D). With a feature source (`use`) the same two, from the source's layers
        (`source_layers`): the output's last hidden state is the last layer's through the final norm."""
        if getattr(self, "source", None) is not None:
            assert not kwargs, "a feature source computes features only"
            states = self.source.features(input_ids_BT).to(self.lm_head.weight.device, self.model.dtype)
            width = self.config.hidden_size
            layers = self.source_layers()
            last = states[..., layers.index(self.config.num_hidden_layers - 1) * width:][..., :width]
            output = BaseModelOutput(last_hidden_state=self.decoder.norm(last))
            return output, states[..., : len(self.layer_ids) * width]
        output = self.decoder(input_ids=input_ids_BT.to(self.lm_head.weight.device), **kwargs)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return output, features

    @torch.no_grad()
    def top_next_tokens(self, states_TNH: torch.Tensor, k: int = 5) -> list[int]:
        """The target's k most likely next tokens after a sequence, from a feature source's states for it (T × n × H,
        its layers `source_layers`): the last layer's state at the last position through the final norm and the LM
        head. How the trainer tells its target from another model of the same shape (train/engine_features.py)."""
        last = self.source_layers().index(self.config.num_hidden_layers - 1)
        state = states_TNH[-1, last].to(self.lm_head.weight.device, self.lm_head.weight.dtype)
        return self.lm_head(self.decoder.norm(state[None]))[0].float().topk(k).indices.tolist()

    def streamed_states(self, input_ids: list[int]) -> torch.Tensor:
        """T × n × H float32: the states at the source layers (`source_layers`) for one short sequence, computed from
        the target's checkpoint one decoder layer at a time (model/streamed.py): how a trainer holding no decoder
        layers proves a fleet's states are the target's."""
        from flashdraft.model.streamed import streamed_states

        return streamed_states(self.path, self.model, self.source_layers(), input_ids, self.lm_head.weight.device)

    @torch.no_grad()
    def features(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids_BT)[1]

    def head_weight(self, drafter: DFlashDrafter) -> torch.Tensor:
        """The LM head rows the drafter scores with (all, or its reduced draft vocabulary), on the head's device."""
        return self.heads_beside(drafter, self.lm_head.weight.device)[0]

    def heads_beside(self, drafter: DFlashDrafter, device, dtype: torch.dtype | None = None):
        """(the rows the drafter scores with, the whole LM head) on the drafter's device, in `dtype` (default: the
        target's), copied there once: training scores every block position against them, so only the drafter's
        hidden states, never rows × vocabulary logits, would otherwise cross devices. With the target on the same
        device and dtype they are the target's own tensors; else the drafter's device holds a copy (Qwen3.6-27B's
        head: 2.5 GB in bfloat16)."""
        key = (drafter, str(device), dtype)
        if getattr(self, "_beside_for", None) != key:
            whole = to_device(self.lm_head.weight.detach(), device).to(dtype or self.lm_head.weight.dtype)
            self._beside, self._beside_for = (drafter.head_weight(whole), whole), key
        return self._beside

    def discard_features(self) -> None:
        """Forget what the hooks captured during a pass whose features are not needed (e.g. `generate`)."""
        self._captured.clear()


def _memory_map(devices: str) -> dict:
    return {int(d.split(":")[1]): "1000GiB" for d in devices.split(",")}
