"""Engines at temperature > 0 (evaluate/engines.py, spread.py): vLLM's CPU build and llama.cpp agree with eval
under the draft rule they draft by, and vLLM's CPU sampler gets its temperatures (vllm#55005). Apart from
test_engines.py so that its slow tests and these run on different workers. Needs `scripts/engines.sh`."""

import json

import pytest

from flashdraft.evaluate.engine_commands import engine_program
from tests.evaluate.test_engines import INSTALLED, agreeing_drafter

# Prompts the target answers by copying: even sampled at temperature 1 it is confident of each next token there, so
# a drafter trained on its answers has drafts to accept at T 1 (on open questions SmolLM2 at T 1 is too uncertain for
# any drafter: τ ≈ 1.02), and an engine that accepts nothing is told from one that agrees.
COPYING = ["Repeat this text exactly, word for word: The river runs past the old mill, under the stone bridge, and on "
           "through the quiet valley to the sea.",
           "Copy the following line exactly: Alice went to the market on Monday and bought apples, bread, cheese and "
           "a small blue jug.",
           "Repeat exactly: One, two, buckle my shoe. Three, four, shut the door. Five, six, pick up sticks. Seven, "
           "eight, lay them straight.",
           "Write this sentence back to me unchanged: Every morning the baker opens the shop at six and sells fresh "
           "bread to the village."]


@pytest.fixture(scope="module")
def copying_export(tmp_path_factory, smollm2_dir):
    """A drafter trained, as the agreeing one, on the target's answers to COPYING, exported; and those prompts."""
    from transformers import AutoTokenizer

    from flashdraft.model.export import save_drafter

    where = tmp_path_factory.mktemp("copying")
    drafter, head = agreeing_drafter(smollm2_dir, AutoTokenizer.from_pretrained(smollm2_dir), steps=60,
                                     prompts=COPYING)
    save_drafter(drafter, where / "drafter", target_lm_head=head)
    prompts = where / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in COPYING))
    return where / "drafter", prompts


@pytest.mark.slow
@pytest.mark.skipif(INSTALLED != ["vllm", "llamacpp"], reason="needs both engines: run scripts/engines.sh")
def test_at_temperature_one_the_engines_agree_with_eval_under_its_draft_rule(tmp_path, smollm2_dir, copying_export):
    """At temperature 1 over 2 seeds, τ with its standard error over prompts × seeds: under the greedy rule (the
    default; the engines' own) vLLM and llama.cpp each agree with eval; under `sample` vLLM, started with
    draft_sample_method probabilistic, agrees. Eval's τ is far
    enough above 1 that an engine accepting nothing (vLLM's CPU build without the fix for vllm#55005) would not
    agree. One prompt, served in the engine alone, is past vLLM's 2,048-token step: split over two prefill steps, a
    seeded request crashed its CPU build ("CPU Generator does not use offset"), so flashdraft asks for a step as long
    as the context."""
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run
    from flashdraft.evaluate.spread import judged

    drafter_dir, prompts = copying_export
    long_prompt = "Summarize: " + "The river runs to the sea. " * 330
    longer = tmp_path / "longer.jsonl"
    longer.write_text(json.dumps({"prompt": long_prompt}) + "\n")
    settings = dict(target=smollm2_dir, max_new_tokens=24, engine_baseline=False, temperature=1.0, seeds=2)
    greedy = run(EvalConfig(prompts=str(prompts), engine=["vllm", "llamacpp"], **settings), drafter_dir,
                 tmp_path / "greedy", log=print)
    # an engine that accepted nothing (τ 1, as vLLM's CPU build without the fix for vllm#55005 could) would not agree
    assert not judged(1.0, 0.0, greedy["acceptance_length"], greedy["standard_error"])["agrees"], greedy
    for engine in ("vllm", "llamacpp"):
        verdict = greedy["engines"][engine]["judged"]
        assert verdict["agrees"] and verdict["bound"] >= 0.04, (engine, verdict)
    report = (tmp_path / "greedy" / "report.md").read_text()
    assert "draft rule greedy" in report and "seeds 0, 1" in report and " ± " in report
    assert "in vllm: greedy (draft_sample_method greedy)" in report and "llama.cpp's only rule" in report

    # under `sample` llama.cpp, which drafts greedily only, is not judged (its row says why: test_spread.py)
    sampled = run(EvalConfig(prompts=str(prompts), engine="vllm", draft_sampling="sample", **settings),
                  drafter_dir, tmp_path / "sample", log=print)
    assert sampled["engines"]["vllm"]["judged"]["agrees"], sampled["engines"]["vllm"]
    assert "draft_sample_method probabilistic" in (tmp_path / "sample" / "report.md").read_text()
    rows = json.loads((tmp_path / "sample" / "report.json").read_text())["prompts"]
    assert sorted({row["seed"] for row in rows}) == [0, 1] and len(rows) == 2 * len(COPYING)

    # the long prompt in the engine alone (eval.engine_only): its seeded requests served whole, once each seed (eval's
    # own decoding of 2,400 tokens twice would add a minute and prove nothing about vLLM)
    alone = run(EvalConfig(prompts=str(longer), engine="vllm", draft_sampling="sample", engine_only=True,
                           **settings), drafter_dir, tmp_path / "long", log=print)
    served = json.loads((tmp_path / "long" / "report.json").read_text())["engines"]["vllm"]["prompts"]
    assert alone["engine_only"] is True and sorted(row["seed"] for row in served) == [0, 1], served
    assert all(row["drafts"] > 0 and len(row["answers"][0]) > 0 for row in served), served
    from transformers import AutoTokenizer

    chat = [{"role": "user", "content": long_prompt}]
    ids = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(chat, add_generation_prompt=True,
                                                                         return_dict=True)["input_ids"]
    assert len(ids) > 2048  # past vLLM's 2,048-token step


EXPAND_PROBE = """
import torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()  # the kernels this CPU can run (AVX-512 or AVX2): `import vllm._C` alone needs AVX-512
from vllm.utils import cpu_triton_utils
out = torch.full((5,), float("nan"))
cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.6, 1.0]), torch.tensor([2, 5], dtype=torch.int32), 0, 1)
import sys
ours = getattr(sys.modules.get("sitecustomize"), "expand_in_torch", None)
fixed = cpu_triton_utils._expand_kernel_impl is ours
print(out.tolist(), fixed)
"""


@pytest.mark.skipif("vllm" not in INSTALLED, reason="vLLM's CPU build is not installed: run scripts/engines.sh")
def test_vllms_cpu_sampler_gets_its_temperatures_with_flashdrafts_fix():
    """vllm#55005: the CPU stand-in for the rejection sampler's expand kernel leaves a float32 output unwritten, so
    temperatures are uninitialised memory at T > 0. The installed build has the defect (without the fix: NaN stays);
    with flashdraft/vllm_cpu on PYTHONPATH, as eval starts vLLM, its probe finds it and the expansion is right."""
    import os
    import subprocess

    from flashdraft.served import vllm_cpu_fixes_env

    python = str(engine_program("vllm", None))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bare = subprocess.run([python, "-c", EXPAND_PROBE], env=env, capture_output=True, text=True, check=True)
    defective = bare.stdout.split("]")[0].count("nan") == 5  # vLLM 0.32: the defect the collapse comes from
    fixed = subprocess.run([python, "-c", EXPAND_PROBE], env=env | vllm_cpu_fixes_env(), capture_output=True,
                           text=True, check=True)
    # right either way; replaced only where the installed vLLM still has the defect (a fixed vLLM keeps its own)
    expected = f"[0.6000000238418579, 0.6000000238418579, 1.0, 1.0, 1.0] {defective}"
    assert fixed.stdout.strip() == expected, (bare.stdout, fixed.stdout)


