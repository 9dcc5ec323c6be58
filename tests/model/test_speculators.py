"""`flashdraft export --format speculators`: vLLM's speculators package reads the result as trained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import save_drafter
from tests.forked_cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def trained_drafter(target: str, out: Path, **kwargs) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(AutoConfig.from_pretrained(target), num_layers=2, block_size=8,
                                         mask_token_id=127, **kwargs))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_drafter(drafter, out)
    return drafter


def test_without_the_speculators_package_one_line_says_how_to_get_it(tmp_path, tiny_target):
    try:
        import speculators  # noqa: F401
        pytest.skip("speculators is installed here")
    except ImportError:
        pass
    trained_drafter(tiny_target, tmp_path / "d")
    run = run_cli("export", "--drafter", str(tmp_path / "d"), "--target", tiny_target, "--out", str(tmp_path / "spec"))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "pip install speculators" in run.stderr and not (tmp_path / "spec").exists()


def test_a_reduced_vocabulary_drafter_is_refused_with_the_reason(tmp_path, tiny_target):
    from flashdraft.errors import BadInput
    from flashdraft.model.speculators import export_speculators

    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(AutoConfig.from_pretrained(tiny_target), num_layers=2, block_size=8,
                                         mask_token_id=127, draft_vocab_size=32))
    drafter.set_draft_vocab(torch.arange(32))
    save_drafter(drafter, tmp_path / "d", target_lm_head=torch.randn(128, 64))
    with pytest.raises(BadInput, match="keeps the full vocabulary and drops d2t"):
        export_speculators(tmp_path / "d", tiny_target, tmp_path / "spec")


def test_a_dflash2_drafter_is_refused_with_what_was_checked(tmp_path, tiny_target):
    from flashdraft.errors import BadInput
    from flashdraft.model.speculators import export_speculators

    save_drafter(dflash2_drafter(tiny_target), tmp_path / "d")
    with pytest.raises(BadInput, match="no DFlash2 converter"):
        export_speculators(tmp_path / "d", tiny_target, tmp_path / "spec")
    assert not (tmp_path / "spec").exists()


def dflash2_drafter(target: str) -> DFlash2Drafter:
    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    drafter = DFlash2Drafter(dflash2_config(draft_config(config, num_layers=2, block_size=8, mask_token_id=127),
                                            config, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                                            selector_top_k=8))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return drafter


@pytest.fixture(scope="module")
def speculators_python(tmp_path_factory) -> str:
    """A throwaway venv with speculators 0.9 and the transformers it pins (this torch and flashdraft reused
    through a .pth), made by the script docs/serving.md gives users: its python."""
    venv = tmp_path_factory.mktemp("spec") / "venv"
    subprocess.run([str(REPO / "scripts" / "speculators_venv.sh"), str(venv)], check=True,
                   env=dict(os.environ, FLASHDRAFT_PYTHON=sys.executable))
    python = str(venv / "bin" / "python")
    return python


@pytest.mark.slow
def test_speculators_reads_the_export_as_trained(tmp_path, tiny_target, speculators_python):
    """flashdraft's export command writes the checkpoint through speculators' own converter, and speculators'
    DFlashDraftModel loads it with flashdraft's weights, layer ids, block size, mask token and attention layout."""
    drafter = trained_drafter(tiny_target, tmp_path / "d", sliding_window=32)
    python = speculators_python

    export = [python, "-m", "flashdraft", "export", "--format", "speculators", "--drafter", str(tmp_path / "d"),
              "--target", tiny_target, "--out", str(tmp_path / "spec")]
    first = subprocess.run(export, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(export, capture_output=True, text=True)
    assert again.returncode == 0 and "already done, verified" in again.stdout + again.stderr

    check = f"""
import json, torch, transformers
from speculators.models.dflash import DFlashDraftModel
assert transformers.__version__ == "5.19.0"
m = DFlashDraftModel.from_pretrained({str(tmp_path / 'spec')!r})
c = m.config
torch.save({{k: v.float() for k, v in m.state_dict().items()}}, {str(tmp_path / 'state.pt')!r})
print(json.dumps({{"aux": c.aux_hidden_state_layer_ids, "block_size": c.block_size, "mask": c.mask_token_id,
                  "non_causal": c.sliding_window_non_causal, "layer_types": c.transformer_layer_config.layer_types,
                  "window": c.transformer_layer_config.sliding_window,
                  "theta": c.transformer_layer_config.rope_parameters["rope_theta"],
                  "verifier": c.speculators_config.verifier.name_or_path}}))
"""
    run = subprocess.run([python, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # speculators counts hidden states with the embedding as 0 (z-lab's layer id + 1)
    assert out["aux"] == [i + 1 for i in drafter.target_layer_ids]
    assert out["block_size"] == 8 and out["mask"] == 127 and out["verifier"] == tiny_target
    # speculators' default: sliding layers causal within the block, as flashdraft trains them
    assert out["non_causal"] is False
    assert out["layer_types"] == ["sliding_attention", "full_attention"] and out["window"] == 32
    assert out["theta"] == drafter.config.rope_parameters["rope_theta"]

    theirs = torch.load(tmp_path / "state.pt")
    ours = {k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()}  # exported in bf16
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
                 "layers.0.mlp.down_proj.weight"):
        assert torch.equal(theirs[name], ours[name]), name
    embed = load_file(str(Path(tiny_target) / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(theirs["embed_tokens.weight"], embed.to(torch.bfloat16).float())  # the verifier's, in bf16

    # DFlash2 (no converter in 0.9, see above): speculators' own DFlash2 modules, given flashdraft's exported
    # tensors, compute what flashdraft's convolution and candidate selector compute.
    dflash2 = dflash2_drafter(tiny_target)
    save_drafter(dflash2, tmp_path / "d2", dtype="float32")
    torch.manual_seed(2)
    x, y = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    unary, hidden, previous = torch.randn(2, 16, 128), torch.randn(2, 16, 64), torch.randint(0, 128, (2, 16))
    torch.save({"x": x, "y": y, "unary": unary, "hidden": hidden, "previous": previous}, tmp_path / "in2.pt")
    check2 = f"""
import torch
from safetensors.torch import load_file
from speculators.models.dflash2.model_definitions import CandidateSelector, GroupedDynamicCausalConv
w, i = load_file({str(tmp_path / 'd2' / 'model.safetensors')!r}), torch.load({str(tmp_path / 'in2.pt')!r})
conv = GroupedDynamicCausalConv(64, block_size=8, kernel_size=2, group_size=16)
conv.load_state_dict({{k.removeprefix("layers.1.mlp_conv."): v for k, v in w.items()
                      if k.startswith("layers.1.mlp_conv.")}})
selector = CandidateSelector(vocab_size=128, hidden_size=64, rank=16, top_k=8)
selector.load_state_dict({{k.removeprefix("candidate_selector."): v for k, v in w.items()
                          if k.startswith("candidate_selector.")}})
with torch.no_grad():
    prepared, kernel = conv.prepare(i["x"])
    ids, scores = selector.select(i["unary"], i["hidden"], i["previous"])
    torch.save({{"prepared": prepared, "finished": conv.finish(i["y"], kernel), "ids": ids, "scores": scores}},
               {str(tmp_path / 'out2.pt')!r})
"""
    run = subprocess.run([python, "-c", check2], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out2.pt")
    conv, selector = dflash2.layers[1].mlp_conv, dflash2.candidate_selector
    with torch.no_grad():
        prepared, kernel = conv.prepare(x)
        ids, scores = selector.scores(unary, hidden, previous, 8)
        assert torch.allclose(theirs["prepared"], prepared, atol=1e-5)
        assert torch.allclose(theirs["finished"], conv.finish(y, kernel), atol=1e-5)
    assert torch.equal(theirs["ids"], ids) and torch.allclose(theirs["scores"], scores, atol=1e-5)


@pytest.mark.slow
def test_the_loss_weights_equal_speculators_own(tmp_path, speculators_python):
    """D-PACE and the decay weights per block position, from speculators' `dpace_loss_decay` and
    `dflash_loss_decay` (what its DFlash trainer multiplies the cross-entropy by, with the anchor slot masked as
    its DFlash model masks it) against flashdraft's `dpace_weights` and `build_blocks`, on the same random
    cross-entropies and supervision. The normalisations differ by design: speculators divides by the count of
    supervised positions of a batch, flashdraft by the weights' total over the whole optimizer step."""
    from flashdraft.model.objective import build_blocks, dpace_weights

    g = torch.Generator().manual_seed(0)
    n, k = 12, 8
    ce = torch.rand(n, k, generator=g) * 4
    supervised = torch.rand(n, k, generator=g) > 0.2
    supervised[:, 0] = False  # the anchor: given, not predicted
    torch.save({"ce": ce, "mask": supervised.float()}, tmp_path / "in.pt")
    check = f"""
import torch
from speculators.losses import dflash_loss_decay, dpace_loss_decay
i = torch.load({str(tmp_path / 'in.pt')!r})
mask = i["mask"].reshape(1, -1)
ce = i["ce"].reshape(1, -1) * mask  # as its loss_function hands the cross-entropy to the weighting
pos = (torch.arange(mask.shape[1]) % {k}).unsqueeze(0).float()
out = {{str(a): dpace_loss_decay(pos, loss_mask=mask, block_size={k}, dpace_alpha=a, elementwise_loss=ce)
       for a in (0.3, 0.5, 1.0)}}
out["decay"] = dflash_loss_decay(pos, gamma=4.0) * mask
torch.save(out, {str(tmp_path / 'out.pt')!r})
"""
    run = subprocess.run([speculators_python, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for alpha in (0.3, 0.5, 1.0):
        ours = dpace_weights(ce, supervised, alpha)
        assert torch.allclose(theirs[str(alpha)].reshape(n, k), ours, rtol=1e-6, atol=1e-6), alpha
    # the decay weights: a sequence whose supervision is the mask above, one anchor every k tokens
    tokens = torch.zeros(n * k, dtype=torch.long)
    anchors = torch.arange(0, n * k, k)
    _, _, _, decay = build_blocks(tokens, supervised.reshape(-1), anchors, k, mask_token_id=1, gamma=4.0)
    assert torch.allclose(theirs["decay"].reshape(n, k), decay, atol=1e-7)


@pytest.mark.slow
def test_speculators_dspark_heads_compute_what_flashdraft_exports(tmp_path, speculators_python):
    """DSpark's heads, judged by an implementation that is not flashdraft's: speculators' own MarkovHead (each head
    type) and ConfidenceHead, given flashdraft's exported tensors, the same backbone hidden states and the same
    previous tokens, compute the same Markov-corrected logits and confidences to 1e-5, and walking the block with
    their bias one slot at a time (the previous token = their own argmax) proposes flashdraft's greedy block."""
    from flashdraft.model.dspark import DSparkDrafter, dspark_config

    vocab, hidden_size, rank, k = 128, 64, 16, 5
    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=hidden_size, intermediate_size=128,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(3)
    hidden, base = torch.randn(2, k, hidden_size), torch.randn(2, k, vocab)
    previous = torch.randint(0, vocab, (2, k))
    torch.save({"hidden": hidden, "base": base, "previous": previous}, tmp_path / "in.pt")
    ours = {}
    for head in ("vanilla", "gated", "rnn"):
        drafter = DSparkDrafter(dspark_config(draft_config(config, num_layers=1, block_size=k, mask_token_id=127),
                                              markov_rank=rank, markov_head=head, confidence_head=True,
                                              num_anchors=8))
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(torch.randn_like(p) * 0.5)
            corrected, confidence = drafter.block_logits(base, hidden, previous)
            path, _, _ = drafter.walk(base[0], hidden[0], int(previous[0, 0]), lambda row: row.argmax())
        ours[head] = (corrected, torch.sigmoid(confidence), path)
        save_drafter(drafter, tmp_path / head, dtype="float32")
    check = f"""
import torch
from safetensors.torch import load_file
from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead
i, out = torch.load({str(tmp_path / 'in.pt')!r}), {{}}
for head in ("vanilla", "gated", "rnn"):
    w = load_file(f"{tmp_path}/{{head}}/model.safetensors")
    markov = MarkovHead(verifier_vocab_size={vocab}, draft_vocab_size={vocab}, markov_rank={rank},
                        hidden_size={hidden_size}, head_type=head)
    markov.load_state_dict({{k.removeprefix("markov_head."): v for k, v in w.items() if k.startswith("markov_head.")}})
    confidence = ConfidenceHead({hidden_size} + {rank})
    confidence.load_state_dict({{k.removeprefix("confidence_head."): v for k, v in w.items()
                                if k.startswith("confidence_head.")}})
    with torch.no_grad():
        emb = markov.prev_embeddings(i["previous"])
        corrected = i["base"] + markov.block_bias(prev_token_ids=i["previous"], hidden_states=i["hidden"], prev_emb=emb)
        conf = torch.sigmoid(confidence(torch.cat([i["hidden"], emb], dim=-1)))
        # the greedy walk of block 0: each slot's bias from the token picked before it (teacher-forcing their own
        # picks through block_bias, which for the rnn head replays the state from the block's start)
        picked = [int(i["previous"][0, 0])]
        for slot in range({k}):
            prev = torch.tensor([picked + [0] * ({k} - len(picked))])
            row = i["base"][0:1] + markov.block_bias(prev_token_ids=prev, hidden_states=i["hidden"][0:1])
            picked.append(int(row[0, slot].argmax()))
    out[head] = (corrected, conf, torch.tensor(picked[1:]))
torch.save(out, {str(tmp_path / 'out.pt')!r})
"""
    run = subprocess.run([speculators_python, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for head, (corrected, confidence, path) in ours.items():
        assert torch.allclose(theirs[head][0], corrected, atol=1e-5), head
        assert torch.allclose(theirs[head][1], confidence, atol=1e-5), head
        assert torch.equal(theirs[head][2], path), head
    assert not torch.equal(ours["vanilla"][2], base[0].argmax(-1))  # the heads change the block: the check has teeth
