"""The README's first command: `flashdraft demo` on the embedded SmolLM2 target, offline."""

import json

import pytest

from flashdraft.artifact import MANIFEST, verify_dir


@pytest.mark.slow
def test_demo_converts_the_embedded_target_once_and_verifies_it(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = cli("demo", "--workdir", str(tmp_path / "work"), check=True)
    target = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert "target: converted" in first.stdout
    assert verify_dir(target) == []
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 576
    assert json.loads((target / MANIFEST).read_text())["kind"] == "model"

    second = cli("demo", "--workdir", str(tmp_path / "work"), check=True)
    assert "target: already done, verified" in second.stdout
    assert second.stdout.count("not built") == 4  # stages not built yet are reported, not faked

    (target / "config.json").write_text((target / "config.json").read_text().replace("576", "577"))
    third = cli("demo", "--workdir", str(tmp_path / "work"), check=True)
    assert "does not verify: config.json" in third.stdout and "target: converted" in third.stdout
