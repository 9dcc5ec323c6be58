"""The training data: the dataset checked against the target, the held-out pick, the mask token, the draft vocabulary.

Every check here runs before any compute, so a dataset that cannot train this target fails in seconds. None of
them reads every token: what they need about the ids comes from the counts tokenize wrote beside the shards
(`flashdraft.tokenize.token_counts`), so a start-up costs the same on 10K samples as on 900K. The held-out pick
reads one 8-byte key a sample (`prompt_opening`), 7 MB for 900K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput
from flashdraft.tokenize.token_counts import TOKEN_COUNTS, TokenCounts, count_dataset
from flashdraft.train.distributed import from_rank_zero


def load_dataset_checked(data: Path, block_size: int, vocab_size: int, max_length: int):
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(str(data))
    except FileNotFoundError as e:
        raise BadTrainingInput(f"{data} is not a tokenize output (datasets.save_to_disk layout): {e}") from None
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise BadTrainingInput(f"{data} has no {', '.join(sorted(missing))} column: run `flashdraft tokenize` first")
    import pyarrow.compute as pc

    ids = dataset.data.column("input_ids")  # checked on the Arrow columns: no Python loop over samples
    longest = pc.max(pc.list_value_length(ids)).as_py() or 0
    if longest < block_size + 1:
        raise BadTrainingInput(f"block size {block_size} is larger than every sample (longest: {longest} tokens)")
    return dataset.with_format("numpy", columns=["input_ids", "loss_mask"])


def check_token_ids(counts: TokenCounts, vocab_size: int) -> None:
    if counts.largest_id >= vocab_size:
        raise BadTrainingInput(
            f"token id {counts.largest_id} is outside the target's vocabulary ({vocab_size}): the dataset was "
            "tokenized with another tokenizer than this target's"
        )


def token_counts(data: Path, dataset, world: int) -> TokenCounts:
    """The dataset's token counts: the file tokenize wrote (each rank reads it), or for a dataset without one a
    single vectorised pass on rank 0 that the other ranks receive."""
    if (data / TOKEN_COUNTS).is_file():
        return TokenCounts.load(data / TOKEN_COUNTS)

    def count() -> list[torch.Tensor]:
        counted = count_dataset(dataset)
        return [torch.from_numpy(counted.tokens), torch.from_numpy(counted.supervised)]

    tokens, supervised = from_rank_zero(world, count, 2)
    return TokenCounts(tokens.numpy(), supervised.numpy())


def check_tokenizer(dataset_vocab: str | None, target_path: str) -> None:
    """The dataset's tokenizer (its vocabulary fingerprint, recorded by tokenize) must be the target's: ids
    from another vocabulary train a drafter on tokens the target never meant."""
    if dataset_vocab is None or not (Path(target_path) / "tokenizer.json").is_file():
        return  # a dataset from elsewhere, or a target without a tokenizer beside its weights: nothing to compare
    from transformers import PreTrainedTokenizerFast

    from flashdraft.model.resolve import vocab_fingerprint

    if vocab_fingerprint(PreTrainedTokenizerFast.from_pretrained(target_path)) != dataset_vocab:
        raise BadTrainingInput(
            f"the dataset was tokenized with another tokenizer than the target's ({target_path}): their "
            "vocabularies differ. Re-run `flashdraft tokenize --tokenizer` with the target's tokenizer"
        )


SELECTOR_BYTES_LIMIT = 8 << 30  # DFlash2's codebooks (float32, with AdamW's two moments) past this are a typo


def require_a_block(dataset, indices: list[int], block_size: int, max_length: int, from_anchor: bool) -> None:
    """Some training sample has a block to train on: a supervised anchor with its block inside the sequence (DSpark:
    the next token supervised too, and K labels after it), as `plan_batch` draws them. Without one, every step
    would train on nothing and the run would still end "done". The scan stops at the first sample that has one
    (almost always the first)."""
    import torch

    for index in indices:
        mask = torch.as_tensor(dataset[index]["loss_mask"][:max_length]).bool()
        eligible = mask[:-1] & mask[1:] if from_anchor else mask
        if bool(eligible[: max(0, len(eligible) - block_size + 1)].any()):
            return
    anchor = "a supervised anchor followed by a supervised token" if from_anchor else "a supervised anchor"
    room = f"its {block_size} labels" if from_anchor else f"its block of {block_size}"
    raise BadTrainingInput(f"no training sample has a block to train on ({anchor}, with {room} inside the sample's "
                           f"first {max_length:,} tokens): use longer samples or a smaller train.block_size")


def check_against_target(cfg: TrainConfig, target_config) -> None:
    """The settings whose range is the target's: layer ids inside it, a mask token, vocabulary sizes and the
    distillation top-k inside its vocabulary, a DFlash2 selector that fits in memory. Refused in one line before
    any weight is built."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers, vocab = t.num_hidden_layers, t.vocab_size
    if cfg.target_layer_ids and (outside := [i for i in cfg.target_layer_ids if i >= layers]):
        raise BadTrainingInput(f"train.target_layer_ids {outside} are not layers of the target, which has {layers} "
                               f"(0 … {layers - 1})")
    if cfg.mask_token_id is not None and cfg.mask_token_id >= vocab:
        raise BadTrainingInput(f"train.mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                               f"(0 … {vocab - 1})")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > vocab:
        raise BadTrainingInput(f"train.draft_vocab_size {cfg.draft_vocab_size:,} is larger than the target's "
                               f"vocabulary ({vocab:,}): drop it for the full vocabulary")
    if cfg.distill_topk > vocab:
        raise BadTrainingInput(f"train.distill_topk {cfg.distill_topk:,} is larger than the target's vocabulary "
                               f"({vocab:,}): the top-k is at most every token (typical: 8 … 64)")
    context = getattr(t, "max_position_embeddings", None)
    reach = cfg.block_size + (cfg.architecture == "dspark")  # DSpark's last slot predicts one position further
    if isinstance(context, int) and reach > min(context, cfg.max_length):
        raise BadTrainingInput(f"train.block_size {cfg.block_size} needs {reach} positions (an anchor and its "
                               f"{'labels' if cfg.architecture == 'dspark' else 'block'}), more than the "
                               f"{min(context, cfg.max_length):,} the target's context and train.max_length hold")
    if cfg.architecture == "dspark" and cfg.markov_rank:
        markov = 2 * vocab * cfg.markov_rank * 4 * 3  # markov_w1 and (at most) markov_w2, with AdamW's moments
        if markov > SELECTOR_BYTES_LIMIT:
            raise BadTrainingInput(f"train.markov_rank {cfg.markov_rank} makes DSpark's Markov head "
                                   f"{markov / 2**30:.0f} GiB with its optimizer state for a {vocab:,}-token "
                                   f"vocabulary (limit {SELECTOR_BYTES_LIMIT / 2**30:.0f} GiB): use a rank of at most "
                                   f"{SELECTOR_BYTES_LIMIT // (2 * vocab * 4 * 3)}")
    if cfg.architecture == "dflash2":
        codebooks = 2 * vocab * cfg.selector_rank * 4 * 3  # weights and AdamW's two moments, float32
        if codebooks > SELECTOR_BYTES_LIMIT:
            raise BadTrainingInput(f"train.selector_rank {cfg.selector_rank} makes DFlash2's codebooks "
                                   f"{codebooks / 2**30:.0f} GiB with their optimizer state for a {vocab:,}-token "
                                   f"vocabulary (limit {SELECTOR_BYTES_LIMIT / 2**30:.0f} GiB): use a rank of at most "
                                   f"{SELECTOR_BYTES_LIMIT // (2 * vocab * 4 * 3)}")


def pick_mask_token(cfg: TrainConfig, target_config, target_path: str, counts: TokenCounts) -> int:
    """An id the target never sees in use: a padded embedding row if there is one, else the highest id
    that the training data never contains."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    tokenizer_len = target_config.vocab_size  # no tokenizer beside the weights: decide from the data
    if any((Path(target_path) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        tokenizer_len = len(AutoTokenizer.from_pretrained(target_path))
    if tokenizer_len < target_config.vocab_size:
        return tokenizer_len
    unused = counts.unused_ids(target_config.vocab_size)
    if len(unused) == 0:
        raise BadTrainingInput("every token id occurs in the data: set train.mask_token_id explicitly")
    return int(unused[-1])


def split_heldout(n: int, eval_samples: int, seed: int, free: np.ndarray | None = None
                  ) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices. The held-out ones are a seeded random pick, not the tail: datasets
    often come sorted (by prompt category, by source), and a tail would measure one kind of text only.

    With `free` (which samples are kin-free, `kin_free`) those come first. A held-out sample whose kin is trained
    on (the same question with other numbers, another turn of its conversation) is easier than a prompt written
    apart, as eval's are: on the demo the log's serving walk read 0.11 above eval over a random pick and 0.04
    over kin-free samples (measured, issue 31). Samples with kin fill up only when too few have none."""
    n_eval = min(eval_samples, max(0, n // 10))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    if free is not None:
        perm = perm[np.argsort(~free[perm], kind="stable")]  # kin-free first, each in seeded order
    return sorted(perm[n_eval:].tolist()), sorted(perm[:n_eval].tolist())


def run_split(dataset, cfg: TrainConfig) -> tuple[list[int], list[int], np.ndarray | None]:
    """The (training, held-out) split a run with `cfg` makes of `dataset`, and which samples are kin-free (None
    for a dataset without `prompt_opening`): for train, and for tools that re-score its held-out samples."""
    free = kin_free_samples(dataset)
    return (*split_heldout(len(dataset), cfg.eval_samples, cfg.seed, free), free)


def kin_free(openings: np.ndarray) -> np.ndarray:
    """Which samples' opening key no other sample has."""
    _, inverse, counts = np.unique(openings, return_inverse=True, return_counts=True)
    return counts[inverse] == 1


def kin_free_samples(dataset) -> np.ndarray | None:
    """`kin_free` of the dataset's `prompt_opening` column (8 bytes a row, not its tokens), or None for a dataset
    made before it existed or by another tool: then the held-out pick is plain random."""
    if "prompt_opening" not in dataset.column_names:
        return None
    return kin_free(dataset.data.column("prompt_opening").to_numpy())


def choose_draft_vocab(counts: TokenCounts, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most often supervised in the training data (ties: lower id first)."""
    return torch.from_numpy(counts.most_supervised(size, vocab_size))
