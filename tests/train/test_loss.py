"""The loss over the LM head a chunk of rows at a time (train/loss.py) equals the dense computation — every term
and its gradients — and a training step's result does not depend on the chunk size, for every objective."""

import sys
from pathlib import Path

import pytest
import torch

import flashdraft.train.loss as loss_module
from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.dspark import DSparkDrafter, dspark_config
from flashdraft.model.modeling_dflash import logit_transform
from flashdraft.model.target import Target
from flashdraft.train.loss import head_terms, target_probs_from_hidden, target_probs_from_topk
from flashdraft.train.step import batch_step

from .test_train import quiet, tiny_cfg

S, D, V, TOPK, RANK = 37, 16, 300, 5, 4


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Relative difference under 1e-5 (float32)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("reduced", [False, True])
def test_every_term_and_its_gradients_equal_the_dense_computation(reduced):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, D, generator=g, requires_grad=True)
    head = torch.randn(V, D, generator=g)
    scored = torch.sort(torch.randperm(V, generator=g)[:120]).values if reduced else torch.arange(V)
    to_scored = torch.full((V,), -1, dtype=torch.long)
    to_scored[scored] = torch.arange(len(scored))
    labels = to_scored[torch.randint(0, V, (S,), generator=g)]  # −1: a label outside a reduced vocabulary
    teacher_ids = to_scored[torch.randint(0, V, (S, TOPK), generator=g)]
    teacher_logprobs = torch.log_softmax(torch.randn(S, TOPK, generator=g), -1)
    target_hidden, target_head = torch.randn(S, D, generator=g), torch.randn(V, D, generator=g)
    markov = torch.nn.Linear(RANK, len(scored), bias=False)
    codes = torch.randn(S, RANK, generator=g, requires_grad=True)
    weights = torch.rand(S, generator=g) * (labels >= 0)

    def transform(x):  # DFlash2's logit transform: a multiplier and a softcap
        return logit_transform(x, 0.7, 30.0)

    def objective(terms):
        return ((terms.ce * weights).sum() + (terms.soft_ce * weights).sum() + (terms.l1 * weights).sum()
                + terms.candidate_logits.sum())

    chunked = head_terms(hidden, head[scored], labels_S=labels, transform=transform,
                         bias=lambda a, b: markov(codes[a:b]), teacher=(teacher_ids, teacher_logprobs),
                         target_probs=target_probs_from_hidden(target_hidden, target_head,
                                                               scored if reduced else None),
                         top_c=3, chunk_rows=7)
    objective(chunked).backward()
    grads = [t.grad.clone() for t in (hidden, codes, markov.weight)]
    for t in (hidden, codes, markov.weight):
        t.grad = None

    # The dense computation: the whole S × V logits at once, as the loss computed them before chunks.
    logits = transform(hidden @ head[scored].T) + markov(codes)
    ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    probs = torch.softmax(teacher_logprobs.masked_fill(teacher_ids < 0, float("-inf")), -1).nan_to_num(0.0)
    soft_ce = -(probs * torch.log_softmax(logits, -1).gather(1, teacher_ids.clamp(min=0))).sum(-1)
    q = torch.softmax(target_hidden @ target_head.T, -1)[:, scored]
    l1 = (torch.softmax(logits, -1) - q).abs().sum(-1) + (1 - q.sum(-1)).clamp(min=0)
    candidates = logits.detach().topk(3, dim=-1).indices
    dense = loss_module.RowTerms(ce=ce, predicted=logits.argmax(-1), soft_ce=soft_ce, l1=l1, candidates=candidates,
                                 candidate_logits=logits.gather(-1, candidates))
    objective(dense).backward()

    for name in ("ce", "soft_ce", "l1", "candidate_logits"):
        assert close(getattr(chunked, name), getattr(dense, name)), name
    assert torch.equal(chunked.predicted, dense.predicted) and torch.equal(chunked.candidates, dense.candidates)
    for mine, theirs in zip(grads, (hidden.grad, codes.grad, markov.weight.grad), strict=True):
        assert close(mine, theirs)
    assert chunked.ce[labels < 0].isfinite().all()  # a label outside scores token 0, weighed 0 by its caller


def test_the_offline_top_k_as_a_distribution_is_scattered_per_chunk():
    ids, inside = torch.tensor([[0, 2], [1, -1]]), torch.tensor([[True, True], [True, False]])
    logprobs = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    q = target_probs_from_topk(ids, inside, logprobs, 3)
    assert torch.allclose(q(0, 2), torch.tensor([[0.75, 0.0, 0.25], [0.0, 0.5, 0.0]]))
    assert torch.allclose(q(1, 2), torch.tensor([[0.0, 0.5, 0.0]]))


def test_without_gradients_nothing_is_kept_and_the_terms_are_the_same():
    g = torch.Generator().manual_seed(1)
    hidden, head, labels = torch.randn(20, D, generator=g), torch.randn(V, D, generator=g), torch.randint(0, V, (20,))
    with torch.no_grad():
        a = head_terms(hidden, head, labels_S=labels, chunk_rows=3)
    b = head_terms(hidden, head, labels_S=labels, chunk_rows=50)
    assert not a.ce.requires_grad and torch.allclose(a.ce, b.ce) and torch.equal(a.predicted, b.predicted)


def drafters(target):
    """One drafter of each kind over the tiny target, block 8, the DSpark one with every head."""
    base = draft_config(target.config, num_layers=2, block_size=8, mask_token_id=127)
    torch.manual_seed(0)
    return {
        "dflash": DFlashDrafter(base),
        "dflash2": DFlash2Drafter(dflash2_config(base, target.config, conv_kernel_size=2, conv_group_size=8,
                                                 selector_rank=4, selector_top_k=5)),
        "dspark": DSparkDrafter(dspark_config(base, markov_rank=4, markov_head="gated", confidence_head=True,
                                              num_anchors=8)),
    }


OBJECTIVES = [
    ("dflash", {}),
    ("dflash", {"loss": "dpace"}),
    ("dflash", {"labels": "target"}),
    ("dflash", {"draft_vocab_size": 64}),
    ("dflash2", {}),
    ("dspark", {"architecture": "dspark"}),
    ("dspark", {"architecture": "dspark", "draft_vocab_size": 64}),
]


@pytest.mark.parametrize(("kind", "settings"), OBJECTIVES, ids=[f"{k}-{'-'.join(s) or 'ce'}" for k, s in OBJECTIVES])
def test_a_steps_loss_and_gradients_do_not_depend_on_the_chunk(tiny_target, tiny_dataset, monkeypatch, kind,
                                                               settings):
    import datasets

    target = Target(tiny_target, "cpu", quiet)
    drafter = drafters(target)[kind]
    target.watch(drafter.target_layer_ids)
    settings = dict(settings)
    vocab = settings.pop("draft_vocab_size", None)
    if vocab:  # a reduced draft vocabulary: every other token
        config = drafter.config
        config.draft_vocab_size = vocab
        drafter = type(drafter)(config)
        drafter.set_draft_vocab(torch.arange(0, 128, 2))
    cfg = tiny_cfg(tiny_target, max_anchors=6, block_size=8, **settings)
    rows = [(r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(tiny_dataset)).select(range(3))]

    def step(budget):
        monkeypatch.setattr(loss_module, "CHUNK_BYTES", budget)
        drafter.zero_grad()
        results = batch_step(drafter, target, rows, cfg, [torch.Generator().manual_seed(i) for i in range(3)], "cpu")
        sum(r["weighted_ce"] for r in results if r).backward()
        return ([r["weighted_ce"].detach() for r in results if r], [r["accepted"] for r in results if r],
                [p.grad.clone() for p in drafter.parameters() if p.grad is not None])

    whole, in_chunks = step(1 << 30), step(4 * (vocab or 128) * 5)  # one chunk; chunks of 5 rows
    for a, b in zip(whole[0], in_chunks[0], strict=True):
        assert close(a, b)
    assert whole[1] == in_chunks[1]
    assert len(whole[2]) == len(in_chunks[2]) > 0
    for a, b in zip(whole[2], in_chunks[2], strict=True):
        assert close(a, b)


@pytest.mark.slow
def test_a_steps_peak_memory_does_not_grow_with_scored_rows_times_vocabulary(tmp_path):
    """One step of a random target with Qwen3.6's 248,320-token untied head, 1,024-token samples, the target's labels,
    micro_batch 4, block 16: from 512 to 2,048 scored rows a micro-batch the peak grows by far less than a float32
    vocabulary row per added row (the dense loss: about 3), and the held-out walk and the offline cache with the
    top 16 stay within a chunk's reach of it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmark's own helpers
    from memory_bench import qwen36_vocab_target, samples
    from memory_counter import MemoryCounter

    from flashdraft.artifact.manifest import Lineage
    from flashdraft.config import TrainConfig
    from flashdraft.train.feature_cache import build_or_reuse
    from flashdraft.train.heldout import serving_walk

    vocab, length = 248_320, 1024  # Qwen3.6's vocabulary
    path = qwen36_vocab_target(tmp_path / "target", vocab)
    target = Target(path, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=16, mask_token_id=0))
    target.watch(drafter.target_layer_ids)
    rows = samples(vocab, length, 4)
    peaks = {}
    for scored in (512, 2048):
        cfg = TrainConfig(target=path, block_size=16, max_anchors=scored // 64, micro_batch=4, batch_size=4,
                          labels="target", max_length=length)
        with MemoryCounter() as counter:
            results = batch_step(drafter, target, rows, cfg, [torch.Generator().manual_seed(i) for i in range(4)],
                                 "cpu")
            sum(r["weighted_ce"] for r in results if r).backward()
        peaks[scored] = counter.peak_bytes
        assert all(r["anchors"] == scored // 64 for r in results)
        drafter.zero_grad(set_to_none=True)
        del results
    row_bytes = 4 * vocab
    assert (peaks[2048] - peaks[512]) / 1536 < 0.25 * row_bytes, peaks

    with MemoryCounter() as dense:  # what the counter sees of the dense loss: the test can tell the two apart
        x = torch.randn(512, 64, requires_grad=True)
        torch.nn.functional.cross_entropy(x @ target.lm_head.weight.T, torch.zeros(512, dtype=torch.long)).backward()
    assert dense.peak_bytes > 2.5 * 512 * row_bytes

    walked_mask = torch.zeros(length, dtype=torch.long)
    walked_mask[-300:] = 1  # 300 blocks in one pass of the walk: 4,800 rows
    with MemoryCounter() as walk:
        serving_walk(drafter, target, rows[0][0], walked_mask, cfg, "cpu")
    import datasets

    dataset = datasets.Dataset.from_dict({"input_ids": [r[0].tolist() for r in rows],
                                          "loss_mask": [r[1].tolist() for r in rows]})
    with MemoryCounter() as cache:
        build_or_reuse(tmp_path / "features", target, dataset, length, Lineage(config="memory"), topk=16, log=quiet)
    # a whole sample's logits would be 1,024 × 248,320 × 4 bytes = 1 GB, the walk's 4,800 rows 4.8 GB
    assert walk.peak_bytes < peaks[2048] + 2**28 and cache.peak_bytes < peaks[2048] + 2**27, (walk.peak_bytes,
                                                                                               cache.peak_bytes)
