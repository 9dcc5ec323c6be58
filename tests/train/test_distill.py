"""Distillation on the target's top-k (`train.distill_topk`) and bfloat16 autocast on CPU (`train.bf16`)."""

import pytest
import torch

from flashdraft.artifact.manifest import read_manifest, verify_dir
from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.target import Target
from flashdraft.train import run
from flashdraft.train.feature_cache import FeatureCache, feature_bytes
from flashdraft.train.plan import plan_batch
from flashdraft.train.step import batch_step

from .test_train import quiet, tiny_cfg


def test_the_cache_keeps_the_targets_top_k_and_a_new_k_rebuilds_it(tiny_target, tiny_dataset, tmp_path):
    lines = []
    run(tiny_cfg(tiny_target, max_steps=4, features="offline", distill_topk=5), tiny_dataset, tmp_path / "a",
        log=lines.append)
    assert any("top 5 next tokens" in line for line in lines)
    assert verify_dir(tmp_path / "a" / "features") == []
    cache = FeatureCache(tmp_path / "a" / "features")
    target = Target(tiny_target, "cpu", quiet)
    target.watch(read_manifest(tmp_path / "a" / "features").stats["layer_ids"])
    sample = __import__("datasets").load_from_disk(str(tiny_dataset))[2]
    ids, mask = torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["loss_mask"]).bool()
    output, _ = target.forward(ids[None])
    exact = torch.log_softmax(target.lm_head(output.last_hidden_state[0]).float(), -1).topk(5, dim=-1)
    got_ids, got_logprobs = cache.teacher(2)
    read = torch.cat([mask[1:], torch.tensor([False])])  # before a supervised token: where training reads it
    assert 0 < read.sum() < len(ids)  # the sample has both kinds of position
    assert torch.equal(got_ids[read], exact.indices[read])
    assert torch.allclose(got_logprobs[read], exact.values[read], atol=2e-2)  # float16 storage
    assert not got_ids[~read].any() and not got_logprobs[~read].any()  # not computed: zeros, no loss weight there
    # What `flashdraft estimate` says the cache weighs is what it weighs on disk.
    stats = read_manifest(tmp_path / "a" / "features").stats
    on_disk = sum(f.stat().st_size for f in (tmp_path / "a" / "features").glob("*.bin"))
    layers = len(stats["layer_ids"])
    assert on_disk == feature_bytes(stats["tokens"], layers, stats["width"] // layers, 5)

    # A cache without distillation has no teacher; its lineage differs, so a top-k run would not reuse it.
    run(tiny_cfg(tiny_target, max_steps=4, features="offline"), tiny_dataset, tmp_path / "b", log=quiet)
    assert FeatureCache(tmp_path / "b" / "features").teacher(2) is None
    assert read_manifest(tmp_path / "b" / "features").lineage != read_manifest(tmp_path / "a" / "features").lineage


def test_a_bfloat16_target_caches_its_own_features_and_is_not_taken_for_float32(tiny_target, tiny_dataset,
                                                                                   tmp_path):
    run(tiny_cfg(tiny_target, max_steps=2, features="offline", target_dtype="bfloat16"), tiny_dataset,
        tmp_path / "bf16", log=quiet)
    run(tiny_cfg(tiny_target, max_steps=2, features="offline"), tiny_dataset, tmp_path / "fp32", log=quiet)
    layers = read_manifest(tmp_path / "bf16" / "features").stats["layer_ids"]
    ids = torch.as_tensor(__import__("datasets").load_from_disk(str(tiny_dataset))[2]["input_ids"])
    features = {}
    for dtype in ("bfloat16", "float32"):
        target = Target(tiny_target, "cpu", quiet, dtype)
        assert target.model.dtype == getattr(torch, dtype)
        target.watch(layers)
        features[dtype] = target.features(ids[None])[0].to(torch.bfloat16).float()  # as the cache stores them
    cached = {"bfloat16": FeatureCache(tmp_path / "bf16" / "features")[2],
              "float32": FeatureCache(tmp_path / "fp32" / "features")[2]}
    assert not torch.equal(features["bfloat16"], features["float32"])  # the two types compute different features
    for dtype, mine in cached.items():
        other = "float32" if dtype == "bfloat16" else "bfloat16"
        assert (mine - features[dtype]).abs().max() < (mine - features[other]).abs().max(), dtype
    lineages = {read_manifest(tmp_path / d / "features").lineage.config for d in ("bf16", "fp32")}
    assert len(lineages) == 2  # a float32 run does not reuse a bfloat16 cache, nor the other way


def test_distillation_needs_the_offline_cache(tiny_target, tiny_dataset, tmp_path):
    with pytest.raises(BadTrainingInput, match="offline feature cache"):
        run(tiny_cfg(tiny_target, max_steps=2, distill_topk=4), tiny_dataset, tmp_path / "out", log=quiet)


def one_sequence(target, drafter, cfg, teacher):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 120, (60,), generator=g)
    mask = torch.ones(60, dtype=torch.long)
    mask[:8] = 0
    features = [target.features(ids[None])[0]]
    plan = plan_batch(target, [(ids, mask)], cfg, [torch.Generator().manual_seed(1)], drafter.block_size,
                      features, None if teacher is None else [teacher(ids)])
    return batch_step(drafter, target, [], cfg, [], "cpu", planned=plan)[0]["loss"].item()


@pytest.fixture
def small(tiny_target):
    torch.manual_seed(0)
    target = Target(tiny_target, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=2, block_size=8, mask_token_id=127))
    target.watch(drafter.target_layer_ids)
    return target, drafter


def test_a_teacher_sure_of_the_label_gives_the_hard_loss_and_another_does_not(small, tiny_target):
    target, drafter = small
    cfg = TrainConfig(target=tiny_target, max_anchors=6, block_size=8, distill_topk=2, distill_weight=0.5)
    hard = one_sequence(target, drafter, cfg, None)

    def sure(ids):  # after position p the target is certain of the token at p + 1 (the label)
        nxt = torch.cat([ids[1:], ids[-1:]])
        return torch.stack([nxt, (nxt + 1) % 120], 1), torch.tensor([[0.0, -80.0]]).expand(len(ids), 2)

    def elsewhere(ids):  # certain of another token
        nxt = (torch.cat([ids[1:], ids[-1:]]) + 1) % 120
        return torch.stack([nxt, (nxt + 1) % 120], 1), torch.tensor([[0.0, -80.0]]).expand(len(ids), 2)

    assert one_sequence(target, drafter, cfg, sure) == pytest.approx(hard, rel=1e-5)
    assert abs(one_sequence(target, drafter, cfg, elsewhere) - hard) > 1e-3  # (an untrained drafter: near uniform)
    weightless = cfg.model_copy(update={"distill_weight": 0.0})
    assert one_sequence(target, drafter, weightless, elsewhere) == pytest.approx(hard, rel=1e-6)


def test_bf16_autocast_on_cpu_computes_in_bfloat16(small, tiny_target):
    target, drafter = small
    cfg = TrainConfig(target=tiny_target, max_anchors=6, block_size=8)
    exact = one_sequence(target, drafter, cfg, None)
    low = one_sequence(target, drafter, cfg.model_copy(update={"bf16": True}), None)
    assert low != exact  # it did run in another precision…
    assert low == pytest.approx(exact, rel=2e-2)  # …of the same numbers


def test_feature_batches_cover_every_sample_once_within_the_token_budget():
    from flashdraft.train.feature_cache import BATCH_TOKENS, _length_batches

    lengths = [40, 2000, 0, 100, 101, 99, 1024, 300, 7, 512, 513]
    batches = _length_batches(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= BATCH_TOKENS
    assert [1] in batches and [6] in batches  # a sample at or past the budget goes alone
    assert any({3, 4, 5} <= set(batch) for batch in batches)  # similar lengths share a pass
