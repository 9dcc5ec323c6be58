"""The recipe's settings: the loss weighting (decay | dpace) under one normalisation over the whole optimizer step,
whichever way the step's sequences are split into micro-batches or over ranks."""

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.config import ConfigError, TrainConfig, load_config
from flashdraft.train import run
from tests.train.test_train import quiet, tiny_cfg, torchrun, write_config


def drafter_weights(out) -> dict:
    return load_file(str(out / "drafter" / "model.safetensors"))


def same_weights(a: dict, b: dict, atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.mark.parametrize("loss", ["decay", "dpace"])
def test_a_step_does_not_depend_on_how_its_sequences_are_split(tiny_target, tiny_dataset, tmp_path, loss):
    """Sequences of different lengths and anchor counts: Σ CE·w / Σ w over the step, not a mean of per-sequence
    ratios, so one micro-batch of 4 and four of 1 give the same update."""
    cfg = tiny_cfg(tiny_target, batch_size=4, max_steps=3, loss=loss, export_dtype="float32")
    run(cfg.model_copy(update={"micro_batch": 4}), tiny_dataset, tmp_path / "four", log=quiet)
    run(cfg.model_copy(update={"micro_batch": 1}), tiny_dataset, tmp_path / "one", log=quiet)
    assert same_weights(drafter_weights(tmp_path / "four"), drafter_weights(tmp_path / "one"))


def test_dpace_reaches_the_step_and_refuses_a_decay_gamma(tiny_target, tiny_dataset, tmp_path):
    cfg = tiny_cfg(tiny_target, max_steps=2, export_dtype="float32")
    run(cfg, tiny_dataset, tmp_path / "decay", log=quiet)
    run(cfg.model_copy(update={"loss": "dpace"}), tiny_dataset, tmp_path / "dpace", log=quiet)
    assert not same_weights(drafter_weights(tmp_path / "decay"), drafter_weights(tmp_path / "dpace"), atol=1e-7)
    with pytest.raises(ConfigError, match="loss_decay_gamma sets the decay loss's weights"):
        load_config(None, {"train.loss": "dpace", "train.loss_decay_gamma": 3.0})
    with pytest.raises(ValueError):
        TrainConfig(loss="dpace", dpace_alpha=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["decay", "dpace"])
def test_two_ranks_of_two_equal_one_process_of_four(tiny_target, tiny_dataset, tmp_path, loss):
    """The step's weight total is summed across ranks before gradients are divided by it."""
    common = dict(max_steps=2, checkpoint_every=1, loss=loss, export_dtype="float32")
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=4, **common)
    ddp = write_config(tmp_path / "ddp.yaml", tiny_target, batch_size=2, **common)
    run(load_config(single).train, tiny_dataset, tmp_path / "one", log=quiet)
    proc = torchrun("train", "--config", str(ddp), "--data", str(tiny_dataset), "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_weights(drafter_weights(tmp_path / "one"), drafter_weights(tmp_path / "two"))
