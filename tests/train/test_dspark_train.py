"""Training DSpark: a run from scratch (online and offline features), DeepSpec's loss and block layout, the warm
start from a DFlash drafter, and the settings DSpark refuses."""

import json

import pytest
import torch

from flashdraft.artifact.manifest import verify_dir
from flashdraft.config import ConfigError, load_config
from flashdraft.errors import BadTrainingInput
from flashdraft.model.dspark import DSparkDrafter
from flashdraft.model.export import load_drafter
from flashdraft.model.objective import build_dspark_blocks
from flashdraft.train import run
from flashdraft.train.drafters import import_drafter
from tests.train.test_recipe import drafter_weights, same_weights
from tests.train.test_train import quiet, tiny_cfg

DSPARK = dict(architecture="dspark", block_size=4, markov_rank=8)


def test_a_dspark_block_predicts_the_token_after_each_slot_and_stops_at_the_first_unsupervised_label():
    ids = torch.arange(100, 120)
    mask = torch.ones(20, dtype=torch.long)
    mask[9] = 0  # the label of the block at 5's slot 3 (position 9) is not supervised
    blocks, positions, labels, weights = build_dspark_blocks(ids, mask, torch.tensor([2, 5]), 5, mask_token_id=7)
    assert blocks.tolist() == [[102, 7, 7, 7, 7], [105, 7, 7, 7, 7]]
    assert positions.tolist() == [[2, 3, 4, 5, 6], [5, 6, 7, 8, 9]]
    assert labels.tolist() == [[103, 104, 105, 106, 107], [106, 107, 108, 109, 110]]  # one past each position
    decay = torch.exp(-torch.arange(5.0) / 4.0)  # exp(−k/γ), γ = 4, the anchor's slot weighted 1
    assert torch.allclose(weights[0], decay)
    assert torch.allclose(weights[1], torch.cat([decay[:3], torch.zeros(2)]))  # slot 4 after it is dropped too


def test_a_dspark_run_trains_exports_in_deepspecs_format_and_reports_its_heads(tiny_target, tiny_dataset, tmp_path):
    out, lines = tmp_path / "run", []
    stats = run(tiny_cfg(tiny_target, max_steps=4, **DSPARK), tiny_dataset, out, log=lines.append)
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["sample_from_anchor"] is True and config["block_size"] == 4
    assert config["target_layer_ids"] and config["mask_token_id"] is not None
    assert verify_dir(out / "drafter") == [] and type(load_drafter(out / "drafter")) is DSparkDrafter
    logged = [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert logged and all(0 <= row["confidence_mean"] <= 1 and 0 <= row["acceptance_overlap_mean"] <= 1
                          for row in logged)
    assert len(logged[-1]["accuracy_by_position"]) == 4  # every slot drafts, the anchor's included
    assert stats["heldout"]["serving_acceptance_length"] >= 1.0
    rerun = []
    run(tiny_cfg(tiny_target, max_steps=4, **DSPARK), tiny_dataset, out, log=rerun.append)
    assert "already done, verified" in rerun[0]


def test_dspark_trains_on_an_offline_cache_with_the_top_k_as_its_target(tiny_target, tiny_dataset, tmp_path):
    """With the target's labels (the cache's top-1) and a reduced draft vocabulary, as the demo trains."""
    stats = run(tiny_cfg(tiny_target, max_steps=2, features="offline", distill_topk=16, markov_head="rnn",
                         labels="target", draft_vocab_size=64, **DSPARK), tiny_dataset, tmp_path / "offline",
                log=quiet)
    drafter = load_drafter(tmp_path / "offline" / "drafter")
    assert stats["steps"] == 2 and drafter.markov_head_type == "rnn" and drafter.draft_vocab_size == 64
    assert stats["heldout"]["serving_acceptance_length"] >= 1.0


def test_the_dspark_loss_does_not_depend_on_how_a_step_is_split(tiny_target, tiny_dataset, tmp_path):
    cfg = tiny_cfg(tiny_target, batch_size=4, max_steps=2, export_dtype="float32", markov_head="gated", **DSPARK)
    run(cfg.model_copy(update={"micro_batch": 4}), tiny_dataset, tmp_path / "four", log=quiet)
    run(cfg.model_copy(update={"micro_batch": 1}), tiny_dataset, tmp_path / "one", log=quiet)
    assert same_weights(drafter_weights(tmp_path / "four"), drafter_weights(tmp_path / "one"))


def test_a_warm_start_takes_the_dflash_backbone_and_fresh_heads(tiny_target, tiny_dataset, tmp_path):
    run(tiny_cfg(tiny_target, max_steps=2, block_size=4, export_dtype="float32"), tiny_dataset, tmp_path / "dflash",
        log=quiet)
    source = tmp_path / "dflash" / "drafter"
    from transformers import AutoConfig

    lines = []
    warm = import_drafter(tiny_cfg(tiny_target, max_steps=2, init_from=str(source), **DSPARK),
                          AutoConfig.from_pretrained(tiny_target), lines.append)
    assert isinstance(warm, DSparkDrafter) and any("DSpark warm start" in line for line in lines)
    dflash = load_drafter(source)
    assert all(torch.equal(warm.state_dict()[name], tensor) for name, tensor in dflash.state_dict().items())
    assert not warm.markov_head.markov_w2.weight.any()  # the bias starts at zero: the backbone's own drafts
    stats = run(tiny_cfg(tiny_target, max_steps=2, init_from=str(source), **DSPARK), tiny_dataset,
                tmp_path / "warm", log=quiet)
    assert stats["steps"] == 2
    with pytest.raises(BadTrainingInput, match="is a DSpark drafter: set train.architecture: dspark"):
        import_drafter(tiny_cfg(tiny_target, init_from=str(tmp_path / "warm" / "drafter"), architecture="dflash2"),
                       AutoConfig.from_pretrained(tiny_target), quiet)


@pytest.mark.parametrize(("settings", "message"), [
    ({"markov_rank": 0}, "markov_rank 0 has no Markov head"),
    ({"loss": "dpace"}, "not D-PACE"),
    ({"sliding_window": 32}, "sliding_window is not supported"),
    ({"features": "offline"}, "set distill_topk"),
])
def test_settings_dspark_cannot_take_are_one_line_each(tmp_path, settings, message):
    path = tmp_path / "c.yaml"
    lines = ["train:", "  architecture: dspark", *(f"  {k}: {v}" for k, v in settings.items())]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_dspark_settings_on_another_architecture_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  markov_rank: 64\n")
    with pytest.raises(ConfigError, match="markov_rank does nothing here"):
        load_config(path)


@pytest.mark.slow
def test_dspark_under_torchrun_two_ranks_equal_one_process_and_fsdp_exports(tiny_target, tiny_dataset, tmp_path):
    """DDP: the step's weight total (DSpark's three terms share it) is summed across ranks, so two ranks of two
    sequences train what one process of four does. FSDP: the heads, outside the layers' shards, train and export."""
    from tests.train.test_train import torchrun, write_config

    common = dict(max_steps=2, checkpoint_every=1, export_dtype="float32", **DSPARK)
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=4, **common)
    ddp = write_config(tmp_path / "ddp.yaml", tiny_target, batch_size=2, **common)
    run(load_config(single).train, tiny_dataset, tmp_path / "one", log=quiet)
    proc = torchrun("train", "--config", str(ddp), "--data", str(tiny_dataset), "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_weights(drafter_weights(tmp_path / "one"), drafter_weights(tmp_path / "two"))
    fsdp = write_config(tmp_path / "fsdp.yaml", tiny_target, batch_size=1, fsdp=True, **common)
    proc = torchrun("train", "--config", str(fsdp), "--data", str(tiny_dataset), "--out", str(tmp_path / "three"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert type(load_drafter(tmp_path / "three" / "drafter")) is DSparkDrafter


# What DeepSpec's Qwen3DSparkModel requires of its config (it asserts each) and reads, beside the Qwen3 fields.
DEEPSPEC_FIELDS = {"target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                   "markov_head_type", "confidence_head_with_markov", "block_size", "num_target_layers"}


@pytest.mark.slow
def test_the_cli_trains_a_dspark_drafter_on_the_embedded_target_in_deepspecs_names_and_shapes(
        cli, smollm2_dir, tiny_dataset, tmp_path):
    """`flashdraft train --architecture dspark` on the embedded target (SmolLM2: 30 layers, 49,152 tokens), with the
    target's own labels and a reduced draft vocabulary: the export's config fields and tensor names and shapes
    are those of DeepSpec's model for that config (its embedding and LM head are the target's, not copied)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.train.test_train import write_config

    config = write_config(tmp_path / "c.yaml", smollm2_dir, num_layers=1, block_size=4, max_steps=2, batch_size=2,
                          markov_rank=16, labels="target", draft_vocab_size=512, mask_token_id=0,
                          target_layer_ids=[1, 14, 27])
    out = tmp_path / "run"
    cli("train", "--architecture", "dspark", "--config", str(config), "--data", str(tiny_dataset), "--out", str(out),
        check=True)
    exported = json.loads((out / "drafter" / "config.json").read_text())
    target = AutoConfig.from_pretrained(smollm2_dir)
    assert DEEPSPEC_FIELDS <= exported.keys() and exported["architectures"] == ["Qwen3DSparkModel"]
    assert exported["target_layer_ids"] == [1, 14, 27] and exported["num_target_layers"] == 30
    assert exported["hidden_size"] == target.hidden_size and exported["vocab_size"] == target.vocab_size
    d, v, r = target.hidden_size, target.vocab_size, 16
    shapes = {name: tuple(t.shape) for name, t in load_file(str(out / "drafter" / "model.safetensors")).items()}
    assert shapes["fc.weight"] == (d, 3 * d) and shapes["hidden_norm.weight"] == (d,) and shapes["norm.weight"] == (d,)
    assert shapes["markov_head.markov_w1.weight"] == (v, r) and shapes["markov_head.markov_w2.weight"] == (512, r)
    assert shapes["confidence_head.proj.weight"] == (1, d + r) and shapes["confidence_head.proj.bias"] == (1,)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (target.num_attention_heads * 64, d)
    assert shapes["lm_head.weight"] == (512, d) and shapes["d2t"] == (512,)  # vLLM's reduced-vocabulary layout
    assert not [name for name in shapes if name.startswith(("model.", "embed_tokens"))]


def test_a_block_the_context_cannot_hold_is_one_error_line(cli, tiny_target, tiny_dataset, tmp_path):
    """DSpark's block of K needs K + 1 positions (its last slot predicts the token after it): refused before any
    weight is built, as DFlash's block of K is past K."""
    from tests.train.test_train import write_config

    config = write_config(tmp_path / "c.yaml", tiny_target, block_size=4, max_length=4, max_steps=1)
    run = cli("train", "--architecture", "dspark", "--config", str(config), "--data", str(tiny_dataset), "--out",
              str(tmp_path / "out"))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("error:") == 1 and "needs 5 positions" in run.stderr
    dflash = cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(tmp_path / "dflash"),
                 "--max-steps", "1")  # DFlash's block of 4 fits in 4 positions, but no sample has one there
    assert "needs" not in dflash.stderr and "no training sample has a block to train on" in dflash.stderr
    fits = write_config(tmp_path / "fits.yaml", tiny_target, block_size=4, max_length=64, max_steps=1)
    cli("train", "--architecture", "dspark", "--config", str(fits), "--data", str(tiny_dataset), "--out",
        str(tmp_path / "tiny"), check=True)  # the CLI on a tiny random Qwen3: DeepSpec's contract, as above
    exported = json.loads((tmp_path / "tiny" / "drafter" / "config.json").read_text())
    assert DEEPSPEC_FIELDS <= exported.keys() and exported["architectures"] == ["Qwen3DSparkModel"]


@pytest.mark.parametrize("architecture", ["dflash", "dspark"])
def test_a_dataset_with_no_block_to_train_on_is_refused_not_trained_on_nothing(cli, tiny_target, tmp_path,
                                                                              architecture):
    """The smallest input: one sample of 6 tokens, 2 supervised. No block of 4 fits after a supervised anchor, so
    every step would train on nothing and the run still say done: one line instead, before any step, no output."""
    from tests.train.test_train import make_dataset, write_config

    data = make_dataset(tmp_path / "tiny", [[5, 6, 7, 8, 9, 10]], prompt_len=4)
    config = write_config(tmp_path / "c.yaml", tiny_target, block_size=4, max_steps=2, eval_samples=0)
    run_ = cli("train", "--architecture", architecture, "--config", str(config), "--data", str(data), "--out",
               str(tmp_path / "out"))
    assert run_.returncode == 1 and "Traceback" not in run_.stderr
    assert "no training sample has a block to train on" in run_.stderr
    assert not (tmp_path / "out" / "drafter").exists()


def test_a_resumed_dspark_run_ends_where_the_uninterrupted_one_does(tiny_target, tiny_dataset, tmp_path):
    """The heads' weights and their optimizer state are in the checkpoint: killed after step 2 of 4 (its export and
    last checkpoint gone), the rerun resumes there and ends with the same drafter."""
    import shutil

    cfg = tiny_cfg(tiny_target, max_steps=4, checkpoint_every=2, export_dtype="float32", **DSPARK)
    run(cfg, tiny_dataset, tmp_path / "whole", log=quiet)
    run(cfg, tiny_dataset, tmp_path / "cut", log=quiet)
    shutil.rmtree(tmp_path / "cut" / "drafter")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-0000004")
    lines = []
    run(cfg, tiny_dataset, tmp_path / "cut", log=lines.append)
    assert any("resuming from step-0000002" in line for line in lines)
    assert same_weights(drafter_weights(tmp_path / "whole"), drafter_weights(tmp_path / "cut"))
