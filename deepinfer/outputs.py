"""User-facing results, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution (1 = most likely)
    and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (top-N plus the chosen token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's fields, in vLLM's order, plus
    ``delta_text``)."""

    index: int
    text: str                              # "" with SamplingParams(detokenize=False)
    token_ids: list[int]
    cumulative_logprob: float | None       # set where SamplingParams.logprobs is
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it
    lora_request: None = None              # vLLM's field; no LoRA adapters here
    # Text new since this sequence's previous output, safe to stream: a possible
    # beginning of a stop string and an unfinished character are held back.
    delta_text: str = ""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result (vLLM's fields; ``error`` is this engine's: why a request
    ended with ``finish_reason="error"``). ``prompt`` is None for a token-id prompt.
    ``metrics``, ``lora_request``, ``encoder_prompt*`` and ``kv_transfer_params`` are
    vLLM's and always empty here: no per-request metrics, LoRA, encoder-decoder models
    or KV transfer."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
