"""A real serving engine in the loop (evaluate/engines.py): vLLM's CPU build serves the embedded target with a
flashdraft export, and the τ it counts is the τ eval measures on the same prompts. The engine tests need
`scripts/engines.sh` (CI runs it); without it they skip and say so."""

import json

import pytest
import torch

from flashdraft.evaluate.engines import default_python, parse_metrics, summary

HAS_VLLM = default_python("vllm").is_file()
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=f"vLLM's CPU build is not installed at "
                                f"{default_python('vllm').parent.parent}: run scripts/engines.sh")

# What vLLM 0.32's /metrics says of speculative decoding (its counter names and labels, as served), after
# 2 drafts of 3 tokens with 4 accepted: position 0 twice, 1 twice, 2 never.
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 2.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 6.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 2.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_the_engines_counters_make_its_own_mean_acceptance_length():
    counters = parse_metrics(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted, counters.by_position) == (2, 6, 4, (2, 2, 0))
    made = counters.minus(parse_metrics(""))
    row = {"drafts": made.drafts, "draft_tokens": made.draft_tokens, "accepted": made.accepted, "tokens": 0}
    row |= {f"position_{i}": v for i, v in enumerate(made.by_position)}
    overall = summary({"set": row})["overall"]
    assert overall["acceptance_length"] == 3.0  # 1 + 4 / 2: vLLM's definition, bonus token included
    assert overall["acceptance_by_position"] == [1.0, 1.0, 0.0]


PROMPTS = ["Tell me about cats.", "Name three colours.", "What is a river?"]


def agreeing_drafter(target_dir: str, tokenizer, steps: int):
    """A one-layer, block-4 drafter trained on the target's own greedy answers to PROMPTS: it accepts well above
    one token on them, so an engine that misreads the export (layer ids, mask token, block layout) shows."""
    from flashdraft.config import TrainConfig
    from flashdraft.evaluate.decode import target_only
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.step import sequence_step

    target = Target(target_dir, "cpu", lambda line: None)
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4,
                                         mask_token_id=tokenizer.vocab_size - 1))
    target.watch(drafter.target_layer_ids)
    sequences = []
    for text in PROMPTS:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
        full = torch.tensor(ids + target_only(target, ids, 40)[0])
        mask = torch.zeros(len(full), dtype=torch.long)
        mask[len(ids) - 1 :] = 1
        sequences.append((full, mask))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    cfg = TrainConfig(block_size=4, max_anchors=64, max_length=4096)
    for step in range(steps):
        for full, mask in sequences:
            generator = torch.Generator().manual_seed(step)
            sequence_step(drafter, target, full, mask, cfg, generator, "cpu")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_the_export_and_counts_the_tau_eval_measures(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run
    from flashdraft.model.export import save_drafter

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    save_drafter(agreeing_drafter(smollm2_dir, tokenizer, steps=120), tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    cfg = EvalConfig(prompts=str(prompts), target=smollm2_dir, max_new_tokens=40, engine="vllm")
    stats = run(cfg, tmp_path / "drafter", tmp_path / "eval", log=print)
    engine = stats["engine"]
    assert stats["lossless"] is True and stats["acceptance_length"] > 1.5  # a drafter worth reading right
    assert abs(engine["overall"]["acceptance_length"] - stats["acceptance_length"]) <= 0.1, engine
    assert engine["tokens_per_s"] > 0 and engine["tokens_per_s_without_drafter"] > 0
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "τ in vllm" in report and f"{engine['overall']['acceptance_length']:.2f}" in report
