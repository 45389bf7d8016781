"""DeepSeek-V4.1 through the whole engine on the tiny engram checkpoint of
tests/data/v41_reference: greedy tokens and prompt logprobs equal what DeepSeek's official
V4.1 reference produced (its unrounded variant, ``kv_cache_dtype="float32"`` here), through
batching, chunked prefill, small pages, prefix-cache hits, preemption and ``n`` > 1, and
every block returns to the pool; with the release's KV formats (``kv_cache_dtype="auto"``) the
Triton path's packed records give the torch path's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.scheduler.kv_cache import kv_bytes_per_token

DATA = Path(__file__).resolve().parent.parent / "data" / "v41_reference"


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "expected.npz"))


def prompts(expected: dict[str, np.ndarray]) -> list[list[int]]:
    ids, off = expected["prompt_ids"], expected["prompt_offsets"]
    return [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def make_llm(**settings) -> LLM:
    return LLM(model=str(DATA / "checkpoint"), device="cpu", dtype="float32", kv_cache_dtype="float32",
               **settings)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("settings", [
    {},
    # Chunks of 16 tokens and pages of 4 (the window is 8): prefix hits of whole pages.
    {"max_num_batched_tokens": 16, "block_size": 4},
    # A pool small enough to preempt.
    {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 20, "max_num_seqs": 8},
], ids=["default", "chunked", "preempting"])
def test_greedy_matches_the_official_reference(expected, settings):
    llm = make_llm(**settings)
    ps = prompts(expected)
    first = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert first == expected["greedy_noquant"].tolist()
    second = llm.generate(ps, GREEDY, use_tqdm=False)             # prefix-cache hits
    assert [o.outputs[0].token_ids for o in second] == first
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0
    elif "block_size" in settings:
        # Hits are whole pages of every group: with pages of 4, the ratio-2 and ratio-1
        # groups' pages span 32 and 16 tokens, shorter than these prompts.
        assert all(o.num_cached_tokens >= 32 for o in second if len(o.prompt_token_ids) > 40)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_prompt_logprobs_match_the_official_reference(expected):
    llm = make_llm(max_num_batched_tokens=24)
    off = expected["prompt_offsets"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for i, out in enumerate(llm.generate(prompts(expected), params, use_tqdm=False)):
        logits = expected["logits_noquant"][off[i]:off[i + 1]].astype(np.float64)
        ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        ids = out.prompt_token_ids
        for p in range(1, len(ids)):
            assert out.prompt_logprobs[p][ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]], abs=1e-4)


def test_siblings_fork_from_the_prompt(expected):
    llm = make_llm()
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate(prompts(expected)[:2], params, use_tqdm=False)
    for i, o in enumerate(out):
        assert [c.token_ids for c in o.outputs] == [expected["greedy_noquant"][i, :12].tolist()] * 3


def test_host_memory_engram_tables_match_the_official_reference(expected, monkeypatch):
    # The release's placement (FP8 tables in host memory, rows gathered per step) through
    # chunked prefill and prefix-cache hits.
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "host")
    llm = make_llm(max_num_batched_tokens=16, block_size=4)
    assert llm.engine.model.model.layers[1].engram.embed.in_host_memory
    ps = prompts(expected)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
        assert got == expected["greedy_noquant"].tolist()


@pytest.mark.slow          # Triton's interpreter, ~45 s; on a GPU the `-m gpu` V4.1 checks run the same kernels
def test_triton_kernels_match_the_official_reference(expected, monkeypatch):
    # The CUDA path's kernels (sparse attention, rope, kv norm, store, indexer scores and
    # top-k, pair pooling, candidate blocks, fused MoE, hyper-connections, the engram gate and
    # the engram row gather from host-memory tables, the release's placement) in Triton's CPU
    # interpreter: same tokens.
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "host")
    llm = make_llm(max_num_batched_tokens=16, block_size=4)
    picked = [2, 7]
    ps = [prompts(expected)[i] for i in picked]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == [expected["greedy_noquant"][i, :6].tolist() for i in picked]


@pytest.mark.slow
def test_packed_kv_records_match_the_rounded_torch_path(expected, monkeypatch):
    # kv_cache_dtype="auto" on the Triton kernels (the CUDA path, here in Triton's CPU
    # interpreter) stores the release's packed records: uint8 rows of 66 (MXFP8 window, D = 64),
    # 36 (NVFP4 entries) and 17 (MXFP4 keys, Di = 32) bytes, stored and read by the kernels. The
    # torch path stores the same rounded values unpacked: the same greedy tokens, also through a
    # prefix-cache hit on packed pages.
    settings = {"max_num_batched_tokens": 16, "block_size": 4}
    ps = [prompts(expected)[i] for i in (2, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rounded = LLM(model=str(DATA / "checkpoint"), device="cpu", dtype="float32", kv_cache_dtype="auto", **settings)
    assert not rounded.engine.model.packed_kv
    want = [o.outputs[0].token_ids for o in rounded.generate(ps, params, use_tqdm=False)]
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    llm = LLM(model=str(DATA / "checkpoint"), device="cpu", dtype="float32", kv_cache_dtype="auto", **settings)
    model = llm.engine.model
    assert model.packed_kv
    records = {(s.kv_spec.record, s.kv_cache.dtype, s.kv_cache.shape[-1]) for s in model.kv_cache_layers()
               if s.kv_spec.record is not None}
    assert records == {("mxfp8", torch.uint8, 66), ("nvfp4", torch.uint8, 36), ("mxfp4", torch.uint8, 17)}
    # The compressor state and engram's token history stay in the compute dtype.
    assert {s.kv_cache.dtype for s in model.kv_cache_layers() if s.kv_spec.record is None} == {torch.float32}
    # Per token of context: layer 2's entry + key per 2 tokens, layer 4's every token.
    assert kv_bytes_per_token(llm.engine.kv.groups)[0] == (36 + 17) / 2 + 36 + 17
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == want
    again = llm.generate(ps[1:], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert again[0].num_cached_tokens >= 32 and again[0].outputs[0].token_ids == want[1][:3]
