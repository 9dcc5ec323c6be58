"""The z-lab export format, written and read back."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.artifact.manifest import read_manifest
from flashdraft.model.dflash2 import DFlash2Drafter, dflash2_config
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import MODELING_FILE, load_drafter, save_drafter
from flashdraft.model.objective import block_masks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_round_trip(tiny_target, tmp_path, dtype):
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(tiny_target)
    target.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    config = draft_config(target, num_layers=2, block_size=8, mask_token_id=127)
    drafter = DFlashDrafter(config)
    save_drafter(drafter, tmp_path / "drafter", stats={"x": 1}, dtype=dtype)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert raw["num_target_layers"] == 6 and raw["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 3]}
    assert raw["model_type"] == "qwen3" and raw["num_hidden_layers"] == 2
    # RoPE stated for transformers 4.x readers (top level) and 5.x (rope_parameters) alike; dtype under both names
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 1_000_000.0 and "rope_scaling" not in raw
    assert raw["dtype"] == raw["torch_dtype"] == dtype and raw["transformers_version"]
    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(weights)
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in weights)
    assert {t.dtype for t in weights.values()} == {getattr(torch, dtype)}
    manifest = read_manifest(tmp_path / "drafter")
    assert manifest.kind == "drafter"
    # the code trust_remote_code would run is the package's own file, and the manifest pins its bytes
    shipped = (tmp_path / "drafter" / MODELING_FILE.name).read_bytes()
    assert shipped == MODELING_FILE.read_bytes()
    assert {e.path: e.sha256 for e in manifest.files}[MODELING_FILE.name] == hashlib.sha256(shipped).hexdigest()
    loaded = load_drafter(tmp_path / "drafter")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a.to(getattr(torch, dtype)).float(), b), name  # exact at the exported precision
    assert loaded.block_size == 8 and loaded.target_layer_ids == [1, 3] and loaded.mask_token_id == 127
    assert loaded.config.rope_parameters["rope_theta"] == 1_000_000.0


def test_a_hand_written_transformers_4_style_drafter_loads_with_its_theta(tmp_path):
    """A z-lab-style drafter directory flashdraft did not write: top-level rope_theta, no rope_parameters."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    made = DFlashDrafter(draft_config(target, num_layers=1, block_size=16, mask_token_id=127, target_layer_ids=[1, 3]))
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 4096,
           "block_size": 16, "num_target_layers": 6, "torch_dtype": "bfloat16",
           "dflash_config": {"mask_token_id": 127, "target_layer_ids": [1, 3]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(torch.bfloat16) for k, v in made.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path)
    assert loaded.config.rope_parameters["rope_theta"] == 1_000_000 and loaded.block_size == 16


def test_an_architecture_without_decoder_layers_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from flashdraft.errors import BadInput
    from flashdraft.model.target import language_model

    with pytest.raises(BadInput, match="GPT2LMHeadModel: cannot find its decoder layers"):
        language_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


@pytest.mark.slow
def test_transformers_4_57_reads_the_trained_theta(tmp_path, tiny_target):
    """The z-lab reference pins transformers 4.57: in a throwaway venv with it (reusing this torch through a
    .pth file), the exported config.json gives the RoPE base, shapes and DFlash fields training used, and the
    shipped modeling file (`trust_remote_code`) computes there what flashdraft's drafter computes here — for a
    DFlash2 drafter too (its hidden states and its greedy path) — and its `spec_generate` decodes losslessly."""
    import subprocess
    import sys
    import sysconfig

    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(tiny_target)
    target.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    drafter = DFlashDrafter(draft_config(target, num_layers=2, block_size=8, mask_token_id=127, sliding_window=32))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_drafter(drafter, tmp_path / "drafter")
    trained = drafter.rotary_emb.inv_freq
    context, k = 40, 8  # longer than the window: the sliding layer's window is exercised
    torch.manual_seed(1)
    block = torch.randn(1, k, target.hidden_size)
    features = torch.randn(1, context, 2 * target.hidden_size)
    torch.save({"block": block, "features": features}, tmp_path / "inputs.pt")
    # and a DFlash2 drafter (full attention), read through the same modeling file there
    dflash2 = DFlash2Drafter(dflash2_config(draft_config(target, num_layers=2, block_size=k, mask_token_id=127),
                                            target, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                                            selector_top_k=8))
    with torch.no_grad():
        for p in dflash2.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_drafter(dflash2, tmp_path / "dflash2", dtype="float32")
    head = torch.nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    torch.save(head.state_dict(), tmp_path / "head.pt")

    venv = tmp_path / "tf457"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "transformers==4.57.1"], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "reuse-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after its own packages
    check = f"""
import json, torch, transformers
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
assert transformers.__version__ == "4.57.1", transformers.__version__
c = Qwen3Config.from_pretrained({str(tmp_path / 'drafter')!r})
print(json.dumps({{"theta": c.rope_theta, "inv_freq": Qwen3RotaryEmbedding(c).inv_freq.tolist(),
                  "block_size": c.block_size, "dflash": c.dflash_config, "layer_types": c.layer_types,
                  "sliding_window": c.sliding_window, "head_dim": c.head_dim, "dtype": str(c.torch_dtype)}}))
model = transformers.AutoModel.from_pretrained({str(tmp_path / 'drafter')!r}, trust_remote_code=True,
                                               torch_dtype=torch.float32)
x = torch.load({str(tmp_path / 'inputs.pt')!r})
with torch.no_grad():
    hidden = model(position_ids=torch.arange({context + k})[None], noise_embedding=x["block"],
                   target_hidden=x["features"])
torch.save(hidden, {str(tmp_path / 'hidden.pt')!r})
model2 = transformers.AutoModel.from_pretrained({str(tmp_path / 'dflash2')!r}, trust_remote_code=True,
                                                torch_dtype=torch.float32)
head = torch.nn.Linear({target.hidden_size}, {target.vocab_size}, bias=False)
head.load_state_dict(torch.load({str(tmp_path / 'head.pt')!r}))
with torch.no_grad():
    hidden2 = model2(position_ids=torch.arange({context + k})[None], noise_embedding=x["block"],
                     target_hidden=x["features"])
    path, candidates, _ = model2.propose(hidden2[:, 1 - {k}:, :], torch.tensor([5]), head, 0.0)
torch.save({{"name": type(model2).__name__, "hidden": hidden2, "path": path, "candidates": candidates}},
           {str(tmp_path / 'dflash2.pt')!r})
# z-lab's README call, as its users make it under the transformers it pins: target-only greedy output
target = transformers.AutoModelForCausalLM.from_pretrained({tiny_target!r}, torch_dtype=torch.float32).eval()
prompt = torch.tensor([[5, 17, 42, 99, 3, 64, 21, 8]])
for drafted in (model, model2):
    ids = drafted.spec_generate(input_ids=prompt, target=target, max_new_tokens=12, stop_token_ids=[],
                                temperature=0.0)
    assert ids.tolist() == target.generate(prompt, max_new_tokens=12, do_sample=False).tolist(), ids
"""
    run = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[0])
    assert out["theta"] == 1_000_000.0 and torch.allclose(torch.tensor(out["inv_freq"]), trained.float())
    assert out["block_size"] == 8
    assert out["dflash"] == {"mask_token_id": 127, "target_layer_ids": [1, 3]}
    assert out["layer_types"] == ["sliding_attention", "full_attention"] and out["sliding_window"] == 32
    assert out["head_dim"] == 16 and out["dtype"] == "torch.bfloat16"

    exported = load_drafter(tmp_path / "drafter")  # the bf16 weights as flashdraft reads them, in fp32
    masks = block_masks(torch.tensor([context]), k, context, exported.sliding_window, "cpu")
    with torch.no_grad():
        ours = exported(block, features, torch.arange(context, context + k)[None], torch.arange(context)[None], masks)
    assert torch.allclose(torch.load(tmp_path / "hidden.pt"), ours, atol=1e-5)

    theirs = torch.load(tmp_path / "dflash2.pt")
    masks = block_masks(torch.tensor([context]), k, context, None, "cpu")
    with torch.no_grad():
        ours = dflash2(block, features, torch.arange(context, context + k)[None], torch.arange(context)[None], masks)
        unary = dflash2.unary_logits(head(ours[0, 1:]))
        path, candidates, _ = dflash2.walk(unary, ours[0, 1:], 5, lambda score: score.argmax())
    assert theirs["name"] == "DFlash2DraftModel" and torch.allclose(theirs["hidden"], ours, atol=1e-5)
    assert torch.equal(theirs["path"][0], path) and torch.equal(theirs["candidates"][0], candidates)
