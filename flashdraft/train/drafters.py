"""The drafter a run trains: a new one of `train.architecture` (DFlash, DFlash2, DSpark), or one imported with
`--init-from` (checked against the target; a DFlash drafter warm-starts DFlash2 or DSpark)."""

from __future__ import annotations

from pathlib import Path

from flashdraft.artifact.manifest import MANIFEST, require_verified
from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput
from flashdraft.model.dflash2 import SETTINGS as DFLASH2_SETTINGS
from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config, is_dflash2
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.dspark import DSparkDrafter, dspark_config, is_dspark


def new_drafter(cfg: TrainConfig, config, target_config) -> DFlashDrafter:
    """A fresh drafter of `train.architecture` on a DFlash draft config (`draft_config`)."""
    if cfg.architecture == "dflash2":
        return DFlash2Drafter(dflash2_config(config, target_config, **dflash2_settings(cfg)))
    if cfg.architecture == "dspark":
        return DSparkDrafter(dspark_config(config, **dspark_settings(cfg)))
    return DFlashDrafter(config)


def dflash2_settings(cfg: TrainConfig) -> dict:
    return {name: getattr(cfg, name) for name in DFLASH2_SETTINGS}


def dspark_settings(cfg: TrainConfig) -> dict:
    return {"markov_rank": cfg.markov_rank, "markov_head": cfg.markov_head, "confidence_head": cfg.confidence_head,
            "confidence_with_markov": cfg.confidence_with_markov, "num_anchors": cfg.max_anchors}


def import_drafter(cfg: TrainConfig, target_config, say) -> DFlashDrafter:
    """An existing z-lab-format drafter (a published one, to fine-tune on your data), checked against the
    target: its shape, the target layers it reads and the vocabulary must be this target's. With
    `train.architecture: dflash2`, a DFlash drafter is the backbone of a new DFlash2 one (warm start)."""
    from flashdraft.model.export import load_drafter, target_mismatches

    path = cfg.init_from
    if (Path(path) / MANIFEST).is_file():  # a drafter flashdraft exported: its bytes are checked before use
        require_verified(path, "--init-from drafter", "re-export it (rerun `flashdraft train`) or pull it again")
    else:
        say(f"train: {path} has no manifest (a drafter from elsewhere): its files are not verified")
    drafter = load_drafter(path)  # refuses weights that are not finite
    c = drafter.config
    mismatches = target_mismatches(c.hidden_size, c.num_target_layers, c.vocab_size, drafter.target_layer_ids,
                                   target_config)
    if mismatches:
        raise BadTrainingInput(f"--init-from {path} was made for another target: {'; '.join(mismatches)}")
    kind = "DFlash2" if is_dflash2(drafter) else "DSpark" if is_dspark(drafter) else "DFlash"
    wanted = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark"}[cfg.architecture]
    if kind != "DFlash" and kind != wanted:
        raise BadTrainingInput(f"--init-from {path} is a {kind} drafter: set train.architecture: {kind.lower()} to "
                               "train it further")
    say(f"train: starting from {path} ({kind}): {len(drafter.layers)} layers, block {drafter.block_size}, target "
        f"layers {drafter.target_layer_ids}, mask token {drafter.mask_token_id} (its settings, not train.num_layers "
        "etc.)")
    if cfg.architecture == "dflash2" and not is_dflash2(drafter):  # dflash2_config refuses what it cannot take
        drafter = DFlash2Drafter.warm_start(drafter, target_config, **dflash2_settings(cfg))
        say("train: DFlash2 warm start: the DFlash drafter's weights as the backbone, convolutions and candidate "
            "selector at identity (it proposes what the DFlash drafter proposes until it trains)")
    if cfg.architecture == "dspark" and not is_dspark(drafter):  # dspark_config refuses what it cannot take
        drafter = DSparkDrafter.warm_start(drafter, **dspark_settings(cfg))
        say("train: DSpark warm start: the DFlash drafter's weights as the backbone, the Markov head at zero and a "
            "fresh confidence head (a DSpark slot predicts one position further than a DFlash one: the backbone "
            "re-learns that)")
    return drafter
