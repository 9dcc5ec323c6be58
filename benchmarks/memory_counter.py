"""Peak tensor memory on a CPU, counted the way `torch.cuda.max_memory_allocated` counts on a GPU.

A CPU has no allocator statistics to read, and a process's peak RSS mixes in the allocator's own caching. So every
tensor an operator returns is counted while its storage lives: a dispatch mode sees each operator's outputs (the
forward's, the backward's, a checkpoint's recomputation), and a weak reference to each storage tells when it is
freed. What was alive before the counter started (weights, inputs) is not counted: the figure is what the code under
it added at its peak. Tensors saved for the backward are counted too, as long as autograd keeps them.

    with MemoryCounter() as counter:
        loss = step(); loss.backward()
    counter.peak_bytes
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class MemoryCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address → (weak reference, bytes)
        self.current_bytes = 0
        self.peak_bytes = 0

    def __enter__(self):
        # storages alive at the start are the baseline, not counted, whatever becomes of them
        return super().__enter__()

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current_bytes -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()  # what the last operators' callers dropped is free before this one allocates
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self.live and not self._inputs_hold(key, args, kwargs):
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    @staticmethod
    def _inputs_hold(key: int, args, kwargs) -> bool:
        """An output that is a view of (or written into) an input's storage allocated nothing."""
        return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == key
                   for t in tree_leaves((args, kwargs)))
