"""The optimizer: AdamW over every drafter parameter, or Muon for the 2-D weight matrices (the draft layers'
projections and `fc`) beside AdamW for the rest (norms, biases) — stepped, zeroed and scheduled as one.

    train.optimizer: muon       # train.muon_lr (None: 10 × lr), train.muon_momentum, train.muon_weight_decay

The shared embedding and LM head are the target's, frozen, and not the drafter's parameters. Each optimizer has its
own cosine schedule with warmup (the same shape, its own peak); a checkpoint keeps every optimizer's state and
every schedule's position.
"""

from __future__ import annotations

import math

import torch

from flashdraft.config import TrainConfig


class Optimizers:
    """One or two torch optimizers and their schedules, driven as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], schedulers: list) -> None:
        self.all, self.schedulers = optimizers, schedulers

    def step(self) -> None:
        for optimizer in self.all:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()

    def zero_grad(self) -> None:
        for optimizer in self.all:
            optimizer.zero_grad(set_to_none=True)

    def last_lr(self) -> float:
        """The AdamW learning rate now (the one `train.lr` sets), what the metrics report."""
        return self.schedulers[-1].get_last_lr()[0]

    def schedule_state(self) -> list[dict]:
        return [scheduler.state_dict() for scheduler in self.schedulers]

    def load_schedule_state(self, states: list[dict] | dict) -> None:
        states = [states] if isinstance(states, dict) else states  # a checkpoint from before Muon: one schedule
        if len(states) != len(self.schedulers):
            from flashdraft.errors import BadTrainingInput

            raise BadTrainingInput(f"the checkpoint holds {len(states)} optimizer schedule(s), this run has "
                                   f"{len(self.schedulers)}: it was made with another train.optimizer")
        for scheduler, state in zip(self.schedulers, states, strict=True):
            scheduler.load_state_dict(state)


def adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, fused: one kernel over all parameters instead of a dozen elementwise passes per parameter, which on
    a CPU takes the demo's 15.8M parameters from 24 to 8 ms a step (benchmarks/RESULTS.md, "the demo's training
    step"); its weights differ from the unfused loop's in the last bit. FSDP's sharded parameters (DTensors) keep
    torch's default."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                             fused=None if sharded(params) else True)


def sharded(params: list[torch.nn.Parameter]) -> bool:
    """Are these FSDP-sharded (DTensor) parameters? They exist only under an initialised process group, so a
    single process never imports torch.distributed.tensor (most of a second)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def build_optimizers(cfg: TrainConfig, drafter: torch.nn.Module, total_steps: int) -> Optimizers:
    from transformers import get_cosine_schedule_with_warmup

    params = [p for p in drafter.parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        # the matrices of the draft layers and fc; DFlash2's codebooks (embedding tables indexed by token) and the
        # selector's projection stay with AdamW
        matrices = [p for name, p in drafter.named_parameters()
                    if p.requires_grad and p.ndim == 2 and name.split(".")[0] in ("layers", "fc")]
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        optimizers = [torch.optim.Muon(matrices, lr=cfg.muon_lr or 10 * cfg.lr, momentum=cfg.muon_momentum,
                                       weight_decay=cfg.muon_weight_decay)]
        optimizers.append(adamw(rest, cfg))
    else:
        optimizers = [adamw(params, cfg)]
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    return Optimizers(optimizers, [get_cosine_schedule_with_warmup(o, warmup, total_steps) for o in optimizers])
