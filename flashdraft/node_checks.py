"""What a training node checks of itself before any work, from what it will hold rather than from the whole
pipeline's plan: its disk, sized from the dataset's manifest (here or in the store: the node has no prompt file), and
its GPUs' memory against `estimate`'s peak for each, with the micro_batch that fits (preflight.py calls both).
"""

from __future__ import annotations

from pathlib import Path

from flashdraft.checks import Check, check_disk, guarded
from flashdraft.config import PipelineConfig
from flashdraft.errors import ExpectedFailure


def dataset_here_or_in_the_store(cfg: PipelineConfig):
    """(the dataset's manifest, whether it is on this disk already), from the workdir or the config's store; None
    where neither holds one (the input check says so)."""
    from flashdraft.artifact.manifest import MANIFEST, ManifestError, parse_manifest
    from flashdraft.artifact.store import StoreError, open_store
    from flashdraft.layout import stage_dir, stage_url

    local = stage_dir(cfg.workdir, "tokenize") / MANIFEST
    try:
        if local.is_file():
            return parse_manifest(local.read_bytes()), True
        if cfg.store and (raw := open_store(stage_url(cfg.store, "tokenize")).read_bytes(MANIFEST)) is not None:
            return parse_manifest(raw), False
    except (OSError, StoreError, ManifestError):
        pass
    return None


def disk_from_the_dataset(cfg: PipelineConfig, stages: list[str], dataset, here: bool) -> Check:
    from flashdraft.estimate import EstimateError, estimate
    from flashdraft.train.feature_cache import feature_bytes

    samples = int(dataset.stats.get("samples") or 1)
    try:
        est = estimate(cfg, num_prompts=samples)
    except ExpectedFailure as e:
        reason = e.reason if isinstance(e, EstimateError) else str(e)
        return Check(f"disk at {cfg.workdir}", True, f"not estimated here ({reason})", skipped=True)
    parts = {"the dataset (pulled)": 0 if here else sum(f.size for f in dataset.files)}
    if "train" in stages:
        parts["checkpoints"] = est["checkpoints_bytes"]
        parts["the export"] = est["drafter_bytes"]
        if cfg.train.features == "offline":
            parts["the offline feature cache"] = feature_bytes(int(dataset.stats.get("tokens") or 0),
                                                               len(est["target_layer_ids"]),
                                                               est["target"]["hidden"], cfg.train.distill_topk)
    target = cfg.train.target if "train" in stages else cfg.eval.target
    if not target_is_here(target):
        parts[f"the target {target} in the model cache"] = 2 * est["gpu_memory"]["target_params"]
    need = sum(parts.values())
    check = check_disk(cfg.workdir, need)
    from flashdraft.progress import human_bytes

    shown = ", ".join(f"{name} {human_bytes(size)}" for name, size in parts.items() if size)
    return Check(check.what, check.ok, f"{check.detail} ({shown or 'nothing new'}: what this node will hold)")


def target_is_here(ref: str) -> bool:
    """The model is on this machine already: a directory, a GGUF file, the embedded one, or a hub id in the cache."""
    from flashdraft.model.resolve import EMBEDDED_TARGET, looks_like_path

    if ref == EMBEDDED_TARGET or looks_like_path(ref):
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(ref, "config.json"), str)
    except (OSError, ValueError):  # not a hub id, or a cache that cannot be read: not here
        return False


GPU_HEADROOM = 0.9  # of a GPU's memory a plan may take: the allocator's fragmentation and CUDA's own need the rest


def cuda_devices(spec: str | None) -> list[str]:
    return sorted({d.strip() for d in (spec or "").replace(";", ",").split(",") if d.strip().startswith("cuda")})


def gpu_memory_fit(cfg: PipelineConfig, memory_of, target_config: Path | None = None) -> str:
    """Each GPU the run trains on against `estimate`'s peak for it (a drafter GPU, a target GPU): one that would not
    hold it at the first step is refused now, with the largest train.micro_batch that fits. `memory_of(device)`: its
    total bytes."""
    from flashdraft.estimate import estimate

    def over(plan: dict) -> list[str]:
        g, tr = plan["gpu_memory"], cfg.train
        roles = (("drafter", tr.device, g["drafter_device_bytes"]), ("target", tr.target_device,
                                                                     g["target_device_bytes"]))
        return [f"{device} ({role}) has {memory_of(device) / 1e9:.1f} GB, the plan needs {need / 1e9:.1f} GB at "
                f"micro_batch {g['micro_batch']}" for role, spec, need in roles for device in cuda_devices(spec)
                if need > GPU_HEADROOM * memory_of(device)]

    too_small = over(estimate(cfg, num_prompts=1, target_config=target_config))
    if not too_small:
        return f"every GPU holds the plan's peak (within {GPU_HEADROOM:.0%} of its memory)"
    for micro in range(min(cfg.train.micro_batch, cfg.train.batch_size) - 1, 0, -1):
        smaller = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": micro})})
        if not over(estimate(smaller, num_prompts=1, target_config=target_config)):
            raise ValueError(f"{too_small[0]}: set train.micro_batch: {micro} (the same loss and gradients, more "
                             "passes a step)")
    raise ValueError(f"{too_small[0]}, and no micro_batch fits: a GPU with more memory, train.feature_source: "
                     "engine (the target's layers in vLLM), or fsdp for the drafter")


def check_gpu_memory(cfg: PipelineConfig) -> Check | None:
    """On a machine with the run's GPUs: their memory against the plan (written, not yet run on a GPU)."""
    import torch

    if not torch.cuda.is_available() or not (cuda_devices(cfg.train.device) or cuda_devices(cfg.train.target_device)):
        return None

    def memory_of(device: str) -> int:
        return torch.cuda.get_device_properties(int(device.partition(":")[2] or 0)).total_memory

    return guarded("train GPU memory", lambda: gpu_memory_fit(cfg, memory_of))
