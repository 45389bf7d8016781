"""Prompt dicts with vLLM's names (``vllm.inputs``): what ``LLM.generate`` takes besides
plain strings and token-id lists."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenised by the engine (special tokens added as the tokenizer's
    post-processor says)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as given."""

    prompt_token_ids: list[int]
