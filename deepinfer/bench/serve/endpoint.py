"""One streamed request to an OpenAI-compatible completions or chat-completions
endpoint, timed on the client.

Times (seconds, ``time.perf_counter``) follow ``vllm bench serve``: the clock starts
when the request is sent; TTFT is the arrival of the first event that carries
output; ITL the gaps between consecutive such events; E2EL the arrival of the last
one. An event carries output when one of its choices has text (completions),
content, reasoning or tool calls (chat), or a finish reason: a chat server's
opening ``{"role": "assistant", "content": ""}`` delta is not a token, and some
servers send it before the prompt has been processed. Several tokens may share an
event (a detokenizer holding back an incomplete character, speculative decoding);
output tokens are counted from the server's ``usage`` (asked for with
``stream_options.include_usage``), or else from the text afterwards.

A request fails, with the reason kept, on a connection error, a status other than
200, an error event in the stream, a stream that ends before ``data: [DONE]`` or
without output, or the timeout (the session's, ``--request-timeout``); a failure
never stops the run. The HTTP itself (aiohttp) is in http_client.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer.bench.serve import http_client
from deepinfer.bench.serve.workload import SampleRequest

if TYPE_CHECKING:
    import aiohttp

CHAT, COMPLETIONS = "openai-chat", "openai"


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds)."""

    success: bool = False
    error: str = ""
    start_time: float = 0.0          # perf_counter when sent
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0             # E2EL
    prompt_len: int = 0              # the server's usage.prompt_tokens when given
    output_tokens: int | None = None  # the server's usage.completion_tokens; None: not reported
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens, when given
    generated_text: str = ""


def endpoint_type(endpoint: str) -> str:
    """``openai-chat`` for a /chat/completions path, ``openai`` for /completions (vLLM's names)."""
    path = endpoint.rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    raise ValueError(f"--endpoint must be a completions or chat completions path "
                     f"(e.g. /v1/completions, /v1/chat/completions), got {endpoint!r}")


def build_payload(kind: str, model: str, sample: SampleRequest, *, ignore_eos: bool,
                  extra_body: dict[str, Any]) -> dict[str, Any]:
    """The request body. ``ignore_eos`` also sends ``min_tokens`` = the output length, so a
    server that ends on stop token ids other than EOS still gives every token asked for."""
    if kind == CHAT:
        if not isinstance(sample.prompt, str):
            raise ValueError("chat completions take text prompts; token-id prompts need /v1/completions")
        return build_chat_payload(model, [{"role": "user", "content": sample.prompt}], sample.output_len,
                                  ignore_eos=ignore_eos, extra_body=extra_body)
    body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len}
    return _streamed(body, sample.output_len, ignore_eos) | extra_body


def build_chat_payload(model: str, messages: list[dict[str, str]], output_len: int, *, ignore_eos: bool,
                       extra_body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat request over ``messages`` (a conversation so far) asking for ``output_len`` tokens."""
    body = {"model": model, "messages": messages, "max_completion_tokens": output_len}
    return _streamed(body, output_len, ignore_eos) | extra_body


def _streamed(body: dict[str, Any], output_len: int, ignore_eos: bool) -> dict[str, Any]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body |= {"ignore_eos": True, "min_tokens": output_len}
    return body


def _carries_output(choice: dict[str, Any]) -> tuple[bool, str]:
    """Whether a streamed choice holds generated output, and its text. Token logprobs count:
    with them asked for (``--extra-body '{"logprobs": 0}'``) tokens without text are seen too."""
    logprobs = choice.get("logprobs") or {}
    if "delta" in choice:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        other = (delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
                 or logprobs.get("content"))
    else:
        text = choice.get("text") or ""
        other = logprobs.get("tokens")
    return bool(text or other or choice.get("finish_reason")), text


async def send(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str],
               prompt_len: int) -> RequestResult:
    """POST ``payload`` (a streaming request) through ``session`` and time its events; never raises."""
    result = RequestResult(prompt_len=prompt_len)
    result.start_time = time.perf_counter()
    try:
        await _stream(session, url, payload, headers, result)
    except asyncio.TimeoutError:
        result.success, result.error = False, f"no complete response within {session.timeout.total:g} s"
    except Exception as exc:    # a failed request is a result, not the end of the run
        result.success, result.error = False, http_client.describe(exc)
    return result


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str],
                  result: RequestResult) -> None:
    start = result.start_time
    last: float | None = None        # arrival of the latest event with output
    text: list[str] = []
    done = False

    def take(event: str, now: float) -> bool:
        """Account ``event``, arrived at ``now``; True once the stream is over."""
        nonlocal last, done
        if event == "[DONE]":
            done = True
            return True
        message = json.loads(event)
        if message.get("error"):
            error = message["error"]
            detail = error.get("message", error) if isinstance(error, dict) else error
            result.error = f"error event: {detail}"
            return True
        outputs = [_carries_output(c) for c in message.get("choices") or []]
        if any(has for has, _ in outputs):
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            text.extend(t for _, t in outputs)
        usage = message.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                result.prompt_len = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                result.cached_tokens = int(cached)
        return False

    # A redirect is a failure with its status: followed, it would turn the POST into a GET.
    async with session.post(url, json=payload, headers=headers, allow_redirects=False) as resp:
        if resp.status != 200:
            result.error = await http_client.error_text(resp)
            return
        async with aclosing(http_client.sse_events(resp)) as events:
            async for event in events:
                if take(event, time.perf_counter()):
                    break
    result.generated_text = "".join(text)
    if result.error:
        return
    if not done:
        result.error = "the stream ended before 'data: [DONE]'"
    elif last is None:
        result.error = "the stream carried no output"
    else:
        result.success = True
        result.latency = last - start
