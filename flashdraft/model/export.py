"""Export and load drafters in the z-lab DFlash format that SGLang (`--speculative-algorithm DFLASH`) and vLLM
(`method: dflash`) load: `config.json` (Qwen3-shaped draft architecture, `architectures: [DFlashDraftModel]`,
`block_size`, `num_target_layers`, `dflash_config.{mask_token_id, target_layer_ids}`) + `model.safetensors`
(fc, hidden_norm, layers.*, norm — the embedding and LM head are the target's).

    from flashdraft.model.export import save_drafter, load_drafter
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import commit_dir
from flashdraft.errors import BadInput
from flashdraft.model.drafter import DFlashDrafter

REQUIRED = ("block_size", "num_target_layers", "dflash_config")


def save_drafter(drafter: DFlashDrafter, out: Path, stats: dict[str, Any] | None = None, lineage=None) -> Path:
    """Write config.json + model.safetensors and commit them with a `drafter` manifest."""
    config = drafter.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    with commit_dir(out, "drafter", stats=stats, lineage=lineage) as tmp:
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True))
        state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """Read a drafter exported by `save_drafter` or any z-lab DFlash checkpoint directory."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise BadInput(f"{path}/config.json is not a DFlash drafter config: missing {', '.join(missing)}")
    config = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config.architectures = raw.get("architectures", ["DFlashDraftModel"])
    config.block_size, config.num_target_layers = raw["block_size"], raw["num_target_layers"]
    config.dflash_config = raw["dflash_config"]
    config.draft_vocab_size = raw.get("draft_vocab_size")
    drafter = DFlashDrafter(config)
    try:
        drafter.load_state_dict(load_file(str(path / "model.safetensors")))
    except (OSError, SafetensorError, RuntimeError) as e:  # missing, truncated, or of another shape
        raise BadInput(f"{path}/model.safetensors cannot be loaded as this drafter: {e}") from None
    return drafter.to(device=device, dtype=dtype)
