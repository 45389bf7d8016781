"""The multi-turn chat workload's sending: each conversation a sequence of streamed chat
requests, the next turn sent as soon as the previous answer is complete (its text appended
to the history as the assistant's message), conversations started at the arrival times.
A failed turn ends its conversation (its later turns are not sent)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Callable

from deepinfer.bench.serve import endpoint
from deepinfer.bench.serve.endpoint import RequestResult
from deepinfer.bench.serve.workload import Conversations

if TYPE_CHECKING:
    import aiohttp


async def run_conversations(session: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str,
                            work: Conversations, offsets: list[float], *, ignore_eos: bool,
                            extra_body: dict[str, Any], max_concurrency: int | None,
                            on_result: Callable[[], None] | None = None) -> tuple[list[RequestResult], list[int]]:
    """Every conversation to its end; the results in the order they finished and each one's turn.
    ``offsets``: each conversation's start, seconds after the call."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    results: list[RequestResult] = []
    turns: list[int] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def conversation(c: int) -> None:
        delay = t0 + offsets[c] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        messages = [{"role": "system", "content": work.system}] if work.system else []
        for t, question in enumerate(work.questions[c]):
            messages.append({"role": "user", "content": question})
            payload = endpoint.build_chat_payload(model, list(messages), work.output_len, ignore_eos=ignore_eos,
                                                  extra_body=extra_body)
            async with limit:
                result = await endpoint.send(session, url, payload, headers, prompt_len=0)
            results.append(result)
            turns.append(t)
            if on_result is not None:
                on_result()
            if not result.success:
                return
            messages.append({"role": "assistant", "content": result.generated_text})

    await asyncio.gather(*(conversation(c) for c in range(len(work.questions))))
    return results, turns
