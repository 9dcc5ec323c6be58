"""Sampling at T > 0 keeps the target's distribution exactly, for DFlash and for DFlash2 (whose drafts come from a
walk through the selector's top-K′, a sparse q) and DSpark, under both draft rules (argmax drafts, the engines'
default; drafts drawn from q) — checked by enumeration, not by sampling.

A decoding step draws through a `Sampler`: a token from a distribution, or an acceptance with a probability. The
`Enumerate` sampler below replays one branch of every draw and records how many branches each had; walking the
branches like an odometer runs the real `SpecDecoder.start` + `step` once per outcome, with that outcome's exact
probability. The tokens a step emits are then checked against the target's own distribution as a stream: for
every x of 1 + K tokens, Σ over outcomes o that x continues of P(o) · Π_{i ≥ |o|} p(x_i | prompt, x_<i) must be
Π_i p(x_i | prompt, x_<i) — the later tokens come from later steps, which start afresh from o."""

import itertools

import pytest
import torch

from flashdraft.evaluate.decode import Sampler, SpecDecoder
from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.dspark import DSparkDrafter, dspark_config
from flashdraft.model.target import Target
from tests.evaluate.test_targets import build

VOCAB, K, TEMPERATURE = 6, 3, 0.8
PROMPT = [1, 4, 2]


class Enumerate(Sampler):
    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.script, self.widths, self.probability = script, [], 1.0

    def _branch(self, options: list[tuple]):
        depth = len(self.widths)
        value, probability = options[self.script[depth] if depth < len(self.script) else 0]
        self.widths.append(len(options))
        self.probability *= probability
        return value

    def token(self, probs: torch.Tensor) -> int:
        probs = probs.double() / probs.double().sum()
        return self._branch([(t, float(probs[t])) for t in torch.nonzero(probs > 0).flatten().tolist()])

    def accept(self, probability: float) -> bool:
        return self._branch([(a, p) for a, p in ((True, probability), (False, 1.0 - probability)) if p > 0])


def outcomes(one_run) -> dict[tuple, float]:
    """Every outcome of `one_run(sampler)` with its exact probability."""
    found, script = {}, []
    while True:
        sampler = Enumerate(script)
        outcome = one_run(sampler)
        found[outcome] = found.get(outcome, 0.0) + sampler.probability
        script = (script + [0] * len(sampler.widths))[: len(sampler.widths)]
        while script and script[-1] + 1 >= sampler.widths[len(script) - 1]:
            script.pop()
        if not script:
            return found
        script[-1] += 1


def tiny_target(tmp_path, kind: str) -> Target:
    torch.manual_seed(0)
    model = build(kind, vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # distributions far from uniform, so a wrong q shows
    model.save_pretrained(tmp_path / kind)
    return Target(str(tmp_path / kind), "cpu", lambda s: None)


def drafter_for(target: Target, architecture: str) -> DFlashDrafter:
    torch.manual_seed(1)
    # DSpark drafts every slot of its block: a block of K − 1 emits as many tokens a step as DFlash's of K
    config = draft_config(target.config, num_layers=1, block_size=K - (architecture == "dspark"),
                          mask_token_id=VOCAB - 1)
    if architecture == "dspark":
        drafter = DSparkDrafter(dspark_config(config, markov_rank=4, markov_head="vanilla", confidence_head=True,
                                              num_anchors=8))
        with torch.no_grad():  # a Markov head strong enough to change the drafts, a confidence head that cuts
            for p in drafter.parameters():
                p.add_(torch.randn_like(p) * (3.0 if p.shape[0] == VOCAB else 0.3))
            drafter.confidence_head.proj.weight.mul_(10)
        return drafter
    if architecture == "dflash2":
        config = dflash2_config(config, target.config, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                selector_top_k=3)  # 3 of 6 tokens: q is 0 for half the vocabulary
    drafter = (DFlash2Drafter if architecture == "dflash2" else DFlashDrafter)(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * (3.0 if p.shape[0] == VOCAB else 0.3))  # a selector that re-ranks
    return drafter


def stream_error(target: Target, decoder: SpecDecoder) -> float:
    """The largest gap, over all 1 + K token sequences, between the step's stream probability and the target's."""
    def one_step(sampler):
        state = decoder.start(PROMPT, TEMPERATURE, sampler)
        decoder.step(state, TEMPERATURE, sampler)
        return tuple(state.tokens)

    with torch.inference_mode():
        found = outcomes(one_step)
        target.discard_features()
        every = torch.tensor([PROMPT + list(x) for x in itertools.product(range(VOCAB), repeat=K)])
        probs = torch.softmax(target.model(every).logits[:, len(PROMPT) - 1 :].double() / TEMPERATURE, dim=-1)
    target.discard_features()

    def p(prefix: tuple, token: int) -> float:  # the target's probability of `token` after prompt + prefix
        row = sum(t * VOCAB ** (K - 1 - i) for i, t in enumerate(prefix))  # a row that starts with it (product order)
        return float(probs[row, len(prefix), token])

    worst = 0.0
    for x in itertools.product(range(VOCAB), repeat=K + 1):
        target_p, stream = 1.0, 0.0
        continuation = [1.0]
        for i, token in enumerate(x):
            target_p *= p(x[:i], token)
            continuation.append(target_p)
        for length in range(2, K + 2):  # a step emits 1..K tokens after its anchor
            if x[:length] in found:
                stream += found[x[:length]] * target_p / continuation[length]
        worst = max(worst, abs(stream - target_p))
    assert abs(sum(found.values()) - 1.0) < 1e-9
    return worst


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
@pytest.mark.parametrize(("kind", "architecture"), [("qwen3", "dflash"), ("qwen3", "dflash2"), ("qwen3_5", "dflash2"),
                                                  ("qwen3", "dspark")])
def test_one_step_at_temperature_keeps_the_target_distribution_exactly(tmp_path, kind, architecture, draft_sampling):
    """Both draft rules: `greedy` (argmax drafts accepted with p(x̂), the engines' default) and `sample`."""
    target = tiny_target(tmp_path, kind)
    decoder = SpecDecoder(target, drafter_for(target, architecture), stop_ids=set(), draft_sampling=draft_sampling)
    assert stream_error(target, decoder) < 1e-5


def test_the_two_draft_rules_accept_differently(tmp_path):
    """The rules are different random variables: on the same target and drafter one step's expected number of
    accepted drafts differs between them (which is why eval measures with the engines' rule)."""
    target = tiny_target(tmp_path, "qwen3")
    drafter = drafter_for(target, "dflash")
    expected = {}
    for rule in ("greedy", "sample"):
        decoder = SpecDecoder(target, drafter, stop_ids=set(), draft_sampling=rule)

        def one_step(sampler, decoder=decoder):
            state = decoder.start(PROMPT, TEMPERATURE, sampler)
            decoder.step(state, TEMPERATURE, sampler)
            return state.accepted[-1]

        with torch.inference_mode():
            expected[rule] = sum(n * p for n, p in outcomes(one_step).items())
    assert abs(expected["greedy"] - expected["sample"]) > 0.01, expected


def test_argmax_drafts_checked_against_the_drafters_softmax_are_caught(tmp_path, monkeypatch):
    """The check has teeth for the greedy rule: argmax drafts verified with min(1, p/q) against the drafter's own
    softmax (the `sample` rule's verification applied to the other rule's drafts) is not lossless."""
    target = tiny_target(tmp_path, "qwen3")
    decoder = SpecDecoder(target, drafter_for(target, "dflash"), stop_ids=set(), draft_sampling="greedy")
    drawn = SpecDecoder._draft

    def softmax_q(self, hidden_KD, anchor, temperature, sampler):
        drafts, _ = drawn(self, hidden_KD, anchor, temperature, sampler)
        logits = hidden_KD[1:] @ self.draft_head.T
        return drafts, torch.softmax(logits.float() / temperature, dim=-1)

    monkeypatch.setattr(SpecDecoder, "_draft", softmax_q)
    assert stream_error(target, decoder) > 1e-3


@pytest.mark.parametrize("rule", ["first", "product"])
def test_a_dspark_block_cut_at_its_confidence_keeps_the_target_distribution_exactly(tmp_path, rule):
    """The cut depends on the drafts drawn before each slot, never on the slot's own: a stopping rule, so
    verification stays lossless; and it does cut (fewer drafts sent than the block holds, in some outcomes)."""
    target = tiny_target(tmp_path, "qwen3")
    decoder = SpecDecoder(target, drafter_for(target, "dspark"), stop_ids=set(), confidence_threshold=0.5,
                          confidence_rule=rule, draft_sampling="sample")
    assert stream_error(target, decoder) < 1e-5
    sent = set()

    def one_step(sampler):
        state = decoder.start(PROMPT, TEMPERATURE, sampler)
        decoder.step(state, TEMPERATURE, sampler)
        sent.add(state.proposed[-1])
        return tuple(state.tokens)

    with torch.inference_mode():
        outcomes(one_step)
    assert min(sent) < K - 1


def test_checking_dspark_drafts_against_the_uncorrected_logits_is_caught(tmp_path, monkeypatch):
    """The check has teeth for DSpark: verifying its drafts against softmax(base / T), without the Markov bias they
    were drawn with, is not lossless."""
    target = tiny_target(tmp_path, "qwen3")
    drafter = drafter_for(target, "dspark")
    decoder = SpecDecoder(target, drafter, stop_ids=set(), draft_sampling="sample")
    drawn = SpecDecoder._draft_dspark

    def base_q(self, hidden_KD, state, temperature, sampler):
        drafts, _ = drawn(self, hidden_KD, state, temperature, sampler)
        return drafts, torch.softmax((hidden_KD @ self.draft_head.T).float() / temperature, dim=-1)

    monkeypatch.setattr(SpecDecoder, "_draft_dspark", base_q)
    assert stream_error(target, decoder) > 1e-3


def test_checking_dflash2_drafts_against_the_unary_softmax_is_caught(tmp_path, monkeypatch):
    """The check has teeth: verifying the selector's drafts against softmax(unary / T), not the sparse q they
    were drawn from, is the mistake a DFlash decoder reused for DFlash2 would make, and it is not lossless."""
    target = tiny_target(tmp_path, "qwen3")
    decoder = SpecDecoder(target, drafter_for(target, "dflash2"), stop_ids=set(), draft_sampling="sample")
    drawn = SpecDecoder._draft

    def unary_q(self, hidden_KD, anchor, temperature, sampler):
        drafts, _ = drawn(self, hidden_KD, anchor, temperature, sampler)
        logits = self.drafter.unary_logits(hidden_KD[1:] @ self.draft_head.T)
        return drafts, torch.softmax(logits.float() / temperature, dim=-1)

    monkeypatch.setattr(SpecDecoder, "_draft", unary_q)
    assert stream_error(target, decoder) > 1e-3
