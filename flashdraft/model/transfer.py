"""Host tensors onto a GPU without waiting for it.

PyTorch's plain (blocking) copy of a host tensor to a GPU synchronises the stream: the host waits for every
kernel queued before it, then queues nothing while the GPU drains. In a training step that interleaves copies
with compute, each copy is such a wait. A copy from pinned memory with `non_blocking=True` is queued like a
kernel instead, and the pinned block is kept until the copy is done (PyTorch's caching host allocator records
the copy's event on it), so the source may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, queued, not waited for: pinned first when it goes from the host to a GPU; device to
    device moves are queued too. A move back to the host is the one kind that must wait (a non-blocking one
    returns before the bytes have arrived), so it stays a plain blocking copy: a read, which a training step
    should not contain (tests/train/test_step_reads.py)."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cpu":
        return tensor.to(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
