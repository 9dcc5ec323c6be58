"""`flashdraft estimate`: the numbers follow from the config and the target's shape, before anything runs."""

import json
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Qwen3-8B's published shape, written the way its config.json on the hub states it.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}


def _last_json(proc) -> dict:
    return json.loads(proc.stdout)


def test_estimate_of_a_local_config_matches_the_real_drafter(cli, tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    from flashdraft.model.drafter import DFlashDrafter, draft_config

    config = tmp_path / "tiny.yaml"
    workdir = tmp_path / "work"
    config.write_text(yaml.safe_dump({
        "workdir": str(workdir),
        "generate": {"model": tiny_model_dir, "max_prompts": 12, "max_new_tokens": 24},
        "tokenize": {"tokenizer": tiny_model_dir, "max_length": 512},
        "train": {"target": tiny_model_dir, "num_layers": 2, "epochs": 3, "batch_size": 4, "keep_checkpoints": 2},
    }))
    est = _last_json(cli("estimate", str(config), "--json", check=True))
    assert not workdir.exists()  # an estimate runs nothing

    assert est["prompts"] == 12 and est["completion_tokens_max"] == 12 * 24
    assert est["prompt_tokens_measured"].startswith("404 prompts rendered")  # the built-in set, measured
    real = DFlashDrafter(draft_config(AutoConfig.from_pretrained(tiny_model_dir), num_layers=2, block_size=16,
                                      mask_token_id=0))
    assert est["drafter_params"] == sum(p.numel() for p in real.parameters())
    assert est["checkpoints_bytes"] == 2 * 12 * est["drafter_params"]
    hidden, layers = 32, len(est["target_layer_ids"])
    assert est["offline_features_bytes"] == est["dataset_tokens"] * layers * hidden * 2
    assert est["train_steps"] == 3 * 3  # 12 samples / batch 4, 3 epochs
    # the export is bfloat16: 2 bytes a parameter; GPU memory counts the real target's parameters
    from transformers import AutoModelForCausalLM

    assert est["drafter_bytes"] == 2 * est["drafter_params"]
    gpu = est["gpu_memory"]
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert gpu["target_params"] == sum(p.numel() for p in whole.parameters())
    assert gpu["target_params_from"] == "counted from its config" and gpu["target_bytes"] == 2 * gpu["target_params"]
    assert gpu["drafter_state_bytes"] == 16 * est["drafter_params"]
    # each GPU's peak (README): the drafter's over its state, the target's over its weights
    assert gpu["drafter_device_bytes"] > gpu["drafter_state_bytes"] + gpu["activation_bytes"] > 0
    assert gpu["target_device_bytes"] > gpu["target_bytes"]


def test_estimate_counts_a_dflash2_drafter_as_built(tiny_model_dir):
    """The convolutions and the selector's codebooks (2 · V · r: the bulk of DFlash2's extra parameters)."""
    from transformers import AutoConfig

    from flashdraft.config import load_config
    from flashdraft.estimate import estimate
    from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
    from flashdraft.model.drafter import draft_config

    settings = {"num_layers": 2, "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 64,
                "selector_top_k": 16}
    cfg = load_config(None, {"train.target": tiny_model_dir, "train.architecture": "dflash2",
                             **{f"train.{k}": v for k, v in settings.items()}})
    est = estimate(cfg, num_prompts=10)
    target = AutoConfig.from_pretrained(tiny_model_dir)
    config = draft_config(target, num_layers=2, block_size=16, mask_token_id=0)
    real = DFlash2Drafter(dflash2_config(config, target, **{k: v for k, v in settings.items() if k != "num_layers"}))
    assert est["drafter_params"] == sum(p.numel() for p in real.parameters())
    dflash = estimate(load_config(None, {"train.target": tiny_model_dir, "train.num_layers": 2}), num_prompts=10)
    assert est["drafter_params"] - dflash["drafter_params"] > 2 * target.vocab_size * 64


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_estimate_counts_a_dspark_drafter_as_built(tiny_model_dir, head):
    """The Markov head's V × r embedding and V′ × r projection (with a reduced draft vocabulary V′), its gate or
    recurrence, and the confidence head."""
    from transformers import AutoConfig

    from flashdraft.config import load_config
    from flashdraft.estimate import estimate
    from flashdraft.model.drafter import draft_config
    from flashdraft.model.dspark import DSparkDrafter, dspark_config

    cfg = load_config(None, {"train.target": tiny_model_dir, "train.architecture": "dspark", "train.num_layers": 2,
                             "train.markov_rank": 32, "train.markov_head": head, "train.draft_vocab_size": 512})
    est = estimate(cfg, num_prompts=10)
    target = AutoConfig.from_pretrained(tiny_model_dir)
    config = draft_config(target, num_layers=2, block_size=16, mask_token_id=0, draft_vocab_size=512)
    real = DSparkDrafter(dspark_config(config, markov_rank=32, markov_head=head, confidence_head=True,
                                       num_anchors=512))
    assert est["drafter_params"] == sum(p.numel() for p in real.parameters())


def test_estimate_counts_max_steps_when_set(cli):
    """The demo sets max_steps (2,600 over 1,267 samples in batches of 4: ≈ 8.2 epochs): the estimate says the
    steps training will run, not the epochs'."""
    from flashdraft.demo import DEMO_SETTINGS

    demo = str(EXAMPLES / "demo-full.yaml")  # DEMO_SETTINGS: the full demo's
    text = cli("estimate", demo, check=True).stdout
    steps = DEMO_SETTINGS["train.max_steps"]
    epochs = steps / -(-DEMO_SETTINGS["generate.max_prompts"] // DEMO_SETTINGS["train.batch_size"])
    assert _last_json(cli("estimate", demo, "--json", check=True))["train_steps"] == steps
    assert (f"train: {steps:,} optimizer steps of 1 process(es) × batch 4 (max_steps, ≈ {epochs:.2f} epochs, "
            "train.nproc_per_node 1 × train.nnodes 1)") in text


def test_estimate_of_the_8b_example_states_rate_and_sizes(cli, tmp_path):
    target = tmp_path / "config.json"
    target.write_text(json.dumps(QWEN3_8B))
    proc = cli("estimate", str(EXAMPLES / "qwen3-8b.yaml"), "--num-prompts", "800000",
               "--target-config", str(target), "--json", check=True)
    est = _last_json(proc)
    assert est["completion_tokens_max"] == 800_000 * 2816
    assert est["generation_tokens_per_s"] == 4 * 2000  # four endpoints in the example, stated in the output
    assert est["generation_hours"] == round(800_000 * 2816 / 8000 / 3600, 2)
    assert est["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert 1.0e9 < est["drafter_params"] < 1.2e9  # 5 Qwen3-8B-shaped layers + fc
    assert "8,000 tokens/s" in proc.stderr and "TB" in proc.stderr  # the offline cache would be terabytes

    faster = cli("estimate", str(EXAMPLES / "qwen3-8b.yaml"), "--num-prompts", "800000", "--target-config",
                 str(target), "--tokens-per-s", "16000", "--json", check=True)
    faster = _last_json(faster)
    assert faster["generation_hours"] == round(est["generation_hours"] / 2, 2)


def test_estimate_says_what_it_is_missing(cli, tmp_path):
    no_target = cli("estimate", str(EXAMPLES / "qwen3.6-27b.yaml"), "--num-prompts", "10")
    assert no_target.returncode == 1 and "--target-config" in no_target.stderr
    no_prompts = cli("estimate", str(EXAMPLES / "qwen3-8b.yaml"))
    assert no_prompts.returncode == 1 and "--num-prompts" in no_prompts.stderr


# A Qwen3.5/3.6-27B checkpoint's config.json: VLM-wrapped (text settings under text_config), hybrid (three Gated
# DeltaNet layers to each full-attention layer), partial RoPE. Shape as published for Qwen3.5-27B.
QWEN3_6_27B = json.loads((Path(__file__).parent / "assets" / "qwen3.6-27b-config.json").read_text())


def test_estimate_of_the_27b_example_reads_the_text_config(cli, tmp_path):
    target = tmp_path / "config.json"
    target.write_text(json.dumps(QWEN3_6_27B))
    est = _last_json(cli("estimate", str(EXAMPLES / "qwen3.6-27b.yaml"), "--num-prompts", "900000",
                         "--target-config", str(target), "--json", check=True))
    assert est["target"] == {"layers": 64, "hidden": 5120, "vocab": 248320, "from": str(target),
                             "linear_attention_layers": 48}  # Gated DeltaNet: 3 of every 4 layers
    assert est["target_layer_ids"] == [1, 16, 31, 46, 61]  # uniform from 1 to L − 3
    # 5 draft layers of the target's shape (q 24 × 256, kv 4 × 256, MLP 17,408) plus fc (5 × 5120 → 5120)
    layer = 5120 * 256 * (2 * 24 + 2 * 4) + 2 * 256 + 3 * 5120 * 17408 + 2 * 5120
    assert est["drafter_params"] == 5 * layer + 5 * 5120 * 5120 + 2 * 5120


def test_estimate_gives_training_and_eval_hours_from_the_measured_step(cli, tmp_path):
    """The 8B shape with its ~1.05B drafter is the measured reference (1.18 s a step at batch 4); the 27B's
    step is scaled up by its training FLOPs; hours are steps × step."""
    from flashdraft.config import load_config

    steps = {}
    for name, config, example in [("8b", QWEN3_8B, "qwen3-8b.yaml"), ("27b", QWEN3_6_27B, "qwen3.6-27b.yaml")]:
        target = tmp_path / f"{name}.json"
        target.write_text(json.dumps(config))
        est = _last_json(cli("estimate", str(EXAMPLES / example), "--num-prompts", "1000", "--target-config",
                             str(target), "--json", check=True))
        steps[name] = est["train_step_s"] * 4 / load_config(EXAMPLES / example).train.batch_size  # at batch 4
        assert est["train_hours"] == round(est["train_steps"] * est["train_step_s"] / 3600, 1)
        assert est["eval_hours"] > 0
    assert abs(steps["8b"] - 1.18) < 0.05 and steps["27b"] > 2 * steps["8b"]


def test_eval_hours_count_every_prompt_set_and_mt_benchs_second_turn():
    import pytest

    from flashdraft.config import load_config
    from flashdraft.estimate import estimate

    one = load_config(None, {"eval.prompts": "gsm8k", "eval.max_new_tokens": 2048})
    many = load_config(None, {"eval.prompts": ["gsm8k", "mt-bench", "builtin:chat-heldout"],
                               "eval.max_new_tokens": 2048})
    hours = [estimate(cfg, num_prompts=1000)["eval_hours"] for cfg in (one, many)]
    assert hours[1] == pytest.approx(4 * hours[0], rel=0.05)  # gsm8k + mt-bench's two turns + the built-in set


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_no_shipped_example_generates_what_tokenize_throws_away(tmp_path, example):
    """generate.max_new_tokens and tokenize.max_length agree in every example: a sample of a mean prompt and a
    full-length completion fits (else estimate's warning line, tested below, is what the user would see)."""
    from flashdraft.config import load_config
    from flashdraft.estimate import estimate

    target = tmp_path / "config.json"
    target.write_text(json.dumps(QWEN3_8B))
    est = estimate(load_config(EXAMPLES / example), num_prompts=1000, target_config=target)
    assert est["completion_share_cut_max"] == 0, est["longest_sample_tokens"]


def test_estimate_warns_when_generation_outruns_max_length_and_fits_a_budget(cli, tmp_path):
    target = tmp_path / "config.json"
    target.write_text(json.dumps(QWEN3_8B))
    cfg = yaml.safe_load((EXAMPLES / "qwen3-8b.yaml").read_text())
    cfg["generate"]["max_new_tokens"] = 8192
    cfg["train"].update(nproc_per_node=2, device="cuda:2;cuda:3", epochs=2, batch_size=4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ("estimate", str(path), "--num-prompts", "1000", "--target-config", str(target), "--train-hours", "0.05")
    text = cli(*args, check=True).stdout
    est = _last_json(cli(*args, "--json", check=True))
    # (200 + 8,192 − 3,072) / 8,192 of a full-length completion is cut
    assert est["completion_share_cut_max"] == round((200 + 8192 - 3072) / 8192, 3)
    assert "tokenize: WARNING" in text and "up to 65% of a completion" in text
    assert est["train_steps"] == 2 * 1000 // (4 * 2)  # 2 epochs, 2 processes × batch 4 a step
    assert est["train_gpu_hours"] == pytest.approx(2 * est["train_hours"], abs=0.1)
    fits = est["train_fits"]
    assert fits["max_steps"] == int(0.05 * 3600 / est["train_step_s"]) < est["train_steps"]
    assert f"set train.max_steps: {fits['max_steps']:,}" in text


def test_estimate_refuses_a_mean_or_budget_that_is_no_number_of_it(cli, tmp_path):
    from flashdraft.config import load_config
    from flashdraft.estimate import EstimateError, estimate

    target = tmp_path / "config.json"
    target.write_text(json.dumps(QWEN3_8B))
    cfg = load_config(EXAMPLES / "qwen3-8b.yaml")
    for name, value in [("mean_new_tokens", 0), ("mean_new_tokens", 999_999), ("train_hours", float("nan")),
                        ("train_hours", -1.0)]:
        with pytest.raises(EstimateError, match="--" + name.replace("_", "-")):
            estimate(cfg, num_prompts=10, target_config=target, **{name: value})
    proc = cli("estimate", str(EXAMPLES / "qwen3-8b.yaml"), "--num-prompts", "10", "--target-config", str(target),
               "--train-hours", "nan")  # and through the command: one line, exit 1
    assert proc.returncode == 1 and "--train-hours" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("hidden", "intermediate", "length", "anchors", "layers"),
                         [(64, 128, 512, 16, 2), (128, 256, 1024, 32, 1), (64, 128, 512, 32, 3)])
def test_the_gpu_memory_formula_holds_to_the_peaks_measured_at_small_shapes(tmp_path, hidden, intermediate, length,
                                                                          anchors, layers):
    """The drafter device's step (offline features: the drafter's side alone) and the target device's pass, each
    measured on a CPU (every tensor counted while it lives, saved-for-backward ones included), against the formulas
    `estimate` prints the reference run's GPUs from, evaluated with the CPU's terms: within 10 % each."""
    import sys

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flashdraft.config import TrainConfig
    from flashdraft.estimate import TargetShape, drafter_step_bytes, target_pass_bytes
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.plan import plan_batch, target_pass
    from flashdraft.train.step import batch_step

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from memory_counter import MemoryCounter

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    target = Target(str(tmp_path), "cpu", lambda s: None)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=layers, block_size=16, mask_token_id=0))
    target.watch(drafter.target_layer_ids)
    micro, rows = 2, []
    for _ in range(micro):
        mask = torch.ones(length, dtype=torch.long)
        mask[: length // 4] = 0
        rows.append((torch.randint(0, 4096, (length,)), mask))
    features = [target.features(ids[None])[0] for ids, _ in rows]
    cfg = TrainConfig(target=str(tmp_path), num_layers=layers, block_size=16, max_anchors=anchors, micro_batch=micro,
                      batch_size=micro, max_length=length, bf16=False)
    plan = plan_batch(target, rows, cfg, [torch.Generator().manual_seed(i) for i in range(micro)], 16, features)
    target.heads_beside(drafter, "cpu")
    with MemoryCounter() as step:
        results = batch_step(drafter, target, [], cfg, [], "cpu", planned=plan)
        sum(r["weighted_ce"] for r in results if r).backward()
    shape = TargetShape.from_config(target.config, "test")
    n = len(drafter.target_layer_ids)
    formula = drafter_step_bytes(shape, cfg, micro, n, cuda=False, context=plan.context_len, rows=anchors * 16)
    assert abs(formula["total"] / step.peak_bytes - 1) < 0.10, (formula, step.peak_bytes)

    with MemoryCounter() as target_side:
        target_pass(target, torch.stack([ids for ids, _ in rows]), length, False)
    assert abs(target_pass_bytes(shape, micro * length, n, cuda=False) / target_side.peak_bytes - 1) < 0.10


def test_a_hybrid_targets_parameters_are_counted_from_its_real_layer_shapes():
    """Gated-DeltaNet and gated full-attention layers counted as transformers builds them (on the meta device), and
    the 27B's shape gives its published size, not the 24.4B of dense attention layers."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from flashdraft.estimate import TargetShape, shape_params, target_params

    config = Qwen3_5TextConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=1000,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                               linear_num_value_heads=6, linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=24, linear_conv_kernel_dim=3, tie_word_embeddings=False)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    assert shape_params(TargetShape.from_config(config, "test")) == sum(p.numel() for p in built.parameters())
    path = Path(__file__).parent / "assets" / "qwen3.6-27b-config.json"
    count, how = target_params("unused", path, target_shape_of(path))
    assert 26.8e9 < count < 27.0e9 and "48 Gated-DeltaNet" in how  # Qwen3.6-27B: 27B (its language model: 26.9B)


def target_shape_of(path):
    from flashdraft.estimate import target_shape

    return target_shape("unused", path)


def test_the_plan_counts_nodes_micro_batch_passes_and_a_measured_step():
    """train divides the data by every process of every node; micro_batch below the batch is several passes a step;
    a step measured on the user's own node replaces the scaled reference; a hybrid target says its hours on
    transformers' reference loop."""
    from flashdraft.config import load_config
    from flashdraft.estimate import estimate

    asset = Path(__file__).parent / "assets" / "qwen3.6-27b-config.json"

    def plan(**overrides):
        cfg = load_config(EXAMPLES / "qwen3.6-27b.yaml", {f"train.{k}": v for k, v in overrides.items()})
        return estimate(cfg, num_prompts=900000, target_config=asset)

    one = plan()
    two = plan(nnodes=2, rdzv_endpoint="node0:29400")
    assert one["train_steps"] == 112500 and two["train_steps"] == 56250
    assert two["train_hours"] == pytest.approx(one["train_hours"] / 2, rel=1e-3)
    assert two["train_gpu_hours"] == pytest.approx(one["train_gpu_hours"], rel=1e-3)  # the same work, twice the GPUs
    three = plan(micro_batch=3)  # two passes a step, each counted as a full micro-batch of 3
    assert three["train_passes_per_step"] == 2 and three["train_step_s"] == pytest.approx(1.5 * one["train_step_s"],
                                                                                          rel=1e-3)
    assert one["train_hours_reference_loop"] == pytest.approx(1.7 * one["train_hours"], rel=1e-2)
    cfg = load_config(EXAMPLES / "qwen3.6-27b.yaml", {})
    measured = estimate(cfg, num_prompts=900000, target_config=asset, step_seconds=4.2)
    assert measured["train_step_s"] == 4.2 and measured["train_hours"] == pytest.approx(112500 * 4.2 / 3600, rel=1e-3)
    assert measured["train_step_measured"] and measured["train_hours_reference_loop"] is None


def test_train_says_its_measured_pace_after_its_first_steps(tiny_target, tiny_dataset, tmp_path):
    from flashdraft.train import run
    from tests.train.test_train import tiny_cfg

    said = []
    run(tiny_cfg(tiny_target, max_steps=14, checkpoint_every=100), tiny_dataset, tmp_path / "out", log=said.append)
    line = next(x for x in said if x.startswith("train: measured "))
    assert "s a step (median of steps 2–10); the 4 steps left take ≈" in line and "--step-seconds" in line
