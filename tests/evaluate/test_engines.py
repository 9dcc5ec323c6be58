"""Real serving engines in the loop (evaluate/engines.py): vLLM's CPU build and llama.cpp serve the embedded target
with a flashdraft export, and what they count is what eval measures on the same prompts. The engine tests need
`scripts/engines.sh` (CI runs it); without it they skip and say so."""

import json

import pytest
import torch

from flashdraft.evaluate.engine_commands import engine_program
from flashdraft.evaluate.engines import parse_metrics, summary

needs_llamacpp = pytest.mark.skipif(not engine_program("llamacpp", None).is_file(), reason="llama.cpp is not built "
                                    f"at {engine_program('llamacpp', None)}: run scripts/engines.sh")

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
    counters = parse_metrics(METRICS, 3)
    assert (counters.drafts, counters.draft_tokens, counters.accepted, counters.by_position) == (2, 6, 4, (2, 2, 0))
    made = counters.minus(parse_metrics("", 3))
    row = {"drafts": made.drafts, "draft_tokens": made.draft_tokens, "accepted": made.accepted, "tokens": 0}
    row |= {f"position_{i}": v for i, v in enumerate(made.by_position)}
    overall = summary({("set", "all"): row})["overall"]
    assert overall["acceptance_length"] == 3.0  # 1 + 4 / 2: vLLM's definition, bonus token included
    assert overall["acceptance_by_position"] == [1.0, 1.0, 0.0]


PROMPTS = ["Tell me about cats.", "Name three colours.", "What is a river?", "How do bees make honey?"]
TEACHER_TOPK = 64  # DSpark's teacher: the target's top 64 at each position, as train.distill_topk keeps it
DRAFT_VOCAB = 2048  # a reduced vocabulary: the layout each engine must read (vLLM: d2t offsets; llama.cpp: I64 ids)


def agreeing_drafter(target_dir: str, tokenizer, steps: int, dspark: bool = False, prompts: list[str] = PROMPTS):
    """A one-layer, block-4 drafter over a 2,048-token draft vocabulary, trained a little on the target's own greedy
    answers to PROMPTS: it accepts a few dozen drafts on them, where an engine that misreads the export (layer ids,
    mask token, block layout, the draft vocabulary's mapping) accepts next to none. `dspark`: a DSpark drafter
    (a vanilla Markov head of rank 16 and a confidence head), trained with DeepSpec's loss."""
    from flashdraft.config import TrainConfig
    from flashdraft.evaluate.decode import target_only
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.dspark import DSparkDrafter, dspark_config
    from flashdraft.model.target import Target
    from flashdraft.train.step import sequence_step

    target = Target(target_dir, "cpu", lambda line: None)
    torch.manual_seed(0)
    config = draft_config(target.config, num_layers=1, block_size=4, draft_vocab_size=DRAFT_VOCAB,
                          mask_token_id=tokenizer.vocab_size - 1)
    drafter = (DSparkDrafter(dspark_config(config, markov_rank=16, markov_head="vanilla", confidence_head=True,
                                           num_anchors=64)) if dspark else DFlashDrafter(config))
    target.watch(drafter.target_layer_ids)
    sequences = []
    for text in prompts:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
        full = torch.tensor(ids + target_only(target, ids, 48)[0])
        mask = torch.zeros(len(full), dtype=torch.long)
        mask[len(ids) - 1 :] = 1
        # the target's pass once a sequence, not once a step (it was most of this fixture's minutes): its features,
        # and for DSpark's L1 and confidence terms its next-token distribution as the offline cache keeps it, a top-k
        # (of all 49,152 tokens, each step's terms took four times as long, for the same drafts accepted)
        with torch.no_grad():
            output, features = target.forward(full[None])
            logprobs = torch.log_softmax(target.lm_head(output.last_hidden_state[0]).float(), dim=-1)
            top = logprobs.topk(TEACHER_TOPK, dim=-1)
            teacher = (top.indices, top.values) if dspark else None
        sequences.append((full, mask, features[0], teacher))
    seen = torch.unique(torch.cat([full for full, *_ in sequences]))
    used = set(seen.tolist())
    others = torch.tensor([i for i in range(target.config.vocab_size) if i not in used])
    drafter.set_draft_vocab(torch.cat([seen, others[: DRAFT_VOCAB - len(seen)]]))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    cfg = TrainConfig(block_size=4, max_anchors=64, max_length=4096, draft_vocab_size=DRAFT_VOCAB,
                      architecture="dspark" if dspark else "dflash")
    for step in range(steps):
        for full, mask, features, teacher in sequences:
            generator = torch.Generator().manual_seed(step)
            sequence_step(drafter, target, full, mask, cfg, generator, "cpu", features, teacher)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter, target.model.get_output_embeddings().weight.detach()


@pytest.fixture(scope="module")
def agreeing_export(tmp_path_factory, smollm2_dir):
    """The drafter above, exported as train exports it (bf16, z-lab format, the target's head rows for its
    vocabulary), and its prompts."""
    from transformers import AutoTokenizer

    from flashdraft.model.export import save_drafter

    where = tmp_path_factory.mktemp("agreeing")
    drafter, head = agreeing_drafter(smollm2_dir, AutoTokenizer.from_pretrained(smollm2_dir), steps=60)
    save_drafter(drafter, where / "drafter", target_lm_head=head)
    prompts = where / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    return where / "drafter", prompts


INSTALLED = [engine for engine in ("vllm", "llamacpp") if engine_program(engine, None).is_file()]


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED, reason="no serving engine is installed: run scripts/engines.sh")
def test_the_engines_serve_the_export_and_accept_what_eval_accepts(tmp_path, smollm2_dir, agreeing_export):
    """One eval, every installed engine in its report (llama.cpp through `export --format gguf`: its converter,
    with the draft vocabulary's d2t it cannot map by itself). Each engine's accepted drafts are eval's, near enough
    to tell a misread export (which accepts next to nothing) from a faithful one, and its τ is eval's within 0.1 —
    overall, and per category of a SPEED-Bench-schema set (two categories of two prompts)."""
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run

    drafter_dir, _ = agreeing_export
    bench = tmp_path / "speed-bench.jsonl"
    bench.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "qa" if i < 2 else "writing",
                                         "sub_category": "", "turns": [text], "source": "test", "src_id": str(i),
                                         "difficulty": "easy", "multiturn": False}) + "\n"
                             for i, text in enumerate(PROMPTS)))
    out = tmp_path / "eval"
    cfg = EvalConfig(prompts=[f"speed-bench={bench}"], target=smollm2_dir, max_new_tokens=48, engine=INSTALLED)
    stats = run(cfg, drafter_dir, out, log=print)
    saved = json.loads((out / "report.json").read_text())
    steps = [p["accepted"] for p in saved["prompts"]]
    accepted, passes = sum(map(sum, steps)), sum(map(len, steps))  # eval's accepted drafts, its verify passes
    assert stats["lossless"] is True and accepted >= 5, (accepted, passes)  # a drafter with something to accept
    report = (out / "report.md").read_text()
    ours = saved["by_dataset"]["speed-bench"]["by_category"]
    for engine in INSTALLED:
        served = stats["engines"][engine]["overall"]
        assert abs(served["accepted_tokens"] - accepted) <= max(2, accepted // 10), (engine, served, accepted)
        assert abs(served["drafts"] - passes) <= 3, (engine, served, passes)
        assert abs(served["acceptance_length"] - stats["acceptance_length"]) <= 0.1
        assert f"τ in {engine}" in report and f"{served['acceptance_length']:.2f}" in report
        pace = stats["engines"][engine]
        assert pace["tokens_per_s"] > 0 and pace["tokens_per_s_without_drafter"] > 0
        per_set = saved["engines"][engine]["by_dataset"]["speed-bench"]
        assert per_set["speedup"] > 0  # speedup beside τ, per set
        # per category: each prompt's own counts, adding up to the set's; τ as eval's for the same prompts
        theirs = per_set["by_category"]
        assert sorted(theirs) == sorted(ours) == ["qa", "writing"]
        assert sum(block["drafts"] for block in theirs.values()) == per_set["drafts"]
        for category, block in theirs.items():
            assert abs(block["acceptance_length"] - ours[category]["acceptance_length"]) <= 0.15, (engine, category)
            assert block["speedup"] > 0
        # and each prompt's own row, named as eval names it, with the engine's answer (one turn each here)
        rows = saved["engines"][engine]["prompts"]
        assert sorted(row["id"] for row in rows) == sorted({row["id"] for row in saved["prompts"]})
        assert sum(row["drafts"] for row in rows) == per_set["drafts"] and all(len(r["answers"]) == 1 for r in rows)
        section = report.split(f"τ in {engine} by category — speed-bench\n")[1].strip().split("\n\n")[0]
        assert [line.split(" | ")[0] for line in section.splitlines()[2:]] == ["| qa", "| writing"], section
    if "vllm" in INSTALLED:
        assert len(stats["engines"]["vllm"]["overall"]["acceptance_by_position"]) == 3  # block 4: three drafted


@pytest.mark.slow
@needs_llamacpp
def test_the_gguf_export_is_a_verified_artifact_with_the_draft_vocabulary_as_target_ids(cli, tmp_path, smollm2_dir,
                                                                                         agreeing_export):
    from gguf import GGUFReader
    from safetensors.torch import load_file

    drafter_dir, _ = agreeing_export
    out = tmp_path / "gguf"
    done = cli("export", "--format", "gguf", "--drafter", str(drafter_dir), "--target", smollm2_dir, "--out",
               str(out), check=True)
    hint = (done.stdout + done.stderr).split("serve with ")[1]  # a command that can be copied: the server
    assert hint.split()[0].endswith("/llama-server") and "--spec-draft-n-max 3" in hint  # block 4: 3 drafts a step
    assert cli("verify", str(out)).returncode == 0
    again = cli("export", "--format", "gguf", "--drafter", str(drafter_dir), "--target", smollm2_dir, "--out",
                str(out), check=True)
    assert "already done, verified" in again.stdout + again.stderr
    d2t = next(t for t in GGUFReader(out / "drafter.gguf").tensors if t.name == "d2t")
    offsets = load_file(drafter_dir / "model.safetensors")["d2t"]
    assert d2t.data.tolist() == (offsets + torch.arange(len(offsets))).tolist()  # absolute target ids


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host vLLM serves DSpark: nothing to refuse")
def test_vllms_cpu_build_is_not_asked_to_serve_dspark(cli, tmp_path, smollm2_dir):
    """vLLM drafts DSpark on its GPU model runner only: on a CPU, eval says so in one line before any work,
    instead of starting vLLM for a minute to hear it refuse."""
    from transformers import AutoConfig

    from flashdraft.model.drafter import draft_config
    from flashdraft.model.dspark import DSparkDrafter, dspark_config
    from flashdraft.model.export import save_drafter

    config = draft_config(AutoConfig.from_pretrained(smollm2_dir), num_layers=1, block_size=4, mask_token_id=0)
    save_drafter(DSparkDrafter(dspark_config(config, markov_rank=4, markov_head="vanilla", confidence_head=True,
                                             num_anchors=8)), tmp_path / "d")
    run = cli("eval", "--drafter", str(tmp_path / "d"), "--target", smollm2_dir, "--out", str(tmp_path / "e"),
              "--engine", "vllm", "--max-prompts", "1")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "GPU model runner only" in run.stderr and not (tmp_path / "e").exists()


def test_an_engine_without_counts_by_position_shows_a_dash_not_an_empty_cell():
    from flashdraft.evaluate.report import engine_table

    block = {"acceptance_length": 1.5, "acceptance_by_position": [], "drafts": 12}
    lines = engine_table({"engine": "llamacpp", "tokens_per_s": 10.0, "by_dataset": {"chat": block}},
                         {"by_dataset": {"chat": {"acceptance_length": 1.6}}, "acceptance_length": 1.6})
    assert lines[-1] == "| chat | 1.50 | 1.60 | — | 12 | — |"  # no baseline run: no speedup either


def test_an_engines_counts_by_category_add_up_to_its_sets_and_are_tabled_beside_evals():
    """Each prompt's counts are kept under its set and category: a set with several categories gets τ for each
    (and speedup, from the run without the drafter), its own τ from their sum, and a table beside eval's."""
    from flashdraft.evaluate.engines import speedups, summary
    from flashdraft.evaluate.report import engine_table

    def row(drafts, accepted, seconds, tokens):
        return {"drafts": drafts, "draft_tokens": 3 * drafts, "accepted": accepted, "seconds": seconds,
                "tokens": tokens}

    cells = {("sb", "coding"): row(10, 20, 1.0, 30), ("sb", "writing"): row(10, 5, 1.0, 15),
             ("gsm8k", "all"): row(4, 4, 1.0, 8)}
    result = summary(cells) | {"tokens_per_s": 26.3}
    sb = result["by_dataset"]["sb"]
    assert (sb["acceptance_length"], sb["drafts"]) == (1 + 25 / 20, 20)  # the categories' counts added
    assert {c: b["acceptance_length"] for c, b in sb["by_category"].items()} == {"coding": 3.0, "writing": 1.5}
    assert "by_category" not in result["by_dataset"]["gsm8k"]  # one category: no table of one row
    assert result["overall"]["drafts"] == 24
    speedups(result, {("sb", "coding"): row(0, 0, 2.0, 30), ("sb", "writing"): row(0, 0, 1.0, 15),
                      ("gsm8k", "all"): row(0, 0, 1.0, 8)})
    assert sb["by_category"]["coding"]["speedup"] == 2.0 and sb["by_category"]["writing"]["speedup"] == 1.0
    assert sb["speedup"] == round(22.5 / 15.0, 3)  # 45 tokens in 2 s with the drafter, in 3 s without
    ours = {"by_dataset": {"sb": {"acceptance_length": 2.0, "by_category": {"coding": {"acceptance_length": 2.9},
                                                                            "writing": {"acceptance_length": 1.4}}},
                           "gsm8k": {"acceptance_length": 2.0}}, "acceptance_length": 2.0}
    lines = engine_table({"engine": "vllm", **result}, ours)
    at = lines.index("τ in vllm by category — sb")
    assert lines[at + 4:] == ["| coding | 3.00 | 2.90 | — | 10 | 2.00× |", "| writing | 1.50 | 1.40 | — | 10 | 1.00× |"]


@pytest.mark.slow
@needs_llamacpp
def test_the_drafter_alone_serves_beside_a_quantized_target(cli, tmp_path, smollm2_dir, agreeing_export):
    """`export --format gguf --drafter-only`: the drafter's file alone (no target converted), which llama-server
    serves beside a target GGUF of the user's own — here llama.cpp's own Q8_0 quantization of the target — and
    accepts there about what it accepts beside the float32 target (printed: the measurement docs/serving.md gives)."""
    import subprocess

    from transformers import AutoTokenizer

    from flashdraft.evaluate.engine_commands import llamacpp_command
    from flashdraft.evaluate.engines import Conversation, decode_all, summary
    from flashdraft.evaluate.prepare import renderer
    from flashdraft.served import served

    drafter_dir, _ = agreeing_export
    alone, whole = tmp_path / "alone", tmp_path / "whole"
    done = cli("export", "--format", "gguf", "--drafter", str(drafter_dir), "--target", smollm2_dir, "--out",
               str(alone), "--drafter-only", "--outtype", "f32")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in alone.iterdir()) == ["drafter.gguf", "manifest.json"]
    assert "-m YOUR-TARGET.gguf -md" in done.stdout + done.stderr
    assert cli("export", "--format", "gguf", "--drafter", str(drafter_dir), "--target", smollm2_dir, "--out",
               str(whole), "--outtype", "f32").returncode == 0
    server = engine_program("llamacpp", None)
    quantized = tmp_path / "target-q8_0.gguf"
    subprocess.run([str(server.with_name("llama-quantize")), str(whole / "target-f32.gguf"), str(quantized), "Q8_0"],
                   check=True, capture_output=True)

    render = renderer(AutoTokenizer.from_pretrained(smollm2_dir))
    turns = [Conversation("p", [{"role": "user", "content": text}], (), False) for text in PROMPTS]
    tau = {}
    for name, target in (("f32", whole / "target-f32.gguf"), ("q8_0", quantized)):
        def command(where, target=target):
            return llamacpp_command(server, target, alone / "drafter.gguf", 4, where, 2048)

        with served(command, tmp_path / f"llama-{name}.log", print) as endpoint:
            by_set, _, _ = decode_all("llamacpp", endpoint, turns, render, 48, 3)
        tau[name] = summary(by_set)["overall"]["acceptance_length"]
    print("τ beside the f32 target and the Q8_0 one:", tau)
    # (the agreeing drafter is accepted a little, as in eval: τ 1.05 here; a misread pair accepts nothing)
    assert tau["f32"] > 1.0 and tau["q8_0"] > 1.0 and abs(tau["q8_0"] - tau["f32"]) < 0.1, tau


def test_seeds_mean_nothing_to_greedy_decoding():
    from flashdraft.config import EvalConfig

    with pytest.raises(ValueError, match="seeds does nothing here: greedy decoding"):
        EvalConfig(seeds=3)
    assert EvalConfig(seeds=3, temperature=0.7).seeds == 3


def test_a_rerun_after_an_engine_failed_serves_only_that_engine_and_keeps_the_others(tmp_path):
    """A committed report whose llama.cpp failed and whose vLLM measured: the rerun tries llama.cpp again (here it
    fails again, in one line: the drafter directory is empty) and carries vLLM's entry and logs over as they were,
    without starting it."""
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate.in_engines import measure_engines
    from flashdraft.evaluate.prepare import Decoding
    from flashdraft.evaluate.sets import EvalPrompt
    from flashdraft.generate.prompts import Prompt

    out, building, empty = tmp_path / "eval", tmp_path / "building", tmp_path / "no-drafter"
    for where in (out, building, empty):
        where.mkdir()
    (out / "engine-vllm.log").write_text("vLLM's own words")
    (out / "engine-vllm-target-only.log").write_text("and without the drafter")
    (out / "engine-llamacpp.log").write_text("the failed run's log")
    kept = {"engine": "vllm", "overall": {"acceptance_length": 1.5}, "by_dataset": {}}
    cfg = EvalConfig(engine=["vllm", "llamacpp"], engine_baseline=False)
    report, stats, said = {"acceptance_length": 1.6, "by_dataset": {}}, {}, []
    prompts = [EvalPrompt("p", Prompt("a", [{"role": "user", "content": "hi"}]))]
    measure_engines(cfg, Decoding(render=lambda messages, thinking: [1, 2, 3], block_size=4, dspark=False), prompts,
                    report, stats, [{"accepted": [0, 1]}], empty, "target", building, out, said.append,
                    measured={"vllm": kept})
    assert report["engines"]["vllm"] is kept and "eval: vllm measured there already: kept" in said
    assert "holds no drafter" in report["engines"]["llamacpp"]["failed"]  # tried again: this run's failure
    assert (building / "engine-vllm.log").read_text() == "vLLM's own words"
    assert (building / "engine-vllm-target-only.log").read_text() == "and without the drafter"
    assert not (building / "engine-llamacpp.log").exists()  # the failed engine's old log is not carried over
