"""The embedded default model (a tiny trained DeepSeek-V4.1 with an engram layer, made by
scripts/make_tiny_model.py) through the whole engine: its release-layout config gives every
layer role, and greedy tokens equal those of the same weights run without a KV cache (the
whole sequence recomputed for each token, ``ForwardContext.no_cache``), on prompts long
enough that every cache path runs (past the 32-token sliding window, more ratio-2 and
ratio-1 entries than the indexers keep and than the candidate blocks hold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import flatten_text_config
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM, layer_roles

NEW_TOKENS = 16      # each checked token recomputes the whole sequence without a cache
PROMPTS = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "Return a new dictionary with keys from iterable and values set to value. " * 4,
    "This module provides access to some objects used or maintained by the interpreter and to "
    "functions that interact strongly with the interpreter. " * 8,
]


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_default_model_is_deepseek_v41(config, llm, prompt_ids):
    # The release layout: an outer wrapper around text_config.
    assert config["architectures"] == ["DeepseekV41ForCausalLM"] and config["model_type"] == "deepseek_v41"
    assert "vocab_size" not in config and config["text_config"]["vocab_size"] == 1000
    assert isinstance(llm.engine.model, DeepseekV41ForCausalLM)
    text = flatten_text_config(config)
    roles = layer_roles(text)
    kinds = {(r.kind, r.ratio) for r in roles}
    assert kinds == {("window", 0), ("source", 2), ("reuse", 2), ("source", 1), ("reindex", 1), ("reuse", 1)}
    assert any(r.candidate_source for r in roles) and any(r.restricted for r in roles)
    assert text["engram_layer_ids"] and llm.engine.model.model.engram_layout is not None
    groups = {(g.kind, g.compress_ratio) for g in llm.engine.kv.groups}
    assert {("sliding", 1), ("compressed", 2), ("full", 1)} <= groups
    # The longest prompt reaches past the window, the indexers' top-k of both streams and
    # several times the candidate blocks' capacity.
    longest = max(len(p) for p in prompt_ids)
    assert longest > text["sliding_window"]
    assert longest // 2 > 2 * text["index_topk"]
    capacity = (text["candidate_topk_blocks"] - 1) * text["candidate_block_size"] + 1
    assert longest > 4 * capacity


def no_cache_greedy(model: DeepseekV41ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor(ids)
            hidden = model(x, ForwardContext.no_cache([len(ids)], x.device))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def test_default_model_greedy_matches_no_cache_forward(llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    assert got == [no_cache_greedy(llm.engine.model, p, NEW_TOKENS) for p in prompt_ids]


def test_default_model_chat_reply_ends_with_im_end(llm):
    """Trained on ChatML pairs: a greedy reply stops on <|im_end|> well before the limit."""
    params = SamplingParams(temperature=0.0, max_tokens=120)
    out = llm.chat([{"role": "user", "content": "What does json.dumps do?"}], params, use_tqdm=False)[0]
    reply = out.outputs[0]
    assert reply.finish_reason == "stop" and len(reply.token_ids) < 120
    assert llm.tokenizer.decode(reply.token_ids[-1:], skip_special_tokens=False) == "<|im_end|>"
