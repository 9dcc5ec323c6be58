"""Two runtime fixes that vLLM's CPU build needs to extract hidden states (train.feature_source: engine), applied in
the vLLM processes flashdraft starts (this directory is put on their PYTHONPATH), outside vLLM's own code:

- its ExampleHiddenStatesConnector copies each request's states into pinned host memory
  (`torch.empty_like(..., pin_memory=True)`), which torch refuses with no accelerator present: the copy is made in
  ordinary memory instead, which is where a CPU build's tensors already are;
- the CPU worker replaces `torch.cuda.Event` with a stand-in (vllm/v1/worker/cpu/shm.py) that lacks `query()`,
  which the connector polls to learn a copy is done: on a CPU every copy is done when it returns, so it is True.

Nothing changes on a machine with a GPU, or in a process without vLLM (the guard that starts it).
"""

import importlib.util

if importlib.util.find_spec("vllm") is not None:
    import torch

    if not torch.cuda.is_available():
        _empty_like = torch.empty_like

        def _empty_like_unpinned(*args, pin_memory=False, **kwargs):
            return _empty_like(*args, **kwargs)

        torch.empty_like = _empty_like_unpinned
        try:
            from vllm.v1.worker.cpu import shm

            shm._EventPlaceholder.query = lambda self: True
        except ImportError:  # another vLLM layout: its own CPU stand-ins apply
            pass
