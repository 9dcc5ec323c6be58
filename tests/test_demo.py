"""The pipeline end to end: `flashdraft run` on a tiny config, and the embedded demo's target preparation."""

import json
import subprocess
import sys

import pytest
import yaml

from flashdraft.artifact.manifest import MANIFEST, read_manifest, verify_dir
from flashdraft.config import load_config
from flashdraft.demo import summary_line


@pytest.mark.slow
def test_embedded_target_is_converted_once_and_verified(tmp_path, monkeypatch):
    from flashdraft.model.resolve import resolve_model

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    # Two processes on a fresh cache at once (a demo and a stage started together): one converts, the other waits
    # for its lock and finds the conversion done; neither is refused.
    resolve = "from flashdraft.model.resolve import resolve_model; print(resolve_model('embedded'))"
    both = [subprocess.Popen([sys.executable, "-c", resolve], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], [err[-2000:] for _, err in outputs]
    said = [out for out, _ in outputs]
    assert sum("target: converted" in out for out in said) == 1
    assert sum("target: already done, verified" in out for out in said) == 1
    assert all(out.strip().endswith(str(target)) for out in said)
    assert verify_dir(target) == []
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 576
    assert json.loads((target / MANIFEST).read_text())["kind"] == "model"

    lines = []
    resolve_model("embedded", log=lines.append)
    assert "target: already done, verified" in lines[0]
    resolve_model("embedded", log=lines.append)  # every stage of a run resolves it: said once a process
    assert len(lines) == 1

    (target / "config.json").write_text((target / "config.json").read_text().replace("576", "577"))  # same size
    lines.clear()
    resolve_model("embedded", log=lines.append)
    assert "does not verify: config.json" in lines[0] and any("target: converted" in line for line in lines)


def tiny_pipeline_config(path, workdir, model_dir) -> str:
    config = {
        "workdir": str(workdir),
        "generate": {"prompts": "builtin:demo", "model": model_dir, "max_prompts": 12, "max_new_tokens": 24,
                     "batch_size": 6},
        "tokenize": {"tokenizer": model_dir, "min_loss_fraction": 0.05, "workers": 1},
        "train": {"target": model_dir, "num_layers": 1, "block_size": 8, "max_anchors": 8, "epochs": 1,
                  "batch_size": 2, "eval_samples": 2, "checkpoint_every": 100},
        "eval": {"target": model_dir, "max_prompts": 3, "max_new_tokens": 16},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_run_pipeline_end_to_end_then_everything_is_done(cli, tmp_path, tiny_model_dir):
    config = tiny_pipeline_config(tmp_path / "tiny.yaml", tmp_path / "work", tiny_model_dir)
    first = cli("run", config, check=True)
    work = tmp_path / "work"
    for path, kind in [("generate", "completions"), ("dataset", "dataset"), ("train/drafter", "drafter"),
                       ("eval", "eval")]:
        assert verify_dir(work / path) == [], path
        assert read_manifest(work / path).kind == kind
    evaluated = read_manifest(work / "eval").stats
    assert evaluated["lossless"] is True and evaluated["near_ties"] == 0  # float32: token for token
    assert "eval: done, verified" in first.stdout

    again = cli("run", config, check=True)
    assert again.stdout.count("already done, verified") == 4
    # The demo's last line reads the same verified eval: τ and the prompt-lookup baseline beside it.
    evaluated = read_manifest(work / "eval").stats
    line = summary_line(load_config(config))
    assert f"τ = {evaluated['acceptance_length']:.2f} on {evaluated['prompts']} held-out prompts" in line
    assert "tokens per target pass, 1.00 = no draft accepted" in line  # what τ means, and what it bought:
    assert f"; {evaluated['speedup']:.2f}× the target alone's speed here" in line
    assert f"prompt lookup τ {evaluated['lookup_acceptance_length']:.2f}" in line
    held = read_manifest(work / "train" / "drafter").stats["heldout"]
    assert f"the training log predicted {held['serving_acceptance_length']:.2f} ({held['samples']} held-out" in line

    plan = cli("run", config, "--dry-run", "--from", "tokenize", check=True)
    assert "generate" not in plan.stdout and "dataset" in plan.stdout
    planned = json.loads(cli("run", config, "--dry-run", "--from", "tokenize", "--json", check=True).stdout)
    assert set(planned["stages"]) == {"tokenize", "train", "eval"} and planned["stages"]["eval"]["verified"]
    assert planned["preflight"] and all(check["ok"] for check in planned["preflight"])

    store = tmp_path / "store"
    pushed = cli("run", config, "--store", str(store), check=True)
    assert pushed.stdout.count("already done, verified") >= 4
    for path in ("generate", "dataset", "train/drafter", "eval"):  # the store mirrors the workdir (layout.py)
        assert verify_dir(store / path) == [], path

    # A fresh machine with the same store: everything is pulled and verified, nothing recomputed.
    fresh = tiny_pipeline_config(tmp_path / "fresh.yaml", tmp_path / "fresh-work", tiny_model_dir)
    joined = cli("run", fresh, "--store", str(store), check=True).stdout
    assert joined.count("pull: ") == 4 and joined.count("already done, verified") >= 4
    assert "generate: building" not in joined and "train: building" not in joined
    assert read_manifest(tmp_path / "fresh-work" / "eval").stats == read_manifest(work / "eval").stats

    # A machine that only tokenizes: the generate artifact it needs comes from the store.
    cpu_box = tiny_pipeline_config(tmp_path / "cpu.yaml", tmp_path / "cpu-work", tiny_model_dir)
    part = cli("run", cpu_box, "--store", str(store), "--from", "tokenize", "--until", "tokenize", check=True)
    assert part.stdout.count("pull: ") == 2 and verify_dir(tmp_path / "cpu-work" / "generate") == []


def test_standalone_stages_and_run_share_one_layout(cli, tmp_path, tiny_model_dir):
    """Each stage run alone with --config writes where `run` and `status` look, and the other way round."""
    config = tiny_pipeline_config(tmp_path / "a.yaml", tmp_path / "a", tiny_model_dir)
    cli("generate", "--config", config, check=True)
    cli("tokenize", "--config", config, check=True)
    report = json.loads(cli("status", "--config", config, "--json", check=True).stdout)
    verified = {r["stage"] for r in report["stages"] if r["verified"]}
    assert verified == {"generate", "tokenize"}
    rest = cli("run", config, "--from", "train", check=True).stdout
    assert "train: building" in rest and "eval: done, verified" in rest
    assert cli("run", config, check=True).stdout.count("already done, verified") == 4

    # The other way round, with a store: `run` up to tokenize, then train and eval alone find its dataset,
    # and `train --push-to {store}/train` puts checkpoints and drafter where `run --store` looks.
    config = tiny_pipeline_config(tmp_path / "b.yaml", tmp_path / "b", tiny_model_dir)
    store = tmp_path / "store"
    cli("run", config, "--until", "tokenize", "--store", str(store), check=True)
    trained = cli("train", "--config", config, "--push-to", str(store / "train"), check=True).stdout
    assert "train: building" in trained and "train: done, verified" in trained
    assert "eval: done, verified" in cli("eval", "--config", config, check=True).stdout
    report = json.loads(cli("status", "--config", config, "--store", str(store), "--json", check=True).stdout)
    assert [(r["stage"], r["where"]) for r in report["stages"] if not r["verified"]] == [("eval", "store")]
    assert [verify_dir(c) for c in (store / "train" / "checkpoints").iterdir()] == [[]]
    again = cli("run", config, "--store", str(store), "--json", check=True)  # stdout: one JSON object only
    assert all(f"{stage}: already done, verified" in again.stderr for stage in ("generate", "tokenize", "train",
                                                                               "eval"))
    result = json.loads(again.stdout)
    assert set(result["stages"]) == {"generate", "tokenize", "train", "eval"}
    assert result["stages"]["eval"]["acceptance_length"] >= 1.0 and result["stages"]["eval"]["lossless"] is True
    assert verify_dir(store / "eval") == []


def test_status_reports_what_it_checks_now(cli, tmp_path, tiny_model_dir):
    config = tiny_pipeline_config(tmp_path / "tiny.yaml", tmp_path / "work", tiny_model_dir)
    cli("run", config, "--until", "tokenize", "--store", str(tmp_path / "store"), check=True)
    report = json.loads(cli("status", "--config", config, "--json", check=True).stdout)
    state = {(r["stage"], r["where"]): r for r in report["stages"]}
    assert state[("generate", "local")]["verified"] and state[("tokenize", "local")]["verified"]
    assert state[("tokenize", "local")]["stats"]["samples"] == 12
    assert not state[("train", "local")]["verified"] and not report["all_verified"]

    # A remote object deleted out of band: the store's copy stops verifying, the local one still does.
    stray = next((tmp_path / "store" / "dataset").glob("data-*.arrow"))
    stray.unlink()
    report = json.loads(cli("status", "--config", config, "--store", str(tmp_path / "store"), "--json",
                            "--markdown", str(tmp_path / "STATUS.md"), check=True).stdout)
    state = {(r["stage"], r["where"]): r for r in report["stages"]}
    assert not state[("tokenize", "store")]["verified"] and stray.name in state[("tokenize", "store")]["reason"]
    assert state[("tokenize", "local")]["verified"] and state[("generate", "store")]["verified"]
    status_md = (tmp_path / "STATUS.md").read_text()
    assert "| tokenize | store |" in status_md and "NO" in status_md

    cli("run", config, "--until", "tokenize", "--store", str(tmp_path / "store"), check=True)  # repairs it
    report = json.loads(cli("status", "--config", config, "--store", str(tmp_path / "store"), "--json",
                            check=True).stdout)
    assert {(r["stage"], r["where"]): r for r in report["stages"]}[("tokenize", "store")]["verified"]


def test_demo_yaml_matches_what_demo_runs():
    from pathlib import Path

    from flashdraft.demo import demo_config

    examples = Path(__file__).resolve().parent.parent / "examples"
    assert load_config(examples / "demo.yaml") == demo_config(native=True)  # as on a CPU with bfloat16 in hardware
    assert load_config(examples / "demo-full.yaml") == demo_config(full=True, native=True)


def test_without_bfloat16_in_hardware_the_demo_computes_in_float32_and_changes_nothing_else():
    from flashdraft.demo import demo_config

    native, emulated = demo_config(native=True), demo_config(native=False)
    assert (native.generate.dtype, native.train.target_dtype, native.train.bf16) == ("bfloat16", "bfloat16", True)
    assert (emulated.generate.dtype, emulated.train.target_dtype, emulated.train.bf16) == ("float32", "float32", False)
    as_native = emulated.model_copy(update={
        "generate": emulated.generate.model_copy(update={"dtype": "bfloat16"}),
        "train": emulated.train.model_copy(update={"target_dtype": "bfloat16", "bf16": True})})
    assert as_native == native


def test_the_docs_describe_the_demo_that_runs():
    """docs/demo.md names the settings `flashdraft demo` (and `--full`) runs; changing one without it fails here."""
    from pathlib import Path

    from flashdraft.demo import DEMO_SETTINGS as F
    from flashdraft.demo import QUICK_SETTINGS as Q

    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "demo.md").read_text().split())
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    rows = [
        f"| prompts | the first {Q['generate.max_prompts']} hand-written ones | all {F['generate.max_prompts']:,} "
        f"(`{F['generate.prompts']}`) |",
        f"| training steps | {Q['train.max_steps']} (~",
        f"| held-out samples in the training log | {Q['train.eval_samples']} | {F['train.eval_samples']} |",
        f"| eval | {Q['eval.max_prompts']} held-out prompts × {Q['eval.max_new_tokens']} tokens | "
        f"{F['eval.max_prompts']} held-out prompts × {F['eval.max_new_tokens']} tokens |",
    ]
    recipe = [
        f"up to {F['generate.max_new_tokens']} tokens",
        f"A {words[F['train.num_layers']]}-layer drafter",
        f"blocks of {F['train.block_size']} and {F['train.max_anchors']} anchors a sequence",
        f"distillation on the top-{F['train.distill_topk']}",
        f"D-PACE loss weights (α {F['train.dpace_alpha']}) on the target's own greedy tokens",
        f"features are cached in {F['train.target_dtype']}",
        f"a {F['train.draft_vocab_size']:,}-token draft vocabulary",
        f"(`{F['eval.prompts']}`)",
    ]
    assert Q["train.max_steps"] != F["train.max_steps"] and f"| {F['train.max_steps']:,} (~" in page
    assert [phrase for phrase in rows + recipe if phrase not in page] == []


def _kill_when(args: list[str], appears, timeout: float = 300) -> None:
    """Start `flashdraft …`, SIGKILL it the moment `appears()` is true (or fail if it never is)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "flashdraft", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not appears():
        assert proc.poll() is None, "the run finished before the kill point was reached"
        assert time.time() < deadline, "kill point not reached in time"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_sigkill_mid_stage_then_run_finishes_without_redoing_work(cli, tmp_path, tiny_model_dir):
    import re

    config = tiny_pipeline_config(tmp_path / "tiny.yaml", tmp_path / "work", tiny_model_dir)
    data = yaml.safe_load(open(config))
    data["generate"]["batch_size"] = 2  # six committed batches: a kill lands between two of them
    data["train"].update(epochs=3, checkpoint_every=1)
    open(config, "w").write(yaml.safe_dump(data))
    work = tmp_path / "work"

    _kill_when(["run", config], lambda: (work / "generate" / "batch-000000.jsonl").exists())
    assert not (work / "generate" / MANIFEST).exists()
    after_generate_kill = cli("run", config, "--until", "tokenize", check=True).stdout
    committed = int(re.search(r"(\d+) already committed", after_generate_kill).group(1))
    assert 1 <= committed < 6  # the finished batches were kept, only the rest generated

    _kill_when(["run", config], lambda: (work / "train" / "checkpoints" / "step-0000002").exists())
    assert not (work / "train" / "drafter").exists()
    final = cli("run", config, check=True).stdout
    assert "generate: already done, verified" in final and "tokenize: already done, verified" in final
    assert "resuming from step-" in final  # training continued from its newest complete checkpoint
    for path in ("generate", "dataset", "train/drafter", "eval"):
        assert verify_dir(work / path) == [], path


def test_the_demos_plan_reproduces_the_measured_demo_of_each_cpu_kind():
    """Each kind of CPU plans with its own measured rates: the run each kind's rates came from is planned within a
    tenth of its measured time (full demo, bfloat16 in hardware: 46 min 49 s; quick demo, AVX2 only: 19 min 01 s),
    and the quick demo on a bfloat16 CPU stays under ten minutes."""
    from flashdraft.demo import demo_config, demo_rates, plan

    def planned(full: bool, native: bool) -> float:
        return sum(seconds for _, _, seconds in plan(demo_config(full=full, native=native)))

    for native in (True, False):
        measured = demo_rates(bfloat16=native)["measured"]
        assert abs(planned(measured["run"] == "full", native) - measured["seconds"]) < 0.1 * measured["seconds"]
    assert demo_rates(True)["measured"]["seconds"] == 46 * 60 + 49 and demo_rates(False)["measured"]["seconds"] == 1141
    assert planned(False, native=True) <= 10 * 60
    assert planned(False, native=False) > 2 * planned(False, native=True)  # float32 on AVX2 is the slower kind


def test_the_demo_heartbeat_prints_a_line_with_the_whole_runs_eta_whatever_the_stage_does():
    import io
    import time

    from rich.console import Console

    from flashdraft.demo import heartbeat

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    stages = [("generate", "", 2.0), ("tokenize", "", 1.0), ("train", "", 3.0), ("eval", "", 1.0)]
    with heartbeat(console, stages, every_s=0.1) as log:
        log("generate: building work/generate")
        time.sleep(0.45)  # a stage that says nothing (a model loading): the heartbeat still speaks
        log("train: building work/train/drafter")
        time.sleep(0.35)
    lines = out.getvalue().splitlines()
    beats = [line for line in lines if line.startswith("demo: ")]
    assert len(beats) >= 5 and "now generate (1/4), ETA ≈" in beats[0]
    assert int(beats[0].split("ETA ≈ ")[1].split(" s")[0]) in (6, 7)  # 7 s planned in all, ~0.1 s gone
    assert any("now train (3/4)" in line for line in beats[-2:])
    assert "generate: building work/generate" in lines  # the stages' own lines pass through
