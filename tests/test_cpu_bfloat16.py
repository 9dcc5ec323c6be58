"""bfloat16 asked for on a CPU that emulates it (no AVX512-BF16 or AMX): said before any work, naming the settings,
and again by the stage that computes in it (flashdraft/cpu_bfloat16.py). Not a failure: slower, not wrong."""

from pathlib import Path

import yaml

import flashdraft.cpu_bfloat16 as cpu_bfloat16
from flashdraft.config import load_config
from flashdraft.cpu_bfloat16 import EMULATED_BFLOAT16, bfloat16_on_this_cpu, native_bfloat16
from flashdraft.model.target import Target
from flashdraft.preflight import pipeline_checks

ASKING = {"generate.dtype": "bfloat16", "train.bf16": True, "train.device": "cpu", "eval.target_dtype": "bfloat16"}


def test_the_settings_that_ask_for_bfloat16_are_named_where_the_cpu_emulates_it(tmp_path, monkeypatch):
    cfg = load_config(None, {"workdir": str(tmp_path), **ASKING})
    monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda: False)
    notice = bfloat16_on_this_cpu(cfg, ["generate", "tokenize", "train", "eval"])
    assert notice.ok and notice.what == "bfloat16 on this CPU (generate.dtype, train.bf16, eval.target_dtype)"
    assert "40x float32's time" in notice.detail
    assert bfloat16_on_this_cpu(cfg, ["tokenize", "train"]).what == "bfloat16 on this CPU (train.bf16)"  # its stages
    float32 = load_config(None, {"workdir": str(tmp_path), "generate.dtype": "float32", "train.bf16": False})
    assert bfloat16_on_this_cpu(float32, ["generate", "train", "eval"]) is None  # nothing asked: nothing said
    on_a_gpu = load_config(None, {"workdir": str(tmp_path), "train.bf16": True, "train.device": "cuda:0"})
    assert bfloat16_on_this_cpu(on_a_gpu, ["train"]) is None  # a GPU computes it in hardware
    monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda: True)
    assert bfloat16_on_this_cpu(cfg, ["generate", "train", "eval"]) is None  # a CPU with it in hardware


def test_the_dry_run_says_it_on_this_machine_exactly_when_its_cpu_emulates_bfloat16(tmp_path):
    """Without a stand-in: this machine's own answer, whichever kind of CPU it is."""
    cfg = load_config(None, {"workdir": str(tmp_path), **ASKING})
    lines = [c.line() for c in pipeline_checks(cfg, ["generate"])]
    said = [line for line in lines if "bfloat16 on this CPU (generate.dtype)" in line]
    assert len(said) == (0 if native_bfloat16() else 1), lines
    assert all(line.startswith("ok ") for line in said)  # a notice, never a failure


def test_the_target_says_it_when_it_loads_in_bfloat16_on_such_a_cpu(tiny_model_dir, monkeypatch):
    for native, expected in ((False, [f"target: bfloat16 — {EMULATED_BFLOAT16}"]), (True, [])):
        monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda native=native: native)
        lines = []
        Target(tiny_model_dir, "cpu", lines.append, "bfloat16")
        assert [line for line in lines if "bfloat16" in line] == expected
        lines.clear()
        Target(tiny_model_dir, "cpu", lines.append, "float32")
        assert lines == []


def test_the_example_config_of_the_demo_asks_for_it_and_the_demo_does_not_where_it_is_emulated(tmp_path):
    from flashdraft.demo import demo_config

    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "demo.yaml").read_text())
    assert example["generate"]["dtype"] == "bfloat16"  # the example is the AVX512-BF16 machine's settings
    assert bfloat16_on_this_cpu(demo_config(tmp_path, native=False), ["generate", "train", "eval"]) is None
