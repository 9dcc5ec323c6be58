"""GPU eval check: decoding against the bandwidth bound, eval's own per-dataset report, and the CLI's training
step beside the isolated one.

    bash benchmarks/gpu_eval.sh            # one H200, ≤ 6 minutes, nothing downloaded
    bash benchmarks/gpu_eval.sh --tiny     # the same code on CPU with tiny shapes (what the tests run)

On the lent H200 (its image lacks a few packages; benchmarks/gpu_prepare.sh fetches them and the tokenizer into
.bench/, which `carry` takes along):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl &&
    PYTHONPATH=/tmp/site:$PWD PYTHON=python3 bash benchmarks/gpu_eval.sh --tokenizer .bench/tokenizer --json

Targets are random-weight Qwen3 models built in memory (benchmarks/gpu_check.py's shapes: Qwen3-0.6B and
Qwen3-8B, bf16); the drafter is untrained (5 layers, block 16), so τ ≈ 1 and a step's cost is what is measured.

1. Decoding, for each shape and each machinery eval has — the growing cache (eager, `generate` for target-only)
   and the static cache (with CUDA graphs on a GPU): target-only milliseconds a token beside the bound (the
   weights' bytes ÷ a copy bandwidth measured here: a copy moves its bytes twice), host launches a token (CUDA
   runtime launch calls; on a CPU, aten ops), and a speculative step's cost in target tokens at τ 1.
2. `flashdraft.evaluate.run` itself on the first shape saved to disk (SmolLM2's tokenizer and vocabulary, for a
   chat template), over the local GSM8K and MT-Bench copies in tests/assets/benchmarks: its τ table, and how far
   apart (units in the last place) greedy speculative and target-only outputs are where they first differ — what
   `eval.near_tie_ulps` must allow with this device's bfloat16 kernels.
3. `flashdraft train` through the CLI for a few steps (online features) against gpu_check's isolated step at the
   same shape, sequence length and anchors, with the target's forward added to it (both in block positions a
   second); then the same training under torch.profiler: the operators where the CLI's time goes, how busy the
   device was, and how many synchronising CUDA calls each optimizer step makes (torch's sync debug mode; the
   step is written to make one, its read of what it reports: tests/train/test_step_reads.py checks that on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_check  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets" / "benchmarks"
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync"}


def seconds_each(fn, device: str, repeats: int) -> float:
    """Seconds one call of `fn` takes on `device`, after one untimed call (allocation, first-use setup)."""
    fn()
    gpu_check.sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    gpu_check.sync(device)
    return (time.perf_counter() - started) / repeats


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes a second a device-to-device copy moves (read and write both counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_each(lambda: dst.copy_(src), device, 5)


def launches(fn, device: str) -> int:
    """Host launches while `fn` runs: CUDA runtime launch calls (a replayed graph is one), or aten ops on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        gpu_check.sync(device)
    if device == "cuda":
        return sum(1 for e in prof.events() if e.name in LAUNCHES)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def decode_check(name: str, shape: dict, args, device: str, dtype, bandwidth: float) -> list[dict]:
    from flashdraft.evaluate.decode import SpecDecoder, target_only
    from flashdraft.evaluate.static import StaticSpecDecoder, cuda_graphs, static_unsupported
    from flashdraft.model.drafter import DFlashDrafter, draft_config

    torch.manual_seed(0)
    target = gpu_check.build_target(shape, device, dtype)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=0))
    drafter = drafter.to(device=device, dtype=dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    bound_ms = weight_bytes / bandwidth * 1e3
    prompt = torch.randint(1, shape["vocab_size"], (args.prompt_len,)).tolist()
    n = args.new_tokens

    def growing_target_only(tokens: int):
        out, seconds, _ = target_only(target, prompt, tokens)
        return out, seconds

    static = StaticSpecDecoder(target, drafter, set(), compiler=cuda_graphs if device == "cuda" else None)

    def static_target_only(tokens: int):
        return static.target_only(prompt, tokens)

    machineries = [("growing cache, eager", SpecDecoder(target, drafter, set()), growing_target_only)]
    if (why := static_unsupported(target)) is None:
        machineries.append(("static cache" + (", CUDA graphs" if device == "cuda" else ""), static, static_target_only))
    else:
        print(f"{name}: no static-cache row: {why}", flush=True)
    rows = []
    for label, decoder, baseline in machineries:
        started = time.perf_counter()
        decoder.generate(prompt, 3 * drafter.block_size)  # warm-up: captures the graphs where there are some
        baseline(9)
        warm_s = time.perf_counter() - started
        tokens, seconds = baseline(n)
        token_ms = seconds / len(tokens) * 1e3
        spec = decoder.generate(prompt, n)
        step_ms = spec.seconds / max(1, len(spec.accepted)) * 1e3
        per_token = (launches(lambda b=baseline: b(17), device) - launches(lambda b=baseline: b(1), device)) / 16
        rows.append({"shape": name, "machinery": label, "token_ms": token_ms, "bound_ms": bound_ms,
                     "x_bound": token_ms / bound_ms, "launches_per_token": per_token, "step_ms": step_ms,
                     "step_in_tokens": step_ms / token_ms, "tau": spec.acceptance_length, "warm_up_s": warm_s,
                     "weight_gb": weight_bytes / 1e9})
    return rows


def save_target(shape: dict, path: Path, dtype, tokenizer_dir: str | None) -> None:
    """A random-weight Qwen3 of `shape` with SmolLM2's tokenizer and vocabulary (for a chat template): the
    embedded target's, or a copy of it in `tokenizer_dir` (benchmarks/gpu_prepare.sh makes one to carry)."""
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from flashdraft.model.resolve import resolve_model

        tokenizer_dir = resolve_model("embedded", log=lambda s: None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    target = gpu_check.build_target({**shape, "vocab_size": len(tokenizer)}, "cpu", dtype,
                                    eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    target.model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def eval_report(target_dir: Path, work: Path, args) -> dict:
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.export import save_drafter
    from flashdraft.model.target import Target

    target = Target(str(target_dir), "cpu", lambda s: None)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=0)),
                 work / "drafter")
    del target
    cfg = EvalConfig(prompts=[f"gsm8k={ASSETS / 'gsm8k.jsonl'}", f"mt-bench={ASSETS / 'mt-bench.jsonl'}"],
                     target=str(target_dir), max_new_tokens=args.eval_tokens, max_prompts=3)
    lines: list[str] = []
    stats = run(cfg, work / "drafter", work / "eval", log=lines.append)
    # How far apart bfloat16 verify and one-token passes round on this device's kernels, where greedy outputs
    # first differ: what eval.near_tie_ulps (2, measured on a CPU) must allow here.
    turns = json.loads((work / "eval" / "report.json").read_text())["prompts"]
    behind = [max(t["divergence"]["ulps_behind_top"]) for t in turns if t["divergence"]
              and "ulps_behind_top" in t["divergence"]]
    return {"stats": stats, "table": (work / "eval" / "report.md").read_text(), "turns": len(turns),
            "diverged": len(behind), "farthest_ulps": max(behind, default=None)}


def write_dataset(path: Path, vocab: int, sequences: int, length: int) -> None:
    from datasets import Dataset

    from flashdraft.artifact.manifest import build_manifest, write_manifest

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(sequences)]
    Dataset.from_dict({"id": [str(i) for i in range(sequences)], "input_ids": ids,
                       "loss_mask": [[0] * 16 + [1] * (length - 16)] * sequences,
                       "num_tokens": [length] * sequences}).save_to_disk(str(path))
    write_manifest(path, build_manifest(path, kind="dataset"))


def train_check(name: str, shape: dict, target_dir: Path, work: Path, args, device: str, dtype) -> dict:
    """The CLI's step (online features, batch of `batch` sequences) against the isolated step for one sequence
    plus the target's forward over it, both as block tokens a second."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_dir).vocab_size
    write_dataset(work / "data", vocab, args.batch * (args.train_steps + 2), args.seq_len)
    settings = {"target": str(target_dir), "max_steps": args.train_steps, "batch_size": args.batch,
                "micro_batch": args.batch, "max_anchors": args.anchors, "max_length": args.seq_len,
                "checkpoint_every": 10_000, "eval_samples": 1}
    config = work / "train.yaml"
    config.write_text(json.dumps({"train": settings}))
    proc = subprocess.run([sys.executable, "-m", "flashdraft", "train", "--config", str(config), "--data",
                           str(work / "data"), "--out", str(work / "train")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"flashdraft train failed:\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    # block positions a second: the isolated step's unit (the sequences' own tokens are a quarter of them here)
    steps = [m["block_tokens_per_s"] for m in metrics if "block_tokens_per_s" in m][1:]  # the first step compiles
    cli = statistics.median(steps)

    torch.manual_seed(0)
    target = gpu_check.build_target({**shape, "vocab_size": vocab}, device, dtype)
    isolated = gpu_check.train_step_check(name, target, "flex" if device == "cuda" else "sdpa", args, device,
                                          "decay", "adamw")
    ids = torch.randint(1, vocab, (1, args.seq_len), device=device)
    target.watch([1])
    forward_s = seconds_each(lambda t=target: t.features(ids), device, 3)
    block_tokens = isolated["tokens_per_s"] * isolated["step_ms"] / 1e3
    with_target = block_tokens / (isolated["step_ms"] / 1e3 + forward_s)
    del target
    return {"shape": name, "cli_tokens_per_s": cli, "isolated_tokens_per_s": isolated["tokens_per_s"],
            "isolated_with_target_tokens_per_s": with_target, "ratio": cli / with_target,
            "target_forward_ms": forward_s * 1e3, "profile": train_profile(settings, work, device)}


def train_profile(settings: dict, work: Path, device: str) -> dict:
    """The same training in this process under torch.profiler: the operators that take its time."""
    from torch.profiler import ProfilerActivity, profile

    from flashdraft.config import TrainConfig
    from flashdraft.train import run

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    cfg = TrainConfig(**{**settings, "max_steps": 3})
    started = time.perf_counter()
    with profile(activities=activities) as prof, syncs_per_step(device) as syncs:
        run(cfg, work / "data", work / "profiled", log=lambda s: None)
        gpu_check.sync(device)
    wall = time.perf_counter() - started
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    busy = sum(getattr(e, key) for e in averages) / 1e6 if device == "cuda" else None
    top = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:12]
    # The loop's own phases (record_function ranges in flashdraft.train): host time, and on a GPU the time of the
    # kernels each launched. `mask`, `forward` and `loss` also run inside `heldout`'s passes.
    device_key = "device_time_total" if device == "cuda" else None
    phases = [{"phase": e.key.removeprefix("flashdraft."), "calls": e.count, "host_ms": e.cpu_time_total / 1e3,
               "device_ms": getattr(e, device_key) / 1e3 if device_key else None}
              for e in averages if e.key.startswith("flashdraft.")]
    return {"wall_s": wall, "device_busy": busy / wall if busy is not None else None, "syncs_per_step": syncs,
            "phases": sorted(phases, key=lambda p: -p["host_ms"]),
            "top": [{"op": e.key, "ms": getattr(e, key) / 1e3, "calls": e.count} for e in top]}


@contextmanager
def syncs_per_step(device: str):
    """The synchronising CUDA calls of each optimizer step the training loop runs meanwhile, as torch's sync
    debug mode reports them (a list filled as steps run; empty on a CPU, where nothing synchronises)."""
    import flashdraft.train.loop as training

    counts: list[int] = []
    original = training.optimizer_step

    def watched(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in caught))

    if device == "cuda":
        training.optimizer_step = watched  # the loop looks it up at each step
    try:
        yield counts
    finally:
        training.optimizer_step = original


def memory_check(shape: dict, args, device: str, dtype) -> list[dict]:
    """One training step's peak on the drafter's side (offline features: the target's pass apart) with Qwen3.6's
    vocabulary (248,320 tokens; 4,096 with --tiny), at a quarter of `--anchors` and at all of them, beside what
    `estimate`'s formula says for it, and the step's time: `torch.cuda.max_memory_allocated` on a GPU, every tensor
    counted while it lives on a CPU (benchmarks/memory_counter.py)."""
    from memory_bench import samples
    from memory_counter import MemoryCounter

    from flashdraft.config import TrainConfig
    from flashdraft.estimate import TargetShape, drafter_step_bytes
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.train.plan import plan_batch
    from flashdraft.train.step import batch_step

    vocab = 4096 if args.tiny else 248_320
    torch.manual_seed(0)
    target = gpu_check.build_target({**shape, "vocab_size": vocab}, device, dtype)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=5, block_size=16, mask_token_id=0)).to(device)
    target.watch(drafter.target_layer_ids)
    rows = samples(vocab, args.seq_len, args.batch)
    features = [target.features(ids[None].to(device))[0] for ids, _ in rows]
    shape_of = TargetShape.from_config(target.config, "gpu_eval")
    results = []
    for anchors in (max(1, args.anchors // 4), args.anchors):
        cfg = TrainConfig(block_size=16, max_anchors=anchors, micro_batch=args.batch, batch_size=args.batch,
                          max_length=args.seq_len, num_layers=5)
        plan = plan_batch(target, rows, cfg, [torch.Generator().manual_seed(i) for i in range(len(rows))], 16,
                          features)
        target.heads_beside(drafter, device)

        def step(cfg=cfg, plan=plan):
            out = batch_step(drafter, target, [], cfg, [], device, planned=plan)
            sum(r["weighted_ce"] for r in out if r).backward()
            drafter.zero_grad(set_to_none=True)

        step()  # compiles FlexAttention's kernels for this shape
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            with MemoryCounter() as counter:
                step()
            peak = counter.peak_bytes
        formula = drafter_step_bytes(shape_of, cfg, args.batch, len(drafter.target_layer_ids), cuda=device == "cuda",
                                     context=plan.context_len, rows=anchors * 16)["total"]
        results.append({"scored_rows": args.batch * anchors * 16, "peak_bytes": peak, "formula_bytes": formula,
                        "step_ms": seconds_each(step, device, 2) * 1e3})
    return results


def main() -> None:
    from flashdraft.config import EvalConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: the same code, in seconds")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="timed isolated steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--tokenizer", help="SmolLM2's tokenizer directory (default: the embedded target's)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    args = ap.parse_args()
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # several targets and shapes run through the same compiled passes
    if args.tiny:
        args.prompt_len, args.new_tokens, args.eval_tokens = 16, 24, 8
        args.seq_len, args.anchors, args.batch, args.train_steps, args.steps, args.warmup = 96, 8, 2, 3, 2, 1
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shapes = gpu_check.TINY if args.tiny else gpu_check.SHAPES
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"

    bandwidth = copy_bandwidth(device, (16 << 20) if args.tiny else (2 << 30))
    decode = [row for name, shape in shapes.items() for row in decode_check(name, shape, args, device, dtype,
                                                                           bandwidth)]
    first = next(iter(shapes))
    with tempfile.TemporaryDirectory(prefix="gpu-eval-") as tmp:
        work = Path(tmp)
        save_target(shapes[first], work / "target", dtype, args.tokenizer)
        report = eval_report(work / "target", work, args)
        train = train_check(first, shapes[first], work / "target", work, args, device, dtype)
    memory = memory_check(shapes[first], args, device, dtype)

    print(f"\n{gpu}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new, untrained drafter (5 layers, block 16)")
    print("| target shape | machinery | target-only ms/token | bound ms | × bound | launches/token | "
          "step ms (τ 1) | step in target tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in decode:
        print(f"| {r['shape']} | {r['machinery']} | {r['token_ms']:.2f} | {r['bound_ms']:.3f} | "
              f"{r['x_bound']:.1f} | {r['launches_per_token']:.0f} | {r['step_ms']:.2f} | {r['step_in_tokens']:.2f} |")
    print(f"\neval's own report ({first}-shaped target, SmolLM2's vocabulary, random weights):\n")
    print(report["table"])
    farthest = f", the farthest {report['farthest_ulps']:g} units in the last place" if report["diverged"] else ""
    print(f"near ties: {report['diverged']} of {report['turns']} turns first differ from target-only{farthest} "
          f"(eval.near_tie_ulps allows {EvalConfig().near_tie_ulps})\n")
    print(f"train ({first}, {args.seq_len}-token sequences, {args.anchors} anchors, batch {args.batch}): the CLI "
          f"{train['cli_tokens_per_s']:,.0f} block tokens/s; isolated {train['isolated_tokens_per_s']:,.0f}, with "
          f"the target's forward ({train['target_forward_ms']:.1f} ms a sequence) "
          f"{train['isolated_with_target_tokens_per_s']:,.0f}: CLI / isolated = {train['ratio']:.2f}")
    profile = train["profile"]
    busy = f", device busy {profile['device_busy']:.0%} of it" if profile["device_busy"] is not None else ""
    if profile["syncs_per_step"]:
        print(f"synchronising CUDA calls in each optimizer step (one is its read): {profile['syncs_per_step']}")
    print("the training loop's phases over those 3 steps (mask, forward and loss include held-out passes):")
    print("| phase | calls | host ms | device ms |")
    print("| --- | --- | --- | --- |")
    for p in profile["phases"]:
        device_ms = f"{p['device_ms']:.1f}" if p["device_ms"] is not None else "–"
        print(f"| {p['phase']} | {p['calls']} | {p['host_ms']:.1f} | {device_ms} |")
    print(f"where a 3-step CLI training run's time goes ({profile['wall_s']:.1f} s wall{busy}):")
    print("| operator | self ms | calls |")
    print("| --- | --- | --- |")
    for op in profile["top"]:
        print(f"| {op['op']} | {op['ms']:.1f} | {op['calls']} |")
    print(f"\nthe drafter's step with {'4,096' if args.tiny else '248,320'} vocabulary tokens ({first}, micro_batch "
          f"{args.batch}, offline features): peak over the weights beside estimate's formula")
    print("| scored rows a micro-batch | peak | estimate's formula | formula / peak | step ms |")
    print("| --- | --- | --- | --- | --- |")
    for m in memory:
        print(f"| {m['scored_rows']:,} | {m['peak_bytes'] / 1e9:.2f} GB | {m['formula_bytes'] / 1e9:.2f} GB | "
              f"{m['formula_bytes'] / m['peak_bytes']:.2f} | {m['step_ms']:.1f} |")
    if args.json:
        print(json.dumps({"decode": decode, "eval": report["stats"], "train": train, "memory": memory}))


if __name__ == "__main__":
    main()
