"""What the fleet's proof must tell apart (train.engine_tolerance), and what it costs: on the embedded SmolLM2-135M,
each layer's relative L2 distance, over the fixed probe, of (a) the same model run in bfloat16 — what a bf16 server
differs by when it serves the target itself — and (b) the model with every decoder matrix perturbed by a fraction of
its own spread — another model under the target's name; and the streamed reference's time and peak memory.

    .venv/bin/python benchmarks/fleet_proof_bench.py [--perturb 0.01,0.05,0.2]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from transformers import AutoModelForCausalLM

from flashdraft.model.resolve import resolve_model
from flashdraft.model.target import Target
from flashdraft.train.engine_features import PROBE
from flashdraft.train.fleet import layer_differences


def states(model, ids) -> torch.Tensor:
    """T × L × H: every decoder layer's output before the final norm (the last one by a hook)."""
    captured = {}
    last = model.model.layers[-1]
    hook = last.register_forward_hook(lambda m, a, out: captured.__setitem__("last", out[0] if isinstance(out, tuple)
                                                                              else out))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    hook.remove()
    return torch.cat([torch.stack(hidden[1:-1], 2)[0], captured["last"][0][:, None].float()], dim=1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perturb", default="0.01,0.05,0.2", help="fractions of each matrix's spread")
    args = parser.parse_args()
    path = resolve_model("embedded", log=lambda s: None)
    ids = torch.tensor([PROBE])
    reference = states(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids)
    bf16 = layer_differences(states(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), ids),
                             reference)
    print(f"bfloat16, the target itself: worst layer {max(bf16):.1%} (layer {bf16.index(max(bf16))}), median "
          f"{sorted(bf16)[len(bf16) // 2]:.1%}")
    for fraction in map(float, args.perturb.split(",")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.model.layers.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn_like(p) * p.std() * fraction)
        other = layer_differences(states(model, ids), reference)
        print(f"every decoder matrix perturbed by {fraction:.0%} of its spread: worst layer {max(other):.1%}, "
              f"first layer {other[0]:.1%}")
    target = Target(path, "cpu", print, layers=False)
    target.watch(list(range(target.config.num_hidden_layers)))
    started = time.perf_counter()
    streamed = target.streamed_states(PROBE)
    seconds = time.perf_counter() - started
    print(f"streamed reference: {seconds:.2f} s, agrees with the whole model to "
          f"{max(layer_differences(streamed, reference)):.1e}; this process's peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
