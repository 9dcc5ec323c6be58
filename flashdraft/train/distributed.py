"""One process's place in a run: rank, world, devices; DDP or FSDP around the drafter; barriers.

    torchrun --nproc-per-node 2 -m flashdraft train …     # gloo on CPU, nccl on GPU
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput, ExpectedFailure

T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    rank: int
    world: int
    device: str  # where the drafter trains
    target_device: str  # where the target runs ("cuda:0,cuda:1" spreads it over both)


def place(cfg: TrainConfig) -> Placement:
    """Join the process group under torchrun and pick this process's devices."""
    rank, world = setup_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = for_rank(cfg.device, local_rank) or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
    return Placement(rank, world, device, for_rank(cfg.target_device, local_rank) or device)


def for_rank(spec: str | None, local_rank: int) -> str | None:
    """Device settings per process: "a;b;c" gives local rank i the i-th entry (the 2 + 2 split under
    `torchrun --nproc-per-node 2`: target_device "cuda:0;cuda:1", device "cuda:2;cuda:3"); within an entry,
    "cuda:0,cuda:1" spreads one process's target over both."""
    if spec is None or ";" not in spec:
        return spec
    entries = [e.strip() for e in spec.split(";")]
    if local_rank >= len(entries):
        raise BadTrainingInput(f"device setting {spec!r} has {len(entries)} entries; local rank {local_rank} has none")
    return entries[local_rank]


def setup_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    return (torch.distributed.get_rank() if world > 1 else 0), world


def wrap(model: torch.nn.Module, cfg: TrainConfig, world: int, device: str) -> torch.nn.Module:
    """DDP by default; FSDP for drafters too large to replicate. One function, two branches."""
    if world == 1:
        return model
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def leave(world: int) -> None:
    """After a run's last collective: close the process group, so no process exits with its connections open
    (a gloo process whose peer has already gone can abort in the group's own threads; torch asks for this too)."""
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def collective_device() -> torch.device:
    # nccl sends only GPU tensors; one GPU per local rank keeps two ranks of a node off the same device
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def once_a_node(world: int, check: Callable[[], T], elsewhere: Callable[[], T]) -> T:
    """Run `check` (re-hashing an input, say) on each node's first process only — the others read the same
    disk, and run the cheap `elsewhere` once it passed — and let every process know the outcome: the failing one
    raises its own error, the rest say where to look, so no rank trains on an input another found broken."""
    if world == 1:
        return check()
    failure, value = None, None
    first_on_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
    if first_on_node:
        try:
            value = check()
        except ExpectedFailure as e:
            failure = e
    failed = torch.tensor([int(failure is not None)], device=collective_device())
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if failed.item():
        raise ExpectedFailure("the input failed its check in the process that checked it for its node (that "
                              "process's error line says why)")
    return value if first_on_node else elsewhere()


def on_rank_zero(world: int, check: Callable[[], T], what: str) -> T | None:
    """Run `check` on global rank 0 only (re-proving what every rank shares, a fleet's servers) and let every rank
    know the outcome: rank 0 raises its own error, the others say where to look; no rank goes on past a failure."""
    failure, value = None, None
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            value = check()
        except ExpectedFailure as e:
            failure = e
    raise_if_any_failed(world, failure, f"{what} failed on rank 0 (its error line says why)")
    return value


def on_every_rank(world: int, check: Callable[[], None], what: str) -> None:
    """Run `check` on every rank (each reads its own node's files) and stop them all if any fails: the failing rank
    raises its own error, the others say where to look."""
    failure = None
    try:
        check()
    except ExpectedFailure as e:
        failure = e
    raise_if_any_failed(world, failure, f"{what} failed on another rank (its error line says why)")


def raise_if_any_failed(world: int, failure: ExpectedFailure | None, elsewhere: str) -> None:
    """Every rank learns whether any failed (one collective): the one that did raises its own error, the rest
    `elsewhere`."""
    if world > 1:
        failed = torch.tensor([int(failure is not None)], device=collective_device())
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failure is None and failed.item():
            raise ExpectedFailure(elsewhere)
    if failure is not None:
        raise failure


def agree(world: int, parts: dict[str, str]) -> None:
    """What every process of a run must share (the dataset, the settings, the target, flashdraft's version: each a
    digest), compared once the group is up: a node that joined with another dataset would have its gradients
    averaged into every step, and one with another lr or loss would drift apart under DDP, silently. Every process
    refuses the run in one line naming the node (and rank) that differs from rank 0 and in what."""
    if world == 1:
        return
    device = collective_device()
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    # 60 bits of each digest, and the node: int64s, gathered from every rank (all_gather_object would pickle)
    mine = torch.tensor([int(hashlib.sha256(v.encode()).hexdigest()[:15], 16) for v in parts.values()] + [node],
                        dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(everyone, mine)
    reference = everyone[0].tolist()
    for rank, theirs in enumerate(t.tolist() for t in everyone):
        differ = [name for name, a, b in zip(parts, theirs, reference, strict=False) if a != b]
        if differ:
            raise BadTrainingInput(
                f"node {theirs[-1]} (rank {rank}) joined this run with another {' and another '.join(differ)} than "
                f"rank 0 (node {reference[-1]}): every node must train on the same dataset, settings, target and "
                "flashdraft version; give them the same --data, config and target, then start them again")


def from_rank_zero(world: int, compute: Callable[[], list[torch.Tensor]], count: int) -> list[torch.Tensor]:
    """`count` int64 vectors that rank 0 computes and every other rank receives: a pass over the data done once
    a run, not once a rank. Sent as tensors (broadcast_object_list would pickle)."""
    if world == 1:
        return compute()
    rank = torch.distributed.get_rank()
    device = collective_device()
    vectors = compute() if rank == 0 else None
    lengths = torch.tensor([len(v) for v in vectors] if vectors is not None else [0] * count, device=device)
    torch.distributed.broadcast(lengths, src=0)
    received = []
    for i, n in enumerate(lengths.tolist()):
        v = vectors[i].to(device, torch.int64) if vectors is not None else torch.empty(n, dtype=torch.int64,
                                                                                        device=device)
        torch.distributed.broadcast(v, src=0)
        received.append(v.cpu())
    return received
