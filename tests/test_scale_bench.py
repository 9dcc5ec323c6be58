"""The scale benchmark at a tiny size (it is not a test of scale): every stage runs, is measured, is reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_scale_bench_measures_every_stage_at_its_smallest_size(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"), "--sizes", "20",
                           "--answer-words", "200", "--work", str(tmp_path / "w"), "--no-record", "--json",
                           str(tmp_path / "runs.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [r["samples"] for r in runs] == [20]
    stages = ["generate", "tokenize", "verify", "sync push", "status", "train start-up", "estimate"]
    for run in runs:
        assert list(run["stages"]) == stages
        assert run["stages"]["generate"]["json"]["errors"] == 0
        assert all(s["seconds"] > 0 and s["peak_rss_mb"] > 0 for s in run["stages"].values())
        assert run["stages"]["generate"]["json"]["records"] == run["samples"]  # every prompt answered
        assert run["stages"]["tokenize"]["json"]["samples"] == run["samples"]
        assert 0 < run["stages"]["train start-up"]["to_first_step_s"] < run["stages"]["train start-up"]["seconds"]
    assert "| train start-up |" in proc.stdout and "projected s @ 902K" in proc.stdout


def test_scale_bench_clears_only_a_work_dir_it_made(tmp_path):
    """It deletes and rebuilds its subdirectories of --work on every run, so a --work holding anything it did
    not make is refused before anything is touched."""
    (tmp_path / "n20").mkdir()
    (tmp_path / "n20" / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"), "--sizes", "20",
                           "--work", str(tmp_path), "--no-record"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "did not make" in proc.stderr
    assert (tmp_path / "n20" / "notes.txt").read_text() == "mine"
