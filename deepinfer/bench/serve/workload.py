"""What the serving benchmark sends, and when.

Prompts (``--dataset-name random``): token ids drawn uniformly from the
tokenizer's vocabulary less its special tokens, after a prefix of
``--random-prefix-len`` ids that every prompt shares. Lengths are uniform
integers in [floor(L (1 - r)), ceil(L (1 + r))] for L = ``--random-input-len``
(``--random-output-len``) and r = ``--random-range-ratio``, as in vLLM; r = 0
gives every request the same lengths.

A prompt goes out as token ids (``"prompt": [ids]`` on /v1/completions, which
vLLM, SGLang and our server accept: the length is exact) or as text. Decoding
ids and encoding the text again need not give the same ids back (neighbouring
tokens merge or split), so a text prompt is re-encoded and its text cut (at
the longest character prefix that encodes short enough) or extended (by more
random ids) until it has the target length, a few rounds at most (vLLM cuts and
extends the ids); the length kept is that of the final encoding, never more than
the target. Either way the server's own ``usage.prompt_tokens``, when it sends
one, replaces the client's count in the results.

Multi-turn chat (``--dataset-name multiturn``): one system prompt of ``--multiturn-system-len``
tokens shared by ``--multiturn-conversations`` conversations of ``--multiturn-turns`` questions
of ``--multiturn-question-len`` tokens each, all text of random tokens (cut to length as
above). A turn's request is the conversation so far, the answers the server gave included,
plus the next question (conversations.py sends them), so prompts share a prefix across
conversations (the system prompt) and grow within one (the history).

Arrivals: at ``--request-rate`` R requests/s the gaps between sends are gamma
distributed with mean 1/R and shape ``--burstiness`` b (b = 1: a Poisson
process; b < 1 burstier, b > 1 more even, b = inf evenly spaced); R = inf sends
everything at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable
import numpy as np

from deepinfer.engine.tokenizer import Tokenizer

# Rounds of cutting / extending a text prompt towards its length.
_TEXT_ROUNDS = 10


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]    # text, or token ids for /v1/completions
    prompt_len: int            # tokens, as the client counts them
    output_len: int            # max_tokens asked for


def length_range(length: int, range_ratio: float, low_at_least: int = 0) -> tuple[int, int]:
    """[floor(length (1 - r)), ceil(length (1 + r))], the low end raised to ``low_at_least``."""
    low = max(math.floor(length * (1 - range_ratio)), low_at_least)
    high = max(math.ceil(length * (1 + range_ratio)), low)
    return low, high


def sample_random(tokenizer: Tokenizer, *, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0, as_text: bool = False,
                  added_special_tokens: int = 0) -> list[SampleRequest]:
    """``num_prompts`` random prompts of ``prefix_len + U[input range]`` tokens asking for
    ``U[output range]`` tokens each. ``as_text``: prompts as text, aimed at that many tokens
    less ``added_special_tokens`` (what the server adds when it encodes text, e.g. BOS)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 0 or prefix_len < 0:
        raise ValueError(f"--random-input-len ({input_len}) and --random-prefix-len ({prefix_len}) "
                         "must be >= 0")
    if output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {output_len}")
    body_len = max(input_len - added_special_tokens, 0) if as_text else input_len
    in_low, in_high = length_range(body_len, range_ratio)
    if prefix_len + in_low < 1:
        raise ValueError(f"prompts could be empty: --random-prefix-len {prefix_len} + the shortest "
                         f"--random-input-len draw {in_low} must be >= 1")
    out_low, out_high = length_range(output_len, range_ratio, low_at_least=1)

    allowed = _ordinary_ids(tokenizer)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        ids = prefix + rng.choice(allowed, size=n_in).tolist()
        if as_text:
            text, n_tokens = _text_of_length(tokenizer, ids, rng, allowed)
            requests.append(SampleRequest(text, n_tokens + added_special_tokens, n_out))
        else:
            requests.append(SampleRequest(ids, len(ids), n_out))
    return requests


@dataclass(frozen=True)
class Conversations:
    system: str                   # the shared system prompt
    questions: list[list[str]]    # [conversation][turn]
    output_len: int               # tokens asked for per answer


def sample_multiturn(tokenizer: Tokenizer, *, conversations: int, turns: int, system_len: int, question_len: int,
                     output_len: int, seed: int = 0) -> Conversations:
    """The multi-turn chat workload: texts of about the given token lengths."""
    for name, value in (("--multiturn-conversations", conversations), ("--multiturn-turns", turns),
                        ("--multiturn-question-len", question_len), ("--random-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if system_len < 0:
        raise ValueError(f"--multiturn-system-len must be >= 0, got {system_len}")
    allowed = _ordinary_ids(tokenizer)
    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        return _text_of_length(tokenizer, rng.choice(allowed, size=n).tolist(), rng, allowed)[0] if n else ""

    system = text(system_len)
    return Conversations(system, [[text(question_len) for _ in range(turns)] for _ in range(conversations)],
                         output_len)


def _ordinary_ids(tokenizer: Tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids)
    allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special], dtype=np.int64)
    if allowed.size == 0:
        raise ValueError("the tokenizer has no ordinary (non-special) tokens to draw prompts from")
    return allowed


def _text_of_length(tokenizer: Tokenizer, ids: list[int], rng: np.random.Generator,
                    allowed: np.ndarray) -> tuple[str, int]:
    """Text whose encoding has len(ids) tokens (or as near as a few rounds get), and that length."""
    target = len(ids)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    text = tokenizer.decode(ids, skip_special_tokens=False)
    for _ in range(_TEXT_ROUNDS):
        n = count(text)
        if n < target:
            text += tokenizer.decode(rng.choice(allowed, size=target - n).tolist(), skip_special_tokens=False)
        elif n > target:
            text = _cut(text, target, count)
        else:
            break
    if count(text) > target:
        text = _cut(text, target, count)
    return text, count(text)


def _cut(text: str, target: int, count: Callable[[str], int]) -> str:
    """The longest prefix of ``text`` that encodes to at most ``target`` tokens, found by
    bisection (the count grows with the prefix, give or take a merge)."""
    # A token is rarely over 16 characters: start from that far below the end when it fits.
    excess = count(text) - target
    low, high = max(len(text) - 16 * excess, 0), len(text)
    if count(text[:low]) > target:
        low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if count(text[:mid]) <= target:
            low = mid
        else:
            high = mid - 1
    return text[:low]


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send time of each request in seconds after the first (which goes at 0)."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests - 1, 1.0 / request_rate)
    else:
        # Its own generator (not the prompts'), so the schedule does not depend on the prompts.
        rng = np.random.default_rng((seed, 1))
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])

