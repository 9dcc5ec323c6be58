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
    """`tensor` on `device`, queued, not waited for: pinned first when it goes from the host to a GPU. Device
    to device moves are queued too; never use this to read a tensor back to the host (non-blocking reads are
    not complete when they return)."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
