"""The tiny trained DeepSeek-V4 of tests/data/tiny-v4-model (the embedded default
before the tiny DeepSeek-V4.1) through the whole engine: greedy tokens equal HF
transformers' greedy tokens, on prompts long enough that every cache path runs
(past the 32-token sliding window, more CSA entries than the indexer keeps,
several HCA entries)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams

from .. import TINY_V4_MODEL

NEW_TOKENS = 48
PROMPTS = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "Return a new dictionary with keys from iterable and values set to value. " * 4,
    "This module provides access to some objects used or maintained by the interpreter and to "
    "functions that interact strongly with the interpreter. " * 8,
]


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((Path(TINY_V4_MODEL) / "config.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=TINY_V4_MODEL, device="cpu")


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_V4_MODEL, dtype=torch.float32).eval()
    # Generate exactly as many tokens as the engine with ignore_eos (no EOS handling at all).
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def test_tiny_v4_model_is_deepseek_v4(config, llm, prompt_ids):
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    rates = config["compress_rates"]
    kinds = sorted((g.kind, g.compress_ratio) for g in llm.engine.kv.groups)
    assert ("sliding", 1) in kinds
    assert ("compressed", rates["compressed_sparse_attention"]) in kinds
    assert ("compressed", rates["heavily_compressed_attention"]) in kinds
    # The longest prompt reaches past the window, the indexer's top-k and several HCA entries.
    longest = max(len(p) for p in prompt_ids)
    assert longest > config["sliding_window"]
    assert longest // rates["compressed_sparse_attention"] > 2 * config["index_topk"]
    assert longest // rates["heavily_compressed_attention"] >= 4


def test_tiny_v4_model_greedy_matches_hf(llm, prompt_ids):
    expected = hf_greedy(prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    assert got == expected
