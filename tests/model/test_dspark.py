"""DSpark's mechanics: the Markov and confidence heads, the export in DeepSpec's native contract read back by
flashdraft and by the shipped modeling file, and what DSpark refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, Qwen3Config

from flashdraft.errors import BadInput
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.dspark import DSparkDrafter, dspark_config
from flashdraft.model.export import load_drafter, save_drafter
from flashdraft.model.objective import block_masks

TARGET = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1_000_000.0)
K = 4


def dspark(seed: int = 0, head: str = "vanilla", **kwargs) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = dspark_config(draft_config(TARGET, num_layers=2, block_size=K, mask_token_id=95, **kwargs),
                           markov_rank=8, markov_head=head, confidence_head=True, num_anchors=16)
    drafter = DSparkDrafter(config)
    with torch.no_grad():  # every weight off its initial value, the Markov head strong enough to re-rank
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        drafter.markov_head.markov_w1.weight.mul_(30)
        drafter.markov_head.markov_w2.weight.mul_(30)
    return drafter


def hidden_of(drafter, context: int, block, features):
    masks = block_masks(torch.tensor([context]), K, context, None, "cpu")
    with torch.no_grad():
        return drafter(block, features, (context + torch.arange(K))[None], torch.arange(context)[None], masks)


def test_a_fresh_dspark_drafts_what_its_backbone_drafts():
    torch.manual_seed(0)
    backbone = DFlashDrafter(draft_config(TARGET, num_layers=2, block_size=K, mask_token_id=95))
    warm = DSparkDrafter.warm_start(backbone, markov_rank=8, markov_head="vanilla", confidence_head=True,
                                    num_anchors=16)
    block, features = torch.randn(1, K, 32), torch.randn(1, 20, 64)
    hidden = hidden_of(warm, 20, block, features)
    assert torch.equal(hidden, hidden_of(backbone, 20, block, features))
    base = hidden[0] @ torch.randn(96, 32).T
    drafts, logits, confidence = warm.walk(base, hidden[0], anchor=7, pick=lambda row: row.argmax())
    assert torch.equal(drafts, base.argmax(-1)) and torch.equal(logits, base)  # a zero bias: the backbone's own
    assert confidence.shape == (K,) and bool(((confidence > 0) & (confidence < 1)).all())


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_the_teacher_forced_block_equals_the_walk_along_the_same_tokens(head):
    """Training's one-pass bias (the token before each slot given) and decoding's left-to-right walk compute the
    same corrected logits and confidences when the walk picks those same tokens — for each head type (the rnn's
    state carried from slot to slot)."""
    drafter = dspark(head=head)
    hidden, base = torch.randn(K, 32), torch.randn(K, 96)
    path = torch.tensor([5, 17, 3, 40])
    picks = iter(path.tolist())
    drafts, walked, confidence = drafter.walk(base, hidden, anchor=9, pick=lambda row: next(picks))
    assert torch.equal(drafts, path)
    previous = torch.tensor([[9, 5, 17, 3]])
    with torch.no_grad():
        forced, logits_c = drafter.block_logits(base[None], hidden[None], previous)
    assert torch.allclose(forced[0], walked, atol=1e-5)
    assert torch.allclose(torch.sigmoid(logits_c[0]), confidence, atol=1e-6)
    assert not torch.allclose(walked, base)  # the bias is there: the check has teeth


def test_the_export_is_deepspecs_native_contract(tmp_path):
    drafter = dspark()
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    for key, value in {"block_size": K, "num_target_layers": 6, "target_layer_ids": drafter.target_layer_ids,
                       "mask_token_id": 95, "num_anchors": 16, "markov_rank": 8, "markov_head_type": "vanilla",
                       "enable_confidence_head": True, "confidence_head_with_markov": True,
                       "sample_from_anchor": True, "model_type": "qwen3", "hidden_size": 32}.items():
        assert config[key] == value, key
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (96, 8)  # previous token (target vocabulary) → rank
    assert tensors["markov_head.markov_w2.weight"].shape == (96, 8)  # rank → draft vocabulary (a Linear's weight)
    assert tensors["confidence_head.proj.weight"].shape == (1, 32 + 8)  # [hidden ; markov_w1[previous]]
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert not any(name.startswith("model.") for name in tensors)  # DeepSpec's names: no prefix
    reloaded = load_drafter(tmp_path / "d")
    assert isinstance(reloaded, DSparkDrafter) and reloaded.markov_rank == 8 and reloaded.with_markov


def test_the_shipped_modeling_file_proposes_the_block_as_flashdraft_does(tmp_path):
    drafter = dspark()
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    assert type(model).__name__ == "Qwen3DSparkModel"
    torch.manual_seed(7)
    context = 20
    block, features = torch.randn(1, K, 32), torch.randn(1, context, 2 * 32)
    head = torch.nn.Linear(32, 96, bias=False)
    ours = hidden_of(drafter, context, block, features)
    with torch.no_grad():
        theirs = model(position_ids=torch.arange(context + K)[None], noise_embedding=block, target_hidden=features)
        assert torch.allclose(theirs, ours, atol=1e-5)
        drafts, corrected, confidence = model.propose(theirs, torch.tensor([11]), head, 0.0)
        mine, my_logits, my_confidence = drafter.walk(head(ours)[0], ours[0], 11, lambda row: row.argmax())
    assert drafts.shape == (1, K) and torch.equal(drafts[0], mine)
    assert torch.allclose(corrected[0], my_logits, atol=1e-5)
    assert torch.allclose(confidence[0], my_confidence, atol=1e-6)
    assert not torch.equal(mine, head(ours)[0].argmax(-1))  # the Markov head changes the block: the check has teeth


def test_a_reduced_vocabulary_dspark_exports_and_drafts_target_ids(tmp_path):
    drafter = dspark(draft_vocab_size=32)
    drafter.set_draft_vocab(torch.arange(64, 96))
    assert drafter.markov_head.markov_w1.weight.shape == (96, 8)  # indexed by the previous token's target id
    assert drafter.markov_head.markov_w2.weight.shape == (32, 8)  # a bias over the draft vocabulary
    save_drafter(drafter, tmp_path / "d", target_lm_head=torch.randn(96, 32), dtype="float32")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (32, 32) and torch.equal(tensors["d2t"], torch.full((32,), 64))
    hidden, base = torch.randn(K, 32), torch.randn(K, 32)
    drafts, _, _ = load_drafter(tmp_path / "d").walk(base, hidden, anchor=3, pick=lambda row: row.argmax())
    assert bool((drafts >= 64).all())  # target ids


@pytest.mark.parametrize(("settings", "message"), [
    ({"markov_rank": 0, "markov_head": "vanilla", "confidence_head": True}, "markov_rank 0 has no Markov head"),
    ({"markov_rank": 8, "markov_head": "lstm", "confidence_head": True}, "is not one of"),
])
def test_dspark_refuses_what_it_cannot_build(settings, message):
    with pytest.raises(BadInput, match=message):
        dspark_config(draft_config(TARGET, num_layers=2, block_size=K, mask_token_id=95), num_anchors=16, **settings)
    with pytest.raises(BadInput, match="sliding-window"):
        dspark_config(draft_config(TARGET, num_layers=2, block_size=K, mask_token_id=95, sliding_window=8),
                      markov_rank=8, markov_head="vanilla", confidence_head=True, num_anchors=16)


def test_a_bonus_anchor_export_is_refused_not_misread(tmp_path):
    save_drafter(dspark(), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "sample_from_anchor": False}))
    with pytest.raises(BadInput, match="bonus-anchor"):
        load_drafter(tmp_path / "d")


def test_the_speculators_format_is_refused_for_dspark_with_the_reason(tmp_path, tiny_target):
    from flashdraft.model.speculators import export_speculators

    save_drafter(dspark(), tmp_path / "d")
    with pytest.raises(BadInput, match="no DSpark converter"):
        export_speculators(tmp_path / "d", tiny_target, tmp_path / "spec")
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize("agree", [False, True])
def test_spec_generate_decodes_as_eval_does(tmp_path, agree):
    """z-lab's `spec_generate` on an exported DSpark drafter (K drafts a step, each slot after its own position):
    target-only greedy output, with eval's acceptance at every step — a random drafter's (every draft rejected),
    and one that agrees with the target (a zero LM head and Markov head: both pick token 0; every draft accepted)."""
    from transformers import Qwen3ForCausalLM

    from flashdraft.evaluate.decode import SpecDecoder
    from flashdraft.model.target import Target

    torch.manual_seed(0)
    target_model, drafter = Qwen3ForCausalLM(TARGET), dspark()
    if agree:
        with torch.no_grad():
            target_model.lm_head.weight.zero_()
            drafter.markov_head.markov_w2.weight.zero_()
    target_model.save_pretrained(tmp_path / "target")
    target = Target(str(tmp_path / "target"), "cpu", print, "float32")
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    model = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True)
    prompt = [5, 17, 42, 9, 3, 64, 21, 8]
    spec = SpecDecoder(target, load_drafter(tmp_path / "d"), stop_ids=set()).generate(prompt, 24)
    ids, steps = model.spec_generate(target=target.model, input_ids=torch.tensor([prompt]), max_new_tokens=24,
                                     return_stats=True)
    target.discard_features()
    expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    assert ids[0].tolist() == expected and ids[0, len(prompt) :].tolist() == spec.tokens
    assert steps == [n + 1 for n in spec.accepted]
    assert set(steps) == ({K + 1} if agree else {1}), steps
