"""benchmarks/levers.py, the one lever harness (issue 48), end to end at a tiny size: real data, real training,
real eval for each lever; levers with another data recipe get their own dataset (from one generation where their
generate settings agree); the table says both scores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ["generate.max_prompts=16", "generate.max_new_tokens=12", "tokenize.min_loss_fraction=0", "train.max_steps=3",
        "train.eval_samples=4", "eval.max_prompts=2", "eval.max_new_tokens=8"]


def test_every_lever_names_settings_the_config_takes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from levers import as_config, lever_settings

    from flashdraft.demo import QUICK_SETTINGS

    for name, lever in yaml.safe_load((ROOT / "benchmarks" / "levers.yaml").read_text()).items():
        assert lever["what"], name
        as_config(lever_settings(QUICK_SETTINGS, lever), Path("/tmp/unused"))  # refused settings raise here


@pytest.mark.slow
def test_two_levers_train_and_score_side_by_side(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "levers.py"), "--levers", "demo,block-8",
                           "--work", str(tmp_path), "--no-record", "--json", *[f"--set={s}" for s in TINY]],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["levers"]
    assert [r["lever"] for r in rows] == ["demo", "block-8"]
    assert rows[0]["data"] != rows[1]["data"]  # block-8's recipe tokenizes for blocks of 8: its own dataset
    # … of the same answers: the two recipes agree on generate, so the target answered once
    assert [p.name.split("-")[0] for p in tmp_path.glob("generate-*")] == ["generate"]
    assert all(r["tau"] >= 1.0 and r["lossless"] is True and r["train_s"] > 0 for r in rows)
    assert "| lever | what it changes | data | train time | eval τ | Δ | log walk τ | Δ | lossless |" in proc.stdout
    config = yaml.safe_load((tmp_path / "lever-block-8.yaml").read_text())
    assert config["train"]["block_size"] == 8 and config["tokenize"]["block_size"] == 8
    assert config["train"]["max_steps"] == 3  # --set reaches every lever
