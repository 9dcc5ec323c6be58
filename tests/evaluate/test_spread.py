"""τ at temperature > 0 and its standard error over prompts × seeds (evaluate/spread.py)."""

import random
import statistics

from flashdraft.evaluate.report import markdown_report
from flashdraft.evaluate.spread import AGREEMENT_FLOOR, eval_draws, judged, tau_error


def experiment(rng: random.Random, prompts: int) -> list[tuple[float, float]]:
    """One run's draws: each prompt its own acceptance rate and length, each verify pass accepting a geometric
    number of drafts (at most 3) — prompts differ far more than passes, as they do in practice."""
    draws = []
    for _ in range(prompts):
        rate, passes = rng.uniform(0.05, 0.7), rng.randint(5, 40)
        accepted = 0
        for _ in range(passes):
            n = 0
            while n < 3 and rng.random() < rate:
                n += 1
            accepted += n
        draws.append((accepted, passes))
    return draws


def test_the_standard_error_is_the_spread_of_tau_over_repeated_runs():
    """Over 400 runs of 30 draws, the standard deviation of τ is what each run's standard error said it would be
    (within 10 %): the number a judgement rests on is the real spread, not a formula's guess."""
    rng = random.Random(0)
    runs = [tau_error(experiment(rng, 30)) for _ in range(400)]
    spread = statistics.stdev(run["tau"] for run in runs)
    said = statistics.fmean(run["standard_error"] for run in runs)
    assert abs(said - spread) / spread < 0.1, (said, spread)


def test_a_prompts_turns_and_seeds_make_draws():
    rows = [{"dataset": "a", "id": "p1", "seed": 0, "accepted": [1, 2]},
            {"dataset": "a", "id": "p1", "seed": 0, "accepted": [0]},  # the second turn: the same draw
            {"dataset": "a", "id": "p1", "seed": 1, "accepted": [3]},
            {"dataset": "a", "id": "p2", "seed": 0, "accepted": [0, 0]}]
    assert sorted(eval_draws(rows)) == [(0, 2), (3, 1), (3, 3)]
    assert tau_error([(3, 3)]) is None  # one draw: no spread to give
    assert tau_error([(2, 2), (4, 4)])["standard_error"] == 0.0


def test_agreement_is_two_combined_standard_errors_or_the_floor():
    wide = judged(1.30, 0.03, 1.40, 0.04)  # combined 0.05: bound 0.10
    assert wide["bound"] == 0.1 and wide["agrees"] and wide["detectable"] == 0.14
    narrow = judged(1.30, 0.001, 1.335, 0.001)  # 2 combined standard errors < the floor
    assert narrow["bound"] == AGREEMENT_FLOOR and narrow["agrees"]
    assert not judged(1.30, 0.001, 1.35, 0.001)["agrees"]
    assert judged(1.30, None, 1.35, 0.01) is None


def test_a_sampled_tau_is_never_shown_without_its_spread():
    """report.md at T > 0 with one seed: every τ carries ± its standard error, and the heading names the draft rule
    and the seed."""
    config = {"thinking": False, "temperature": 1.0, "seed": 0, "seeds": 1, "draft_sampling": "greedy",
              "max_new_tokens": 8}
    block = {"prompts": 4, "prompt_tokens_mean": 20.0, "acceptance_length": 1.31, "standard_error": 0.021,
             "acceptance_length_mean_per_turn": 1.3, "acceptance_by_position": [0.2, 0.1], "speedup": 1.0,
             "lossless": None}
    report = {**block, "config": config, "target_dtype": "float32", "decoding": "growing KV cache",
              "by_dataset": {"set": block}}
    table = markdown_report(report)
    assert "| 1.31 ± 0.02 |" in table and "draft rule greedy" in table and "seed 0" in table
    assert "1.31 |" not in table.replace("1.31 ± 0.02 |", "")


def test_a_report_over_two_seeds_shows_them_and_each_rows_spread():
    config = {"thinking": False, "temperature": 0.7, "seed": 5, "seeds": 2, "draft_sampling": "sample",
              "max_new_tokens": 8}
    block = {"prompts": 8, "prompt_tokens_mean": 20.0, "acceptance_length": 1.5, "standard_error": 0.04,
             "acceptance_length_mean_per_turn": 1.4, "acceptance_by_position": [0.3], "speedup": 1.0,
             "lossless": None}
    report = {**block, "config": config, "target_dtype": "float32", "decoding": "growing KV cache",
              "by_dataset": {"a": block, "b": {**block, "standard_error": None}}}
    table = markdown_report(report)
    assert "seeds 5, 6" in table and "turns count each seed's" in table and "draft rule sample" in table
    assert "| a | 8 | 20 | 1.50 ± 0.04 |" in table and "| b | 8 | 20 | 1.50 ± ? (one draw) |" in table


def test_an_engine_is_judged_only_under_the_rule_it_drafts_by():
    """llama.cpp drafts greedily only: under `sample` its row says so instead of a verdict; vLLM is judged under
    either rule (eval starts it with the matching draft_sample_method), and its table names that method."""
    from flashdraft.evaluate.in_engines import judge_sampled

    def served(name):
        rows = [{"dataset": "s", "category": "all", "accepted": a, "drafts": d} for a, d in ((3, 10), (5, 10))]
        return {"engine": name, "overall": {"acceptance_length": 1.4}, "prompts": rows,
                "by_dataset": {"s": {"acceptance_length": 1.4}}}

    ours = {"acceptance_length": 1.38, "standard_error": 0.05}
    for rule in ("greedy", "sample"):
        llama, vllm = served("llamacpp"), served("vllm")
        judge_sampled("llamacpp", rule, llama, ours)
        judge_sampled("vllm", rule, vllm, ours)
        assert vllm["judged"]["agrees"] and vllm["overall"]["standard_error"] == 0.1
        assert ("probabilistic" if rule == "sample" else "draft_sample_method greedy") in vllm["draft_rule"]
        assert ("judged" in llama) == (rule == "greedy") and ("not_comparable" in llama) == (rule == "sample")
