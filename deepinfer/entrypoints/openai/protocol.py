"""Request and response bodies of the OpenAI-compatible API (pydantic).

Field names, defaults and shapes follow OpenAI's API, plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``structured_outputs``, ...) so that clients written for vLLM
work unchanged. Requests carry only types here; ranges are checked where the
values are used (``SamplingParams`` names the field and its limit), except the
caps that protect the server itself (``n``).

Field policy: every field a request model declares is honoured, or refused with a
400 naming it when set (``REFUSED_FIELDS``), or handed as it is to the tokenizer or
the chat template (``PASSTHROUGH_FIELDS``: the checkpoint decides its effect), or
listed in ``NO_OP_FIELDS`` with the reason it changes nothing
(tests/server/test_field_policy.py holds every field to this). Unknown fields are
accepted and ignored with a warning naming them, as vLLM does (clients written for
OpenAI send fields of its platform, such as ``store`` or ``metadata``); a message's
unknown fields are template variables, like its declared ones.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

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
    grammar, json_object, structural_tag (see ``StructuredOutputsParams``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``StructuredOutputsParams`` (vLLM names)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0          # prompt tokens served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


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
    # Output constraints: at most one of these (response_format of type "text" constrains nothing).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs.json / regex / choice / grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


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


class FunctionCallIn(_Request):
    name: str
    # A JSON object as text (OpenAI's shape); an object is accepted and serialised.
    arguments: str | dict[str, Any]


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    """One message. Every field, and any field not declared here, is a variable of the
    chat template (``tool_calls`` and ``tool`` messages are also rendered in DeepSeek's
    format when the template has no tool support)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    # Unset: "auto" when tools are given, as in OpenAI and vLLM.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # A chat template variable (DeepSeek-V4's templates read it).
    reasoning_effort: str | None = None
    # OpenAI fields this server refuses when set (REFUSED_FIELDS says what to use instead).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM extras
    include_reasoning: bool | None = True
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


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


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


class _DropNone(BaseModel):
    """Serialised without its unset (None) fields: a tool-call delta carries only what
    changed (the id, type and name once, then argument fragments), as OpenAI's do."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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


# -- field policy (see the module doc) -------------------------------------------------------------
_TEMPLATE = "a chat template variable: the checkpoint's template decides what it does"
_TOKENIZER = "handed to the tokenizer: adds the checkpoint's special tokens (BOS, ...) if it has any"

# "Model.field" -> why it is handed on as it is.
PASSTHROUGH_FIELDS: dict[str, str] = {
    "CompletionRequest.add_special_tokens": _TOKENIZER,
    "ChatCompletionRequest.add_special_tokens": _TOKENIZER,
    "ChatCompletionRequest.reasoning_effort": _TEMPLATE,
    "ChatMessage.name": _TEMPLATE,
    "ChatMessage.tool_call_id": _TEMPLATE + " (DeepSeek's templates do not render call ids)",
    "ChatMessage.reasoning_content": _TEMPLATE + " (DeepSeek's templates drop earlier reasoning)",
    "ToolCallIn.id": _TEMPLATE + " (DeepSeek's templates do not render call ids)",
}

# "Model.field" -> why it changes nothing.
NO_OP_FIELDS: dict[str, str] = {
    "CompletionRequest.user": "an end-user id for OpenAI's abuse monitoring; generation does not read it",
    "ChatCompletionRequest.user": "an end-user id for OpenAI's abuse monitoring; generation does not read it",
    "JsonSchemaFormat.name": "a label for the schema; the schema alone constrains the output",
    "JsonSchemaFormat.description": "a label for the schema; the schema alone constrains the output",
    "JsonSchemaFormat.strict": "schemas are always enforced exactly (strict or not)",
    "FunctionDefinition.strict": "forced calls always follow the schema exactly; auto calls are never "
                                 "constrained (the model chooses), strict or not",
}

# "Model.field" -> what to use instead; a request that sets the field is a 400 naming it.
REFUSED_FIELDS: dict[str, str] = {
    "ChatCompletionRequest.functions": "the legacy function-calling API is not supported; use tools",
    "ChatCompletionRequest.function_call": "the legacy function-calling API is not supported; use tool_choice",
    "ChatCompletionRequest.audio": "audio output is not supported; this server generates text",
    "ChatCompletionRequest.modalities": "only [\"text\"] is supported",
    "ChatCompletionRequest.prediction": "predicted outputs are not supported",
    "ChatCompletionRequest.web_search_options": "web search is not supported",
    "CompletionRequest.suffix": "suffix (fill-in-the-middle) is not supported",
    "CompletionRequest.best_of": "best_of is not supported; it must be unset or equal n",
}


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

