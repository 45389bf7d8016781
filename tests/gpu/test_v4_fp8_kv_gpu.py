"""DeepSeek-V4's FP8 KV records on a CUDA device (run on the GPU machine:
``python -m pytest -q -m gpu tests/gpu/test_v4_fp8_kv_gpu.py``).

The record kernels at the release's sizes (D = 512, 64 bf16 RoPE channels: 584-byte records):
the store byte for byte against the reference, the in-register decode bit for bit against
``unpack_record``, the sparse attention over window + entry records at 64 heads against the
reference on the decoded values (decode and long prefill, which stays on the Triton kernel);
then the engine on CUDA with ``kv_cache_dtype="fp8"`` (packed records, CUDA graphs) against the
CPU reference path (rounded values unpacked) on the tiny trained checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kernels import reference
from deepinfer.kernels import sparse_attention as sa
from deepinfer.kernels.kv_records import store_records
from deepinfer.kv_spec import ds_mla_format, record_bytes

from .. import TINY_V4_MODEL
from ..engine.test_tiny_v4_model import PROMPTS
from ..kernels.paged_sources import page_buffer_records
from ..kernels.test_ds_mla_records import random_rows
from ..kernels.test_ds_mla_records import test_kernel_decode_matches_unpack as check_decode
from ..kernels.test_kv_records import record_cache
from ..kernels.test_sparse_attention import KERNEL_TOL, v4_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
FMT = ds_mla_format(64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kernel_at_release_sizes(dtype):
    gen = torch.Generator().manual_seed(1)
    t = 300
    x = random_rows(gen, t, 512, 64).to(dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:t].int()
    slots[::7] = -1
    buffer, cache = record_cache(64, 16, record_bytes(FMT, 512), CUDA)
    ref_buffer, ref_cache = record_cache(64, 16, record_bytes(FMT, 512), torch.device("cpu"))
    store_records(cache, slots.to(CUDA), x.to(CUDA), FMT)
    reference.store_record(ref_cache, slots, x, FMT)
    assert cache.shape[-1] == 584
    assert torch.equal(buffer.cpu(), ref_buffer)


def test_decode_at_release_sizes():
    check_decode(512, 64, CUDA)


@pytest.mark.parametrize("t,decode", [(1, True), (16, True), (64, True), (4096, False)])
def test_sparse_attention_over_records(t, decode):
    """64 bf16 heads x 512 over window rows and top-512 entries stored as 584-byte records: the
    reference on the decoded values, within bf16 tolerance; long prefill stays on this kernel."""
    gen = torch.Generator().manual_seed(t)
    q, plain_sources, sinks = v4_inputs(t, decode, torch.bfloat16, gen)
    n_blocks = plain_sources[0][0].shape[0]
    caches, values = page_buffer_records(n_blocks, [(16, 1, 512, FMT), (16, 1, 512, FMT)], torch.float32,
                                         CUDA, gen)
    sources = [(cache, slots) for cache, (_, slots) in zip(caches, plain_sources)]
    formats = [FMT, FMT]
    assert not sa._takes_gluon(q, sources, formats)
    out = sa.sparse_attention(q, sources, sinks, 512 ** -0.5, formats=formats)
    ref = reference.sparse_attention(q, [(v, slots) for v, (_, slots) in zip(values, plain_sources)], sinks,
                                     512 ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[torch.bfloat16])


def _run(llm: LLM, ids: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]
    return tokens, logprobs


def test_engine_on_cuda_matches_the_cpu_reference_path():
    """float32 on CUDA (packed 88-byte records, Triton kernels, decode CUDA graphs, chunked prefill)
    gives the CPU torch path's greedy tokens and prompt logprobs; bf16 on CUDA stays close."""
    cpu = LLM(model=TINY_V4_MODEL, device="cpu", kv_cache_dtype="fp8")
    ids = [cpu.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    want_tokens, want_lp = _run(cpu, ids)
    del cpu
    gpu = LLM(model=TINY_V4_MODEL, device="cuda", dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=64)
    assert gpu.engine.model.packed_kv
    assert {s.kv_spec.record for s in gpu.engine.model.kv_cache_layers() if s.kv_spec.record} == {"ds_mla_r16"}
    tokens, lp = _run(gpu, ids)
    assert tokens == want_tokens
    for a, b in zip(lp, want_lp):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
    del gpu
    torch.cuda.empty_cache()
    bf16 = LLM(model=TINY_V4_MODEL, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")
    tokens, lp = _run(bf16, ids)
    diffs = torch.cat([a - b for a, b in zip(lp, want_lp)]).abs()
    assert float(diffs.mean()) < 0.05
    assert sum(t == w for t, w in zip(tokens, want_tokens)) >= 2
