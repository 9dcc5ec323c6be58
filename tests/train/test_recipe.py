"""The recipe's settings: the loss weighting (decay | dpace) under one normalisation over the whole optimizer step,
whichever way the step's sequences are split into micro-batches or over ranks."""

import math

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.config import ConfigError, TrainConfig, load_config
from flashdraft.train import run
from tests.train.test_train import quiet, rerun_without_the_end, tiny_cfg, torchrun, write_config


def drafter_weights(out) -> dict:
    return load_file(str(out / "drafter" / "model.safetensors"))


def same_weights(a: dict, b: dict, atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def tensors_apart(one: dict, two: dict, start: dict, fraction: float) -> list[str]:
    """The tensors where two Muon runs differ by more than `fraction` of run one's update from `start`: torch's
    Muon orthogonalises in bfloat16, so runs that sum gradients in another order agree to a fraction, not 1e-5."""
    return [k for k in one if (one[k] - two[k]).norm() > fraction * (one[k] - start[k]).norm() + 1e-6]


@pytest.mark.parametrize("loss", ["decay", "dpace"])
def test_a_step_does_not_depend_on_how_its_sequences_are_split(tiny_target, tiny_dataset, tmp_path, loss):
    """Sequences of different lengths and anchor counts: Σ CE·w / Σ w over the step, not a mean of per-sequence
    ratios, so one micro-batch of 4 and four of 1 give the same update."""
    cfg = tiny_cfg(tiny_target, batch_size=4, max_steps=3, loss=loss, export_dtype="float32")
    run(cfg.model_copy(update={"micro_batch": 4}), tiny_dataset, tmp_path / "four", log=quiet)
    run(cfg.model_copy(update={"micro_batch": 1}), tiny_dataset, tmp_path / "one", log=quiet)
    assert same_weights(drafter_weights(tmp_path / "four"), drafter_weights(tmp_path / "one"))


def test_dpace_reaches_the_step_and_refuses_a_decay_gamma(tiny_target, tiny_dataset, tmp_path):
    cfg = tiny_cfg(tiny_target, max_steps=2, export_dtype="float32")
    run(cfg, tiny_dataset, tmp_path / "decay", log=quiet)
    run(cfg.model_copy(update={"loss": "dpace"}), tiny_dataset, tmp_path / "dpace", log=quiet)
    assert not same_weights(drafter_weights(tmp_path / "decay"), drafter_weights(tmp_path / "dpace"), atol=1e-7)
    with pytest.raises(ConfigError, match="loss_decay_gamma sets the decay loss's weights"):
        load_config(None, {"train.loss": "dpace", "train.loss_decay_gamma": 3.0})
    with pytest.raises(ValueError):
        TrainConfig(loss="dpace", dpace_alpha=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "optimizer"), [("decay", "adamw"), ("dpace", "adamw"), ("decay", "muon")])
def test_two_ranks_of_two_equal_one_process_of_four(tiny_target, tiny_dataset, tmp_path, loss, optimizer):
    """The step's weight total is summed across ranks before gradients are divided by it."""
    common = dict(max_steps=2, checkpoint_every=1, loss=loss, optimizer=optimizer, export_dtype="float32")
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=4, **common)
    ddp = write_config(tmp_path / "ddp.yaml", tiny_target, batch_size=2, **common)
    run(load_config(single).train, tiny_dataset, tmp_path / "one", log=quiet)
    proc = torchrun("train", "--config", str(ddp), "--data", str(tiny_dataset), "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = drafter_weights(tmp_path / "one"), drafter_weights(tmp_path / "two")
    if optimizer == "adamw":
        assert same_weights(one, two)
        return
    # torch's Muon orthogonalises in bfloat16, where a 1e-6 change of a gradient (another summation order)
    # moves the update by ~1 % (measured): the two runs agree to that, tensor by tensor, not to 1e-5.
    start = load_file(str(tmp_path / "one" / "checkpoints" / "step-0000001" / "drafter.safetensors"))  # lr 0
    assert tensors_apart(one, two, start, 0.03) == []


@pytest.mark.slow
def test_muon_under_fsdp_orthogonalises_whole_matrices_and_resumes(tiny_target, tiny_dataset, tmp_path):
    """FSDP holds each matrix as row shards (DTensors); torch's Muon runs its Newton–Schulz iteration on them
    through DTensor's operators, which gather what a product needs, so the update is the whole matrix's. A run
    resumed from a checkpoint into the shards (Muon's momentum included) ends where the uninterrupted one does."""
    common = dict(max_steps=4, checkpoint_every=2, optimizer="muon", export_dtype="float32")
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=4, **common)
    fsdp = write_config(tmp_path / "fsdp.yaml", tiny_target, batch_size=2, fsdp=True, **common)
    run(load_config(single).train, tiny_dataset, tmp_path / "one", log=quiet)
    args = ["train", "--config", str(fsdp), "--data", str(tiny_dataset), "--out", str(tmp_path / "two")]
    proc = torchrun(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = drafter_weights(tmp_path / "one"), drafter_weights(tmp_path / "two")
    # Against one process, to bfloat16's rounding (measured: at most 0.14 of a tensor's update, where these tiny
    # low-rank gradients leave near-zero singular values that the iteration amplifies); orthogonalising each
    # shard on its own instead is off by about the whole update (1.09 for fc, measured by that mutation).
    start = load_file(str(tmp_path / "one" / "checkpoints" / "step-0000002" / "drafter.safetensors"))
    assert tensors_apart(one, two, start, 0.3) == []

    final = load_file(str(tmp_path / "two" / "checkpoints" / "step-0000004" / "drafter.safetensors"))
    again, resumed = rerun_without_the_end(args, tmp_path / "two", "step-0000004")
    assert again.returncode == 0 and "resuming from step-0000002" in again.stdout + again.stderr, again.stderr[-3000:]
    assert all(torch.allclose(resumed[k], final[k], atol=1e-6) for k in final)


def test_muon_takes_the_matrices_and_adamw_the_rest(tiny_target):
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.optim import build_optimizers

    target = Target(tiny_target, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=2, block_size=8, mask_token_id=127))
    muon, adamw = build_optimizers(TrainConfig(optimizer="muon", lr=1e-3), drafter, 10).all
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    by_name = {id(p): name for name, p in drafter.named_parameters()}
    matrices = {by_name[id(p)] for g in muon.param_groups for p in g["params"]}
    assert "fc.weight" in matrices and "layers.0.self_attn.q_proj.weight" in matrices
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert {by_name[id(p)] for g in adamw.param_groups for p in g["params"]} == set(by_name.values()) - matrices
    assert muon.param_groups[0]["initial_lr"] == 1e-2 and muon.param_groups[0]["weight_decay"] == 0.1  # 10 × lr


def test_adamw_is_fused_and_updates_as_torchs_loop_does(tiny_target):
    """One fused kernel over every parameter (3x faster on CPU, measured), the same update as torch's
    per-parameter loop to float32 rounding, step by step under the same schedule."""
    from transformers import get_cosine_schedule_with_warmup

    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.optim import build_optimizers

    config = draft_config(Target(tiny_target, "cpu", quiet).config, num_layers=2, block_size=8, mask_token_id=127)
    torch.manual_seed(0)
    ours, reference = DFlashDrafter(config), DFlashDrafter(config)
    reference.load_state_dict(ours.state_dict())
    start = {k: v.clone() for k, v in ours.state_dict().items()}
    cfg = TrainConfig(lr=1e-3, weight_decay=0.01)
    optimizers = build_optimizers(cfg, ours, 10)
    assert optimizers.all[0].param_groups[0]["fused"] is True
    loop = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), foreach=False)
    schedule = get_cosine_schedule_with_warmup(loop, math.ceil(cfg.warmup_ratio * 10), 10)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
            mine.grad = torch.randn(mine.shape, generator=g)
            theirs.grad = mine.grad.clone()
        optimizers.step()
        loop.step()
        schedule.step()
    after, expected = ours.state_dict(), reference.state_dict()
    assert all(torch.allclose(after[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected)
    assert not torch.equal(after["fc.weight"], start["fc.weight"])  # the steps did something


def test_target_labels_are_the_targets_greedy_tokens(tiny_target):
    """On the target's own greedy continuation they equal the data; on a sampled one they differ exactly where
    a sampled token is not the target's argmax (computed here by transformers' own forward over the sequence)."""
    from transformers import AutoModelForCausalLM

    from flashdraft.model.target import Target
    from flashdraft.train.plan import plan_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    prompt = torch.tensor([[5, 17, 33, 2, 91, 64, 8, 12]])
    torch.manual_seed(0)
    greedy = model.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)[0]
    sampled = model.generate(prompt, max_new_tokens=30, do_sample=True, temperature=1.5, min_new_tokens=30)[0]
    target = Target(tiny_target, "cpu", quiet, "float32")
    target.watch([1, 3])
    cfg = TrainConfig(target=tiny_target, labels="target", block_size=4, max_anchors=64)
    mask = [0] * 8 + [1] * 30
    for ids, is_greedy in ((greedy, True), (sampled, False)):
        plan = plan_batch(target, [(ids.tolist(), mask)], cfg, [torch.Generator().manual_seed(0)], 4)
        labels, anchors = plan.labels[0], plan.live[0][3]
        reach = int(anchors.max()) + 3  # the last label a block reads
        with torch.no_grad():
            argmax = model(ids[None]).logits[0].argmax(-1)
        assert torch.equal(labels[9 : reach + 1], argmax[8:reach])
        departs = ids[9 : reach + 1] != argmax[8:reach]
        assert not departs.any() if is_greedy else departs.any()


def test_target_labels_from_the_offline_cache_are_the_online_ones(tiny_target, tiny_dataset, tmp_path):
    from datasets import load_from_disk

    from flashdraft.artifact.manifest import read_manifest
    from flashdraft.model.target import Target
    from flashdraft.train.feature_cache import FeatureCache
    from flashdraft.train.plan import plan_batch

    with pytest.raises(ConfigError, match="labels: target with features: offline reads the target's argmax"):
        load_config(None, {"train.labels": "target", "train.features": "offline"})
    cfg = tiny_cfg(tiny_target, max_steps=2, labels="target", features="offline", distill_topk=1, distill_weight=0.0,
                   target_dtype="float32")
    run(cfg, tiny_dataset, tmp_path / "out", log=quiet)  # trains on them
    cache, rows = FeatureCache(tmp_path / "out" / "features"), load_from_disk(str(tiny_dataset))
    target = Target(tiny_target, "cpu", quiet, "float32")
    target.watch(read_manifest(tmp_path / "out" / "features").stats["layer_ids"])
    for index in (0, 5):
        row = (rows[index]["input_ids"], rows[index]["loss_mask"])
        online = plan_batch(target, [row], cfg, [torch.Generator().manual_seed(index)], cfg.block_size)
        offline = plan_batch(target, [row], cfg, [torch.Generator().manual_seed(index)], cfg.block_size,
                             [cache[index]], [cache.teacher(index)])
        reach = int(online.live[0][3].max()) + cfg.block_size - 1
        supervised = torch.as_tensor(row[1][: reach + 1]).bool()
        assert torch.equal(online.labels[0][: reach + 1][supervised], offline.labels[0][: reach + 1][supervised])
