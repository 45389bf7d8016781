"""Incremental detokenizer: streaming equals full decode (ours and transformers'),
characters split across byte-level tokens, stop strings across token boundaries,
and the stream holdback."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Return a new list containing all items from the iterable in ascending order.",
    "naïve café — déjà vu; 数学 and 日本語のテキスト",
    "emoji: 🤖🚀 and a family 👨‍👩‍👧 with ZWJ, flags 🇫🇷!",
    "  indented\n\tcode = {'a': 1}\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def stream(tok, prompt_ids, ids, **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` one at a time; returns the detokenizer and the streamed deltas."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = []
    for t in ids:
        d.add_tokens([t])
        deltas.append(d.stream_delta(finished=False))
    deltas.append(d.stream_delta(finished=True))
    return d, deltas


def test_multibyte_characters_span_tokens(tok):
    # The premise of the tests below: some characters are split over several tokens.
    ids = tok.encode("🤖")
    assert len(ids) > 1
    assert "\ufffd" in tok.decode(ids[:1])


@pytest.mark.parametrize("text", TEXTS)
def test_one_by_one_equals_full_decode(tok, hf, text):
    prompt = tok.encode("Question: what is this?\nAnswer:")
    ids = tok.encode(text)
    d, deltas = stream(tok, prompt, ids)
    assert d.text == tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == text
    assert d.token_ids == ids
    # no replacement character for a character that later completes
    assert not any("\ufffd" in x for x in deltas)


def test_random_tokens_and_special_tokens(tok, hf):
    rng = random.Random(0)
    im_end = tok.encode("<|im_end|>")[0]
    for trial in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        if trial % 3 == 0:
            ids.insert(len(ids) // 2, im_end)
        for skip in (True, False):
            d, deltas = stream(tok, [], ids, skip_special_tokens=skip)
            full = hf.decode(ids, skip_special_tokens=skip)
            # text equals full decode even when the sequence ends inside a character
            assert d.text == full == "".join(deltas)
    d, _ = stream(tok, [], tok.encode("a<|im_end|>b"), skip_special_tokens=False)
    assert d.text == "a<|im_end|>b"


def test_several_tokens_per_call(tok):
    text = TEXTS[2]
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("x"))
    out = []
    for i in range(0, len(ids), 3):
        d.add_tokens(ids[i:i + 3])
        out.append(d.stream_delta(finished=False))
    out.append(d.stream_delta(finished=True))
    assert "".join(out) == d.text == text


def spanning_stop(tok, text: str) -> tuple[list[int], str, int]:
    """Token ids of ``text`` and a stop string that starts inside one token and ends
    inside a later one; also the index of the token that completes it."""
    ids = tok.encode(text)
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]        # text end after token i
    for i in range(1, len(ids) - 2):
        start, stop_end = ends[i] - 1, ends[i + 1] - 1       # last char of token i .. inside token i+1
        if (ends[i] - ends[i - 1] >= 2 and ends[i + 1] - ends[i] >= 3
                and text.index(text[start:stop_end]) == start):
            return ids, text[start:stop_end], i + 1
    raise AssertionError("no multi-character tokens to build a spanning stop string")


def test_stop_string_across_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog. The end."
    ids, stop, completing = spanning_stop(tok, text)
    for include in (False, True):
        d = IncrementalDetokenizer(tok, tok.encode("Q:"), stop=["never", stop], include_stop_str_in_output=include)
        hits = [d.add_tokens([t]) for t in ids]
        assert hits[completing] == stop
        assert all(h is None for j, h in enumerate(hits) if j != completing)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert d.text == text[:cut]
        assert d.stop_reason == stop
        assert d.token_ids == ids                     # later tokens still recorded
        assert d.stream_delta(finished=False) == text[:cut]


def test_stop_earliest_match_wins_and_not_in_prompt(tok):
    text = "alpha beta gamma delta"
    d = IncrementalDetokenizer(tok, tok.encode("gamma beta"), stop=["delta", "beta", "gamma"])
    assert d.add_tokens(tok.encode(text)) == "beta"
    assert d.text == "alpha "
    # the stop string in the prompt does not count
    d = IncrementalDetokenizer(tok, tok.encode("say STOP"), stop=["STOP"])
    assert d.add_tokens(tok.encode(" nothing here")) is None
    assert d.text == " nothing here"


def test_min_tokens_defers_stop_strings(tok):
    ids = tok.encode("one two one two")
    first_two = len(tok.encode("one two"))
    d = IncrementalDetokenizer(tok, [], stop=["two"], min_tokens=first_two)
    hits = [d.add_tokens([t]) for t in ids]
    assert hits.count("two") == 1 and hits.index("two") == len(ids) - 1
    assert d.text == "one two one "


def test_stream_holdback(tok):
    text = "abcdefghij klmnopqrstuvwxyz 0123456789"
    ids = tok.encode(text)
    stop = ["WXYZ!", "XY"]                                  # longest 5: hold back 4 chars
    d = IncrementalDetokenizer(tok, [], stop=stop)
    streamed = ""
    for t in ids:
        assert d.add_tokens([t]) is None
        streamed += d.stream_delta(finished=False)
        assert streamed == d.text[:max(0, len(d.text) - 4)]
    assert streamed + d.stream_delta(finished=True) == text
    assert d.stream_delta(finished=True) == ""


def test_stream_never_shows_a_spanning_stop(tok):
    text = "The quick brown fox jumps over the lazy dog. The end."
    ids, stop, _ = spanning_stop(tok, text)
    d = IncrementalDetokenizer(tok, [], stop=[stop, "a much longer stop string"])
    streamed = ""
    for t in ids:
        hit = d.add_tokens([t])
        streamed += d.stream_delta(finished=hit is not None)
        assert stop not in streamed
        if hit:
            break
    assert streamed == text[:text.index(stop)]


def test_bad_stop_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])
