"""Incremental detokenization equals whole decoding and never emits half a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.gateway.generation import IncrementalDetokenizer

TEXTS = [
    "Hello, world! 😀🎉 naïve café — 日本語のテキスト, Ελληνικά, emoji 👩‍👩‍👧 end.",
    "  leading spaces and\nnew\n\nlines\ttabs",
    "🙂" * 5 + "x" + "中文" * 4,
    "plain ascii text that is split into many pieces",
]


def _stream(tokenizer, ids, chunks, prompt=None):
    d = IncrementalDetokenizer(tokenizer.decoder(True), prompt)
    out, i = [], 0
    for n in chunks:
        piece = d.add(ids[i:i + n])
        assert "\ufffd" not in piece
        out.append(piece)
        i += n
    out.append(d.flush())
    return "".join(out)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert _stream(tokenizer, ids, [1] * len(ids)) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunking_with_a_prompt_before(tokenizer, text):
    prompt = tokenizer.encode("The answer is:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(len(text))
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(1, 4)))
        left -= chunks[-1]
    assert _stream(tokenizer, ids, chunks, prompt) == text


def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level vocabulary splits this emoji
    d = IncrementalDetokenizer(tokenizer.decoder(True))
    assert [d.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1:]) == "😀"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi", add_special_tokens=False)
    skip = IncrementalDetokenizer(tokenizer.decoder(True))
    keep = IncrementalDetokenizer(tokenizer.decoder(False))
    assert "".join(skip.add([t]) for t in ids) + skip.flush() == "hi"
    assert "".join(keep.add([t]) for t in ids) + keep.flush() == "<|im_start|>hi"


@settings(max_examples=40, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40))
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    d = IncrementalDetokenizer(tokenizer.decoder(True))
    assert "".join(d.add([t]) for t in ids) + d.flush() == whole
