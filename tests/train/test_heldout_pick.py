"""The held-out pick: samples without kin in training first (issue 31). A held-out sample whose kin is trained on
(the same question with other numbers, another turn of its conversation) reads a higher τ than prompts written
apart, as eval's are; tokenize keys each sample by its first user turn's opening words so train can tell."""

import numpy as np
import torch
from datasets import load_from_disk

from flashdraft import train
from flashdraft.config import TokenizeConfig, TrainConfig
from flashdraft.records import opening_key
from flashdraft.tokenize import run
from flashdraft.train.data import kin_free, kin_free_samples, split_heldout
from tests.tokenize.test_tokenize import conv, write_jsonl


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_prompts_are_kin_when_their_first_user_turn_opens_with_the_same_three_words():
    same = opening_key(user("I bought three notebooks at $2.40."))
    assert opening_key(user("i BOUGHT three... pens, for $9?")) == same  # words, not case or punctuation
    assert opening_key(user("I bought five notebooks at $2.40.")) != same
    # the first user turn decides, not a system prompt every sample shares, nor a later turn
    system = [{"role": "system", "content": "You are helpful."}]
    assert opening_key(system + user("I bought three pens")) == same
    assert opening_key(user("Tell me a joke") + [{"role": "assistant", "content": "No."}]
                       + user("I bought three")) != same


def test_without_openings_the_pick_is_the_seeded_random_one_it_always_was():
    train, held = split_heldout(50, 5, seed=3)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()
    assert held == sorted(perm[:5]) and train == sorted(perm[5:])
    # a dataset without the column (an older one, another tool's) has no kin-free mask: that plain pick
    from datasets import Dataset

    assert kin_free_samples(Dataset.from_dict({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]})) is None


def test_samples_without_kin_are_held_out_first_and_kin_fill_up_only_when_too_few():
    openings = np.array([7] * 30 + list(range(100, 120)) + [8] * 50)  # 20 kin-free among 100
    train, held = split_heldout(100, 10, seed=0, free=kin_free(openings))
    assert len(held) == 10 and set(held) <= set(range(30, 50))
    assert sorted(train + held) == list(range(100))
    # another seed picks other kin-free samples: still random among them
    assert split_heldout(100, 10, seed=1, free=kin_free(openings))[1] != held
    # asking for more than there are: all 20 kin-free ones, then kin
    _, many = split_heldout(400, 40, seed=0, free=kin_free(np.concatenate([openings, np.full(300, 9)])))
    assert set(range(30, 50)) <= set(many) and len(many) == 40
    assert kin_free(np.array([1, 2, 1, 3])).tolist() == [False, True, False, True]


def test_tokenize_keys_every_sample_and_train_holds_out_the_kin_free(tmp_path, smollm2_dir, tiny_model_dir):
    # 24 prompts from one template (kin) and 8 written apart; answers long enough to supervise
    templated = [conv(f"How many apples are {i} plus {i + 1}?", f"That is {2 * i + 1} apples. " * 3) for i in range(24)]
    apart = [conv(text, "A short, plain answer to that. " * 3) for text in
             ["Why is the sky blue?", "Name a prime above 90.", "Write a haiku about rain.", "What does DNS do?",
              "Explain recursion briefly.", "Is a tomato a fruit?", "Translate 'bonjour' please.", "Sort 3 1 2."]]
    src = write_jsonl(tmp_path / "c.jsonl", templated + apart)
    run(TokenizeConfig(tokenizer=smollm2_dir, workers=1, min_loss_fraction=0.0), src, tmp_path / "ds",
        log=lambda s: None)
    dataset = load_from_disk(str(tmp_path / "ds"))
    keys = {row["id"]: row["prompt_opening"] for row in dataset}
    assert len(keys) == 32 and len(set(keys.values())) == 9  # one key for the template, one each for the others
    assert dataset[0]["prompt_opening"] == opening_key(templated[0]["messages"])
    _, held = split_heldout(len(dataset), 3, seed=0, free=kin_free_samples(dataset))
    apart_keys = {opening_key(c["messages"]) for c in apart}
    assert len(held) == 3 and all(dataset[i]["prompt_opening"] in apart_keys for i in held)
    # a random pick from this data mostly lands on the template (3/4 of it): the test can fail
    _, random_held = split_heldout(len(dataset), 3, seed=0)
    assert not all(dataset[i]["prompt_opening"] in apart_keys for i in random_held)
    # a training run makes the same pick and says so
    lines = []
    cfg = TrainConfig(target=tiny_model_dir, num_layers=1, block_size=4, max_anchors=4, batch_size=2, max_steps=1,
                      eval_samples=3, checkpoint_every=100)
    stats = train.run(cfg, tmp_path / "ds", tmp_path / "train", log=lines.append)
    assert "train: held out 3 samples, 3 of them without kin in training" in "\n".join(lines)
    assert stats["heldout"]["samples"] == 3 and stats["train_samples"] == 29
