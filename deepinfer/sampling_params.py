"""SamplingParams: how one request is sampled and when it stops.

Field names and defaults follow vLLM's ``SamplingParams`` so user code moves
between the two unchanged. Every field is checked at construction; a bad value
raises ``ValueError`` naming the field and its allowed range, so a bad request
is refused before it reaches the engine. Checks that need the model (token ids
against the vocabulary, the logprobs limit) are in ``verify_for_model``.

This module imports no torch: ``from deepinfer import SamplingParams`` stays cheap.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import math
from dataclasses import dataclass, fields
from typing import Any


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value: object, low: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")


def _check_token_id(what: str, tok: object) -> None:
    if not _is_int(tok) or tok < 0:
        raise ValueError(f"{what} {tok!r} must be a token id (an int >= 0)")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """``value`` in [low, high] (or (low, high] with ``low_open``); high may be inf."""
    lo = "(" if low_open else "["
    bounds = (f"in {lo}{low:g}, {high:g}]" if math.isfinite(high)
              else f"> {low:g}" if low_open else f">= {low:g}")
    if not _is_number(value):
        raise ValueError(f"{name}={value!r} must be a finite number {bounds}")
    if value < low or (low_open and value == low) or value > high:
        raise ValueError(f"{name}={value} must be {bounds}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


_GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM names). Set exactly one of:

    - ``json``: a JSON Schema, as a dict or a JSON string; the output is a JSON
      document that satisfies it (as far as the grammar backend can express it).
    - ``regex``: the output matches the regular expression in full.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar (xgrammar / GBNF syntax, start rule ``root``).
    - ``json_object``: any JSON object or array.
    - ``structural_tag``: an xgrammar structural tag (``{"type": "structural_tag",
      "format": {...}}``, as a dict or a JSON string): a sequence of fixed strings, free
      text, JSON Schemas, regexes and grammars. The server builds one for forced tool
      calls and for grammars that start after a reasoning block.

    ``disable_any_whitespace`` (JSON only) allows no whitespace between JSON
    tokens beyond single spaces after separators, which keeps small models from
    drifting into endless whitespace. The grammar is compiled when the request is
    added: a malformed or unsupported spec raises ValueError there.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(_GRAMMAR_KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif isinstance(self.json, dict):
            try:
                _json.dumps(self.json)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_outputs.json is not JSON-serialisable: {exc}") from None
        elif self.json is not None:
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON Schema as a dict "
                             "or a JSON string")
        if isinstance(self.structural_tag, str):
            try:
                tag = _json.loads(self.structural_tag)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}") from None
        else:
            tag = self.structural_tag
            try:
                _json.dumps(tag)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_outputs.structural_tag is not JSON-serialisable: {exc}") from None
        if tag is not None and not isinstance(tag, dict):
            raise ValueError(f"structured_outputs.structural_tag={self.structural_tag!r} must be a JSON "
                             "object (a dict or a JSON string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty str")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice:
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty "
                                 "list of str")
            self.choice = list(self.choice)
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice={self.choice!r}: every choice must be a str")
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """Which of json / regex / choice / grammar / json_object / structural_tag is set."""
        return next(k for k in _GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**d)


class RequestOutputKind(enum.Enum):
    """Which outputs the engine's steps return for a request (vLLM's names).

    CUMULATIVE: an output every step the request advances, holding all its tokens so far
    (and ``delta_text``, the text since the previous output). FINAL_ONLY: only the finished
    output; ``LLM.generate`` asks for this, sparing the per-step copies of every token list.
    DELTA (only the new tokens in each output) is not supported yet.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM names and defaults).

    ``temperature=0`` is greedy decoding. ``top_k`` of 0 or -1 disables top-k
    (stored as 0). ``stop`` and ``stop_token_ids`` are stored as lists.
    ``logprobs=N`` returns, for each generated token, the N most likely tokens
    plus the sampled one; ``prompt_logprobs=N`` does the same for prompt tokens.
    Logprobs are those of the raw model distribution, before any processing
    (the grammar mask of ``structured_outputs`` included).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind={self.output_kind!r} must be a RequestOutputKind")
        if self.output_kind is RequestOutputKind.DELTA:
            raise NotImplementedError("output_kind=DELTA is not supported yet; use CUMULATIVE (each "
                                      "output also carries delta_text) or FINAL_ONLY")
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1, or 0 / -1 to disable it")
        self.top_k = max(self.top_k, 0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        # OpenAI's ranges for the additive penalties.
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias={self.logit_bias!r} must be a dict of token id -> bias")
            for tok, bias in self.logit_bias.items():
                _check_token_id("logit_bias key", tok)
                _check_float(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int or None")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty str")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for tok in self.stop_token_ids:
            _check_token_id("stop_token_ids entry", tok)

        _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a "
                             "StructuredOutputsParams, a dict of its fields, or None")

    def verify_for_model(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Checks that need the model: token ids inside the vocabulary and the
        logprobs counts within the engine's limit. ``top_k`` above the vocabulary
        size is allowed: it keeps every token."""
        for tok in self.logit_bias or {}:
            if tok >= vocab_size:
                raise ValueError(f"logit_bias key {tok} must be < vocab_size={vocab_size}")
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise ValueError(f"stop_token_ids entry {tok} must be < vocab_size={vocab_size}")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs={self.logprobs} must be <= max_logprobs={max_logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} must be <= max_logprobs={max_logprobs}")

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
