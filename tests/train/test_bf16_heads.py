"""Under `train.bf16` (the GPU default) only the drafter's matmuls and the LM head's logits run in bfloat16; the small
heads — DSpark's Markov and confidence heads, DFlash2's candidate selector — and every loss term compute in float32,
as the dense loss did ("bfloat16 would tie them"). Proven by forcing every matmul of those heads to float32 (autocast
off, float32 inputs): a bf16 step's loss and every gradient do not move. Before, the heads ran under the step's
autocast and markov_w2's gradient moved by 5.8 % of its largest entry."""

import datasets
import pytest
import torch

from flashdraft.model.target import Target
from flashdraft.train.step import batch_step
from tests.train.test_loss import drafters
from tests.train.test_train import quiet, tiny_cfg

HEADS = ("markov_head", "confidence_head", "candidate_selector")


def in_float32(module: torch.nn.Module) -> None:
    """Every Linear and Embedding inside `module` computes in float32 whatever autocast is on outside it."""
    for inner in module.modules():
        if isinstance(inner, torch.nn.Linear | torch.nn.Embedding):
            forward = inner.forward

            def forced(x, forward=forward):
                with torch.autocast(x.device.type, enabled=False):
                    return forward(x if not x.is_floating_point() else x.float())
            inner.forward = forced


def step(drafter, target, cfg, rows):
    drafter.zero_grad()
    results = batch_step(drafter, target, rows, cfg, [torch.Generator().manual_seed(i) for i in range(len(rows))],
                         "cpu")
    total = sum(r["weighted_ce"] for r in results if r)
    total.backward()
    return float(total), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_the_small_heads_compute_in_float32_under_bf16(tiny_target, tiny_dataset, kind):
    target = Target(tiny_target, "cpu", quiet)
    drafter = drafters(target)[kind]
    target.watch(drafter.target_layer_ids)
    settings = {"architecture": "dspark"} if kind == "dspark" else {}
    rows = [(r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(tiny_dataset)).select(range(3))]
    cfg = tiny_cfg(tiny_target, max_anchors=6, block_size=8, bf16=True, **settings)
    loss, grads = step(drafter, target, cfg, rows)
    float32_loss, float32_grads = step(drafter, target, tiny_cfg(tiny_target, max_anchors=6, block_size=8,
                                                                 bf16=False, **settings), rows)
    heads = [getattr(drafter, name) for name in HEADS if getattr(drafter, name, None) is not None]
    for head in heads:
        in_float32(head)
    forced_loss, forced_grads = step(drafter, target, cfg, rows)

    assert forced_loss == pytest.approx(loss, rel=1e-6)
    assert forced_grads.keys() == grads.keys()
    for name, grad in grads.items():
        scale = max(float(forced_grads[name].abs().max()), 1e-12)
        assert float((grad - forced_grads[name]).abs().max()) <= 1e-5 * scale, name
    # bfloat16 is really on (the backbone's matmuls), and the step stays the float32 step's at bf16 tolerance
    assert any(float((grads[n] - float32_grads[n]).abs().max()) > 1e-4 * float(float32_grads[n].abs().max())
               for n in grads)
    assert loss == pytest.approx(float32_loss, rel=5e-2)
    assert (kind == "dflash") == (not heads)  # DFlash has no small head; its terms are float32 (head_terms)


def test_under_bf16_every_norm_moves_across_a_resume_and_checkpoints_hold_float32(tiny_target, tiny_dataset,
                                                                                  tmp_path):
    """The field's numerics trap: a drafter trained in pure bfloat16 keeps every RMSNorm weight at exactly 1.0 (an
    update of lr 3e-3 is below bfloat16's step at 1.0), and a float32 master copy lost on resume stops them there.
    flashdraft keeps float32 weights and AdamW moments under autocast: every norm weight moves before the checkpoint
    and again after a resume from it, and every tensor a checkpoint stores is float32."""
    import shutil

    from safetensors.torch import load_file

    from flashdraft.train import run

    out = tmp_path / "out"
    cfg = tiny_cfg(tiny_target, bf16=True, max_steps=4, checkpoint_every=2, lr=3e-3)
    run(cfg, tiny_dataset, out, log=quiet)
    shutil.rmtree(out / "drafter")
    shutil.rmtree(out / "checkpoints" / "step-0000004")  # as if killed after step 2's checkpoint
    said = []
    run(cfg, tiny_dataset, out, log=said.append)
    assert any("resuming from step-0000002" in line for line in said)

    at = {step: load_file(str(out / "checkpoints" / f"step-{step:07d}" / "drafter.safetensors")) for step in (2, 4)}
    norms = [name for name in at[4] if "norm" in name]
    assert norms
    for name in norms:
        assert not torch.all(at[2][name] == 1.0), f"{name} never moved from 1.0"
        assert not torch.equal(at[2][name], at[4][name]), f"{name} did not move after the resume"
    for step in (2, 4):
        stored = {**at[step], **load_file(str(out / "checkpoints" / f"step-{step:07d}" / "optimizer.safetensors"))}
        assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float32}
