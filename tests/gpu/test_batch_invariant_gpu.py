"""Batch-invariant mode on CUDA (run on the GPU machine:
``python -m pytest -q -m gpu tests/gpu/test_batch_invariant_gpu.py``).

For Llama and Qwen3-MoE (random weights, bf16), the tiny trained DeepSeek-V4 and the embedded
DeepSeek-V4.1: a needle request's tokens, logprobs and prompt logprobs are bitwise the same
alone (decode steps replayed from CUDA graphs), alone eager, inside a batch, chunked, after a
prefix-cache hit and after preemption. The mode's kernels in bf16 at V4-Flash-like widths
(tensor-core MMAs): a row alone and among others, bitwise. The negative control: in normal
mode the same products and reductions on CUDA do change with the batch (and the mode's do not).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams, batch_invariant

from .. import TINY_V4_MODEL

pytestmark = pytest.mark.gpu

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "eos_token_id": 299,
         "hidden_act": "silu", "tie_word_embeddings": False}
QWEN3_MOE = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
             "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
             "norm_topk_prob": True, "mlp_only_layers": []}
# name -> LLM arguments (model None: the embedded DeepSeek-V4.1).
MODELS = {"llama": {"model": "tiny", "hf_config": LLAMA, "load_format": "dummy", "skip_tokenizer_init": True,
                    "dtype": "bfloat16", "seed": 3},
          "qwen3_moe": {"model": "tiny", "hf_config": QWEN3_MOE, "load_format": "dummy", "skip_tokenizer_init": True,
                        "dtype": "bfloat16", "seed": 3},
          "tiny_v4": {"model": TINY_V4_MODEL},
          "v41": {"model": None}}
# DeepSeek-V3, random weights, bf16 (its invariant MLA: layers/mla.py).
V3 = {**LLAMA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "moe_intermediate_size": 32,
      "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
      "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1, "num_nextn_predict_layers": 0}
MODELS["v3"] = {"model": "tiny", "hf_config": V3, "load_format": "dummy", "skip_tokenizer_init": True,
                "dtype": "bfloat16", "seed": 3}
GRAPH_SIZES = [1, 2, 4, 8]
# KV blocks of 4 tokens that hold each request alone but not all four at once (DeepSeek's
# sliding-window layers hold less per token than full attention does).
PREEMPT_BLOCKS = {"llama": 60, "qwen3_moe": 60, "tiny_v4": 24, "v41": 24, "v3": 60}


def make(name: str, **more) -> LLM:
    kwargs = {"num_kv_blocks": 400, "cuda_graph_sizes": GRAPH_SIZES, **more}
    return LLM(**MODELS[name], device="cuda", batch_invariant=True, **kwargs)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
             [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs or []])
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("name", list(MODELS))
def test_needle_is_bitwise_the_same_alone_batched_chunked_eager_hit_and_preempted(name):
    vocab = 300
    # 90 tokens: the needle spans two 64-key attention tiles, so chunk and tile boundaries fall inside it.
    needle = [(7 * i) % (vocab - 10) + 1 for i in range(90)]
    others = [[(3 * i) % (vocab - 10) + 2 for i in range(n)] for n in (5, 33, 130)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=4, prompt_logprobs=2)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=11, logprobs=4, prompt_logprobs=2)
    params = [greedy, seeded]

    # Prefix caching off where one engine serves several comparisons, so no run reads another's blocks.
    llm = make(name, enable_prefix_caching=False)
    assert llm.engine.runner.decode_graphs is not None, "decode graphs were captured"
    alone = [run(llm, [needle], [p])[0] for p in params]
    assert len(alone[0][0]) == 8 and len(alone[0][2]) == 90
    for p, want in zip(params, alone):
        got = run(llm, [others[0], needle, *others[1:]], [greedy, p, seeded, greedy])[1]
        assert got == want, "the needle changed inside a batch"
    # For the prefix-hit and preemption runs below (requests with prompt logprobs compute every
    # position and read no cached blocks, so these ask for none).
    no_plp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=4, ignore_eos=True)
    want = run(llm, [needle], [no_plp])[0][:2]
    del llm
    torch.cuda.empty_cache()

    llm = make(name, enforce_eager=True, enable_prefix_caching=False)
    assert [run(llm, [needle], [p])[0] for p in params] == alone, "eager differs from CUDA graphs"
    del llm
    torch.cuda.empty_cache()

    llm = make(name, max_num_batched_tokens=16, block_size=16, enable_prefix_caching=False)
    for p, want_p in zip(params, alone):
        got = run(llm, [*others, needle], [greedy, seeded, greedy, p])[3]
        assert got == want_p, "the needle changed when chunked"
    del llm
    torch.cuda.empty_cache()

    # A prefix hit: the needle's first 48 tokens come from another request's blocks.
    llm = make(name, block_size=16)
    run(llm, [needle[:50] + [5, 6, 7]], [no_plp])
    after = llm.generate([{"prompt_token_ids": needle}], no_plp, use_tqdm=False)[0]
    assert after.num_cached_tokens >= 32
    assert [after.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()}
                                         for pos in after.outputs[0].logprobs]] == list(want), "prefix hit"
    del llm
    torch.cuda.empty_cache()

    # Preemption: a pool too small for all four at once.
    llm = make(name, block_size=4, num_kv_blocks=PREEMPT_BLOCKS[name], max_num_batched_tokens=16)
    got = run(llm, [*others, needle], [no_plp] * 4)[3][:2]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want, "preemption"
    del llm
    torch.cuda.empty_cache()


def _rows_differ(fn, x: torch.Tensor, ms: tuple[int, ...] = (1, 3, 17, 64)) -> bool:
    """Whether row 0 of ``fn(x[:m])`` differs from row 0 of ``fn(x)`` for some m."""
    full = fn(x)[0]
    return any(not torch.equal(fn(x[:m])[0], full) for m in ms)


def test_normal_mode_varies_with_the_batch_and_the_mode_does_not():
    """The negative control, op by op: cuBLAS picks its kernel (split-K included) by M, and
    torch's row reductions split a long row over several CTAs when there are few rows."""
    torch.manual_seed(0)
    a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(256, 129280, device="cuda") * 3
    ops = [lambda t: F.linear(t, w), lambda t: t.sum(-1), lambda t: torch.log_softmax(t, -1),
           lambda t: torch.logsumexp(t, -1)]
    inputs = [a, logits, logits, logits]
    normal = [_rows_differ(op, x, (1, 3, 17, 64, 1000)) for op, x in zip(ops, inputs)]
    with batch_invariant.batch_invariant_mode():
        for op, x in zip(ops, inputs):
            assert not _rows_differ(op, x, (1, 3, 17, 64, 1000))
        # The mode's products still compute the product.
        torch.testing.assert_close(F.linear(a[:8], w).float(), (a[:8].float() @ w.float().t()),
                                   rtol=2e-2, atol=2e-1)
    print("normal mode differs with the batch for [linear, sum, log_softmax, logsumexp]:", normal)
    assert any(normal), "the stock CUDA kernels gave the same bits for every M: no negative control here"


def test_bf16_kernels_keep_a_row_whatever_the_batch():
    """The mode's kernels at DeepSeek-V4-Flash-like widths in bf16 (tensor-core MMAs, which the
    interpreter tests cannot reach): a row's bits alone equal its bits among others."""
    from deepinfer.kernels import batch_invariant_ops as ops
    from deepinfer.kernels.fused_moe import fused_moe
    from deepinfer.kernels.paged_attention import paged_attention, paged_decode_attention_invariant
    from deepinfer.kernels.sparse_attention import invariant_config, sparse_attention

    from ..kernels.test_paged_attention import build_cache

    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    x = torch.randn(1000, 4096, device=dev, dtype=bf16)
    w = torch.randn(2048, 4096, device=dev, dtype=bf16)
    full = ops.mm(x, w.t())
    for m in (1, 3, 17, 64):
        assert torch.equal(ops.mm(x[:m], w.t()), full[:m]), m
    assert torch.equal(ops.mm(x[700:701], w.t())[0], full[700])

    # Paged attention (GQA 32 / 8, D = 128): the last token of a 300-token prompt, as a decode,
    # and as the last of a 7-token chunk beside another sequence's chunk.
    gen = torch.Generator().manual_seed(1)
    lens = [300, 40]
    cache, table = build_cache(lens, 16, 8, 128, gen)
    cache, table = cache.to(dev, bf16), table.to(dev)
    q = torch.randn(300, 32, 128, generator=gen).to(dev, bf16)
    whole = paged_attention(q, cache, table[:1], [0, 300], lens[:1], 0.088, invariant=True)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    decoded = paged_decode_attention_invariant(torch.stack([q[-1], q[0]]), cache, table, lens_t, 0.088)
    assert torch.equal(decoded[0], whole[-1])
    chunk = torch.cat([q[-7:], torch.randn(5, 32, 128, generator=gen).to(dev, bf16)])
    got = paged_attention(chunk, cache, table, [0, 7, 12], lens, 0.088, invariant=True)
    assert torch.equal(got[6], whole[-1])

    # Sparse attention (64 heads x 512, MQA): one token alone and among 16 with wider slot rows.
    kv = torch.randn(64, 64, 1, 1, 512, device=dev, dtype=bf16)
    sinks = torch.randn(64, device=dev)
    q1 = torch.randn(1, 64, 512, device=dev, dtype=bf16)
    row = torch.randperm(64 * 64, device=dev)[:600]
    alone = sparse_attention(q1, [(kv, row[None])], sinks, 0.044, config=invariant_config(q1))
    qs = torch.randn(17, 64, 512, device=dev, dtype=bf16)
    qs[4] = q1[0]
    slots = torch.randint(0, 64 * 64, (17, 1100), device=dev)
    slots[4] = -1
    slots[4, :600] = row
    many = sparse_attention(qs, [(kv, slots)], sinks, 0.044, config=invariant_config(qs))
    assert torch.equal(many[4], alone[0])

    # Fused MoE: a token's output alone and among 16 and 300 others routed elsewhere too.
    e, h, i, k = 16, 1024, 512, 4
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=bf16) * 0.03
    down = torch.randn(e, h, i, device=dev, dtype=bf16) * 0.03
    xm = torch.randn(301, h, device=dev, dtype=bf16)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(301)])
    tw = torch.rand(301, k, device=dev)
    want = fused_moe(xm[:1], gate_up, down, tw[:1], ids[:1], invariant=True)
    for m in (17, 301):
        assert torch.equal(fused_moe(xm[:m], gate_up, down, tw[:m], ids[:m], invariant=True)[0], want[0]), m


@pytest.mark.parametrize("varlen", [False, True], ids=["full", "varlen"])
def test_speculative_decoding_in_the_mode(varlen):
    """The embedded DeepSeek-V4.1 with its DSpark drafter in the mode on CUDA: a greedy and a
    seeded sampled request's tokens and logprobs are bitwise the same alone, inside a batch,
    eager and from CUDA graphs (verification steps replayed), and without speculation, with
    full-width and with confidence-scheduled (varlen) verification."""
    needle = [(7 * i) % 290 + 1 for i in range(40)]
    others = [[(3 * i) % 290 + 2 for i in range(n)] for n in (5, 33, 70)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, logprobs=3, ignore_eos=True)]
    other = SamplingParams(max_tokens=24, temperature=1.0, seed=9, logprobs=1, ignore_eos=True)
    spec = {"method": "dspark", "num_speculative_tokens": 4, "varlen": varlen}

    llm = make("v41", enable_prefix_caching=False)
    plain = [run(llm, [needle], [p])[0][:2] for p in params]
    del llm
    torch.cuda.empty_cache()

    llm = make("v41", enable_prefix_caching=False, speculative_config=spec)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None
    assert [run(llm, [needle], [p])[0][:2] for p in params] == plain, "speculation changed the needle"
    for p, want in zip(params, plain):
        got = run(llm, [others[0], needle, *others[1:]], [other, p, other, params[0]])[1][:2]
        assert got == want, "the needle changed inside a batch with speculation"
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert runner.verify_graph_steps > 0, "verification steps replayed graphs"
    del llm
    torch.cuda.empty_cache()

    llm = make("v41", enable_prefix_caching=False, speculative_config=spec, enforce_eager=True)
    assert [run(llm, [needle], [p])[0][:2] for p in params] == plain, "eager speculation differs"
    del llm
    torch.cuda.empty_cache()
