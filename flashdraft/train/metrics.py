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


def selector_metrics(results: list[dict]) -> dict:
    """DSpark's (the confidence head's mean estimate of acceptance and the mean overlap Σ min(p, q) it is fitted to)
    or DFlash2's own metrics over per-sequence step results (empty for DFlash): how often the label is among the
    unary top-K′ (`unary_recall_at_k`: the selector cannot pick it otherwise), how often the selector picks it when
    it is (`selector_accuracy`), and the simulated τ of the unary argmax, beside the selector path's (which is
    `simulated_acceptance_length`, what decoding proposes)."""
    from flashdraft.model.objective import expected_acceptance_length

    if results and "calibration" in results[0]:  # DSpark: the confidence head's mean estimate beside the truth
        estimated, overlap, slots = (sum(r["calibration"][i] for r in results) for i in (0, 1, 2))
        return {"confidence_mean": round(estimated / slots, 4) if slots else None,
                "acceptance_overlap_mean": round(overlap / slots, 4) if slots else None}
    if not results or "recall" not in results[0]:
        return {}
    hits, supervised = (sum(r["recall"][i] for r in results) for i in (0, 1))
    right, inside = (sum(r["selector"][i] for r in results) for i in (0, 1))
    unary = mean_rates([r["unary_rates"] for r in results])
    return {"unary_recall_at_k": round(hits / supervised, 4) if supervised else None,
            "selector_accuracy": round(right / inside, 4) if inside else None,
            "unary_simulated_acceptance_length": round(expected_acceptance_length(unary), 4)}


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
    """On resume, drop metric lines past the checkpoint so the curve has no duplicate steps. The file is read up to
    its last complete line: a kill or a full disk may leave a partial one (and a line that is not a metrics record
    is dropped with it), which must not stop every resume."""
    if not path.exists():
        return
    keep = [line for line, record in complete_records(path) if record["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def complete_records(path: Path) -> list[tuple[str, dict]]:
    """metrics.jsonl's records (each with its line) up to its last complete line: what follows the last newline is
    a kill's or a full disk's partial write, and a line that is not a record with an integer step is skipped."""
    try:
        lines = path.read_text(errors="replace").split("\n")[:-1]
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append((line, record))
    return records
