"""The fleet commands docs/train.md tells a user to run are the ones the code prints, and its figures are
estimate's: a docs command typed by hand served one layer too few (the target's last, which train also asks for)."""

import json
import textwrap
from pathlib import Path

import yaml

from flashdraft.config import TrainConfig
from flashdraft.train.fleet import fleet_recipe, run_layers

ROOT = Path(__file__).resolve().parents[1]
TARGET_CONFIG = ROOT / "tests" / "assets" / "qwen3.6-27b-config.json"


def docs_fleet_config() -> TrainConfig:
    """The runbook's train section with the fleet keys docs/train.md shows (read from its YAML block)."""
    page = (ROOT / "docs" / "train.md").read_text().split("### A target fleet", 1)[1]
    shown = yaml.safe_load(textwrap.dedent(page.split("```yaml\n", 1)[1].split("```", 1)[0]))["train"]
    runbook = yaml.safe_load((ROOT / "examples" / "qwen3.6-27b.yaml").read_text())["train"]
    return TrainConfig(**(runbook | shown))


def test_the_docs_fleet_recipe_is_what_the_dry_run_prints():
    cfg = docs_fleet_config()
    text = json.loads(TARGET_CONFIG.read_text())
    layers = run_layers(cfg, text.get("text_config", text))
    assert layers == [1, 16, 31, 46, 61, 63]  # the drafter's five and the target's last
    printed = "\n".join(["the fleet, started in this order before train:",
                         *(f"  {line}" for line in fleet_recipe(cfg, layers, key_made=False))])
    page = (ROOT / "docs" / "train.md").read_text().split("### A target fleet", 1)[1]
    shown = textwrap.dedent(page.split("```text\n", 1)[1].split("```", 1)[0]).rstrip()
    assert shown == printed
    assert "target-layers-1-16-31-46-61-63" in page and "[2, 17, 32, 47, 62, 64]" in page
    assert "target-layers-1-16-31-46-61 " not in page  # the five-layer command of before


def test_the_docs_fleet_figures_are_estimates(cli, tmp_path):
    config = yaml.safe_load((ROOT / "examples" / "qwen3.6-27b.yaml").read_text())
    config["train"] = docs_fleet_config().model_dump(exclude_defaults=True)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    est = json.loads(cli("estimate", str(path), "--num-prompts", "900000", "--target-config", str(TARGET_CONFIG),
                         "--json", check=True).stdout)
    shared, probe = est["shared_directory"], est["fleet_probe"]
    assert shared["bytes_per_sequence"] == 3016 * 6 * 5120 * 2 and shared["layers_written"] == 6
    page = " ".join((ROOT / "docs" / "train.md").read_text().split())
    assert f"{shared['bytes_per_sequence'] / 1e6:.0f} MB a sequence (3,016 tokens × 6 layers × 5,120 × 2 bytes)" in page
    assert f"about {shared['bytes_per_s'] / 1e9:.2f} GB/s each way" in page
    assert f"about {2 * shared['bytes_per_s'] / 1e9:.2f} GB/s, for the run's {round(shared['hours'])} hours" in page
    assert f"about {shared['bytes_in_flight'] / 1e9:.0f} GB is in it at a time" in page
    assert f"({probe['bytes_read'] / 1e9:.1f} GB, ≈ {probe['seconds_at_2gb_s']} s at 2 GB/s" in page
    assert f"({probe['layer_bytes'] / 1e9:.1f} GB in float32)" in page
