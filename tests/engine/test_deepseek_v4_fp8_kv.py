"""DeepSeek-V4 with ``kv_cache_dtype="fp8"`` on the tiny trained checkpoint (tests/data/tiny-v4-model:
D = 64, 16 RoPE channels, so a record is 48 E4M3 bytes + 16 bf16 + 1 scale + 7 pad = 88 bytes):
window rows and compressed entries rounded as DeepSeek's reference stores them. On the torch path
(the CPU default) the rounded values are stored unpacked; where the Triton kernels run they are
packed records. Checked: close to the bf16/float32 KV ("auto"), the same through chunked prefill
and a prefix-cache hit, the packed path equal to the torch path, and clear errors for values a
model does not take."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.scheduler.kv_cache import kv_bytes_per_token

from .. import TINY_V4_MODEL
from .conftest import make_checkpoint
from .test_tiny_v4_model import PROMPTS

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llms() -> dict[str, LLM]:
    return {kv: LLM(model=TINY_V4_MODEL, device="cpu", kv_cache_dtype=kv) for kv in ("auto", "fp8")}


@pytest.fixture(scope="module")
def prompt_ids(llms) -> list[list[int]]:
    # 4, 21, 68 and 305 tokens: the last runs past the 32-token window, keeps more CSA entries
    # than the indexer's top-8 and holds 19 HCA entries.
    return [llms["auto"].tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def prompt_logprobs(llm: LLM, ids: list[list[int]]) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]


def greedy(llm: LLM, ids: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)]


def test_fp8_kv_is_rounded_and_close_to_unrounded(llms, prompt_ids):
    model = llms["fp8"].engine.model
    assert model.kv_cache_dtype == "fp8" and not model.packed_kv
    # The torch path keeps values in the compute dtype; the spec says which record they follow.
    attn = model.model.layers[1].self_attn
    assert attn.kv_record == "ds_mla_r16" and attn.compressor.kv_record == "ds_mla_r16"
    assert attn.window_cache.kv_spec.record is None and attn.window_cache.kv_cache.dtype == torch.float32
    # Teacher-forced prompt logprobs: the rounding changes every position a little, no more.
    exact, fp8 = prompt_logprobs(llms["auto"], prompt_ids), prompt_logprobs(llms["fp8"], prompt_ids)
    diffs = torch.cat([a - b for a, b in zip(exact, fp8)]).abs()
    assert diffs.shape[0] == sum(len(i) - 1 for i in prompt_ids)
    assert 0 < float(diffs.mean()) < 0.02 and float(diffs.max()) < 0.1
    # Greedy decoding: the same 32 tokens on most prompts; where a prompt's tokens part, the two
    # candidates were a near tie under the unrounded KV.
    want = greedy(llms["auto"], prompt_ids, logprobs=5)
    got = greedy(llms["fp8"], prompt_ids)
    same = [w.token_ids == g.token_ids for w, g in zip(want, got)]
    assert sum(same) >= 3
    for w, g in zip(want, got):
        if w.token_ids != g.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b)
            top = w.logprobs[i]
            assert g.token_ids[i] in top and top[w.token_ids[i]].logprob - top[g.token_ids[i]].logprob < 0.1


def test_fp8_kv_chunked_prefill_and_prefix_hits_match(llms, prompt_ids):
    """Within the mode, chunked prefill (16-token steps, 8-token blocks) and a prefix-cache hit give
    the unchunked run's tokens: every entry is rounded once, from the same values."""
    want = greedy(llms["fp8"], prompt_ids, logprobs=0)
    chunked = LLM(model=TINY_V4_MODEL, device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=16,
                  block_size=8)
    got = greedy(chunked, prompt_ids, logprobs=0)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        a = torch.tensor([next(iter(d.values())).logprob for d in g.logprobs])
        b = torch.tensor([next(iter(d.values())).logprob for d in w.logprobs])
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    long_prompt = prompt_ids[3]
    again = chunked.generate([{"prompt_token_ids": long_prompt}],
                             SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert again[0].num_cached_tokens >= 256
    assert again[0].outputs[0].token_ids == want[3].token_ids


def test_kv_cache_dtype_errors(tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' is not supported for DeepseekV4ForCausalLM; "
                                         r"supported: auto, fp8"):
        LLM(model=TINY_V4_MODEL, device="cpu", kv_cache_dtype="bfloat16")
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4' is not supported for DeepSeek-V4; supported: auto, fp8"):
        DeepseekV4ForCausalLM({"num_hidden_layers": 1}, torch.float32, kv_cache_dtype="fp4")
    llama = make_checkpoint(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported for LlamaForCausalLM; supported: auto"):
        LLM(model=str(llama), device="cpu", kv_cache_dtype="fp8")


@pytest.mark.slow
def test_packed_records_match_the_torch_path(llms, prompt_ids, monkeypatch):
    """The Triton kernels (the CUDA path, here in Triton's CPU interpreter) store 88-byte records and
    read them in the attention: the torch path's tokens and logprobs (to summation order)."""
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    llm = LLM(model=TINY_V4_MODEL, device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=32, block_size=8)
    model = llm.engine.model
    assert model.packed_kv
    records = {(s.kv_spec.record, s.kv_cache.dtype, s.kv_cache.shape[-1]) for s in model.kv_cache_layers()
               if s.kv_spec.record is not None}
    assert records == {("ds_mla_r16", torch.uint8, 88)}
    # Per token of context: the CSA layers' entries (88 B) and index keys (32 float32) per 4
    # tokens, the HCA layer's entry per 16.
    assert kv_bytes_per_token(llm.engine.kv.groups)[0] == 2 * (88 + 32 * 4) / 4 + 88 / 16
    # 44 tokens in two chunks: past the window, more CSA entries than the top-8, two HCA entries.
    ids = [prompt_ids[3][:44]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    want = llms["fp8"].generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor([next(iter(d.values())).logprob for d in got.logprobs]),
                               torch.tensor([next(iter(d.values())).logprob for d in want.logprobs]),
                               atol=1e-4, rtol=0)
