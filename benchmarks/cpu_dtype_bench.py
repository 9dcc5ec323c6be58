"""What the demo's dtype costs on this CPU: one thread's matmul of the embedded target's MLP shape (64 rows × 576 by
576 × 1,536) in float32 and in bfloat16, and whether torch's oneDNN has bfloat16 in hardware here
(flashdraft/cpu_bfloat16.py native_bfloat16: the demo computes in float32 where it has not).

    .venv/bin/python benchmarks/cpu_dtype_bench.py
"""

import json
import time

import torch

from flashdraft.cpu_bfloat16 import native_bfloat16


def ms_per_matmul(dtype: torch.dtype, repeats: int = 100) -> float:
    a, w = torch.randn(64, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    a @ w  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        a @ w
    return (time.perf_counter() - start) * 1000 / repeats


if __name__ == "__main__":
    torch.set_num_threads(1)
    fp32, bf16 = ms_per_matmul(torch.float32), ms_per_matmul(torch.bfloat16)
    print(json.dumps({"cpu": torch.backends.cpu.get_cpu_capability(), "native_bfloat16": native_bfloat16(),
                      "float32_ms": round(fp32, 2), "bfloat16_ms": round(bf16, 2), "ratio": round(bf16 / fp32, 1)}))
