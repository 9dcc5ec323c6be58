"""The drafter's losses over the LM head, a chunk of scored rows at a time: nothing of shape rows × vocabulary is
kept, in the forward or for the backward.

A scored row is one block position. Its logits over the vocabulary are needed only to be reduced to a few numbers
a row: the cross-entropy with its label, the soft cross-entropy with the target's top-k (distillation), the L1
distance to the target's next-token distribution (DSpark), the greedy token, and DFlash2's unary top-K′. So
`head_terms` computes the logits of `chunk_rows` rows, reduces them, and drops them; with autograd on, each chunk
is a checkpoint, and its logits are computed again, a chunk at a time, in the backward. Peak memory is a few
copies of one chunk's logits, whatever the rows (Qwen3.6: 248,320 tokens a row, 8,192 rows a sequence).

The same arithmetic as the dense loss, in the same order for each row: the tests hold losses and gradients to the
dense computation for every objective (tests/train/test_loss.py). This is the torch path, on every device; a fused
kernel (liger-kernel's linear cross-entropy) computes only the first of these terms, so it is not used.

    loss = head_terms(hidden_SD, head_VD, labels_S=labels)          # RowTerms: ce, predicted, …

Shape legend: S scored rows, D hidden size, V scored vocabulary (the draft vocabulary or the target's), k the
teacher's top-k, C the selector's candidates (DFlash2's top-K′).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# One chunk's float32 logits at most this size: the loss holds about four of them at its peak (logits, their
# float32 copy or softmax, and in the backward their gradient), so ~¼ GiB whatever the vocabulary. Small enough
# that a sequence of a few hundred scored rows is already chunked (its peak is then the same at 512 scored rows as
# at 8,192); large enough that a chunk is still a large matrix product on a GPU (Qwen3.6-27B: 67 × 5,120 × 248,320).
CHUNK_BYTES = 64 * 2**20


def chunk_rows_for(vocab: int, budget: int | None = None) -> int:
    """Rows a chunk may hold so that its float32 logits fit `budget` bytes (`CHUNK_BYTES`; at least one row)."""
    return max(1, (budget or CHUNK_BYTES) // (4 * vocab))


@dataclass
class RowTerms:
    """Per scored row (S): what the objectives read of the logits. Loss terms carry gradients; the rest do not."""

    ce: torch.Tensor  # cross-entropy with the label (a label < 0 scores token 0: its weight must be 0)
    predicted: torch.Tensor  # the greedy token (scored-vocabulary index)
    soft_ce: torch.Tensor | None = None  # −Σ p_teacher · log q over the teacher's top-k
    l1: torch.Tensor | None = None  # Σ_v |softmax − q_target| + the target's mass outside the scored vocabulary
    candidates: torch.Tensor | None = None  # S × C: the top-C tokens (DFlash2's selector)
    candidate_logits: torch.Tensor | None = None  # S × C, float32, with gradient


def head_terms(hidden_SD: torch.Tensor, head_VD: torch.Tensor, *, labels_S: torch.Tensor,
               transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
               bias: Callable[[int, int], torch.Tensor] | None = None,
               teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
               target_probs: Callable[[int, int], torch.Tensor] | None = None,
               top_c: int = 0, chunk_rows: int | None = None, bf16: bool = False) -> RowTerms:
    """The per-row terms of `hidden_SD @ head_VD.T`, never holding more than `chunk_rows` rows of logits.

    `transform`: applied to the head's logits (DFlash2's multiplier and softcap). `bias(start, stop)`: added after it
    (DSpark's Markov bias of those rows, V wide). `teacher`: (ids S × k in the scored vocabulary, −1 for a token
    outside it; log-probs S × k), for `soft_ce`. `target_probs(start, stop)`: the target's next-token probabilities
    over the scored vocabulary for those rows, for `l1`. `top_c`: also the top-C candidates and their logits.
    `bf16` (`train.bf16`): the head's logits (and `transform`) in bfloat16 under autocast, as the drafter's own
    matmuls; everything after them — the bias, softmaxes, the terms — in float32, as the dense loss computed them."""
    rows = hidden_SD.shape[0]
    chunk = chunk_rows or chunk_rows_for(head_VD.shape[0])
    teacher_probs = None
    if teacher is not None:  # renormalised over the tokens the drafter can score; none inside: no mass
        ids_Sk, logprobs_Sk = teacher
        teacher_probs = torch.softmax(logprobs_Sk.float().masked_fill(ids_Sk < 0, float("-inf")), -1).nan_to_num(0.0)

    def terms(start: int, stop: int) -> tuple[torch.Tensor, ...]:
        with torch.autocast(hidden_SD.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = torch.nn.functional.linear(hidden_SD[start:stop], head_VD)
            if transform is not None:
                logits = transform(logits)
        if bias is not None:
            logits = logits + bias(start, stop).to(logits.dtype)
        full = logits.float()
        out = [torch.nn.functional.cross_entropy(full, labels_S[start:stop].clamp(min=0), reduction="none"),
               logits.detach().max(-1).indices]  # argmax's token (the first of a tie too), twice as fast on a CPU
        if teacher_probs is not None:
            gathered = torch.log_softmax(full, dim=-1).gather(1, teacher[0][start:stop].clamp(min=0))
            out.append(-(teacher_probs[start:stop] * gathered).sum(-1))
        if target_probs is not None:
            out.append(l1_distance(torch.softmax(full, dim=-1), target_probs(start, stop)))
        if top_c:
            candidates = logits.detach().topk(top_c, dim=-1).indices
            out += [candidates, logits.gather(-1, candidates).float()]
        return tuple(out)

    pieces = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        if torch.is_grad_enabled():  # its logits are recomputed in the backward, not kept
            pieces.append(checkpoint(terms, start, stop, use_reentrant=False))
        else:
            pieces.append(terms(start, stop))
    if not pieces:  # no rows: empty terms of the right kinds
        pieces.append(terms(0, 0))
    columns = [torch.cat(parts) for parts in zip(*pieces, strict=True)]
    result = RowTerms(ce=columns.pop(0), predicted=columns.pop(0))
    if teacher_probs is not None:
        result.soft_ce = columns.pop(0)
    if target_probs is not None:
        result.l1 = columns.pop(0)
    if top_c:
        result.candidates, result.candidate_logits = columns.pop(0), columns.pop(0)
    return result


def l1_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_v |p_v − q_v| over the scored vocabulary, plus the target's mass outside it (where p is 0)."""
    return (p - q).abs().sum(-1) + (1 - q.sum(-1)).clamp(min=0)


def target_probs_from_hidden(hidden_SD: torch.Tensor, head_VD: torch.Tensor,
                             scored_ids: torch.Tensor | None) -> Callable[[int, int], torch.Tensor]:
    """`target_probs` for `head_terms` from the target's last hidden states at the rows (online): the softmax of its
    whole LM head, then the scored vocabulary's columns (its mass outside them left out). Computed per chunk, with
    the head on the drafter's device."""

    def probs(start: int, stop: int) -> torch.Tensor:
        with torch.no_grad():
            full = torch.softmax(torch.nn.functional.linear(hidden_SD[start:stop].to(head_VD.dtype), head_VD).float(),
                                 dim=-1)
        return full if scored_ids is None else full[:, scored_ids]

    return probs


def target_probs_from_topk(ids_Sk: torch.Tensor, inside_Sk: torch.Tensor, logprobs_Sk: torch.Tensor,
                           vocab: int) -> Callable[[int, int], torch.Tensor]:
    """`target_probs` from the offline cache's top-k (ids in the scored vocabulary, which are inside it, log-probs):
    the top-k renormalised, the mass outside it taken as 0, scattered into a chunk's rows."""
    probs_Sk = torch.softmax(logprobs_Sk.float(), dim=-1) * inside_Sk

    def probs(start: int, stop: int) -> torch.Tensor:
        q = torch.zeros(stop - start, vocab, device=probs_Sk.device)
        return q.scatter_add_(1, ids_Sk[start:stop].clamp(min=0), probs_Sk[start:stop])

    return probs
