"""Fixtures for end-to-end engine tests: the embedded model, and tiny random HF
checkpoints that borrow its tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer.config import flatten_text_config
from deepinfer.entrypoints.llm import DEFAULT_MODEL, LLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_checkpoint(tmp: Path, arch: str, **overrides) -> Path:
    """A tiny random HF checkpoint of ``arch`` saved with transformers, with the
    embedded model's tokenizer (so the vocabularies match)."""
    import transformers

    vocab = flatten_text_config(json.loads((Path(DEFAULT_MODEL) / "config.json").read_text()))["vocab_size"]
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                tie_word_embeddings=False)
    base.update(overrides)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**base)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp / arch
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEFAULT_MODEL) / name, out / name)
    return out


def hf_greedy(path: Path, prompts: list[list[int]], n: int,
              with_logprobs: bool = False) -> list[list[int]] | tuple[list[list[int]], list[torch.Tensor]]:
    """HF transformers' greedy continuation of each prompt, exactly ``n`` tokens (EOS
    handling off, like the engine's ``ignore_eos``); with ``with_logprobs`` also each
    prompt's float32 log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
            tokens.append(gen[0, len(p):].tolist())
            if with_logprobs:
                logprobs.append(torch.log_softmax(model(ids).logits[0].float(), -1))
    return (tokens, logprobs) if with_logprobs else tokens


@pytest.fixture(scope="session")
def tiny_llm() -> LLM:
    return LLM(device="cpu", max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "MistralForCausalLM", sliding_window=8)


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory) -> Path:
    """Qwen3 with one full-attention layer and two sliding-window layers (two KV groups)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", num_hidden_layers=3,
                           use_sliding_window=True, max_window_layers=1, sliding_window=8, head_dim=16)
