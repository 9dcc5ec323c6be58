"""benchmarks/gpu_check.sh, the one command for a GPU machine, runs here in its tiny CPU form so it cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A bare environment, as a GPU machine's shell has, but one torch thread as every process of the suite has: left
# to itself torch starts a thread a core, and on a machine the suite's other workers keep busy those threads wait
# on each other
ENV = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def test_gpu_check_runs_end_to_end_in_its_tiny_cpu_form():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--tiny", "--json"], capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| target shape | attention | train tokens/s | MFU | peak GiB | step ms |" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["shape"], r["attention"].split()[0]) for r in result["train"]] == [
        ("tiny-a", "flex"), ("tiny-a", "sdpa"), ("tiny-b", "flex"), ("tiny-b", "sdpa")]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in result["train"])
    # a step for each loss and optimizer, as train builds them, at one fixed anchor count
    assert [(r["loss"], r["optimizer"]) for r in result["recipes"]] == [
        ("decay", "adamw"), ("dpace", "adamw"), ("decay", "muon"), ("dpace", "muon")]
    assert len({r["anchors"] for r in result["recipes"]}) == 1
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in result["recipes"])
    assert "| loss | optimizer | train tokens/s | MFU | × SpecForge's MFU anchor | peak GiB | step ms |" in proc.stdout
    assert result["eval"]["lossless"] is True and result["eval"]["tau"] >= 1.0
    assert result["eval"]["divergence"] is None  # float32 on a CPU: token for token
    assert "lossless True (token for token)" in proc.stdout


def test_gpu_eval_runs_end_to_end_in_its_tiny_cpu_form():
    """benchmarks/gpu_eval.sh: both decoding machineries against the bound, eval's own per-dataset table, and the
    CLI's training step beside the isolated one with its profile."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_eval.sh"), "--tiny", "--json"], capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["shape"], r["machinery"]) for r in result["decode"]] == [
        ("tiny-a", "growing cache, eager"), ("tiny-a", "static cache"),
        ("tiny-b", "growing cache, eager"), ("tiny-b", "static cache")]
    for r in result["decode"]:
        assert r["token_ms"] > r["bound_ms"] > 0 and r["launches_per_token"] > 0 and r["step_in_tokens"] > 0
        assert r["tau"] >= 1.0
    assert set(result["eval"]["by_dataset"]) == {"gsm8k", "mt-bench"} and result["eval"]["lossless"] is True
    assert "| gsm8k | 3 |" in proc.stdout and "| mt-bench | 6 |" in proc.stdout  # both of mt-bench's turns
    train = result["train"]
    assert train["cli_tokens_per_s"] > 0 and 0 < train["ratio"] and train["profile"]["top"]
    assert train["profile"]["syncs_per_step"] == []  # counted on CUDA only
    phases = {p["phase"]: p["calls"] for p in train["profile"]["phases"]}
    assert {"plan": 3, "backward": 3, "optimizer": 3, "read": 3, "bookkeeping": 3}.items() <= phases.items()
    assert phases["forward"] >= 3 and phases["mask"] >= 3 and phases["heldout"] >= 1
    assert "CLI / isolated" in proc.stdout and "| operator | self ms | calls |" in proc.stdout
    memory = result["memory"]  # the drafter's step peak beside estimate's formula, at two sizes
    assert [m["scored_rows"] for m in memory] == [64, 256]
    assert all(m["peak_bytes"] > 0 and 0.85 < m["formula_bytes"] / m["peak_bytes"] < 1.15 for m in memory)
