"""Helpers for comparing our models with HF transformers on tiny random checkpoints.

Each test builds a tiny HF model (float32, seeded), adds noise to every
parameter so that norms and biases are not trivially ones and zeros, saves it
with ``save_pretrained`` and loads it back with our loader.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.models.base import CausalLM
from deepinfer.models.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
LOGITS_RTOL = 1e-4
GREEDY_TOKENS = 32


def make_hf_model(arch: str, seed: int = 0, noise: float = 0.1, **overrides):
    """A tiny random HF ``arch`` model in float32 with every parameter perturbed."""
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model


def save(model, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(path, **save_kwargs)
    return path


def load_ours(path: Path) -> CausalLM:
    config = ModelConfig.from_path(path, "float32", None, CPU)
    return load_model(config, CPU)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def random_prompts(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def our_logits(model: CausalLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per-sequence [T_b, V] logits from one flattened no-cache forward of all sequences."""
    ids = torch.tensor([t for s in seqs for t in s])
    ctx = ForwardContext.no_cache([len(s) for s in seqs], CPU)
    logits = model.compute_logits(model(ids, ctx))
    assert logits.dtype == torch.float32
    return list(logits.split([len(s) for s in seqs]))


@torch.no_grad()
def our_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, re-running the whole sequence each step (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(our_logits(model, [seq])[0][-1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def assert_matches_hf(hf_model, ours: CausalLM, seq_lens: list[int]) -> None:
    """Logits of one sequence and of a flattened batch within LOGITS_RTOL of HF's,
    and GREEDY_TOKENS greedy tokens identical."""
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(seq_lens, vocab)
    refs = [hf_logits(hf_model, p) for p in prompts]

    single = our_logits(ours, [prompts[0]])[0]
    assert single.shape == refs[0].shape
    assert rel_err(single, refs[0]) <= LOGITS_RTOL, rel_err(single, refs[0])

    for b, (got, ref) in enumerate(zip(our_logits(ours, prompts), refs)):
        err = rel_err(got, ref)
        assert err <= LOGITS_RTOL, f"sequence {b} (len {seq_lens[b]}): rel err {err}"

    prompt = prompts[0]
    assert our_greedy(ours, prompt, GREEDY_TOKENS) == hf_greedy(hf_model, prompt, GREEDY_TOKENS)


@pytest.fixture
def checkpoint(tmp_path):
    """checkpoint(arch, **config) -> (hf_model, our_model, path)."""
    def build(arch: str, seed: int = 0, **overrides):
        hf_model = make_hf_model(arch, seed=seed, **overrides)
        path = save(hf_model, tmp_path / arch)
        return hf_model, load_ours(path), path
    return build
