"""Several sequences per forward pass (`train.micro_batch`) give the losses and gradients of one at a time."""

import pytest
import torch

from flashdraft.config import TrainConfig
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.target import Target
from flashdraft.train.step import batch_step, sequence_step


def rows_of_mixed_lengths():
    g = torch.Generator().manual_seed(3)
    rows = []
    for length in (30, 70, 45, 16, 90):
        ids = torch.randint(0, 120, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.long)
        mask[:6] = 0
        rows.append((ids, mask))
    rows.append((torch.randint(0, 120, (20,), generator=g), torch.zeros(20, dtype=torch.long)))  # no anchor at all
    return rows


def gradients(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("features", ["online", "offline"])
@pytest.mark.parametrize("sliding_window", [None, 16], ids=["full", "sliding"])
def test_a_batch_in_one_pass_equals_one_sequence_at_a_time(tiny_target, features, sliding_window):
    torch.manual_seed(0)
    target = Target(tiny_target, "cpu", lambda s: None)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=2, block_size=8, mask_token_id=127,
                                         sliding_window=sliding_window))
    target.watch(drafter.target_layer_ids)
    cfg = TrainConfig(target=tiny_target, max_anchors=6, block_size=8)
    rows = rows_of_mixed_lengths()
    cached = [target.features(ids[None])[0] for ids, _ in rows] if features == "offline" else [None] * len(rows)

    def gens():
        return [torch.Generator().manual_seed(100 + i) for i in range(len(rows))]

    one_at_a_time = [sequence_step(drafter, target, ids, mask, cfg, g, "cpu", f)
                     for (ids, mask), g, f in zip(rows, gens(), cached, strict=True)]
    sum(r["loss"] for r in one_at_a_time if r is not None).backward()
    expected = gradients(drafter)

    batched = batch_step(drafter, target, rows, cfg, gens(), "cpu", None if features == "online" else cached)
    sum(r["loss"] for r in batched if r is not None).backward()
    got = gradients(drafter)

    assert [r is None for r in batched] == [r is None for r in one_at_a_time] == [False] * 5 + [True]
    for mine, theirs in zip(batched, one_at_a_time, strict=True):
        if mine is not None:  # tolerance: float32 sums in another order (padding changes matmul shapes)
            assert mine["loss"].item() == pytest.approx(theirs["loss"].item(), rel=1e-5, abs=1e-6)
            assert mine["rates"] == pytest.approx(theirs["rates"], nan_ok=True)
            assert mine["anchors"] == theirs["anchors"] and mine["tokens"] == theirs["tokens"]
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-4, atol=1e-6), name


def test_a_training_run_has_the_same_loss_curve_batched_prefetched_or_one_at_a_time(tiny_target, tmp_path):
    """Whole runs: micro-batch 1 (one sequence per pass), 4 (the default) and 4 with the next step's target
    features prepared on a thread while the drafter trains (online features, as the 2 + 2 GPU split does)."""
    import json

    from flashdraft.train import run
    from tests.train.test_train import make_dataset, tiny_cfg

    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 120, (30 + 7 * i,), generator=g).tolist() for i in range(14)]
    data = make_dataset(tmp_path / "ds", sequences)

    def losses(name, **kw):
        run(tiny_cfg(tiny_target, batch_size=4, epochs=2, checkpoint_every=2, **kw), data, tmp_path / name,
            log=lambda s: None)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        return [m["loss"] for m in rows if "loss" in m], [m["heldout"] for m in rows if "heldout" in m]

    one, held_one = losses("one", micro_batch=1)
    batched, held_batched = losses("batched", micro_batch=4)
    prefetched, held_prefetched = losses("prefetched", micro_batch=4, prefetch=True)
    assert len(one) == 6
    assert batched == pytest.approx(one, rel=1e-4) and prefetched == pytest.approx(batched, rel=1e-4)
    assert [h["simulated_acceptance_length"] for h in held_prefetched] == pytest.approx(
        [h["simulated_acceptance_length"] for h in held_one], rel=1e-3)
