"""The standard benchmark sets: local copies in each public dataset's own schema (tests/assets/benchmarks, written
for this project), formatted as z-lab/dflash's benchmark.py formats them; cut, rejected and reported per set."""

import json
import shutil
from pathlib import Path

import pytest

from flashdraft.errors import BadInput
from flashdraft.evaluate.sets import load_eval_sets, load_standard
from flashdraft.standard_sets import split_source, standard_sets

ASSETS = Path(__file__).parent.parent / "assets" / "benchmarks"
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def first_turns(name: str, path: str | Path) -> list[str]:
    return [p.prompt.messages[0]["content"] for p in load_standard(name, str(path)).prompts]


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / f"{name}.jsonl").read_text().splitlines()]


def test_each_set_is_formatted_as_z_labs_benchmark_formats_it():
    assert set(standard_sets()) == {"gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "speed-bench",
                                    *(f"speed-bench-{n}k" for n in (1, 2, 8, 16, 32))}
    assert standard_sets()["speed-bench-8k"]["hub"] == ["nvidia/SPEED-Bench", "throughput_8k"]
    assert first_turns("gsm8k", ASSETS / "gsm8k.jsonl") == [r["question"] + BOXED for r in rows("gsm8k")]
    assert first_turns("math500", ASSETS / "math500.jsonl") == [r["problem"] + BOXED for r in rows("math500")]
    assert first_turns("humaneval", ASSETS / "humaneval.jsonl") == [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + r["prompt"] + "\n```" for r in rows("humaneval")]
    assert first_turns("mbpp", ASSETS / "mbpp.jsonl") == [r["prompt"] for r in rows("mbpp")]
    mt = load_standard("mt-bench", str(ASSETS / "mt-bench.jsonl")).prompts
    turns = [(p.prompt.messages[0]["content"], *p.follow_ups) for p in mt]
    assert turns == [tuple(r["prompt"]) for r in rows("mt-bench")]
    assert [p.prompt.category for p in mt] == ["writing", "math", "roleplay"]
    assert all(p.dataset == "mt-bench" for p in mt) and len({p.prompt.id for p in mt}) == 3


def test_a_local_copy_may_be_parquet_or_a_save_to_disk_directory(tmp_path):
    from datasets import Dataset

    table = Dataset.from_list(rows("humaneval"))
    table.to_parquet(str(tmp_path / "he.parquet"))
    table.save_to_disk(str(tmp_path / "he"))
    from_jsonl = first_turns("humaneval", ASSETS / "humaneval.jsonl")
    assert first_turns("humaneval", tmp_path / "he.parquet") == from_jsonl
    assert first_turns("humaneval", tmp_path / "he") == from_jsonl


def test_records_a_set_cannot_format_are_rejected_with_the_reason(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    shutil.copy(ASSETS / "gsm8k.jsonl", path)
    with path.open("a") as f:
        f.write(json.dumps({"problem": "a MATH-500 record in the wrong file"}) + "\n{not json\n")
    loaded = load_standard("gsm8k", str(path))
    assert len(loaded.prompts) == 3
    assert [r.line for r in loaded.rejected] == [4, 5]
    assert "no `question` field (has: problem)" in loaded.rejected[0].reason
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"prompt": "one string, not a list of turns"}) + "\n")
    assert "must be a non-empty list" in load_standard("mt-bench", str(mt)).rejected[0].reason


def test_max_prompts_applies_per_set_and_cuts_the_same_prompts_every_time():
    sources = [f"gsm8k={ASSETS / 'gsm8k.jsonl'}", f"mt-bench={ASSETS / 'mt-bench.jsonl'}", "builtin:chat-heldout"]
    sets = load_eval_sets(sources, max_prompts=2)
    assert [(s.name, len(s.prompts)) for s in sets] == [("gsm8k", 2), ("mt-bench", 2), ("builtin:chat-heldout", 2)]
    again = load_eval_sets(sources, max_prompts=2)
    assert [p.prompt.id for s in sets for p in s.prompts] == [p.prompt.id for s in again for p in s.prompts]
    every = {p.prompt.id for p in load_standard("gsm8k", str(ASSETS / "gsm8k.jsonl")).prompts}
    assert {p.prompt.id for p in sets[0].prompts} < every


def test_sources_are_told_apart_and_a_missing_copy_is_one_clear_error(tmp_path):
    assert split_source("gsm8k") == ("gsm8k", None)
    assert split_source("mt-bench=/data/mt.jsonl") == ("mt-bench", "/data/mt.jsonl")
    assert split_source("data/gsm8k.jsonl") == (None, None)  # a prompt file, read as generate reads prompts
    with pytest.raises(BadInput, match="gsm8k: .*nope.jsonl not found .*openai/gsm8k's own schema"):
        load_standard("gsm8k", str(tmp_path / "nope.jsonl"))
    with pytest.raises(BadInput, match="gsm8k: no path after = not found"):
        load_standard("gsm8k", "")
    with pytest.raises(BadInput, match="prompts not found: mtbench .*or a standard set: gsm8k, math500, .*mt-bench"):
        load_eval_sets(["mtbench"], 5)  # a misspelt set name is not taken for a file that happens to be missing
    with pytest.raises(BadInput, match="named twice"):
        load_eval_sets([f"gsm8k={ASSETS / 'gsm8k.jsonl'}", "gsm8k"], 5)


def test_a_hub_set_on_a_machine_without_the_hub_names_the_local_way(cli, tmp_path):
    """The real load path (datasets.load_dataset with the hub name), offline: one line that says what to pass."""
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 4}')
    result = cli("eval", "--drafter", str(tmp_path / "drafter"), "--prompts", "gsm8k", "--out", str(tmp_path / "e"),
                 env=env)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot load openai/gsm8k (main, test) from the hub" in lines[0], result.stderr
    assert "--prompts gsm8k=PATH" in lines[0] and "Traceback" not in result.stderr


def test_a_hub_that_does_not_answer_is_one_line_not_a_minute_of_retries(cli, tmp_path):
    """Issue 56: without offline mode set, an unreachable hub (here a closed port) used to print datasets' six retry
    warnings over ~25 s before the line; the hub is probed first, and the error is the one line."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 4}')
    result = cli("eval", "--drafter", str(tmp_path / "drafter"), "--prompts", "gsm8k", "--out", str(tmp_path / "e"),
                 env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "127.0.0.1 unreachable" in lines[0] and "--prompts gsm8k=PATH" in lines[0]


def random_drafter(target_dir: str, out: Path) -> Path:
    """A one-layer, block-4 drafter of random weights for the target: τ near 1, lossless all the same."""
    import torch

    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.export import save_drafter
    from flashdraft.model.target import Target

    target = Target(target_dir, "cpu", lambda s: None)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4, mask_token_id=0)), out)
    return out


def test_eval_reports_a_tau_table_per_dataset(cli, tmp_path, tiny_model_dir):
    """One `flashdraft eval` over two standard sets (one of them two-turn) and a built-in one: a row per set and
    one for all in report.md (printed too) and report.json; mt-bench's second turn is asked after the first
    answer; the decoding machinery is named."""
    random_drafter(tiny_model_dir, tmp_path / "drafter")
    out = tmp_path / "eval"
    result = cli("eval", "--drafter", str(tmp_path / "drafter"), "--target", tiny_model_dir, "--out", str(out),
                 "--prompts", f"gsm8k={ASSETS / 'gsm8k.jsonl'}", "--prompts", f"mt-bench={ASSETS / 'mt-bench.jsonl'}",
                 "--prompts", "builtin:chat-heldout", "--max-prompts", "2", "--max-new-tokens", "8",
                 "--decoding", "static", check=True)
    table = (out / "report.md").read_text()
    assert table in result.stdout.replace("\n", "\n")  # printed as written
    assert "thinking off, temperature 0 (greedy)" in table and "decoding: static KV cache" in table
    first = table.split("\n\n")[1]  # the table by dataset (mt-bench's categories follow in their own)
    body = [line for line in first.splitlines() if line.startswith("| ") and not line.startswith("| dataset")]
    assert [line.split(" | ")[0] for line in body] == ["| gsm8k", "| mt-bench", "| builtin:chat-heldout", "| **all**"]
    assert [int(line.split(" | ")[1]) for line in body] == [2, 4, 2, 8]  # mt-bench's two prompts: two turns each

    report = json.loads((out / "report.json").read_text())
    assert list(report["by_dataset"]) == ["gsm8k", "mt-bench", "builtin:chat-heldout"]
    for block in report["by_dataset"].values():
        assert block["acceptance_length"] >= 1.0 and block["lossless"] is True
        assert len(block["acceptance_by_position"]) == 3 and block["speedup"] > 0
    mt = [row for row in report["prompts"] if row["dataset"] == "mt-bench"]
    assert [row["turn"] for row in mt] == [1, 2, 1, 2] and mt[0]["id"] == mt[1]["id"]
    for first, second in (mt[:2], mt[2:]):  # the second turn's prompt holds the first turn and its answer
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["tokens"] // 2
    assert report["decoding"].startswith("static KV cache") and report["config"]["thinking"] is False
    assert json.loads((out / "manifest.json").read_text())["stats"]["by_dataset"]["gsm8k"]["prompts"] == 2


def test_speed_bench_reports_tau_per_category_and_by_input_length(cli, tmp_path, tiny_model_dir):
    """SPEED-Bench from local files in its own schema (question_id, category, sub_category, turns, source, …): the
    qualitative config with a row per category in report.md, a two-turn record asked after the target's answer,
    a placeholder record of the hub copy rejected with the reason; two throughput configs with their mean input
    tokens and a plot of τ against it; lossless throughout."""
    random_drafter(tiny_model_dir, tmp_path / "drafter")
    out = tmp_path / "eval"
    result = cli("eval", "--drafter", str(tmp_path / "drafter"), "--target", tiny_model_dir, "--out", str(out),
                 "--prompts", f"speed-bench={ASSETS / 'speed-bench-qualitative.jsonl'}",
                 "--prompts", f"speed-bench-1k={ASSETS / 'speed-bench-throughput_1k.jsonl'}",
                 "--prompts", f"speed-bench-2k={ASSETS / 'speed-bench-throughput_2k.jsonl'}",
                 "--max-new-tokens", "8", check=True)
    report = json.loads((out / "report.json").read_text())
    qualitative = report["by_dataset"]["speed-bench"]
    assert sorted(qualitative["by_category"]) == ["coding", "math", "roleplay"]
    assert qualitative["prompts"] == 6 and qualitative["by_category"]["roleplay"]["prompts"] == 2  # two turns
    assert report["lossless"] is True
    table = (out / "report.md").read_text()
    section = table.split("τ by category — speed-bench\n")[1].strip().split("\n\n")[0]
    assert [line.split(" | ")[0] for line in section.splitlines()[2:]] == ["| coding", "| math", "| roleplay"]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 1 and "placeholder" in rejected[0]["reason"] and "specdec_bench" in rejected[0]["reason"]

    short, long = report["by_dataset"]["speed-bench-1k"], report["by_dataset"]["speed-bench-2k"]
    assert long["prompt_tokens_mean"] > 2.5 * short["prompt_tokens_mean"]
    assert sorted(short["by_category"]) == ["high_entropy", "low_entropy"]
    assert f"| speed-bench-2k | 2 | {long['prompt_tokens_mean']:,.0f} |" in table
    assert (out / "tau_by_input_length.png").stat().st_size > 0
    assert "1 records could not be formatted" in result.stdout + result.stderr


def test_both_thinking_modes_are_measured_in_one_run_a_row_each(cli, tmp_path, tiny_model_dir, qwen3_5_template):
    """`--thinking on,off`: every prompt in both modes (the chat template's generation prompt differs: an empty
    think block with thinking off), a row per set and mode; `run` follows generate's mode unless eval sets one."""
    import shutil

    from transformers import AutoTokenizer

    from flashdraft.config import PipelineConfig
    from flashdraft.pipeline import eval_settings

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = qwen3_5_template
    tokenizer.save_pretrained(model)
    random_drafter(str(model), tmp_path / "drafter")
    out = tmp_path / "eval"
    cli("eval", "--drafter", str(tmp_path / "drafter"), "--target", str(model), "--out", str(out), "--prompts",
        f"gsm8k={ASSETS / 'gsm8k.jsonl'}", "--max-new-tokens", "6", "--thinking", "on,off", check=True)
    report = json.loads((out / "report.json").read_text())
    on, off = report["by_dataset"]["gsm8k · thinking on"], report["by_dataset"]["gsm8k · thinking off"]
    assert list(report["by_dataset"]) == ["gsm8k · thinking on", "gsm8k · thinking off"]
    assert on["prompts"] == off["prompts"] and off["prompt_tokens_mean"] > on["prompt_tokens_mean"]  # </think>
    assert report["lossless"] is True and report["config"]["thinking"] == [True, False]
    assert "thinking on and off (a row each)" in (out / "report.md").read_text()

    generated_in = {True: True, "mixed": [True, False], False: False}
    for mode, expected in generated_in.items():
        assert eval_settings(PipelineConfig(generate={"thinking": mode})).thinking == expected
    assert eval_settings(PipelineConfig(generate={"thinking": True}, eval={"thinking": False})).thinking is False
