"""bfloat16 on a CPU: whether this one computes it in hardware, and what is said where a setting asks for it and the
CPU would emulate it — before any work (preflight, a notice naming the settings) and by the stage that computes in it
(the target's load, generation, train's autocast). Not a failure: slower, not wrong. Its own module, below the model
and the stages that say it (node_checks.py reaches up to `estimate`, which reaches the model).
"""

from __future__ import annotations

from flashdraft.checks import Check
from flashdraft.config import PipelineConfig

# Where the CPU has no bfloat16 in hardware (no AVX512-BF16 or AMX: an AVX2 machine), torch emulates each bfloat16
# matmul, at about 40x float32's time on 2 AVX2 cores (benchmarks/cpu_dtype_bench.py; RESULTS.md).
EMULATED_BFLOAT16 = ("this CPU has no bfloat16 in hardware (no AVX512-BF16 or AMX): torch emulates it, about 40x "
                     "float32's time a matmul on 2 AVX2 cores (benchmarks/cpu_dtype_bench.py); float32 is the faster "
                     "type here")


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 in hardware, as torch's oneDNN backend sees it."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bfloat16_notice(device: str) -> str | None:
    """What to say before computing in bfloat16 on `device`: the notice where it is a CPU that emulates it."""
    return EMULATED_BFLOAT16 if str(device).startswith("cpu") and not native_bfloat16() else None


def bfloat16_on_this_cpu(cfg: PipelineConfig, stages: list[str]) -> Check | None:
    """The settings of these stages that ask for bfloat16 where they will compute on this machine's CPU, if it
    emulates it: a notice before any work (not a failure: slower, not wrong). None where nothing is asked."""
    g, tr, ev = cfg.generate, cfg.train, cfg.eval

    def on_cpu(spec: str | None) -> bool:  # a device setting; None: CUDA where there is one
        if spec is None:
            import torch

            return not torch.cuda.is_available()
        return any(d.strip().startswith("cpu") for d in spec.replace(";", ",").split(","))

    asked = [key for key, stage, wants, device in (
        ("generate.dtype", "generate", g.backend == "hf" and g.dtype == "bfloat16", None),
        ("train.bf16", "train", tr.bf16 is True, tr.device),
        ("train.target_dtype", "train", tr.target_dtype == "bfloat16", tr.target_device or tr.device),
        ("eval.target_dtype", "eval", ev.target_dtype == "bfloat16", None),
    ) if stage in stages and wants and on_cpu(device)]
    if not asked or native_bfloat16():
        return None
    return Check(f"bfloat16 on this CPU ({', '.join(asked)})", True, EMULATED_BFLOAT16)
