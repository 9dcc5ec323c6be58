"""docs/config-keys.md lists every config key, generated from the config model: it cannot drift from the code, and a
key added without a comment saying what it does fails here."""

from pathlib import Path

from flashdraft.config import PipelineConfig
from flashdraft.config_reference import reference, undocumented

PAGE = Path(__file__).parents[1] / "docs" / "config-keys.md"


def test_the_config_reference_is_the_one_the_code_generates():
    assert PAGE.read_text() == reference(), (
        "docs/config-keys.md differs from the config model: "
        ".venv/bin/python -m flashdraft.config_reference > docs/config-keys.md")


def test_every_key_says_what_it_does_with_its_default_and_bounds():
    assert undocumented() == []
    page = PAGE.read_text()
    defaults = PipelineConfig()
    for section in ("generate", "tokenize", "train", "eval"):
        body = page.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        for name in type(getattr(defaults, section)).model_fields:
            assert f"| `{name}` |" in body, (section, name)
    assert "| `block_size` | `16` | int (≥ 2, ≤ 128) |" in page
    assert '| `feature_source` | `"transformers"` | `"transformers"` \\| `"engine"` |' in page
