"""Eval with DSpark drafters: the Markov walk drafts K tokens a step, greedy output is the target's own with the
blocks whole and cut by the confidence head (both rules), and the report gives the proposed length and the
head's calibration. (Sampling's exactness is checked by enumeration in test_sampling.py.)"""

import json

import pytest
import torch

from flashdraft.config import EvalConfig, TrainConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate import run
from flashdraft.evaluate.decode import SpecDecoder, proposal_length
from flashdraft.model.drafter import draft_config
from flashdraft.model.dspark import DSparkDrafter, dspark_config
from flashdraft.model.export import save_drafter
from flashdraft.model.target import Target
from flashdraft.train.step import sequence_step
from tests.evaluate.test_evaluate import PROMPT, continuation_sample, greedy, new_drafter, quiet

K = 6


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> Target:
    return Target(tiny_model_dir, "cpu", quiet)


@pytest.fixture(scope="module")
def dspark_drafter(target) -> DSparkDrafter:
    """A DSpark drafter that learned the target's own greedy continuation of PROMPT with DeepSpec's loss (its
    confidence head fitted to the overlap with the target's distribution)."""
    torch.manual_seed(0)
    drafter = DSparkDrafter(dspark_config(draft_config(target.config, num_layers=1, block_size=K, mask_token_id=0),
                                          markov_rank=16, markov_head="vanilla", confidence_head=True, num_anchors=32))
    target.watch(drafter.target_layer_ids)
    cfg = TrainConfig(architecture="dspark", block_size=K, max_anchors=32, max_length=4096, markov_rank=16)
    ids, mask = continuation_sample(target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    for step in range(50):
        sequence_step(drafter, target, ids, mask, cfg, torch.Generator().manual_seed(step), "cpu")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter


def test_the_confidence_rules_cut_where_each_engine_family_cuts():
    confidence = [0.9, 0.8, 0.6, 0.95]
    assert proposal_length(confidence, 0.75, "first") == 2  # DeepSpec, llama.cpp: the first slot below (0.6)
    assert proposal_length(confidence, 0.75, "product") == 1  # vLLM, SGLang: 0.9 · 0.8 = 0.72 is below
    assert proposal_length(confidence, 0.5, "first") == 4 and proposal_length([0.4], 0.5, "product") == 0


@pytest.mark.parametrize(("threshold", "rule"),
                         [(None, "first"), (0.5, "first"), (0.5, "product"), ("median", "first")])
def test_greedy_dspark_decoding_is_the_targets_own_output(target, dspark_drafter, threshold, rule):
    if threshold == "median":  # the median confidence the head gives a block's first slot: it cuts some blocks
        uncut = SpecDecoder(target, dspark_drafter, stop_ids=set()).generate(PROMPT, 64)
        threshold = sorted(c[0] for c in uncut.confidence)[len(uncut.confidence) // 2]
    decoder = SpecDecoder(target, dspark_drafter, stop_ids=set(), confidence_threshold=threshold, confidence_rule=rule)
    spec = decoder.generate(PROMPT, 64)
    assert spec.tokens == greedy(target, PROMPT, 64)
    assert all(0 <= n <= m <= K for n, m in zip(spec.accepted, spec.proposed, strict=True))
    assert len(spec.confidence) == len(spec.accepted) and all(len(c) == K for c in spec.confidence)
    if threshold is None:
        assert spec.acceptance_length > 3.0 and set(spec.proposed) == {K}  # K drafts a step, most accepted
    if threshold not in (None, 0.5):
        assert 0 in spec.proposed  # the head cut blocks before their first slot: it is read


def test_eval_reports_dspark_blocks_cut_and_uncut_and_the_heads_calibration(tmp_path, tiny_model_dir,
                                                                          dspark_drafter):
    save_drafter(dspark_drafter, tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "owls")))
    cfg = EvalConfig(prompts=str(prompts), target=tiny_model_dir, max_new_tokens=24, confidence_threshold=0.6,
                     confidence_rule="product")
    lines = []
    stats = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=lines.append)
    assert stats["lossless"] is True and "DSpark" in stats["decoding"]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    dspark = report["dspark"]
    assert dspark["threshold"] == 0.6 and dspark["rule"] == "product"
    assert dspark["uncut"]["mean_proposed"] == K and dspark["mean_proposed"] <= K
    assert len(report["acceptance_by_position"]) == K  # DSpark's K drafts a step, the anchor's slot included
    rows = dspark["uncut"]["calibration_by_slot"]
    assert len(rows) == K and rows[0]["reached"] == len([n for p in report["prompts"] for n in p["accepted_uncut"]])
    assert all(0 <= row["confidence"] <= 1 and 0 <= row["accepted"] <= 1 for row in rows if row["reached"])
    table = (tmp_path / "eval" / "report.md").read_text()
    assert "cut at product < 0.6" in table and "calibration" in table


def test_what_eval_refuses_for_dspark_is_one_line_each(tmp_path, tiny_model_dir, target, dspark_drafter):
    save_drafter(dspark_drafter, tmp_path / "dspark")
    save_drafter(new_drafter(target), tmp_path / "dflash")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n")
    base = EvalConfig(prompts=str(prompts), target=tiny_model_dir, max_new_tokens=4)
    with pytest.raises(BadInput, match="not a DSpark drafter"):
        run(base.model_copy(update={"confidence_threshold": 0.5}), tmp_path / "dflash", tmp_path / "e1", log=quiet)
    with pytest.raises(BadInput, match="static is not written for DSpark"):
        run(base.model_copy(update={"decoding": "static"}), tmp_path / "dspark", tmp_path / "e2", log=quiet)
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()
