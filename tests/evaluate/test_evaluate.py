"""Speculative decoding with a DFlash drafter: lossless, cached == recomputed, distribution-preserving."""

import copy
import json

import pytest
import torch

from flashdraft.artifact.manifest import read_manifest, verify_dir
from flashdraft.config import EvalConfig, TrainConfig
from flashdraft.evaluate import run
from flashdraft.evaluate.decode import SpecDecoder
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import save_drafter
from flashdraft.model.objective import block_masks, build_blocks
from flashdraft.model.target import Target
from flashdraft.train.step import sequence_step


def quiet(_):
    return None


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> Target:
    return Target(tiny_model_dir, "cpu", quiet)


def new_drafter(target: Target, block_size: int = 8, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = draft_config(target.config, num_layers=1, block_size=block_size, mask_token_id=0)
    return DFlashDrafter(config)


def greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    target.discard_features()
    return out[0, len(prompt) :].tolist()


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 3365, 3717, 257, 22234, 411, 2]


def test_untrained_drafter_is_lossless_with_tau_near_one(target):
    decoder = SpecDecoder(target, new_drafter(target), stop_ids=set())
    spec = decoder.generate(PROMPT, 40)
    assert spec.tokens == greedy(target, PROMPT, 40)
    assert 1.0 <= spec.acceptance_length < 1.5


def continuation_sample(target: Target) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPT + the target's own greedy continuation, supervised from the last prompt token on."""
    ids = torch.tensor(PROMPT + greedy(target, PROMPT, 64))
    mask = torch.zeros(len(ids), dtype=torch.long)
    mask[len(PROMPT) - 1 :] = 1
    return ids, mask


def overfit(drafter: DFlashDrafter, target: Target, ids, mask, steps: int) -> dict:
    """Train `drafter` on one sequence; returns the last step's result."""
    target.watch(drafter.target_layer_ids)
    cfg = TrainConfig(block_size=8, max_anchors=32, max_length=4096)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        result = sequence_step(drafter, target, ids, mask, cfg, torch.Generator().manual_seed(step), "cpu")
        result["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return result


@pytest.fixture(scope="module")
def overfit_drafter(target) -> DFlashDrafter:
    """A drafter that learned the target's own greedy continuation of PROMPT."""
    drafter = new_drafter(target)
    overfit(drafter, target, *continuation_sample(target), steps=100)
    return drafter


def test_overfit_drafter_accepts_many_tokens_and_stays_lossless(target, overfit_drafter):
    decoder = SpecDecoder(target, overfit_drafter, stop_ids=set())
    spec = decoder.generate(PROMPT, 64)
    assert spec.tokens == greedy(target, PROMPT, 64)
    assert spec.acceptance_length > 3.0


def test_a_bfloat16_target_decodes_with_a_bfloat16_drafter(tmp_path, tiny_model_dir, overfit_drafter):
    """`eval.target_dtype: bfloat16`: the eval stage runs the target and the drafter in bfloat16 and the drafter
    still proposes what it learned. Token-for-token equality with one-token greedy decoding is not asserted: in
    bfloat16 a verify pass over several tokens rounds differently from a one-token pass, so a near-tie can go
    the other way (what the lossless check allows, tests/evaluate/test_lossless.py)."""
    save_drafter(overfit_drafter, tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about cats."}) + "\n")
    cfg = EvalConfig(prompts=str(prompts), target=tiny_model_dir, max_new_tokens=16, target_dtype="bfloat16")
    stats = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=quiet)
    assert stats["prompts"] == 1 and stats["acceptance_length"] >= 1.0 and stats["target_dtype"] == "bfloat16"
    bf16 = Target(tiny_model_dir, "cpu", quiet, "bfloat16")
    drafter = copy.deepcopy(overfit_drafter).to(torch.bfloat16)
    spec = SpecDecoder(bf16, drafter, stop_ids=set()).generate(PROMPT, 40)
    assert bf16.model.dtype == torch.bfloat16 and len(spec.tokens) == 40
    assert spec.acceptance_length > 2.0  # the drafter trained on the float32 target's continuation still fits


def test_reduced_draft_vocab_trains_exports_and_decodes_losslessly(target, tmp_path):
    """A drafter scoring only 64 target tokens: label mapping, export (d2t/t2d) and eval agree end to end."""
    from flashdraft.model.export import load_drafter
    from flashdraft.tokenize.token_counts import TokenCounts
    from flashdraft.train.data import choose_draft_vocab

    ids, mask = continuation_sample(target)
    counts = TokenCounts()
    counts.add(ids.numpy(), mask.numpy())
    vocab = choose_draft_vocab(counts, 64, target.config.vocab_size)
    assert set(ids[mask.bool()].tolist()) <= set(vocab.tolist())  # every supervised token made the cut
    torch.manual_seed(0)
    config = draft_config(target.config, num_layers=1, block_size=8, mask_token_id=0, draft_vocab_size=64)
    drafter = DFlashDrafter(config)
    drafter.set_draft_vocab(vocab)
    result = overfit(drafter, target, ids, mask, steps=150)
    assert result["rates"][0] > 0.9  # mapped labels: a wrong mapping would leave accuracy near zero

    save_drafter(drafter, tmp_path / "drafter", dtype="float32", target_lm_head=target.lm_head.weight)
    loaded = load_drafter(tmp_path / "drafter")
    assert torch.equal(loaded.draft_ids(), vocab)

    # Read the way vLLM's DFlash loader does (qwen3_dflash.py): an lm_head of draft_vocab_size rows, d2t as
    # draft_id_to_target_id, and logits scattered to target id = draft id + d2t (−inf elsewhere).
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (64, target.config.hidden_size)
    hidden = torch.randn(3, target.config.hidden_size)
    engine_targets = torch.arange(64) + weights["d2t"]
    engine_logits = torch.full((3, target.config.vocab_size), float("-inf"))
    engine_logits[:, engine_targets] = hidden @ weights["lm_head.weight"].T
    ours = loaded.to_target_vocab(hidden @ target.head_weight(loaded).T, target.config.vocab_size)
    assert torch.allclose(engine_logits, ours, atol=1e-5)

    spec = SpecDecoder(target, loaded, stop_ids=set()).generate(PROMPT, 64)
    assert spec.tokens == ids[len(PROMPT) :].tolist() and spec.acceptance_length > 3.0


def reference_decode(target: Target, drafter: DFlashDrafter, prompt: list[int], max_new: int) -> tuple[list, list]:
    """Greedy speculative decoding recomputed from scratch at every step: no KV cache anywhere."""
    k = drafter.block_size
    embed, head = target.model.get_input_embeddings(), target.lm_head
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits
        tokens, accepted = [int(logits[0, -1].argmax())], []
        while len(tokens) < max_new:
            seq = prompt + tokens  # committed tokens; the last one is the anchor
            anchor_pos = len(seq) - 1
            features = target.features(torch.tensor([seq[:anchor_pos]]))
            block, positions, _, _ = build_blocks(torch.tensor(seq + [0] * k), torch.ones(len(seq) + k),
                                                  torch.tensor([anchor_pos]), k, drafter.mask_token_id)
            hidden = drafter(embed(block.view(1, -1)), features, positions.view(1, -1), torch.arange(anchor_pos)[None],
                             block_masks(torch.tensor([anchor_pos]), k, anchor_pos, drafter.sliding_window, "cpu"))
            drafts = head(hidden[0, 1:]).argmax(-1)
            full = target.model(torch.tensor([seq + drafts.tolist()])).logits[0, anchor_pos:]
            target.discard_features()
            predicted = full.argmax(-1)
            n = int((drafts == predicted[:-1]).int().cumprod(0).sum())
            tokens += drafts[:n].tolist() + [int(predicted[n])]
            accepted.append(n)
    return tokens[:max_new], accepted


def test_sliding_window_drafter_decodes_as_recomputed_and_losslessly(target):
    """Draft layers that see only the last 12 context positions: eval's cached path applies the same window."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=2, block_size=8, mask_token_id=0,
                                         sliding_window=12))
    overfit(drafter, target, *continuation_sample(target), steps=60)
    spec = SpecDecoder(target, drafter, stop_ids=set()).generate(PROMPT, 48)
    tokens, accepted = reference_decode(target, drafter, PROMPT, 48)
    assert spec.tokens == tokens == greedy(target, PROMPT, 48) and spec.accepted == accepted
    assert spec.acceptance_length > 1.5


def test_cached_decoding_equals_recomputing_from_scratch(target, overfit_drafter):
    decoder = SpecDecoder(target, overfit_drafter, stop_ids=set())
    spec = decoder.generate(PROMPT, 48)
    tokens, accepted = reference_decode(target, overfit_drafter, PROMPT, 48)
    assert spec.tokens == tokens and spec.accepted == accepted


def test_sampling_keeps_the_target_distribution(tmp_path):
    """Every emitted token is a target sample: the second token's frequencies match the exact marginal."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    vocab = 12
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked distributions: a wrong acceptance rule shows up
    model.save_pretrained(tmp_path / "t")
    target = Target(str(tmp_path / "t"), "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4, mask_token_id=vocab - 1))
    decoder = SpecDecoder(target, drafter, stop_ids=set())
    prompt = [3, 5, 7]

    with torch.no_grad():  # exact marginal of the second generated token
        p0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        second = torch.zeros(vocab)
        for t0 in range(vocab):
            second += p0[t0] * torch.softmax(model(torch.tensor([prompt + [t0]])).logits[0, -1], -1)
    target.discard_features()

    generator = torch.Generator().manual_seed(1)
    n = 2500
    counts = torch.zeros(vocab)
    drafted = 0
    for _ in range(n):
        spec = decoder.generate(prompt, 3, temperature=1.0, generator=generator)
        counts[spec.tokens[1]] += 1
        drafted += spec.accepted[0] > 0
    expected = second * n
    keep = expected > 5
    chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
    assert chi2 < 40.0, (chi2, counts.tolist(), expected.tolist())  # df ≤ 11: p < 1e-4 for a correct sampler
    assert 0 < drafted < n  # both paths (accepted draft, resampled residual) were exercised


@pytest.mark.slow
def test_eval_stage_writes_a_verified_report(tmp_path, tiny_model_dir, target, overfit_drafter):
    save_drafter(overfit_drafter, tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}.", "category": c}) + "\n"
                               for w, c in [("cats", "a"), ("dogs", "a"), ("owls", "b")]))
    cfg = EvalConfig(prompts=str(prompts), target=tiny_model_dir, max_new_tokens=24)
    stats = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=quiet)
    assert stats["lossless"] is True and stats["acceptance_length"] >= 1.0 and stats["prompts"] == 3
    assert stats["target_dtype"] == "float32"  # what the lossless check compared in (auto, on a CPU)
    assert stats["near_ties"] == 0  # in float32 token for token
    assert verify_dir(tmp_path / "eval") == [] and read_manifest(tmp_path / "eval").kind == "eval"
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert set(report["by_category"]) == {"a", "b"} and len(report["acceptance_by_position"]) == 7
    assert abs(report["acceptance_length"] - report["acceptance_length_from_rates"]) < 1e-6
    ratios = sorted(p["target_seconds"] / p["spec_seconds"] for p in report["prompts"])
    per = report["speedup_per_prompt"]  # median and 10–90 % range of the per-prompt ratios
    lowest, middle, highest = (round(r, 3) for r in ratios)  # the report rounds to 3 decimals
    assert per["median"] == middle and lowest <= per["p10"] <= per["median"] <= per["p90"] <= highest
    assert stats["speedup_per_prompt"] == per
    assert (tmp_path / "eval" / "acceptance_by_position.png").read_bytes()[:4] == b"\x89PNG"
    lines = []
    run(cfg, tmp_path / "drafter", tmp_path / "eval", log=lines.append)
    assert "already done, verified" in lines[0]
    # The same file name with other prompts (a newer export, a fixed record): other inputs, measured again.
    before = {p["id"] for p in report["prompts"]}
    prompts.write_text(prompts.read_text().replace("owls", "bats"))
    lines.clear()
    again = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=lines.append)
    assert "already done" not in lines[0] and again["prompts"] == 3
    after = {p["id"] for p in json.loads((tmp_path / "eval" / "report.json").read_text())["prompts"]}
    assert len(after - before) == 1  # the rewritten prompt was measured
    sampled = run(cfg.model_copy(update={"temperature": 0.7}), tmp_path / "drafter", tmp_path / "sampled",
                  log=lines.append)
    assert sampled["lossless"] is None and sampled["near_ties"] == 0
    assert "lossless not checked (sampled at temperature 0.7" in lines[-1]


def test_eval_of_a_z_lab_format_drafter_flashdraft_did_not_make(tmp_path, tiny_model_dir, overfit_drafter):
    """A drafter directory as the reference publishes them: transformers-4 config (top-level rope_theta, no
    rope_parameters, torch_dtype), bf16 weights, no manifest. Eval reads it, says it is unverified, stays lossless."""
    from safetensors.torch import save_file

    c = overfit_drafter.config
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_parameters["rope_theta"], "max_position_embeddings": c.max_position_embeddings,
           "block_size": c.block_size, "num_target_layers": c.num_target_layers, "torch_dtype": "bfloat16",
           "dflash_config": c.dflash_config}
    drafter_dir = tmp_path / "z-lab-style"
    drafter_dir.mkdir()
    (drafter_dir / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(torch.bfloat16) for k, v in overfit_drafter.state_dict().items()},
              str(drafter_dir / "model.safetensors"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about owls."}) + "\n")
    lines = []
    stats = run(EvalConfig(prompts=str(prompts), target=tiny_model_dir, max_new_tokens=24), drafter_dir,
                tmp_path / "eval", log=lines.append)
    assert any("has no manifest" in line for line in lines)
    assert stats["lossless"] is True and stats["prompts"] == 1


def test_eval_in_a_log_file_says_how_far_it_has_got(cli, tmp_path, tiny_model_dir, overfit_drafter):
    """Hours of eval are never silent (issue 56): in a log file, a line per interval with the turns decoded of all,
    the τ so far and an ETA (FLASHDRAFT_PROGRESS_SECONDS 0: a line a turn)."""
    import os

    save_drafter(overfit_drafter, tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "dogs", "owls")))
    run_ = cli("eval", "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts), "--target", tiny_model_dir,
               "--out", str(tmp_path / "eval"), "--max-new-tokens", "8",
               env=dict(os.environ, FLASHDRAFT_PROGRESS_SECONDS="0"))
    assert run_.returncode == 0, run_.stderr[-2000:]
    progress = [line for line in run_.stderr.splitlines() if line.startswith("eval: turns decoded")]
    assert [line.split(", τ so far")[1].split(" ")[2] for line in progress] == ["1/3", "2/3", "3/3"]
    assert all("ETA" in line and " turns/s, " in line for line in progress)


def test_eval_that_never_reaches_a_verify_step_is_refused_not_reported_as_tau_zero(tmp_path, tiny_model_dir, target,
                                                                                  overfit_drafter):
    """A turn's first token comes from the prompt's own pass; when every turn ends there, no draft was verified and
    τ would be 0/0. That is one line and no report, not "done, verified — τ 0.00" (and --max-new-tokens 1, which
    always ends there, is refused as a setting)."""
    import shutil

    from flashdraft.config import ConfigError, load_config
    from flashdraft.errors import ExpectedFailure

    save_drafter(overfit_drafter, tmp_path / "drafter")
    stops_at_once = tmp_path / "target"
    shutil.copytree(tiny_model_dir, stops_at_once)
    generation = json.loads((stops_at_once / "generation_config.json").read_text())
    generation["eos_token_id"] = list(range(target.config.vocab_size))  # every token ends the turn
    (stops_at_once / "generation_config.json").write_text(json.dumps(generation))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about owls."}) + "\n")
    cfg = EvalConfig(prompts=str(prompts), target=str(stops_at_once), max_new_tokens=8)
    with pytest.raises(ExpectedFailure, match="no turn reached a verify step"):
        run(cfg, tmp_path / "drafter", tmp_path / "eval", log=quiet)
    assert not (tmp_path / "eval" / "manifest.json").exists()
    config = tmp_path / "c.yaml"
    config.write_text("eval:\n  max_new_tokens: 1\n")
    with pytest.raises(ConfigError, match="eval.max_new_tokens"):
        load_config(config)
