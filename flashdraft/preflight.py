"""Preflight: before a stage (or `run`) does any work, check in seconds what it will need (DESIGN §2b).

    flashdraft run examples/qwen3-8b.yaml --until generate --dry-run   # the plan and every check; exit 1 if any fails
    flashdraft run examples/qwen3-8b.yaml --until generate             # the same checks, then the work

What is checked, each one line — `ok` with what was found, or the reason naming the URL or path (never a secret):
- a **store**: credentials resolve through the AWS chain, the bucket answers, a write is permitted (a small probe
  object put under the stage's own prefix and deleted again), and the prefix holds no artifact of another kind;
  a local store: its directory can be created and written.
- an OpenAI **endpoint**: `GET /v1/models` answers and lists the model the stage will ask for.
- a **model** (target or tokenizer): the embedded one's package, a directory with `config.json` and a tokenizer,
  a GGUF file, or a hub id already in the local cache — its config, never its weights.
- **prompts**: the built-in set exists, or the file/directory is readable, with its count of lines.
- **disk**: free space where the workdir lives against `flashdraft estimate`'s sizes.
- **devices**: each CUDA device train is told to use exists.
- **bfloat16 on a CPU** that emulates it (no AVX512-BF16 or AMX): a notice naming the settings that ask for it.

Checks only read, except the store's probe object, which lives under an internal name (`.flashdraft-preflight-…`)
that no listing of an artifact shows, and is deleted at once.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashdraft.artifact.atomic import INTERNAL_PREFIX
from flashdraft.checks import Check, check_disk, guarded
from flashdraft.config import EMBEDDED_TARGET, GenerateConfig, PipelineConfig, TrainConfig
from flashdraft.cpu_bfloat16 import bfloat16_on_this_cpu
from flashdraft.errors import ExpectedFailure
from flashdraft.node_checks import check_gpu_memory, dataset_here_or_in_the_store, disk_from_the_dataset

ENDPOINT_TIMEOUT_S = 5.0


# ---------------------------------------------------------------------------------------------- store


def check_store(url: str, kind: str | None = None) -> Check:
    """Credentials, bucket, a permitted write under `url`, and no artifact of another kind there."""
    return guarded(f"store {url}", lambda: _store(url, kind))


def _store(url: str, kind: str | None) -> str:
    from flashdraft.artifact.manifest import MANIFEST
    from flashdraft.artifact.store import LocalStore, open_store

    store = open_store(url)
    if isinstance(store, LocalStore):
        root = Path(store.root)
        existing = next((p for p in [root, *root.parents] if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"cannot create or write {root} (nearest existing: {existing})")
        where = "writable directory"
    else:
        where = _s3_probe(store)
    raw = store.read_bytes(MANIFEST)
    if raw is not None and kind is not None:
        if (theirs := manifest_kind(raw, "")) != kind:
            raise ValueError(f"holds a {theirs} artifact, not a {kind} one: the stage would be refused there")
        return f"{where}; holds a {kind} artifact (checked for its lineage when the stage runs)"
    return f"{where}; no artifact there yet" if raw is None else f"{where}; holds an artifact"


def manifest_kind(raw: bytes, where: str) -> str:
    """The kind a manifest's bytes name; one that does not parse is a failed check, said with `where`."""
    from flashdraft.artifact.manifest import ManifestError, parse_manifest

    try:
        return parse_manifest(raw).kind
    except ManifestError as e:
        raise ValueError(f"{where}{' ' if where else ''}holds a manifest flashdraft cannot read ({e})") from None


def _s3_probe(store) -> str:
    """Credentials, bucket and write permission of an S3 prefix: a probe object put (never over another) and
    deleted. Each failure names what is missing, not a retry count."""
    from botocore.exceptions import BotoCoreError, ClientError

    if not store.has_credentials:
        raise ValueError("no credentials found in the AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                         "AWS_PROFILE or --profile, ~/.aws/credentials, an instance role)")
    key = store.key(f"{INTERNAL_PREFIX}preflight-{uuid.uuid4().hex}")
    try:
        # A listing first: it names a missing bucket or a bad key in its error body (a HEAD of the bucket answers a
        # bare 403 for both, and some stores create a missing bucket on a PUT). Then the probe write.
        store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.key(""), MaxKeys=1)
        store.client.put_object(Bucket=store.bucket, Key=key, Body=b"preflight", IfNoneMatch="*")
        store.client.delete_object(Bucket=store.bucket, Key=key)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        why = {"404": f"bucket {store.bucket} does not exist", "NoSuchBucket": f"bucket {store.bucket} does not exist",
               "403": "access denied (the credentials are not allowed to use this bucket)",
               "AccessDenied": "access denied: the credentials may not write here",
               "InvalidAccessKeyId": "the access key is not known to the store (check the credentials)",
               "SignatureDoesNotMatch": "the secret key does not match the access key (check the credentials)",
               }.get(code, f"{code}: {e.response.get('Error', {}).get('Message', '')}")
        raise ValueError(store.redactor.redact(why)) from None
    except BotoCoreError as e:
        where = store.endpoint or "the default S3 endpoint"
        raise ValueError(store.redactor.redact(f"cannot reach {where}: {e}")) from None
    return f"credentials found, bucket {store.bucket} answers, a write is permitted (probe put and deleted)"


# ---------------------------------------------------------------------------------------------- endpoints


def check_endpoint(base_url: str, model: str | None) -> Check:
    """`GET {base_url}/models` answers within seconds and lists `model` (None: any model will do)."""
    return guarded(f"endpoint {base_url}", lambda: _endpoint(base_url, model))


def _endpoint(base_url: str, model: str | None) -> str:
    from flashdraft.bounded import HTTPStatus, get_json

    try:
        answer = get_json(f"{base_url.rstrip('/')}/models", bearer=os.environ.get("OPENAI_API_KEY"),
                          deadline_s=ENDPOINT_TIMEOUT_S)
    except HTTPStatus as e:
        raise ValueError(f"GET /models answered HTTP {e.code}" + (" (the API key is refused)" if e.code in (401, 403)
                                                                  else "")) from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("GET /models did not answer as an OpenAI-compatible server does")
    served = [m.get("id") for m in data if isinstance(m, dict)]
    if model is not None and model not in served:
        raise ValueError(f"does not serve {model!r}; it serves {', '.join(map(repr, served[:5])) or 'nothing'}")
    return f"serves {model!r}" if model else f"serves {', '.join(map(repr, served[:3]))}"


# ---------------------------------------------------------------------------------------------- inputs


def check_model(ref: str, role: str = "target") -> Check:
    """The model is there to load — its config and tokenizer files, not its weights."""
    return guarded(f"{role} {ref}", lambda: _model(ref))


def _model(ref: str) -> str:
    if ref == EMBEDDED_TARGET:
        from flashdraft.model.resolve import embedded_gguf

        return f"embedded SmolLM2-135M-Instruct ({embedded_gguf().name})"
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"no GGUF file at {path}")
        return "GGUF file"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a model directory")
        tokenizers = [n for n in ("tokenizer.json", "tokenizer.model", "vocab.json") if (path / n).is_file()]
        return f"model directory (config.json{', ' + tokenizers[0] if tokenizers else ', no tokenizer files'})"
    from flashdraft.model.resolve import looks_like_path

    if looks_like_path(ref):
        raise ValueError("not a directory, GGUF file or hub id")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(ref, "config.json"), str):
        return "hub id, config in the local cache"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ValueError("a hub id not in the local cache, and HF_HUB_OFFLINE=1")
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(ref, timeout=ENDPOINT_TIMEOUT_S)
    except Exception as e:  # the hub's own errors (not found, gated, unreachable) are many classes
        raise ValueError(f"a hub id that is not in the local cache and not reachable ({type(e).__name__})") from None
    return "hub id, found on the hub"


def check_prompts(source: str) -> Check:
    return guarded(f"prompts {source}", lambda: _prompts(source))


def check_eval_prompts(source: str) -> Check:
    """An eval source: a standard benchmark set is read (from the hub or its local copy) and formatted, as eval
    will read it first; any other source is checked as generate's prompts are."""
    from flashdraft.evaluate.sets import load_standard
    from flashdraft.standard_sets import split_source

    name, path = split_source(source)
    if name is None:
        return check_prompts(source)

    def standard() -> str:
        loaded = load_standard(name, path)
        if not loaded.prompts:
            raise ValueError(f"none of its {len(loaded.rejected)} records formats as {name}: "
                             f"{loaded.rejected[0].reason if loaded.rejected else 'it is empty'}")
        return f"{len(loaded.prompts):,} prompts" + (f", {len(loaded.rejected)} unusable" if loaded.rejected else "")

    return guarded(f"prompts {source}", standard)


def _prompts(source: str) -> str:
    from flashdraft.generate.prompts import BUILTIN, builtin_prompts

    if source.startswith(BUILTIN):
        return f"{len(builtin_prompts(source[len(BUILTIN):]))} built-in prompts"
    path = Path(source)
    if path.is_dir():
        return "a save_to_disk directory"
    if not path.exists() or not os.access(path, os.R_OK):
        raise ValueError("no readable file there")
    from flashdraft.bounded import open_regular

    with open_regular(path) as f:  # a FIFO or a device is refused, never read
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return f"{pq.ParquetFile(f).metadata.num_rows:,} rows"
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return f"{lines:,} lines"


def check_devices(devices: Iterable[str | None], role: str) -> list[Check]:
    """Each CUDA device named (`cuda:0`, `cuda:0,cuda:1`, `cuda:0;cuda:1`) exists here."""
    named = sorted({d.strip() for spec in devices if spec for d in spec.replace(";", ",").split(",") if d.strip()})
    checks = []
    for device in named:
        def one(device=device) -> str:
            if not device.startswith("cuda"):
                return "CPU" if device == "cpu" else device
            import torch

            count = torch.cuda.device_count()
            index = int(device.partition(":")[2] or 0)
            if index >= count:
                raise ValueError(f"this machine has {count} CUDA device(s)")
            return torch.cuda.get_device_name(index)

        checks.append(guarded(f"{role} device {device}", one))
    return checks


# ---------------------------------------------------------------------------------------------- the pipeline


STAGE_KINDS = {"generate": "completions", "tokenize": "dataset", "train": "drafter", "eval": "eval"}


def generate_checks(g: GenerateConfig, upload_to: str | None = None) -> list[Check]:
    """The prompts, and the endpoints (openai backend, asked at once) or the model (hf); the upload store."""
    checks = [check_prompts(g.prompts)]
    if g.backend == "openai":
        if not g.base_urls:
            checks.append(Check("generate endpoints", False, "the openai backend needs at least one --base-url"))
        model = g.model if g.model != EMBEDDED_TARGET else None
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(g.base_urls)))) as pool:
            checks += list(pool.map(lambda url: check_endpoint(url, model), g.base_urls))
    elif g.backend == "hf":
        checks.append(check_model(g.model, "generate model"))
    if upload_to:
        checks.append(check_store(upload_to, STAGE_KINDS["generate"]))
    return checks


def train_checks(tr: TrainConfig) -> list[Check]:
    """The target, an imported drafter, the devices, the feature engine, and the store checkpoints are pushed to."""
    checks = [check_model(tr.target, "train target")]
    if tr.init_from:
        checks.append(guarded(f"--init-from {tr.init_from}", lambda: _drafter(tr.init_from)))
    checks += check_devices([tr.device, tr.target_device], "train")
    if tr.feature_source == "transformers" and (kernels := hybrid_kernels(tr.target)):
        checks.append(kernels)
    if tr.engine_urls:
        from flashdraft.train.fleet import check_fleet

        checks.append(guarded("train feature fleet", lambda: check_fleet(tr)))
    elif tr.feature_source == "engine":
        from flashdraft.train.engine_features import check_engine_features

        checks.append(guarded("train feature engine", lambda: check_engine_features(tr)))
    if tr.push_to:
        checks.append(check_store(tr.push_to))
    return checks


def hybrid_kernels(ref: str) -> Check | None:
    """A hybrid target (Gated-DeltaNet layers) whose config is here: which path transformers will run those layers
    on, said before any work (a notice, not a failure: the reference loop is slower, not wrong)."""
    from flashdraft.model.target import linear_attention_path

    config = Path(ref).expanduser() / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        return None  # the target check says what is wrong with it
    path_taken = linear_attention_path(raw.get("text_config", raw)) if isinstance(raw, dict) else None
    return Check(f"train target's linear attention ({ref})", True, path_taken) if path_taken else None


def pipeline_checks(cfg: PipelineConfig, stages: list[str], every: bool = True) -> list[Check]:
    """Everything the selected stages will need, checked now: what `run` checks before its first stage. The disk
    check comes last and, unless `every` (a dry run lists every check), only when the others passed: it may
    have to convert the embedded target once to count tokens, which is no reason to keep a failure waiting."""
    from flashdraft.layout import generate_parts, join, stage_url

    g, checks = cfg.generate, []
    if stages and stages[0] in ("train", "eval"):  # --from a later stage: its input must be here or in the store
        checks.append(check_input(cfg, stages[0]))  # (tokenize's input may be generate's shards, checked there)
    if cfg.store:
        for stage in stages:
            url = join(cfg.store, generate_parts(g.num_shards)[g.shard_index]) if stage == "generate" and \
                g.num_shards > 1 else stage_url(cfg.store, stage)
            checks.append(check_store(url, STAGE_KINDS[stage]))
    if "generate" in stages:
        checks += generate_checks(g)
    if "tokenize" in stages:
        checks.append(check_model(cfg.tokenize.tokenizer, "tokenizer"))
    if "train" in stages:
        from flashdraft.pipeline import train_settings

        checks += train_checks(train_settings(cfg))
        if (memory := check_gpu_memory(cfg)) is not None:
            checks.append(memory)
    if "eval" in stages:
        checks.append(check_model(cfg.eval.target, "eval target"))
        checks += [check_eval_prompts(source) for source in cfg.eval.sources]
        from flashdraft.evaluate.engine_commands import check_engine

        checks += [guarded(f"eval engine {engine}", lambda engine=engine: check_engine(
            engine, cfg.eval.engine_url, cfg.eval.engine_python)) for engine in cfg.eval.engines]
    if notice := bfloat16_on_this_cpu(cfg, stages):
        checks.append(notice)
    if every or all(c.ok for c in checks):
        checks.append(_disk_for(cfg, stages))
    return checks


def check_input(cfg: PipelineConfig, stage: str) -> Check:
    """The artifact `stage` starts from (the stage before's), committed locally or in the store, where the run
    will fetch it from: its manifest and kind, read now (its bytes are verified when the stage starts — re-hashing
    a dataset of many GB is the stage's work, not the preflight's)."""
    from flashdraft.artifact.manifest import MANIFEST
    from flashdraft.layout import STAGES, stage_dir, stage_url

    before = STAGES[STAGES.index(stage) - 1]
    kind, local = STAGE_KINDS[before], stage_dir(cfg.workdir, before)

    def of_kind(raw: bytes, where: str) -> None:
        if (theirs := manifest_kind(raw, where)) != kind:
            raise ValueError(f"{where} holds a {theirs} artifact, not the {kind} {stage} reads")

    def found() -> str:
        if (local / MANIFEST).is_file():
            of_kind((local / MANIFEST).read_bytes(), str(local))
            return f"{kind} at {local}"
        if cfg.store:
            from flashdraft.artifact.store import StoreError, open_store

            url = stage_url(cfg.store, before)
            try:
                raw = open_store(url).read_bytes(MANIFEST)
            except StoreError as e:  # said with where it looked: the store's own message names only the file
                raise ValueError(f"not at {local}, and {url} cannot be read: {e}") from None
            if raw is not None:
                of_kind(raw, url)
                return f"{kind} in the store at {url} (fetched and verified when {stage} starts)"
        where = f"{local}" + (f" nor in {stage_url(cfg.store, before)}" if cfg.store else "")
        raise ValueError(f"no {kind} at {where}: run --from {before}, or push it there")

    return guarded(f"input of {stage}", found)


def check_dataset(data: Path, store: str | None) -> Check:
    """train's dataset, before any work (on a node of several: before the rendezvous, not after the nodes meet):
    committed at `data`, or in the config's store, from where `train` pulls it."""
    from flashdraft.artifact.manifest import MANIFEST
    from flashdraft.layout import stage_url

    def found() -> str:
        if (data / MANIFEST).is_file():
            if (kind := manifest_kind((data / MANIFEST).read_bytes(), str(data))) != "dataset":
                raise ValueError(f"{data} holds a {kind} artifact, not the dataset train reads")
            return f"dataset at {data}"
        if store:
            from flashdraft.artifact.store import StoreError, open_store

            url = stage_url(store, "tokenize")
            try:
                raw = open_store(url).read_bytes(MANIFEST)
            except StoreError as e:
                raise ValueError(f"not at {data}, and {url} cannot be read: {e}") from None
            if raw is not None:
                if (kind := manifest_kind(raw, url)) != "dataset":
                    raise ValueError(f"{url} holds a {kind} artifact, not the dataset train reads")
                return f"dataset in the store at {url} (pulled and verified before training)"
        raise ValueError(f"no dataset at {data}" + (f" nor in {stage_url(store, 'tokenize')}" if store else "")
                         + ": run `flashdraft tokenize`, or name the store it was pushed to (store: in the config) "
                         "and train pulls it")

    return guarded("train dataset", found)


def _drafter(path: str) -> str:
    from flashdraft.layout import hub_download_hint

    if hub := hub_download_hint(path):
        raise ValueError(hub)
    if not (Path(path) / "config.json").is_file():
        raise ValueError("no drafter there (config.json)")
    return "drafter directory"


def _disk_for(cfg: PipelineConfig, stages: list[str]) -> Check:
    """Free disk against the estimate's sizes of what the selected stages write; an estimate that cannot be
    made here (the target's config elsewhere) is said, not failed. A run from train on (the training node, which
    has no prompt file) is sized from what that node will hold: the dataset (its manifest, here or in the store:
    pulled when not here), the checkpoints, the export, an offline feature cache of its tokens, and the target
    where it is not in the model cache yet."""
    from flashdraft.estimate import EstimateError, estimate

    if stages and stages[0] in ("train", "eval") and (found := dataset_here_or_in_the_store(cfg)):
        return disk_from_the_dataset(cfg, stages, *found)
    try:
        est = estimate(cfg)
    except ExpectedFailure as e:  # `estimate`'s own flags (--num-prompts …) are not this command's: its reason only
        reason = e.reason if isinstance(e, EstimateError) else str(e)
        return Check(f"disk at {cfg.workdir}", True, f"not estimated here ({reason}; `flashdraft estimate` with "
                     "--num-prompts / --target-config sizes it)", skipped=True)
    train = est["checkpoints_bytes"] + est["drafter_bytes"] + (
        est["offline_features_bytes"] if cfg.train.features == "offline" else 0)
    sizes = {"generate": est["completions_bytes"], "tokenize": est["dataset_bytes"], "train": train}
    return check_disk(cfg.workdir, sum(sizes.get(stage, 0) for stage in stages))
