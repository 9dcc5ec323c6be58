import pytest

from flashdraft.config import ConfigError, PipelineConfig, load_config


def test_defaults_are_the_embedded_demo():
    cfg = load_config()
    assert cfg == PipelineConfig()
    assert cfg.generate.model == "embedded" and cfg.train.target == "embedded"
    assert cfg.train.block_size == 16 and cfg.train.lr == 6e-4 and cfg.train.epochs == 6
    assert cfg.tokenize.max_length == 3072 and cfg.tokenize.min_loss_fraction == 0.3


def test_yaml_overrides_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("workdir: /data/run1\ntrain:\n  lr: 1.0e-3\n  target_layer_ids: [1, 9, 17]\n")
    cfg = load_config(p)
    assert cfg.workdir == "/data/run1"
    assert cfg.train.lr == 1e-3 and cfg.train.target_layer_ids == [1, 9, 17]
    assert cfg.train.epochs == 6  # untouched keys keep their defaults


def test_flags_override_yaml_and_none_means_not_given(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tokenize:\n  max_length: 1024\n  workers: 4\n")
    cfg = load_config(p, {"tokenize.max_length": 2048, "tokenize.workers": None})
    assert cfg.tokenize.max_length == 2048 and cfg.tokenize.workers == 4


def test_unknown_key_names_key_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("generate:\n  batch_size: 8\n\ntokenize:\n  max_lenght: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert f"{p}:5: tokenize.max_lenght: unknown key" in str(e.value)


def test_unknown_section_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: trian: unknown key"):
        load_config(p)


def test_wrong_type_names_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  epochs: many\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: train.epochs: .*integer"):
        load_config(p)


def test_bad_flag_value_is_blamed_on_the_flag():
    with pytest.raises(ConfigError, match=r"--epochs \(train.epochs\)"):
        load_config(None, {"train.epochs": "x"})


@pytest.mark.parametrize("key, value", [("train.epochs", 0), ("train.epochs", -1), ("train.max_steps", 0),
                                        ("train.lr", -1.0), ("generate.batch_size", 0), ("generate.num_shards", 0),
                                        ("generate.temperature", -1.0), ("tokenize.min_loss_fraction", 2.0),
                                        ("eval.max_new_tokens", 0), ("train.block_size", 1)])
def test_values_that_cannot_work_are_refused_naming_the_key(tmp_path, key, value):
    section, name = key.split(".")
    p = tmp_path / "c.yaml"
    p.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"c.yaml:2: {key}: Input should be"):
        load_config(p)


def test_invalid_yaml_and_non_mapping(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on frozen assignment
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_nproc_per_node_needs_a_device_entry_for_each_process(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  nproc_per_node: 3\n  device: cuda:2;cuda:3\n")
    with pytest.raises(ConfigError, match=r"device 'cuda:2;cuda:3' has 2 per-process entries for nproc_per_node 3"):
        load_config(p)
    p.write_text("train:\n  nproc_per_node: 2\n  device: cuda:2;cuda:3\n  target_device: cuda:0,cuda:1\n")
    assert load_config(p).train.nproc_per_node == 2  # each process spreads its target over both
    p.write_text("train:\n  nproc_per_node: 0\n")
    with pytest.raises(ConfigError, match=r"train.nproc_per_node"):
        load_config(p)
