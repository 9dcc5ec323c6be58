"""The lossless check: greedy speculative output equals target-only output, or first differs only where the
target's own two best tokens are a rounding apart (bfloat16 verify passes round differently from one-token passes).
A decoding bug must still fail it, at the default tolerance, in bfloat16."""

import copy
import json

import pytest
import torch

from flashdraft.config import EvalConfig
from flashdraft.evaluate import run
from flashdraft.evaluate.decode import TargetCache, divergence
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import save_drafter
from flashdraft.model.target import Target


def quiet(_):
    return None


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 3365, 3717, 257, 22234, 411, 2]


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> Target:
    target = Target(tiny_model_dir, "cpu", quiet)
    target.watch([1])
    return target


def greedy(target: Target, n: int = 12) -> list[int]:
    out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)
    target.discard_features()
    return out[0, len(PROMPT):].tolist()


def next_logits(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        output, _ = target.forward(torch.tensor([ids]))
        return target.lm_head(output.last_hidden_state[0, -1])


def test_the_same_output_has_no_divergence(target):
    reference = greedy(target)
    assert divergence(target, PROMPT, reference, list(reference), tie_ulps=2) is None


def test_a_token_the_target_ranks_far_below_its_best_is_no_near_tie(target):
    reference = greedy(target)
    worst = int(next_logits(target, PROMPT + reference[:5]).argmin())
    tokens = reference[:5] + [worst] + reference[6:]
    found = divergence(target, PROMPT, reference, tokens, tie_ulps=1000)
    assert found["at"] == 5 and found["target_token"] == reference[5] and found["spec_token"] == worst
    assert found["ulps_behind_top"][0] == 0 and found["ulps_behind_top"][1] > 1000
    assert found["near_tie"] is False


def test_two_tokens_the_target_scores_alike_are_a_near_tie(target):
    """The LM head row of one of the target's greedy tokens copied onto a token it never emits: the two tie (up to
    the matmul's rounding), so a decoder that picks the twin there is as right as one that does not."""
    reference = greedy(target)
    at = max(i for i in range(len(reference)) if reference[i] not in reference[:i])  # a token's first appearance
    chosen, twin = reference[at], target.config.vocab_size - 1
    assert twin not in PROMPT + reference
    twin_model = copy.deepcopy(target.model)
    with torch.no_grad():
        twin_model.lm_head.weight[twin] = twin_model.lm_head.weight[chosen]
    twinned = Target.from_model(twin_model)
    twinned.watch([1])
    assert greedy(twinned)[:at] == reference[:at]  # the twin's row changes nothing before `chosen` first appears
    found = divergence(twinned, PROMPT, reference[: at + 1], reference[:at] + [twin], tie_ulps=2)
    assert found["at"] == at and max(found["ulps_behind_top"]) <= 2 and found["near_tie"] is True
    assert divergence(target, PROMPT, reference[: at + 1], reference[:at] + [twin], tie_ulps=2)["near_tie"] is False


def test_the_same_tokens_but_a_shorter_output_is_not_lossless(target):
    reference = greedy(target)
    assert divergence(target, PROMPT, reference, reference[:-3], tie_ulps=2) == {"at": 9, "near_tie": False}


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["decoder", "decoder-keeping-rejected-drafts"])
def test_bfloat16_eval_of_smollm2_is_lossless_and_a_decoding_bug_is_not(tmp_path, smollm2_dir, monkeypatch, broken):
    """The embedded SmolLM2 in bfloat16 with an untrained drafter (blocks of 4: every verify pass checks 4 tokens).
    Measured on the demo's 40 held-out prompts: bfloat16 output differs from one-token greedy on about half the
    prompts, always at 0 or 1 unit in the last place. With the verify pass's rejected drafts left in the cache (the
    bug the crop prevents) the same check must fail."""
    if broken:
        monkeypatch.setattr(TargetCache, "keep", lambda self, block, accepted, snapshot, advance: None)
    smol = Target(smollm2_dir, "cpu", quiet, "bfloat16")
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(smol.config, num_layers=1, block_size=4, mask_token_id=0))
    save_drafter(drafter, tmp_path / "drafter", dtype="bfloat16", target_lm_head=smol.lm_head.weight)
    # the bug corrupts the cache at the first rejected draft, so 3 prompts show it; the faithful decoder gets 4.
    # 24 tokens a prompt: on a CPU without bfloat16 in hardware each of SmolLM2's emulated passes is slow (the
    # suite's second-longest test at 6 × 32)
    prompts = 3 if broken else 4
    cfg = EvalConfig(prompts="builtin:chat-heldout", max_prompts=prompts, max_new_tokens=24, target=smollm2_dir,
                     target_dtype="bfloat16")
    lines = []
    stats = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=lines.append)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    diverged = [p["divergence"] for p in report["prompts"] if p["divergence"]]
    assert stats["target_dtype"] == "bfloat16"
    if broken:
        assert stats["lossless"] is False and any(not d["near_tie"] for d in diverged)
        assert min(max(d["ulps_behind_top"]) for d in diverged if not d["near_tie"]) > cfg.near_tie_ulps
        failed = sum(not d["near_tie"] for d in diverged)
        assert f"{failed} of {prompts} differ beyond one: see `divergence` in report.json" in lines[-1]
    else:
        assert stats["lossless"] is True and all(d["near_tie"] for d in diverged)
        assert stats["near_ties"] == len(diverged)
        if diverged:  # how often rounding flips a near-tie depends on the CPU's bfloat16 kernels
            assert f"{len(diverged)} of {prompts} prompts diverge at a near-tie" in lines[-1]
