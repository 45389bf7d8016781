"""Fixtures for structured-output tests: the xgrammar backend over the embedded
model's tokenizer, and the embedded model itself on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL, LLM
from deepinfer.structured.xgrammar_backend import XGrammarBackend

TOKENIZER_JSON = Path(DEFAULT_MODEL) / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend.from_tokenizer_file(TOKENIZER_JSON, tokenizer.vocab_size, tokenizer.eos_token_ids,
                                               tokenizer.all_special_ids)


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(device="cpu", max_num_batched_tokens=512)
