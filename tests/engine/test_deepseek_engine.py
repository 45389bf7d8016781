"""DeepSeek-V4 and V3 through the whole engine: greedy tokens equal HF
transformers' greedy tokens with batching, chunked prefill, prefix caching and
preemption on, and every block returns to the pool."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import flatten_text_config
from deepinfer.entrypoints.llm import DEFAULT_MODEL

from ..models.test_deepseek_v4 import HF_STYLE, randomize
from .conftest import TOKENIZER_FILES, hf_greedy

VOCAB = flatten_text_config(json.loads((Path(DEFAULT_MODEL) / "config.json").read_text()))["vocab_size"]


def save_with_tokenizer(model, out: Path) -> Path:
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEFAULT_MODEL) / name, out / name)
    return out


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory) -> Path:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

    cfg = hf_v4.DeepseekV4Config(**{**copy.deepcopy(HF_STYLE), "vocab_size": VOCAB,
                                    "max_position_embeddings": 512})
    torch.manual_seed(0)
    model = hf_v4.DeepseekV4ForCausalLM(cfg).eval()
    randomize(model, 0, cfg.n_routed_experts, cfg.num_experts_per_tok)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("v4") / "ckpt")


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                           topk_group=1, first_k_dense_replace=1, max_position_embeddings=512,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.add_(torch.randn_like(p.float()).to(p.dtype) * 0.05)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("v3") / "ckpt")


def run_engine(path: Path, prompts, n: int, **settings) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(path), device="cpu", **settings)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = llm.generate(prompts, params, use_tqdm=False)  # prefix-cache hits
    assert [o.outputs[0].token_ids for o in second] == first
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    return first, llm


def prompts(lens):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def test_deepseek_v4_engine_matches_hf(v4_dir):
    # 300 tokens: prefix hits are whole blocks of every group (128 tokens for HCA here).
    # 32 new tokens: decode still crosses the ratio-4 and ratio-8 compression boundaries many times.
    ps = prompts([300, 9, 30])
    expected = hf_greedy(v4_dir, ps, 32)
    got, llm = run_engine(v4_dir, ps, 32, max_num_batched_tokens=16, block_size=4)
    assert got == expected
    assert llm.engine.kv.prefix_hits > 0
    kinds = sorted({(g.kind, g.compress_ratio) for g in llm.engine.kv.groups})
    assert ("compressed", 4) in kinds and ("compressed", 8) in kinds and ("sliding", 1) in kinds


@pytest.mark.slow      # 70 s on 2 cores; V4 preemption stays in tests/unit/test_batch_invariant.py (tiny-v4)
def test_deepseek_v4_engine_preemption(v4_dir):
    # Short prompts admitted together, then long generations: the compressed groups
    # grow until the pool runs out and sequences are preempted and recomputed.
    ps = prompts([10, 12, 14, 16])
    reference, _ = run_engine(v4_dir, ps, 130, max_num_batched_tokens=256)
    got, llm = run_engine(v4_dir, ps, 130, max_num_batched_tokens=32, block_size=4, num_kv_blocks=14)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == reference


def test_deepseek_v3_engine_matches_hf(v3_dir):
    ps = prompts([33, 7, 20])
    expected = hf_greedy(v3_dir, ps, 32)
    got, llm = run_engine(v3_dir, ps, 32, max_num_batched_tokens=16, block_size=4)
    assert got == expected
    assert llm.engine.kv.prefix_hits > 0


def test_deepseek_v3_triton_kernels_match_hf(v3_dir, monkeypatch):
    """Through the Triton kernels (the CPU interpreter here): decode steps take the absorbed
    MLA kernel (kernels/mla_decode.py), routing and experts the fused kernels."""
    from deepinfer.kernels import mla_decode

    calls = []
    kernel = mla_decode.mla_decode

    def counted(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    monkeypatch.setattr(mla_decode, "mla_decode", counted)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    ps = prompts([19, 6])
    expected = hf_greedy(v3_dir, ps, 8)
    got, _ = run_engine(v3_dir, ps, 8, max_num_batched_tokens=16, block_size=4)
    assert got == expected
    assert 2 in calls            # decode steps of both sequences went through the kernel
