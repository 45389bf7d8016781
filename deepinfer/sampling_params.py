"""SamplingParams: how one request is sampled and when it stops.

Field names and defaults follow vLLM's ``SamplingParams`` so user code moves
between the two unchanged. Every field is checked at construction; a bad value
raises ``ValueError`` naming the field and its allowed range, so a bad request
is refused before it reaches the engine. Checks that need the model (token ids
against the vocabulary, the logprobs limit) are in ``verify_for_model``.

Every vLLM field is either honoured or refused: a vLLM field this engine does not
have (``logits_processors``, ``logprob_token_ids``, beam search, ...) raises
``ValueError`` naming it and why, unless it is passed at its vLLM default (which
asks for nothing), and a keyword vLLM does not know either raises ``ValueError``
naming the closest field names. ``guided_decoding`` (vLLM's older name of
``structured_outputs``) is taken as ``structured_outputs``.

This module imports no torch: ``from deepinfer import SamplingParams`` stays cheap.
"""

from __future__ import annotations

import copy
import difflib
import enum
import functools
import json as _json
import math
from dataclasses import dataclass, field, fields
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


def _check_logprobs(name: str, value: object) -> None:
    if not _is_int(value) or value < -1:
        raise ValueError(f"{name}={value!r} must be an int >= 0, or -1 for the whole vocabulary")


def unknown_keyword_error(owner: str, name: str, known: list[str]) -> ValueError:
    """A ValueError for a keyword ``owner`` does not take, naming the closest known ones."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"{owner} got an unknown keyword argument {name!r}{hint}")


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
    (stored as 0). ``seed=-1`` is no seed (stored as None). ``stop``,
    ``stop_token_ids`` and ``bad_words`` are stored as lists.
    ``logprobs=N`` returns, for each generated token, the N most likely tokens
    plus the sampled one (-1: the whole vocabulary, which the engine's
    ``max_logprobs`` must allow); ``prompt_logprobs=N`` does the same for prompt
    tokens. Logprobs are those of the raw model distribution, before any
    processing (the grammar mask of ``structured_outputs`` included).

    As in vLLM: ``best_of`` may only equal ``n`` (vLLM's V1 engine dropped best-of-n
    as well); ``detokenize=False`` leaves ``text`` empty (stop strings then cannot
    apply); ``spaces_between_special_tokens=False`` joins consecutive added tokens
    without the space a tokenizer's decoder may put between them;
    ``truncate_prompt_tokens=K`` keeps the last K prompt tokens (-1: the last
    ``max_model_len``); ``allowed_token_ids`` restricts every draw to those ids;
    ``bad_words`` bans a word's last token wherever the tokens before it would
    complete the word (each word with and without a leading space);
    ``extra_args`` is carried along for the caller, unread by the engine.
    """

    n: int = 1
    best_of: int | None = None
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
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    # The token sequences of ``bad_words``, which need the tokenizer: set by the engine
    # when the request is added.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of != self.n:
                raise ValueError(f"best_of={self.best_of} with n={self.n}: keeping the best n of best_of "
                                 "samples is not supported (nor by vLLM's V1 engine); leave best_of unset "
                                 "or equal to n")
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
        if self.seed == -1:
            self.seed = None

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
            _check_logprobs("logprobs", self.logprobs)
        if self.prompt_logprobs is not None:
            _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        if self.stop and not self.detokenize:
            raise ValueError(f"stop={self.stop!r} needs detokenize=True: stop strings are found in the text")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or k == 0 or k < -1):
            raise ValueError(f"truncate_prompt_tokens={k!r} must be an int >= 1, or -1 for max_model_len")
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty list of "
                                 "token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for tok in self.allowed_token_ids:
                _check_token_id("allowed_token_ids entry", tok)
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, str):
            raise ValueError(f"bad_words={self.bad_words!r} must be a list of str, not one str")
        else:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words={self.bad_words!r}: every bad word must be a non-blank str")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args={self.extra_args!r} must be a dict or None")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a "
                             "StructuredOutputsParams, a dict of its fields, or None")

    def verify_for_model(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Checks that need the model: token ids inside the vocabulary and the
        logprobs counts within the engine's limit (``max_logprobs=-1``: no limit;
        a count of -1 is the whole vocabulary, as in vLLM). ``top_k`` above the
        vocabulary size is allowed: it keeps every token."""
        for what, ids in (("logit_bias key", self.logit_bias or {}), ("stop_token_ids entry", self.stop_token_ids),
                          ("allowed_token_ids entry", self.allowed_token_ids or ())):
            for tok in ids:
                if tok >= vocab_size:
                    raise ValueError(f"{what} {tok} must be < vocab_size={vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            count = vocab_size if value == -1 else value
            if value is not None and max_logprobs != -1 and count > max_logprobs:
                raise ValueError(f"{name}={value} must be <= max_logprobs={max_logprobs} (a setting of the "
                                 "engine: LLM(max_logprobs=...), -1 for no limit)")

    def resolved_for_model(self, vocab_size: int) -> SamplingParams:
        """These params with a logprobs count of -1 replaced by ``vocab_size`` (self when
        neither count is -1)."""
        if self.logprobs != -1 and self.prompt_logprobs != -1:
            return self
        resolved = self.clone()
        resolved.logprobs = vocab_size if self.logprobs == -1 else self.logprobs
        resolved.prompt_logprobs = vocab_size if self.prompt_logprobs == -1 else self.prompt_logprobs
        return resolved

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's constructor for optional values: a None is the field's default (where that
        default is not None itself)."""
        defaults = {f.name: f.default for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in kwargs.items() if v is not None or defaults.get(k, 0) is None})

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# vLLM's other SamplingParams fields, which this engine does not have: each with its vLLM
# default (passing it asks for nothing and is accepted) and why another value is refused.
_VLLM_ONLY_FIELDS: dict[str, tuple[Any, str]] = {
    "logits_processors": (None, "custom logits processors (Python callables) are not supported"),
    "logprob_token_ids": (None, "logprobs of chosen token ids are not supported; use logprobs=N"),
    "prompt_logprob_token_ids": (None, "prompt logprobs of chosen token ids are not supported; "
                                       "use prompt_logprobs=N"),
    "prompt_logprob_start": (None, "prompt logprobs start at the first prompt token"),
    "flat_logprobs": (False, "logprobs come as one dict per position only"),
    "thinking_token_budget": (None, "a thinking-token budget is not supported"),
    "repetition_detection": (None, "repetition detection is not supported"),
    "stream_interval": (None, "each output carries every token the step produced"),
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "early_stopping": (False, "early_stopping applies to beam search, which is not supported"),
    "trace_decode_token_ids": (None, "forcing decode tokens is not supported"),
    "skip_reading_prefix_cache": (None, "prefix-cache reads cannot be skipped per request"),
    "routed_experts_prompt_start": (0, "returning routed experts is not supported"),
    "skip_clone": (False, "the engine copies parameters only where it must"),
}
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams) if f.init)
_KNOWN_NAMES = sorted(_FIELD_NAMES | set(_VLLM_ONLY_FIELDS) | {"guided_decoding"})


def _checked_init(init):
    """Wrap the dataclass ``__init__``: vLLM-only fields are refused unless at their default,
    ``guided_decoding`` becomes ``structured_outputs``, unknown keywords name the closest."""
    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "guided_decoding" in kwargs:
            guided = kwargs.pop("guided_decoding")
            if guided is not None:
                if kwargs.get("structured_outputs") is not None:
                    raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
                kwargs["structured_outputs"] = guided
        for name in [k for k in kwargs if k not in _FIELD_NAMES]:
            value = kwargs.pop(name)
            if name not in _VLLM_ONLY_FIELDS:
                raise unknown_keyword_error("SamplingParams", name, _KNOWN_NAMES)
            default, why = _VLLM_ONLY_FIELDS[name]
            if value != default:
                raise ValueError(f"SamplingParams {name}={value!r}: {why}")
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _checked_init(SamplingParams.__init__)  # type: ignore[method-assign]

# vLLM's older name of StructuredOutputsParams.
GuidedDecodingParams = StructuredOutputsParams
