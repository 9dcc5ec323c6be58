"""The serving-walk τ training reports is what eval measures: on the target's own greedy completions, walking
each sequence block by block gives exactly the verify steps speculative decoding takes."""

import json

import pytest
import torch

from flashdraft.config import GenerateConfig, TrainConfig
from flashdraft.model.objective import acceptance_length


def quiet(_):
    return None


@pytest.fixture(scope="module")
def greedy_run(tmp_path_factory, tiny_model_dir):
    """24 prompts answered greedily by the tiny Llama (40 tokens each), as training samples of exactly its tokens
    (its rendered prompt + the ids it generated: a random model's text does not survive a decode/encode round
    trip, so tokenize's re-encoding would not be its tokens), and a small drafter trained on them (exported in
    float32, so eval decodes with the weights training held)."""
    from transformers import AutoTokenizer

    from flashdraft import generate, train
    from tests.train.test_train import make_dataset

    work = tmp_path_factory.mktemp("walk")
    prompts = work / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i} and what follows it."}) + "\n"
                               for i in range(10, 34)))  # two digits each: prompts of one length
    generate.run(GenerateConfig(prompts=str(prompts), model=tiny_model_dir, max_new_tokens=40, batch_size=24),
                 work / "gen", log=quiet)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = [json.loads(line) for line in (work / "gen" / "batch-000000.jsonl").read_text().splitlines()]
    rendered = [list(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]) for r in records]
    make_dataset(work / "ds", [ids + r["token_ids"] for ids, r in zip(rendered, records, strict=True)],
                 prompt_len=len(rendered[0]), ids=[r["id"] for r in records])
    assert len({len(ids) for ids in rendered}) == 1 and all(len(r["token_ids"]) == 40 for r in records)
    cfg = TrainConfig(target=tiny_model_dir, num_layers=1, block_size=8, max_anchors=32, batch_size=4, max_steps=20,
                      lr=3e-3, checkpoint_every=1000, eval_samples=16, export_dtype="float32", target_dtype="float32")
    held = train.run(cfg, work / "ds", work / "train", log=quiet)["heldout"]
    return work, prompts, cfg, held


def test_the_walk_takes_the_verify_steps_eval_takes(greedy_run, tiny_model_dir):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from flashdraft.evaluate.decode import SpecDecoder
    from flashdraft.generate.prompts import load_prompts
    from flashdraft.model.export import load_drafter
    from flashdraft.model.resolve import stop_token_ids
    from flashdraft.model.target import Target
    from flashdraft.train.heldout import serving_walk

    work, prompts, cfg, _ = greedy_run
    target = Target(tiny_model_dir, "cpu", quiet, "float32")
    drafter = load_drafter(work / "train" / "drafter")
    target.watch(drafter.target_layer_ids)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    decoder = SpecDecoder(target, drafter, stop_token_ids(tokenizer, tokenizer.eos_token_id))
    by_id = {p.id: p for p in load_prompts(str(prompts)).prompts}
    horizon = 40 - drafter.block_size  # eval stops before its blocks reach past the 40 tokens the data holds
    steps, walks = [], []
    for row in load_from_disk(str(work / "ds")):
        walk = serving_walk(drafter, target, row["input_ids"], row["loss_mask"], cfg, "cpu")
        ids = tokenizer.apply_chat_template(by_id[row["id"]].messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        decoded = decoder.generate(list(ids), horizon)
        assert decoded.tokens == row["input_ids"][len(ids): len(ids) + len(decoded.tokens)]  # the same text
        assert walk[: len(decoded.accepted)] == decoded.accepted, row["id"]  # block for block
        steps += decoded.accepted
        walks.append(walk)
    assert acceptance_length(steps) > 1.2  # the drafter is right often enough for the walk to matter


def test_training_reports_the_walk_beside_the_per_anchor_value(greedy_run, tiny_model_dir):
    """Over whole held-out sequences the walk's τ is eval's τ up to each sequence's last block (where eval would
    also compare drafts with the target's continuation past the data's 40 tokens): at most K − 1 drafts a
    sequence. The per-anchor value, which starts blocks at random supervised positions rather than where the last
    one stopped, is not (measured here: walk 1.82, eval 1.95, per-anchor 3.95)."""
    from datasets import load_from_disk

    from flashdraft import evaluate
    from flashdraft.config import EvalConfig
    from flashdraft.generate.prompts import load_prompts
    from flashdraft.train.data import run_split

    work, prompts, cfg, held = greedy_run
    dataset = load_from_disk(str(work / "ds"))
    _, heldout, _ = run_split(dataset, cfg)  # the run's own pick
    ids = {dataset[i]["id"] for i in heldout}
    lines, parsed = prompts.read_text().splitlines(), load_prompts(str(prompts)).prompts
    assert len(lines) == len(parsed)
    chosen = work / "heldout-prompts.jsonl"
    chosen.write_text("".join(line + "\n" for line, p in zip(lines, parsed, strict=True) if p.id in ids))
    stats = evaluate.run(EvalConfig(prompts=str(chosen), target=tiny_model_dir, max_new_tokens=40,
                                    target_dtype="float32"), work / "train" / "drafter", work / "eval", log=quiet)
    assert stats["lossless"] and stats["prompts"] == len(heldout) == held["samples"]
    # each of the held-out sequences' last blocks can differ by at most K − 1 accepted drafts
    bound = len(heldout) * (cfg.block_size - 1) / held["serving_blocks"]
    assert abs(held["serving_acceptance_length"] - stats["acceptance_length"]) <= bound
    assert abs(held["simulated_acceptance_length"] - stats["acceptance_length"]) > bound


def test_a_walk_restarts_right_after_each_bonus_token(tiny_target):
    """On a drafter that accepts nothing, a walk has one block per supervised token (every bonus token is the
    next anchor); a sequence without supervised tokens has no walk."""
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.heldout import serving_walk

    target = Target(tiny_target, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4, mask_token_id=127)).eval()
    torch.nn.init.zeros_(drafter.norm.weight)  # every logit 0: argmax 0, a token the sequence never holds
    target.watch(drafter.target_layer_ids)
    cfg = TrainConfig(target=tiny_target, block_size=4, max_anchors=3)  # several passes of 3 anchors
    ids = list(range(1, 21))
    mask = [0] * 8 + [1] * 12
    assert serving_walk(drafter, target, ids, mask, cfg, "cpu") == [0] * 11  # anchors 8 … 18: one needs a label
    assert serving_walk(drafter, target, ids, [0] * 20, cfg, "cpu") == []


def test_on_sampled_completions_the_walk_accepts_what_verification_would(greedy_run, tiny_model_dir):
    """On sampled completions, a block's accepted drafts are what greedy verification accepts
    from the same context (the real decoder, started on the sequence's prefix), up to the first position where
    the sequence departs from the target's argmax: past it the label verification would use is conditioned on
    a token the data does not hold. The sequence's own tokens would be the wrong labels: checked here, the
    sampled data departs from the target's argmax inside many of the walk's blocks. Temperature 0.03: the random
    model's logits spread ~0.1, so at 0.03 it keeps its argmax about two times in three (a trained model's T ≈ 1)."""
    from transformers import AutoTokenizer

    from flashdraft import generate
    from flashdraft.evaluate.decode import Sampler, SpecDecoder
    from flashdraft.model.export import load_drafter
    from flashdraft.model.resolve import stop_token_ids
    from flashdraft.model.target import Target
    from flashdraft.train.heldout import serving_walk

    work, prompts, cfg, _ = greedy_run
    generate.run(GenerateConfig(prompts=str(prompts), model=tiny_model_dir, max_new_tokens=40, batch_size=24,
                                temperature=0.03, seed=3), work / "sampled", log=quiet)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = [json.loads(line) for line in (work / "sampled" / "batch-000000.jsonl").read_text().splitlines()]
    target = Target(tiny_model_dir, "cpu", quiet, "float32")
    drafter = load_drafter(work / "train" / "drafter")
    target.watch(drafter.target_layer_ids)
    decoder = SpecDecoder(target, drafter, stop_token_ids(tokenizer, tokenizer.eos_token_id))
    k = drafter.block_size
    checked = departed = accepted_total = 0
    for record in records:
        prompt = list(tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"])
        ids = prompt + record["token_ids"]
        walk = serving_walk(drafter, target, ids, [0] * len(prompt) + [1] * len(record["token_ids"]), cfg, "cpu")
        position = len(prompt)  # the first block: at the first supervised position
        for accepted in walk:
            if position + k > len(ids):
                break  # a block reaching past the data: its labels there are not the target's
            state = decoder.start(ids[:position], 0.0, Sampler())
            if state.anchor == ids[position]:  # the decoder's anchor is the sequence's token: the same block
                decoder.step(state, 0.0, Sampler())
                greedy = state.tokens  # the target's tokens at position, position + 1, …
                follows = next((j for j in range(1, len(greedy)) if greedy[j] != ids[position + j]), k)
                assert accepted == min(state.accepted[0], follows), (record["id"], position)
                checked += 1
                departed += follows < k - 1
                accepted_total += accepted
            position += accepted + 1
    assert checked >= 200 and departed >= 10 and accepted_total >= 40, (checked, departed, accepted_total)
