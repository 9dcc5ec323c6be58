"""Where each token sits in the text, without asking the tokenizer for offsets.

The tokenize stage needs the token at a handful of characters per sample (turn boundaries, the end of the
prompt). `encode_batch` computes character offsets for every token; `encode_batch_fast`, which does not, is
6–13 % faster on the tokenize benchmark's texts (back-to-back runs). For byte-level BPE tokenizers (GPT-2,
Llama 3, Qwen, SmolLM) the offsets follow from the ids alone: every token stands for a fixed byte string, and
a sample's tokens concatenate to its UTF-8 bytes. So tokenize encodes with `encode_batch_fast` and places
boundaries with a cumulative sum of token byte lengths.

Each sample is checked: its token bytes must add up to its text's bytes, and, under an NFC normalizer, the
text must already be NFC (else the normalizer changed what the tokens cover). A sample that fails either
check, or any tokenizer that is not byte-level BPE, goes through the offsets path instead; the two give the
same token positions (tested).
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import numpy as np


class ByteLevelEncoding:
    """The members of `tokenizers.Encoding` that tokenize uses (`ids`, `char_to_token`, `token_to_chars`),
    answered from token byte lengths, with `Encoding`'s conventions: a token that holds part of a multi-byte
    character covers that whole character."""

    def __init__(self, text: str, raw: bytes, ids: np.ndarray, ends: np.ndarray) -> None:
        self.text, self.raw, self.ids, self.ends = text, raw, ids, ends
        self.ascii = len(raw) == len(text)

    def _byte(self, char: int) -> int:
        return char if self.ascii else len(self.text[:char].encode("utf-8"))

    def _char(self, byte: int) -> int:
        """The character that byte `byte` belongs to (a partial character at the cut is dropped by decode)."""
        return byte if self.ascii else len(self.raw[:byte].decode("utf-8", errors="ignore"))

    def char_to_token(self, char: int) -> int | None:
        if not 0 <= char < len(self.text):
            return None
        return int(np.searchsorted(self.ends, self._byte(char), side="right"))

    def token_to_chars(self, token: int) -> tuple[int, int]:
        start = int(self.ends[token - 1]) if token else 0
        return self._char(start), self._char(int(self.ends[token]) - 1) + 1


class ByteLengths:
    """Byte length of every token id of a byte-level BPE tokenizer."""

    def __init__(self, lengths: np.ndarray, nfc: bool) -> None:
        self.lengths, self.nfc = lengths, nfc

    @classmethod
    def for_tokenizer(cls, backend: Any) -> ByteLengths | None:
        """None when positions cannot be derived from ids alone (not byte-level BPE, or a normalizer that
        rewrites text in ways a per-sample check cannot rule out)."""
        from tokenizers.pre_tokenizers import ByteLevel

        spec = json.loads(backend.to_str())
        if spec["model"].get("type") != "BPE" or "ByteLevel" not in _types(spec.get("pre_tokenizer")):
            return None
        normalizers = _types(spec.get("normalizer")) - {"Sequence"}
        if not normalizers <= {"NFC"}:
            return None
        added = backend.get_added_tokens_decoder()
        alphabet = set(ByteLevel.alphabet())
        vocab = backend.get_vocab(with_added_tokens=True)
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        for piece, token in vocab.items():
            if token in added:  # matched on the raw text: its bytes are its content's
                lengths[token] = len(added[token].content.encode("utf-8"))
            elif set(piece) <= alphabet:  # one alphabet character per byte
                lengths[token] = len(piece)
            else:
                return None
        return cls(lengths, nfc=bool(normalizers))

    def locate(self, text: str, ids: list[int]) -> ByteLevelEncoding | None:
        """Positions for `ids` (the encoding of `text`), or None if this sample needs real offsets."""
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        raw = text.encode("utf-8")
        ids_array = np.asarray(ids, dtype=np.int32)
        ends = np.cumsum(self.lengths[ids_array])
        if (ends[-1] if len(ends) else 0) != len(raw):  # e.g. an added token that swallowed spaces
            return None
        return ByteLevelEncoding(text, raw, ids_array, ends)


def _types(component: dict | None) -> set[str]:
    """Every `type` in a tokenizer.json component, through Sequences."""
    if not component:
        return set()
    found = {component.get("type", "")}
    for key in ("normalizers", "pretokenizers"):  # what a Sequence holds, in tokenizer.json
        for inner in component.get(key) or []:
            found |= _types(inner)
    return found


def encode(backend: Any, lengths: ByteLengths | None, texts: list[str]) -> list[Any]:
    """Encodings of `texts` (no special tokens added) that answer `char_to_token` / `token_to_chars`."""
    if lengths is None:
        return backend.encode_batch(texts, add_special_tokens=False)
    out = []
    for text, fast in zip(texts, backend.encode_batch_fast(texts, add_special_tokens=False), strict=True):
        located = lengths.locate(text, fast.ids)
        out.append(located if located is not None else backend.encode(text, add_special_tokens=False))
    return out


# ---------------------------------------------------------------------------------------------- masks


def mask_from_spans(encoding: Any, ids: np.ndarray, spans: list[tuple[int, int]], stop_ids: set[int]) -> np.ndarray:
    """Supervised tokens: those starting inside a span, up to and including the span's first stop token."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in spans:
        first = _token_at_or_after(encoding, start, end)
        last = _token_at_or_before(encoding, end - 1, start)
        if first is None or last is None or last < first:
            continue
        turn = ids[first : last + 1]
        stops = [int(np.argmax(hit)) for hit in (turn == stop for stop in stop_ids) if hit.any()]
        if stops:
            last = first + min(stops)
        mask[first : last + 1] = 1
    return mask


def _token_at_or_after(encoding: Any, char: int, limit: int) -> int | None:
    while char < limit:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char += 1  # a character no token covers (stripped by a normalizer): look at the next one
    return None


def _token_at_or_before(encoding: Any, char: int, limit: int) -> int | None:
    while char >= limit:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char -= 1
    return None


PROMPT_CHECK_TOKENS = 8


def prompt_tail(encoding: Any, prompt_text: str) -> tuple[int, int, str]:
    """(first token checked, prompt length in tokens, the prompt text from that token's start)."""
    end = len(prompt_text)
    n_prompt = _token_at_or_after(encoding, end, end + 64) if end else 0
    n_prompt = len(encoding.ids) if n_prompt is None else n_prompt
    first = max(0, n_prompt - PROMPT_CHECK_TOKENS)
    start = encoding.token_to_chars(first)[0] if n_prompt else 0
    return first, n_prompt, prompt_text[start:]


def longest_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())
