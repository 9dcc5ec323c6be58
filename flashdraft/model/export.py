"""Export and load drafters in the z-lab format that SGLang (`--speculative-algorithm DFLASH`) and vLLM
(`method: dflash`) load: `config.json` (Qwen3-shaped draft architecture, `architectures: [DFlashDraftModel]`,
`block_size`, `num_target_layers`, `dflash_config.{mask_token_id, target_layer_ids}`) + `model.safetensors`
(fc, hidden_norm, layers.*, norm — the embedding and LM head are the target's) + `modeling_dflash.py`, which
`auto_map` names, so `AutoModel.from_pretrained(dir, trust_remote_code=True)` gives the drafter as trained.

A DFlash2 drafter is written in z-lab's published DFlash2 contract: `architectures: [DFlash2DraftModel]`,
`dflash_config` adds `block_size`, the convolution and selector settings, `output_multiplier` and
`final_logit_softcapping`; `is_causal: false`; the tensors add `layers.N.{attention,mlp}_conv.base_kernel` /
`.kernel_projection.weight` and `candidate_selector.{predecessor,successor}_codebook` /
`.hidden_projection.weight`.

A DSpark drafter is written in DeepSpec's native contract (what vLLM, SGLang and llama.cpp load):
`architectures: [Qwen3DSparkModel]`, the draft fields at the top level (`target_layer_ids`, `mask_token_id`,
`num_anchors`, `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
`sample_from_anchor: true`), no `dflash_config`; the tensors add `markov_head.*` and `confidence_head.proj.*`.
A bonus-anchor DSpark config (`sample_from_anchor: false`) is refused on load rather than decoded in the wrong
layout.

    from flashdraft.model.export import save_drafter, load_drafter
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import Qwen3Config

from flashdraft.artifact.atomic import atomic_write_text, write_safetensors
from flashdraft.artifact.ownership import commit_dir
from flashdraft.errors import BadInput
from flashdraft.model.dflash2 import SETTINGS as DFLASH2_SETTINGS
from flashdraft.model.dflash2 import DFlash2Drafter, is_dflash2
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from flashdraft.model.dspark import NATIVE_FIELDS as DSPARK_FIELDS
from flashdraft.model.dspark import DSparkDrafter, is_dspark

# DSpark architectures read as DeepSpec's Qwen3 drafter ("DSparkDraftModel" with a qwen3 config is vLLM's other name
# for it), and what a native config may leave out: DeepSpec's own defaults.
DSPARK_READS = (DSPARK_ARCHITECTURE, "DSparkDraftModel")
DSPARK_DEFAULTS = {"num_anchors": 512, "markov_head_type": "vanilla", "enable_confidence_head": False,
                   "confidence_head_with_markov": False, "sample_from_anchor": True}

REQUIRED = ("block_size", "num_target_layers", "dflash_config")
MODELING_FILE = Path(__file__).with_name("modeling_dflash.py")  # self-contained: torch + transformers only


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def export_config(drafter: DFlashDrafter, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json as every reader must compute what training computed: RoPE both as transformers 5's
    `rope_parameters` and as the top-level `rope_theta` (+ `rope_scaling` when not default) that transformers
    4.x readers — the z-lab reference pins 4.57 — use, falling back to θ = 10,000 without it; the weights' dtype
    under both names; the transformers version that wrote it."""
    config = drafter.config.to_dict()
    rope = dict(config.get("rope_parameters") or {})
    architecture = ("DFlash2DraftModel" if is_dflash2(drafter) else
                    DSPARK_ARCHITECTURE if is_dspark(drafter) else "DFlashDraftModel")
    config["architectures"] = [architecture]
    config["auto_map"] = {"AutoModel": f"{MODELING_FILE.stem}.{architecture}"}
    config["rope_theta"] = rope.get("rope_theta", 10_000.0)
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config["dtype"] = config["torch_dtype"] = dtype
    # No causality flag for DFlash: a `sliding_attention` layer is causal within the block and a `full_attention`
    # one is not — the default of the z-lab reference and vLLM (`is_causal` / `dflash_config.causal` would override
    # every layer at once) and what SGLang always does; training masks the same way (objective.py). DFlash2 (full
    # attention only) states `is_causal: false`, as z-lab's published DFlash2 config does: readers differ on its
    # default there.
    if is_dflash2(drafter):
        config["is_causal"] = False
    if is_dspark(drafter):  # DeepSpec's native form: the draft fields at the top level only (dspark.py)
        del config["dflash_config"]
        missing = [key for key in DSPARK_FIELDS if key not in config]
        assert not missing, missing
    return config


def save_drafter(drafter: DFlashDrafter, out: Path, stats: dict[str, Any] | None = None, lineage=None,
                 dtype: str = "bfloat16", target_lm_head: torch.Tensor | None = None) -> Path:
    """Write config.json + model.safetensors (floating weights in `dtype`; bf16 like the published drafters)
    and commit them with a `drafter` manifest.

    A reduced draft vocabulary is written the way vLLM's DFlash loader reads one: `draft_vocab_size` in the
    config, `d2t` (target id = draft id + d2t) and an `lm_head.weight` of `draft_vocab_size` rows — the target's
    LM head rows for those ids, which the drafter scored with in training (`target_lm_head` is required)."""
    config = export_config(drafter, dtype)
    state = dict(drafter.state_dict())
    if drafter.draft_vocab_size:
        if target_lm_head is None:
            raise BadInput("a reduced-vocabulary drafter needs the target's LM head to export its rows")
        state["lm_head.weight"] = drafter.head_weight(target_lm_head)
    with commit_dir(out, "drafter", stats=stats, lineage=lineage) as tmp:
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True))
        shutil.copyfile(MODELING_FILE, tmp / MODELING_FILE.name)
        state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().to("cpu").contiguous()
                 for k, v in state.items()}
        write_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
    return Path(out)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """Read a drafter exported by `save_drafter` or any z-lab DFlash checkpoint directory."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    dspark = raw.get("architectures", [None])[0] in DSPARK_READS
    if dspark:  # DeepSpec's native config: the DFlash fields at the top level
        if absent := [key for key in ("target_layer_ids", "mask_token_id", "markov_rank") if key not in raw]:
            raise BadInput(f"{path}/config.json is a DSpark config without {', '.join(absent)}")
        if raw.get("sample_from_anchor", True) is not True:
            raise BadInput(f"{path}/config.json is a bonus-anchor DSpark export (sample_from_anchor: false): "
                           "flashdraft decodes the anchor-first layout only")
        raw["dflash_config"] = {"mask_token_id": raw["mask_token_id"], "target_layer_ids": raw["target_layer_ids"]}
    dflash = raw.get("dflash_config") or {}
    if "block_size" not in raw and "block_size" in dflash:  # a DFlash2 config may keep it in dflash_config only
        raw["block_size"] = dflash["block_size"]
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise BadInput(f"{path}/config.json is not a DFlash drafter config: missing {', '.join(missing)}")
    dflash2 = raw.get("architectures", [None])[0] == "DFlash2DraftModel"
    if dflash2 and (absent := [key for key in DFLASH2_SETTINGS if key not in dflash]):
        raise BadInput(f"{path}/config.json is a DFlash2 config without dflash_config.{', '.join(absent)}")
    # transformers 4.x-style configs (top-level rope_theta, no rope_parameters) read the same way: 5.x folds
    # rope_theta into rope_parameters.
    skip = ("architectures", "model_type", "torch_dtype", "auto_map")
    config = Qwen3Config(**{k: v for k, v in raw.items() if k not in skip})
    config.architectures = raw.get("architectures", ["DFlashDraftModel"])
    config.block_size, config.num_target_layers = raw["block_size"], raw["num_target_layers"]
    config.dflash_config = raw["dflash_config"]
    config.draft_vocab_size = raw.get("draft_vocab_size")
    if dspark:
        for key in DSPARK_FIELDS:
            setattr(config, key, raw.get(key, DSPARK_DEFAULTS.get(key)))
        drafter = DSparkDrafter(config)
    else:
        drafter = DFlash2Drafter(config) if dflash2 else DFlashDrafter(config)
    try:
        state = load_file(str(path / "model.safetensors"))
        state.pop("lm_head.weight", None)  # a reduced vocabulary's head rows: the target's, read from the target
        drafter.load_state_dict(state)
    except (OSError, SafetensorError, RuntimeError) as e:  # missing, truncated, or of another shape
        raise BadInput(f"{path}/model.safetensors cannot be loaded as this drafter: {e}") from None
    if bad := nonfinite_weights(drafter):
        raise BadInput(f"{path}/model.safetensors holds weights that are not finite (NaN or inf) in {bad[0]}"
                       + (f" and {len(bad) - 1} more tensors" if len(bad) > 1 else "")
                       + ": a diverged run's; it cannot draft")
    return drafter.to(device=device, dtype=dtype)


def target_mismatches(hidden_size: int, num_target_layers: int, vocab_size: int, target_layer_ids: list[int],
                      target_config) -> list[str]:
    """How a drafter of these settings does not fit the target of `target_config` (its text config): empty when it
    was made for it. Checked wherever a drafter meets a target it was not trained beside (import, export)."""
    found = [f"{what} {mine} vs the target's {theirs}" for what, mine, theirs in (
        ("hidden size", hidden_size, target_config.hidden_size),
        ("target layer count", num_target_layers, target_config.num_hidden_layers),
        ("vocabulary", vocab_size, target_config.vocab_size),
    ) if mine != theirs]
    if max(target_layer_ids) >= target_config.num_hidden_layers:
        found.append(f"target layers {target_layer_ids} beyond its {target_config.num_hidden_layers}")
    return found


def nonfinite_weights(module: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (a sharded parameter: this process's shard)."""
    bad = []
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(local.detach()).all()):
            bad.append(name)
    return bad
