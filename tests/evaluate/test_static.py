"""The static-cache decoder (evaluate/static.py): token for token what the growing cache decodes, in float32 on a
CPU; its fixed-shape passes trace whole (what CUDA-graph capture needs); what it cannot hold falls back or is
refused. The CUDA graphs themselves need a GPU: benchmarks/gpu_eval.sh runs them."""

import pytest
import torch

from flashdraft.config import EvalConfig
from flashdraft.errors import BadInput
from flashdraft.evaluate.decode import SpecDecoder, counted_forwards, target_only
from flashdraft.evaluate.prepare import choose_decoder
from flashdraft.evaluate.static import StaticSpecDecoder, static_unsupported
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.target import Target

PROMPTS = [[5, 17, 42, 99, 3, 64, 21, 8, 77, 120, 33, 2], [9, 9, 1], list(range(3, 90))]


@pytest.fixture(scope="module")
def target(tiny_target) -> Target:
    return Target(tiny_target, "cpu", lambda s: None)


def drafter(target: Target, **settings) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(draft_config(target.config, num_layers=2, block_size=4, mask_token_id=127, **settings))


def agreeing(target: Target, d: DFlashDrafter, prompt: list[int], n: int) -> DFlashDrafter:
    """`d` made to propose the target's own continuation of `prompt` now and then: a few steps of training."""
    from flashdraft.config import TrainConfig
    from flashdraft.train.step import sequence_step

    target.watch(d.target_layer_ids)
    ids = torch.tensor(prompt + target_only(target, prompt, n)[0])
    mask = torch.zeros(len(ids), dtype=torch.long)
    mask[len(prompt) - 1 :] = 1
    optimizer = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for step in range(40):
        sequence_step(d, target, ids, mask, TrainConfig(block_size=4, max_anchors=16), torch.Generator().manual_seed(
            step), "cpu")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return d


@pytest.mark.parametrize("window", [None, 6])
def test_static_decoding_is_the_growing_caches_token_for_token(target, window):
    """Buffers reused across prompts of different lengths, drafts accepted and rejected (rollback by position),
    and a sliding-window drafter's masks over the buffer: the same tokens and the same acceptances, one target
    pass a step."""
    d = agreeing(target, drafter(target, sliding_window=window), PROMPTS[0], 40)
    assert d.layer_types == (["sliding_attention", "full_attention"] if window else ["full_attention"] * 2)
    dynamic, static = SpecDecoder(target, d, set()), StaticSpecDecoder(target, d, set())
    hidden = {dynamic: [], static: []}  # the drafter's block states, step by step: the buffer's masks at work
    for decoder in hidden:
        draft = decoder._draft
        decoder._draft = lambda h, *a, _draft=draft, _seen=hidden[decoder]: (_seen.append(h.clone()), _draft(h, *a))[1]
    accepted = []
    for prompt in PROMPTS:
        expected = dynamic.generate(prompt, 40)
        calls, handle = counted_forwards(target)
        got = static.generate(prompt, 40)
        handle.remove()
        assert got.tokens == expected.tokens == target_only(target, prompt, 40)[0]
        assert got.accepted == expected.accepted and calls[0] == 1 + len(got.accepted)
        accepted += got.accepted
    assert len(hidden[static]) == len(hidden[dynamic]) == len(accepted)
    for mine, theirs in zip(hidden[static], hidden[dynamic], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert any(n == 3 for n in accepted) and any(n < 3 for n in accepted), accepted  # whole blocks and cut ones
    assert static.capacity == 1024  # one reservation held every prompt


def test_the_static_target_only_baseline_is_generates(target):
    static = StaticSpecDecoder(target, drafter(target), set())
    for prompt in PROMPTS:
        assert static.target_only(prompt, 30)[0] == target_only(target, prompt, 30)[0]


def test_every_fixed_shape_pass_traces_whole(target):
    """Dynamo with fullgraph=True (its eager backend: no compiler needed) refuses a graph break, which would split
    a CUDA graph; each pass is traced once per shape — buffers and cache reused, no recompiles across prompts."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = []

    def trace(fn):
        traced = torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
        compiled.append(traced)
        return traced

    d = agreeing(target, drafter(target), PROMPTS[0], 24)
    static = StaticSpecDecoder(target, d, set(), compiler=trace)
    assert len(compiled) == 4  # one-token, verify, the drafter's block pass, its context projection
    for prompt in PROMPTS:
        assert static.generate(prompt, 24).tokens == SpecDecoder(target, d, set()).generate(prompt, 24).tokens
        static.target_only(prompt, 8)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"] and frames["ok"] <= 5  # the target's pass at 1 and K tokens, 3 others


def test_what_the_static_cache_cannot_hold_falls_back_or_is_refused(tmp_path, target):
    import transformers as t

    from tests.evaluate.test_targets import HYBRID, SHAPE

    torch.manual_seed(0)
    t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(**SHAPE, **HYBRID)).save_pretrained(tmp_path / "hybrid")
    hybrid = Target(str(tmp_path / "hybrid"), "cpu", lambda s: None)
    assert "hybrid linear-attention" in static_unsupported(hybrid)
    assert static_unsupported(target) is None
    d, quiet = drafter(hybrid), (lambda s: None)
    decoder, words = choose_decoder(EvalConfig(decoding="auto"), hybrid, d, set(), quiet)
    assert type(decoder) is SpecDecoder and "hybrid linear-attention" in words
    with pytest.raises(BadInput, match="eval.decoding is static, but the static KV cache cannot hold .*hybrid"):
        choose_decoder(EvalConfig(decoding="static"), hybrid, d, set(), quiet)
    decoder, words = choose_decoder(EvalConfig(decoding="auto"), target, drafter(target), set(), quiet)
    assert type(decoder) is SpecDecoder and "on a CPU" in words  # where the growing cache is the faster
    decoder, words = choose_decoder(EvalConfig(decoding="static"), target, drafter(target), set(), quiet)
    assert isinstance(decoder, StaticSpecDecoder) and words.startswith("static KV cache")


def test_a_greedy_step_reads_from_the_device_once(target, monkeypatch):
    """No host sync in a step of flashdraft's beyond reading the accepted count (with the target's tokens, in one
    read): every way a tensor's value reaches Python is counted while steps run, by where it is called from.
    (Run eagerly, as here, transformers' mask code also reads the static cache's position once a target pass; under
    torch.compile it does not — masking_utils skips that read while tracing.)"""
    import sys

    import transformers

    from flashdraft.evaluate.decode import Sampler
    from tests.own_files import inside, package_dir

    transformers_dir = package_dir(transformers)
    static = StaticSpecDecoder(target, agreeing(target, drafter(target), PROMPTS[0], 24), set())
    state = static.start(PROMPTS[0], 0.0, Sampler())
    reads = []

    def counted(name, original):
        def read(self, *args):
            caller = sys._getframe(1).f_code.co_filename
            reads.append((name, "transformers" if inside(caller, transformers_dir) is not None else "flashdraft" if
                          inside(caller) is not None else caller))
            return original(self, *args)
        return read

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    steps = 0
    while len(state.tokens) < 20:
        static.step(state, 0.0, Sampler())
        steps += 1
    monkeypatch.undo()
    assert [r for r in reads if r[1] != "transformers"] == [("tolist", "flashdraft")] * steps
    assert any(n > 0 for n in state.accepted)
