"""Runtime fixes for vLLM's CPU build, applied in the vLLM processes flashdraft starts (this directory is put on
their PYTHONPATH: eval's engine, and train's feature extraction), outside vLLM's own code.

To extract hidden states (train.feature_source: engine):
- its ExampleHiddenStatesConnector copies each request's states into pinned host memory
  (`torch.empty_like(..., pin_memory=True)`), which torch refuses with no accelerator present: the copy is made in
  ordinary memory instead, which is where a CPU build's tensors already are;
- the CPU worker replaces `torch.cuda.Event` with a stand-in (vllm/v1/worker/cpu/shm.py) that lacks `query()`,
  which the connector polls to learn a copy is done: on a CPU every copy is done when it returns, so it is True.

To verify drafts at temperature > 0 (vllm-project/vllm#55005, fixed upstream by PR #55006):
- the rejection sampler spreads each request's temperature over its tokens with `expand_batch_to_tokens`, which on a
  CPU without Triton runs a C++ stand-in (`_expand_kernel_impl`, vllm/utils/cpu_triton_utils.py). The stand-in
  writes into an int64 *copy* of its output (`_ensure_int64(output)`) and never writes it back, so every float32
  output (the temperatures) stays uninitialised memory: the target's logits are divided by garbage and drafts are
  rejected, some runs and not others. The stand-in is replaced by the same expansion in torch — only where a probe
  finds the installed vLLM still leaves a float output unwritten, so a vLLM with the fix keeps its own.

To start in two processes, not three: the CPU platform turns vLLM's default single-process executor into the
multiprocess one (a worker process beside the engine core, for its OpenMP thread binding) unless
VLLM_ENABLE_V1_MULTIPROCESSING is 0. The API server starts its engine core in a process of its own either way, so 0
here only keeps the worker inside the engine core: each process imports vLLM and torch for about 13 s of one core on
2 AVX2 cores (measured from the engine's log), a third of a start. Set only when the environment has not chosen.

Nothing changes on a machine with a GPU, or in a process without vLLM (the guard that starts it).
"""

import importlib.util
import os


def expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """The rejection sampler's `expand_kernel`: request i's value (replace_from → replace_to) written over its tokens,
    cu_num_tokens[i − 1] up to cu_num_tokens[i], in the output's own type."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(ends[-1]) if ends.numel() else 0
    output[:n].copy_(values.repeat_interleave(counts).to(output.dtype))


def leaves_floats_unwritten(expand) -> bool:
    """Whether vLLM's CPU stand-in still loses a float32 output (vllm#55005): a NaN-filled output it should fill."""
    import torch

    output = torch.full((3,), float("nan"))
    expand(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    return not torch.equal(output, torch.tensor([0.5, 2.0, 2.0]))


if importlib.util.find_spec("vllm") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read by the CPU platform's config check
        _empty_like = torch.empty_like

        def _empty_like_unpinned(*args, pin_memory=False, **kwargs):
            return _empty_like(*args, **kwargs)

        torch.empty_like = _empty_like_unpinned
        try:
            from vllm.v1.worker.cpu import shm

            shm._EventPlaceholder.query = lambda self: True
        except ImportError:  # another vLLM layout: its own CPU stand-ins apply
            pass
        try:
            # registers torch.ops._C, which the stand-in calls: vLLM's own choice of the kernels built for this CPU
            # (AVX-512 with BF16, AVX-512, or AVX2) — `import vllm._C` alone loads the AVX-512-BF16 build, which dies
            # with SIGILL on a CPU without it (an AMD EPYC with AVX2 only, seen here)
            from vllm.platforms.cpu import CpuPlatform
            from vllm.utils import cpu_triton_utils

            CpuPlatform.import_kernels()

            if leaves_floats_unwritten(cpu_triton_utils._expand_kernel_impl):
                # read when the CPU platform registers its stand-ins, after this module has run
                cpu_triton_utils._expand_kernel_impl = expand_in_torch
        except (ImportError, AttributeError, RuntimeError):  # another layout or build: nothing of ours to fix
            pass
