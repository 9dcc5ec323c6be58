"""benchmarks/gpu_check.sh, the one command for a GPU machine, runs here in its tiny CPU form so it cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_end_to_end_in_its_tiny_cpu_form():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--tiny", "--json"], capture_output=True,
                          text=True, timeout=300, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
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
