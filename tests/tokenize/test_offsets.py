from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from flashdraft.tokenize.offsets import ByteLengths, encode

# Multi-byte characters that byte-level BPE splits across tokens (emoji with a skin tone, a math letter),
# CJK, a decomposed accent, and template markers between them.
TRICKY = "Héllo 👋🏽 wörld 你好世界 e\u0301 𝔘𝔫𝔦 <|im_start|>x🙂<|im_end|>\n ok\n\n  indented\tand tabs"


@pytest.fixture
def backend(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_file(str(Path(smollm2_dir) / "tokenizer.json"))


def assert_same_positions(real, located, text: str) -> None:
    assert list(located.ids) == real.ids
    assert [located.char_to_token(c) for c in range(len(text) + 1)] == [
        real.char_to_token(c) for c in range(len(text) + 1)
    ]
    assert [located.token_to_chars(t) for t in range(len(real.ids))] == [
        real.token_to_chars(t) for t in range(len(real.ids))
    ]


def test_positions_from_byte_lengths_equal_the_tokenizers_offsets(backend):
    lengths = ByteLengths.for_tokenizer(backend)
    assert lengths is not None and not lengths.nfc
    for text in (TRICKY, "plain ascii only", "👋", "a" * 3 + "🙂" * 5):
        real = backend.encode(text, add_special_tokens=False)
        assert len(real.ids) < len(text.encode())  # tokens of several bytes, so positions are not byte indices
        located = lengths.locate(text, backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        assert_same_positions(real, located, text)


def test_nfc_normalizer_falls_back_to_offsets_for_text_it_would_change(backend):
    backend.normalizer = normalizers.NFC()
    lengths = ByteLengths.for_tokenizer(backend)
    assert lengths is not None and lengths.nfc
    decomposed, composed = "Cafe\u0301 ok", "Caf\u00e9 ok"
    real = backend.encode(decomposed, add_special_tokens=False)
    assert lengths.locate(decomposed, real.ids) is None
    [fallback, fast] = encode(backend, lengths, [decomposed, composed])
    assert fallback.offsets == real.offsets and fallback.char_to_token(4) == real.char_to_token(4)
    assert_same_positions(backend.encode(composed, add_special_tokens=False), fast, composed)


def test_added_token_that_swallows_spaces_falls_back_to_offsets(backend):
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    lengths = ByteLengths.for_tokenizer(backend)
    text = "fill   <mask> here"
    ids = backend.encode(text, add_special_tokens=False).ids
    assert lengths.locate(text, ids) is None  # the token covers "   <mask>", more than its own bytes
    [enc] = encode(backend, lengths, [text])
    assert enc.char_to_token(len("fill ")) == backend.encode(text, add_special_tokens=False).char_to_token(5)


def test_tokenizers_that_are_not_byte_level_use_offsets():
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert ByteLengths.for_tokenizer(word_level) is None
    metaspace = Tokenizer(models.BPE({"▁a": 0, "a": 1, "▁": 2}, []))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert ByteLengths.for_tokenizer(metaspace) is None


def test_lowercasing_normalizer_is_not_trusted(backend):
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    assert ByteLengths.for_tokenizer(backend) is None
