"""Training metrics: metrics.jsonl always, TensorBoard and W&B when installed; per-position rates as JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from flashdraft.artifact.atomic import atomic_write_text


def mean_rates(rows: list[list[float]]) -> list[float]:
    """Mean over sequences of per-position rates; NaN where no sequence reached a position."""
    import warnings

    arr = np.array(rows, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns are expected: they stay NaN
        return [float(x) for x in np.nanmean(arr, axis=0)] if len(arr) else []


def json_rates(rates: list[float]) -> list[float | None]:
    """Rates for JSON: None where no sample reached a position (NaN is not JSON)."""
    return [None if math.isnan(x) else round(x, 4) for x in rates]


class MetricSinks:
    """metrics.jsonl always; TensorBoard (`<out>/tensorboard`) when `tensorboard` is installed; Weights &
    Biases when `wandb` is installed and WANDB_PROJECT is set (so nothing ever waits on a login prompt)."""

    def __init__(self, out: Path, enabled: bool, config: dict) -> None:
        self.path, self.sinks, self.enabled = out / "metrics.jsonl", [], enabled
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.sinks.append(("tensorboard", SummaryWriter(str(out / "tensorboard"))))
        except ImportError:
            pass
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb

                self.sinks.append(("wandb", wandb.init(project=os.environ["WANDB_PROJECT"], config=config)))
            except ImportError:
                pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        append_jsonl(self.path, record)
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("step", "epoch")}
        for key in ("simulated_acceptance_length", "serving_acceptance_length"):
            if "heldout" in record and record["heldout"].get(key) is not None:
                scalars[f"heldout_{key}"] = record["heldout"][key]
        for name, sink in self.sinks:
            if name == "tensorboard":
                for key, value in scalars.items():
                    sink.add_scalar(key, value, record["step"])
            else:
                sink.log(scalars, step=record["step"])

    def close(self) -> None:
        for name, sink in self.sinks:
            if name == "tensorboard":
                sink.close()
            else:
                sink.finish()


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines past the checkpoint so the curve has no duplicate steps."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))
