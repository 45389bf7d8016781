"""Request and response bodies of the OpenAI-compatible API (pydantic).

Field names, defaults and shapes follow OpenAI's API, plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``structured_outputs``, ...) so that clients written for vLLM
work unchanged. Requests carry only types here; ranges are checked where the
values are used (``SamplingParams`` names the field and its limit), except the
caps that protect the server itself (``n``). Unknown request fields are kept
and ignored with a log line, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The most sequences one request may ask for (OpenAI's limit for ``n``).
MAX_N = 128


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors --------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- shared pieces --------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool | None = False


class StructuredOutputsRequest(_Body):
    """vLLM's ``structured_outputs`` body field: exactly one of json, regex, choice,
    grammar, json_object (see ``StructuredOutputsParams``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``StructuredOutputsParams`` (vLLM names)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(_Request):
    """Fields common to completions and chat completions."""

    model: str | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsRequest | None = None


# -- /v1/completions -----------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM extras
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = True


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's per-token prompt logprob (``prompt_logprobs`` field of a choice)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM extra: with the request's prompt_logprobs=N, token id -> logprob per prompt position
    # (None for the first); sent once per choice.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ------------------------------------------------------------------------
class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/models ----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepinfer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- /tokenize, /detokenize (vLLM shapes) ---------------------------------------------------------
class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

