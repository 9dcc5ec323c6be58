import json
import os
from pathlib import Path

import pytest
import typer
from typer.main import get_command

from flashdraft.cli import app

COMMANDS = ["generate", "tokenize", "train", "eval", "export", "manifest", "verify", "sync", "status", "run", "demo",
            "estimate"]

# The CLI is an interface others script against (DESIGN §6): a new or renamed flag must be a deliberate
# change to this table, not an accident.
FROZEN_FLAGS = {
    "generate": [
        "--backend",
        "--base-url",
        "--batch-size",
        "--config",
        "--dtype",
        "--json",
        "--max-new-tokens",
        "--model",
        "--num-shards",
        "--out",
        "--prompts",
        "--shard-index",
        "--temperature",
        "--thinking",
        "--turns",
        "--upload-to",
    ],
    "tokenize": [
        "--block-size",
        "--config",
        "--input",
        "--json",
        "--max-length",
        "--min-loss-fraction",
        "--out",
        "--show",
        "--tokenizer",
        "--workers",
    ],
    "train": [
        "--architecture",
        "--config",
        "--data",
        "--epochs",
        "--features",
        "--init-from",
        "--json",
        "--max-steps",
        "--node-rank",
        "--out",
        "--push-to",
        "--resume",
        "--target",
    ],
    "eval": [
        "--confidence-rule",
        "--confidence-threshold",
        "--config",
        "--decoding",
        "--draft-sampling",
        "--drafter",
        "--engine",
        "--engine-only",
        "--engine-url",
        "--json",
        "--max-new-tokens",
        "--max-prompts",
        "--out",
        "--prompts",
        "--seeds",
        "--skip-unreadable",
        "--target",
        "--temperature",
        "--thinking",
    ],
    "export": [
        "--config",
        "--drafter",
        "--drafter-only",
        "--format",
        "--json",
        "--out",
        "--outtype",
        "--target",
    ],
    "manifest": [
        "--json",
        "--kind",
    ],
    "verify": [
        "--deep",
        "--endpoint-url",
        "--json",
        "--profile",
    ],
    "sync": [
        "--delete",
        "--endpoint-url",
        "--force",
        "--jobs",
        "--json",
        "--part-size-mb",
        "--profile",
        "--verbose",
    ],
    "status": [
        "--config",
        "--json",
        "--markdown",
        "--store",
    ],
    "run": [
        "--dry-run",
        "--from",
        "--json",
        "--store",
        "--until",
    ],
    "demo": [
        "--full",
        "--json",
        "--workdir",
    ],
    "estimate": [
        "--json",
        "--mean-new-tokens",
        "--num-prompts",
        "--step-seconds",
        "--target-config",
        "--tokens-per-s",
        "--train-hours",
    ],
}


def test_every_command_has_json_output_as_the_readme_says():
    assert [name for name in COMMANDS if "--json" not in FROZEN_FLAGS[name]] == []


def test_help_lists_every_command(cli):
    proc = cli("--help", check=True)
    for name in COMMANDS:
        assert f" {name} " in proc.stdout, name


def test_version(cli):
    assert cli("--version", check=True).stdout.startswith("flashdraft 0.")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(cli, name):
    proc = cli(name, "--help", check=True)
    assert "Usage:" in proc.stdout and len(proc.stdout) > 200


def test_flag_set_is_frozen():
    group = get_command(app)
    ctx = typer.Context(group)
    for name, flags in FROZEN_FLAGS.items():
        command = group.get_command(ctx, name)
        found = sorted(opt for p in command.params for opt in p.opts if opt.startswith("--") and opt not in ("--help",))
        assert found == sorted(flags), name


def _make_artifact(cli, root: Path) -> None:
    (root / "d").mkdir(parents=True)
    (root / "d" / "x.bin").write_bytes(os.urandom(4096))
    (root / "y.txt").write_text("some text\n")
    proc = cli("manifest", str(root), "--json", check=True)
    assert json.loads(proc.stdout)["files"] == 2


def _tamper_same_size(root):
    p = root / "d" / "x.bin"
    b = bytearray(p.read_bytes())
    b[0] ^= 1
    p.write_bytes(bytes(b))
    return "d/x.bin"


def _truncate(root):
    (root / "y.txt").write_text("some")
    return "y.txt"


def _delete(root):
    (root / "y.txt").unlink()
    return "y.txt"


def _extra(root):
    (root / "d" / "stray.arrow").write_bytes(b"1")
    return "d/stray.arrow"


def _drop_manifest(root):
    (root / "manifest.json").unlink()
    return "manifest.json"


def _garble_manifest(root):
    (root / "manifest.json").write_text('{"format": 1, "kind": "files", "files": [')
    return "manifest.json"


@pytest.mark.parametrize("tamper", [_tamper_same_size, _truncate, _delete, _extra, _drop_manifest, _garble_manifest])
def test_verify_cli_names_the_file_and_fails(cli, tmp_path, tamper):
    _make_artifact(cli, tmp_path)
    ok = cli("verify", str(tmp_path), "--json", check=True)
    assert json.loads(ok.stdout) == {"ok": True, "problems": []}

    name = tamper(tmp_path)
    proc = cli("verify", str(tmp_path), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert [p["path"] for p in report["problems"]] == [name]
    assert name in proc.stderr


def test_verify_of_a_non_directory_is_a_clear_error(cli, tmp_path):
    proc = cli("verify", str(tmp_path / "nope"))
    assert proc.returncode == 1 and "not a directory" in proc.stderr


def test_run_reports_config_errors_with_file_and_line(cli, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  lr: 0.001\n  learning_rate: 0.1\n")
    proc = cli("run", str(cfg))
    assert proc.returncode == 1
    assert f"{cfg}:3: train.learning_rate: unknown key" in proc.stderr


def test_stage_help_shows_each_options_effective_default_and_generate_needs_prompts(cli, tmp_path):
    from flashdraft.config import PipelineConfig

    defaults = PipelineConfig()
    wide = dict(os.environ, COLUMNS="400")  # one option a line, so a default never wraps
    shown = " ".join(cli("generate", "--help", check=True, env=wide).stdout.split())
    assert "(default: hf)" in shown and f"(default: {defaults.generate.max_new_tokens})" in shown
    assert "(required, or generate.prompts in --config)" in shown
    shown = " ".join(cli("train", "--help", check=True, env=wide).stdout.split())
    assert f"Passes over the data. (default: {defaults.train.epochs})" in shown
    proc = cli("generate", "--out", str(tmp_path / "gen"))  # no silent 404 built-in prompts into a default dir
    assert proc.returncode == 2 and "--prompts is required" in proc.stderr and not (tmp_path / "gen").exists()


def test_with_json_a_failure_is_one_json_object_on_stdout_too(cli, tmp_path):
    """A script reading --json output gets an object on failure as on success: ok false and the error line."""
    missing = cli("eval", "--drafter", str(tmp_path / "none"), "--out", str(tmp_path / "e"), "--json")
    assert missing.returncode == 1
    assert json.loads(missing.stdout) == {"ok": False, "error": f"{tmp_path / 'none'} holds no drafter "
                                                                "(config.json): run `flashdraft train` first"}
    assert "error:" in missing.stderr
    refused = cli("verify", str(tmp_path / "nope"), "--json")
    assert refused.returncode == 1 and json.loads(refused.stdout)["ok"] is False


def test_settings_that_do_not_go_together_are_named_by_their_flags(cli, tmp_path):
    proc = cli("train", "--data", str(tmp_path), "--out", str(tmp_path / "t"), "--features", "offline",
               "--architecture", "dspark")
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "train settings (--features offline, --architecture dspark): architecture: dspark's L1" in line
    assert "Value error" not in line and "<defaults>" not in line


def test_a_thinking_mode_it_does_not_know_is_one_line_naming_the_flag(cli, tmp_path):
    proc = cli("eval", "--drafter", str(tmp_path), "--out", str(tmp_path / "e"), "--thinking", "maybe")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: --thinking maybe: on, off, or on,off (both modes, a row each)"]
