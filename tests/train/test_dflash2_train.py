"""Training DFlash2: a run from scratch, the warm start from a DFlash drafter through `--init-from`, the selector's
metrics, and the recipe's contracts (split-invariant loss, Muon's parameter groups) with the two new modules."""

import json

import pytest
import torch

from flashdraft.artifact.manifest import read_manifest, verify_dir
from flashdraft.errors import BadTrainingInput
from flashdraft.model.dflash2 import DFlash2Drafter
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.export import load_drafter
from flashdraft.model.objective import block_masks
from flashdraft.train import run
from flashdraft.train.drafters import import_drafter
from flashdraft.train.optim import build_optimizers
from tests.train.test_recipe import drafter_weights, same_weights
from tests.train.test_train import quiet, tiny_cfg

DFLASH2 = dict(architecture="dflash2", selector_top_k=8, selector_rank=16, conv_group_size=16)
SELECTOR_METRICS = {"unary_recall_at_k", "selector_accuracy", "unary_simulated_acceptance_length"}


def test_a_dflash2_run_trains_exports_and_reports_the_selector(tiny_target, tiny_dataset, tmp_path):
    out, lines = tmp_path / "run", []
    stats = run(tiny_cfg(tiny_target, max_steps=4, **DFLASH2), tiny_dataset, out, log=lines.append)
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 8
    assert verify_dir(out / "drafter") == [] and type(load_drafter(out / "drafter")) is DFlash2Drafter
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in steps if "loss" in row]
    assert logged and all(SELECTOR_METRICS <= row.keys() for row in logged)
    assert all(0 <= row["unary_recall_at_k"] <= 1 for row in logged)
    assert SELECTOR_METRICS <= stats["heldout"].keys()
    rerun = []
    run(tiny_cfg(tiny_target, max_steps=4, **DFLASH2), tiny_dataset, out, log=rerun.append)
    assert "already done, verified" in rerun[0]


def test_dflash2_trains_under_bfloat16_autocast(tiny_target, tiny_dataset, tmp_path):
    """What the demo runs (train.bf16 on a CPU): the selector scores bfloat16 logits and hidden states."""
    stats = run(tiny_cfg(tiny_target, max_steps=2, bf16=True, **DFLASH2), tiny_dataset, tmp_path / "bf16", log=quiet)
    assert stats["steps"] == 2 and stats["heldout"]["unary_recall_at_k"] is not None


def test_the_dflash2_loss_does_not_depend_on_how_a_step_is_split(tiny_target, tiny_dataset, tmp_path):
    cfg = tiny_cfg(tiny_target, batch_size=4, max_steps=2, export_dtype="float32", **DFLASH2)
    run(cfg.model_copy(update={"micro_batch": 4}), tiny_dataset, tmp_path / "four", log=quiet)
    run(cfg.model_copy(update={"micro_batch": 1}), tiny_dataset, tmp_path / "one", log=quiet)
    assert same_weights(drafter_weights(tmp_path / "four"), drafter_weights(tmp_path / "one"))


def test_a_warm_start_proposes_what_the_dflash_drafter_did_then_trains(tiny_target, tiny_dataset, tmp_path):
    run(tiny_cfg(tiny_target, max_steps=3, export_dtype="float32"), tiny_dataset, tmp_path / "dflash", log=quiet)
    source = tmp_path / "dflash" / "drafter"
    cfg = tiny_cfg(tiny_target, max_steps=2, init_from=str(source), **DFLASH2)
    from transformers import AutoConfig

    lines = []
    warm = import_drafter(cfg, AutoConfig.from_pretrained(tiny_target), lines.append)
    dflash = load_drafter(source)
    assert type(warm) is DFlash2Drafter and type(dflash) is DFlashDrafter
    torch.manual_seed(0)
    anchors, block, features = torch.tensor([9, 20]), torch.randn(1, 16, 64), torch.randn(1, 30, 2 * 64)
    masks = block_masks(anchors, 8, 30, None, "cpu")
    positions = (anchors[:, None] + torch.arange(8)).view(1, -1)
    with torch.no_grad():
        ours, theirs = (d(block, features, positions, torch.arange(30)[None], masks) for d in (warm, dflash))
    assert torch.equal(ours, theirs)
    assert any("DFlash2 warm start" in line for line in lines)

    stats = run(cfg, tiny_dataset, tmp_path / "warm", log=quiet)
    assert stats["steps"] == 2 and type(load_drafter(tmp_path / "warm" / "drafter")) is DFlash2Drafter
    assert read_manifest(tmp_path / "warm" / "drafter").kind == "drafter"
    with pytest.raises(BadTrainingInput, match="is a DFlash2 drafter: set train.architecture: dflash2"):
        run(tiny_cfg(tiny_target, max_steps=2, init_from=str(tmp_path / "warm" / "drafter")), tiny_dataset,
            tmp_path / "back", log=quiet)


def test_muon_takes_the_draft_layers_matrices_and_adamw_the_codebooks(tiny_target):
    from transformers import AutoConfig

    from flashdraft.model.dflash2 import dflash2_config
    from flashdraft.model.drafter import draft_config

    target = AutoConfig.from_pretrained(tiny_target)
    drafter = DFlash2Drafter(dflash2_config(draft_config(target, num_layers=2, block_size=8, mask_token_id=127),
                                            target, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                                            selector_top_k=8))
    muon, adamw = build_optimizers(tiny_cfg(tiny_target, optimizer="muon", **DFLASH2), drafter, 10).all
    names = {id(p): name for name, p in drafter.named_parameters()}
    muon_names = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    adamw_names = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert "layers.0.attention_conv.kernel_projection.weight" in muon_names and "fc.weight" in muon_names
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.mlp_conv.base_kernel"} <= adamw_names
    assert muon_names | adamw_names == set(names.values()) and not muon_names & adamw_names
