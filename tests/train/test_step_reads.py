"""A training step waits for the device once: every way a tensor's value reaches Python is counted while real
optimizer steps run (planned micro-batches in, update applied, stats out), by where it is called from. On a GPU
each such read stalls the host until the queue drains; in the loop that was one per sequence and statistic. So
does a blocking copy onto the GPU (PyTorch synchronises the stream after it): every move our code makes in a
step must be queued (`non_blocking`, from pinned memory: model/transfer.py)."""

import sys

import pytest
import torch

from flashdraft.artifact.verified import open_input
from flashdraft.train.distributed import place
from flashdraft.train.loop import optimizer_step, prepare
from flashdraft.train.stage import setup
from tests.own_files import inside
from tests.train.test_train import quiet, tiny_cfg

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero")


def ours() -> str | None:
    """The flashdraft file that called the patched method (two frames up), if it is ours."""
    return inside(sys._getframe(2).f_code.co_filename)


def counted_reads(monkeypatch) -> tuple[list, list]:
    reads, blocking_moves = [], []

    def counted(name, original):
        def read(self, *args, **kwargs):
            if where := ours():  # torch's own (the optimizers' host step counters) are not ours to count
                reads.append((name, where))
            return original(self, *args, **kwargs)
        return read

    def moved(original):
        def to(self, *args, **kwargs):
            to_a_device = "device" in kwargs or any(isinstance(a, str | torch.device | torch.Tensor) for a in args)
            if to_a_device and not kwargs.get("non_blocking") and (where := ours()):
                blocking_moves.append(where)
            return original(self, *args, **kwargs)
        return to

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "to", moved(torch.Tensor.to))
    return reads, blocking_moves


@pytest.mark.parametrize("settings", [
    {},
    {"loss": "dpace", "labels": "target", "draft_vocab_size": 64, "micro_batch": 2},
    {"architecture": "dflash2", "optimizer": "muon"},
    {"features": "offline", "distill_topk": 4, "distill_weight": 0.5, "draft_vocab_size": 64},
], ids=["dflash", "dpace-target-labels-draft-vocab", "dflash2-muon", "offline-distill-draft-vocab"])
def test_an_optimizer_step_reads_from_the_device_once(tiny_target, tiny_dataset, tmp_path, monkeypatch, settings):
    cfg = tiny_cfg(tiny_target, batch_size=4, **settings)
    dataset = open_input(tiny_dataset, "dataset", "rebuild it").verified()
    s = setup(cfg, dataset, tmp_path, tiny_target, place(cfg), None, quiet)
    steps = [prepare(cfg, s, s.train_ids[i : i + 4], 0) for i in (0, 4)]  # host work, as on the prefetch thread
    before = [p.detach().clone() for p in s.drafter.parameters()]
    reads, blocking_moves = counted_reads(monkeypatch)
    outcomes = [optimizer_step(cfg, s, plans) for plans in steps]
    monkeypatch.undo()
    assert reads == [("tolist", "train/step.py")] * len(steps)  # read_once, at each step's end
    assert blocking_moves == []
    for results, loss, grad_norm in outcomes:  # and that one read carried everything the step reports
        assert results and all(isinstance(r["weight"], float) and len(r["rates"]) == cfg.block_size - 1
                               and all(isinstance(n, int) for n in r["accepted"]) for r in results)
        assert loss > 0 and grad_norm > 0
        if cfg.architecture == "dflash2":
            assert all(isinstance(r["recall"][1], int) and "unary_rates" in r for r in results)
    assert any(not torch.equal(a, b) for a, b in zip(before, s.drafter.parameters(), strict=True))  # updated
