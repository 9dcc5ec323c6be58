"""The runbook as a new user walks it past training (issue 71): serving with current engine releases, the baseline
measured against a served engine, a fleet's shared directory sized, one recipe for several nodes."""

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "reference-run.md"
ASSETS = Path(__file__).parent / "assets"


def block(name: str) -> str:
    text = RUNBOOK.read_text()
    return text[text.index(f"<!-- {name}") : text.index(f"<!-- /{name} -->")]


def test_the_serving_block_names_the_v2_runner_switch_and_only_merged_pull_requests():
    """Mixed sliding/full drafters are served by vllm#47914 on the V2 runner only (behind VLLM_USE_V2_MODEL_RUNNER=1
    up to 0.27.x); #40898 was closed unmerged, and SGLang's #35371 is DFlash2's, not DFlash's."""
    serving = block("serving")
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in serving and "vLLM ≥ 0.26.0" in serving
    assert "#47914" in serving and "sglang#22077" in serving and "trtllm_mha" in serving
    for unmerged_or_other in ("40898", "35371"):
        assert unmerged_or_other not in RUNBOOK.read_text()


def test_the_baseline_is_measured_against_a_served_engine():
    """z-lab's drafter is measured as yours is: `--engine-url … --engine-only`, never by an eval that would start a
    CPU engine for a 27B here (or decode it in-process for hours)."""
    text = RUNBOOK.read_text()
    baseline = text[text.index("## The drafter to beat") : text.index("## 1.")]
    command = re.search(r"^flashdraft eval .*?(?<!\\)$", baseline, re.M | re.S).group(0)
    assert "--drafter /models/z-lab-qwen3.6-27b-dflash" in command
    assert "--engine-url http://serve-0:8000" in command and "--engine-only" in command
    assert "hf download z-lab/Qwen3.6-27B-DFlash --local-dir" in baseline


def test_no_docs_page_starts_torchrun_by_hand_for_several_nodes():
    for page in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for line in page.read_text().splitlines():
            assert not re.search(r"^\s*torchrun .*--nnodes", line), (page.name, line)
            assert "start `torchrun" not in line, (page.name, line)


def test_a_drafter_named_by_its_hub_id_says_to_download_it(cli, tmp_path):
    for args in (["eval", "--drafter", "z-lab/Qwen3.6-27B-DFlash", "--out", str(tmp_path / "e")],
                 ["train", "--init-from", "z-lab/Qwen3.6-27B-DFlash", "--data", str(tmp_path / "d"), "--out",
                  str(tmp_path / "t")]):
        result = cli(*args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "hf download z-lab/Qwen3.6-27B-DFlash --local-dir /models/Qwen3.6-27B-DFlash" in result.stderr


def test_eval_refuses_to_start_a_cpu_engine_for_a_target_it_cannot_hold(cli, tmp_path):
    """A 32B target and no --engine-url: the CPU build would need ~131 GB of float32 weights here; refused in one
    line that says where to measure instead, before any decoding."""
    from flashdraft.evaluate.engine_commands import cpu_engine_too_small, engine_program

    target = tmp_path / "qwen3-32b"
    target.mkdir()
    (target / "config.json").write_text((ASSETS / "qwen3-32b-config.json").read_text())
    why = cpu_engine_too_small("llamacpp", None, None, str(target))
    assert why and "--engine-url http://HOST:PORT --engine-only" in why and "GB in float32" in why
    assert cpu_engine_too_small("vllm", "http://gpu:8000", None, str(target)) is None  # served elsewhere: fine
    if not engine_program("vllm", None).is_file():
        pytest.skip("vLLM's CPU build is not installed: run scripts/engines.sh")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 16}))
    result = cli("eval", "--drafter", str(drafter), "--target", str(target), "--engine", "vllm", "--out",
                 str(tmp_path / "eval"))
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("error: eval --engine vllm")


def test_estimate_gives_what_a_fleets_shared_directory_must_sustain(cli, tmp_path):
    """With the engine as the feature source: the bytes a sequence, the sustained rate and for how long, and the
    kind of filesystem — for the runbook's config as a fleet run."""
    config = yaml.safe_load((ROOT / "examples" / "qwen3.6-27b.yaml").read_text())
    config["train"] |= {"feature_source": "engine", "engine_urls": ["http://10.0.0.5:8000"],
                        "engine_storage": "/mnt/shared/hidden-states"}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["estimate", str(path), "--num-prompts", "900000", "--target-config",
            str(ASSETS / "qwen3.6-27b-config.json")]
    printed = cli(*args, check=True).stdout
    line = next(line for line in printed.splitlines() if line.startswith("shared directory"))
    assert "185.3 MB a sequence" in line and "464.3 MB/s each way (the filesystem carries it twice)" in line
    assert "parallel filesystem" in line and "the user that owns the fleet's key" in line
    shared = json.loads(cli(*args, "--json", check=True).stdout)["shared_directory"]
    # the drafter's 5 layers and the target's last, which the engine writes too
    assert shared["bytes_per_sequence"] == 3016 * 6 * 5120 * 2 and round(shared["hours"]) == 100
