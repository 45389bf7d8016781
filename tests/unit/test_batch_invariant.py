"""Batch-invariant mode: the switch, the CPU ops, and bitwise-equal engine outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer import batch_invariant, env
from deepinfer.entrypoints.cli import build_parser, engine_kwargs
from deepinfer.entrypoints.llm import LLM, build_engine_config
from deepinfer.sampling_params import SamplingParams

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "eos_token_id": 299,
         "hidden_act": "silu", "tie_word_embeddings": False}


# The other covered architectures on random weights; Mistral with a sliding window shorter
# than the needle. (DeepSeek-V4 and V4.1 run from checkpoints: test_deepseek_checkpoints.)
ARCHITECTURES = {"LlamaForCausalLM": {},
                 "Qwen3ForCausalLM": {"model_type": "qwen3", "head_dim": 16},
                 "MistralForCausalLM": {"model_type": "mistral", "sliding_window": 48},
                 "Qwen3MoeForCausalLM": {"model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 32,
                                         "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                                         "norm_topk_prob": True, "mlp_only_layers": []},
                 "DeepseekV3ForCausalLM": {"model_type": "deepseek_v3", "moe_intermediate_size": 32,
                                           "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24,
                                           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                                           "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
                                           "num_nextn_predict_layers": 0}}
DATA = Path(__file__).resolve().parent.parent / "data"


def llama(arch: str = "LlamaForCausalLM", **options) -> LLM:
    config = {**LLAMA, **ARCHITECTURES[arch], "architectures": [arch]}
    return LLM("tiny", hf_config=config, load_format="dummy", skip_tokenizer_init=True,
               device="cpu", seed=3, cpu_kv_cache_bytes=16 << 20, **options)


def test_plain_cpu_matmul_varies_with_batch_and_the_mode_does_not():
    """The problem is real on this CPU: a row computed alone differs from the same row in a
    larger call (M = 1 differed for every shape measured). The engine-level comparison in
    normal mode may happen to agree for a tiny model, so the negative control is op-level."""
    torch.manual_seed(0)
    a, w, b = torch.randn(40, 256), torch.randn(512, 256), torch.randn(512)
    assert not torch.equal(F.linear(a[:1], w), F.linear(a, w)[:1])
    with batch_invariant.batch_invariant_mode():
        full, full_b = F.linear(a, w), F.linear(a, w, b)
        batched = F.linear(a.view(4, 10, 256), w).reshape(40, -1)
        for m in (1, 2, 3, 5, 7, 16, 17):
            assert torch.equal(F.linear(a[:m], w), full[:m])
            assert torch.equal(F.linear(a[:m], w, b), full_b[:m])
            assert torch.equal(batched[:m], full[:m])
        perm = torch.randperm(40)
        assert torch.equal(F.linear(a[perm], w), full[perm])
        x, y = torch.randn(3, 40, 64), torch.randn(3, 64, 30)
        assert torch.equal(torch.bmm(x[:, :3], y), torch.bmm(x, y)[:, :3])
        rows = torch.randn(40, 5000)
        for op in (lambda t: t.softmax(-1), lambda t: torch.log_softmax(t, -1),
                   lambda t: t.pow(2).mean(-1, keepdim=True), lambda t: t.sum(-1)):
            assert torch.equal(op(rows[:1]), op(rows)[:1])
        # Reductions over other dims run the stock kernels, with the stock results.
        assert torch.equal(rows.sum(0), torch.ops.aten.sum.IntList_out(rows, [0], False, out=torch.empty(5000)))
    assert not batch_invariant.enabled()


def test_mode_is_scoped_and_reentrant():
    a, w = torch.randn(40, 256), torch.randn(512, 256)
    with batch_invariant.batch_invariant_mode():
        with batch_invariant.batch_invariant_mode():
            assert batch_invariant.enabled()
        assert batch_invariant.enabled()
        assert torch.equal(F.linear(a[:1], w), F.linear(a, w)[:1])
    assert not batch_invariant.enabled()
    # The stock kernel is back: the M = 1 row differs again.
    assert not torch.equal(F.linear(a[:1], w), F.linear(a, w)[:1])


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
             [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs or []])
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_engine_outputs_are_bitwise_equal_alone_batched_and_chunked(arch):
    # The needle spans two attention key tiles, so chunk and tile boundaries both fall inside it.
    needle = [(7 * i) % 290 + 1 for i in range(90)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=3)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=11, logprobs=5, prompt_logprobs=3)
    others = [[(3 * i) % 290 + 2 for i in range(n)] for n in (5, 33, 130)]
    for params in (greedy, seeded):
        alone = _run(llama(arch, batch_invariant=True), [needle], [params])[0]
        batched = _run(llama(arch, batch_invariant=True), [others[0], needle, *others[1:]],
                       [greedy, params, seeded, greedy])
        chunked = _run(llama(arch, batch_invariant=True, max_num_batched_tokens=16, block_size=16),
                       [*others, needle], [greedy, seeded, greedy, params])
        assert batched[1] == alone
        assert chunked[3] == alone
        assert len(alone[0]) == 8 and len(alone[2]) == 90


# DeepSeek-V4.1 (the embedded model, trained; DeepSeek's tiny reference checkpoint with its
# compressed ratio-2 / ratio-1 sources, indexers and engram) and DeepSeek-V4 (the tiny trained
# one: sliding, CSA and HCA layers, hash routing).
CHECKPOINTS = {"embedded-v41": (None, {}),
               "reference-v41": (str(DATA / "v41_reference" / "checkpoint"),
                                 {"dtype": "float32", "kv_cache_dtype": "float32"}),
               "tiny-v4": (str(DATA / "tiny-v4-model"), {})}


# The embedded V4.1 (35 s on 2 cores) only in the slow run: reference-v41 covers V4.1 by default.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "embedded-v41" else n
                                  for n in CHECKPOINTS])
def test_deepseek_checkpoints(name):
    """Alone, inside a batch, chunked, after a prefix-cache hit and after preemption: the
    needle's greedy tokens, logprobs and prompt logprobs are bitwise the same."""
    model, options = CHECKPOINTS[name]
    vocab = 300
    needle = [(7 * i) % vocab + 1 for i in range(70)]
    others = [[(3 * i) % vocab + 2 for i in range(n)] for n in (5, 33, 100)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, prompt_logprobs=2)

    def make(**more) -> LLM:
        return LLM(model=model, device="cpu", batch_invariant=True, **options, **more)

    alone = _run(make(), [needle], [greedy])[0]
    assert _run(make(), [others[0], needle, *others[1:]], [greedy] * 4)[1] == alone
    assert _run(make(max_num_batched_tokens=16, block_size=16), [*others, needle], [greedy] * 4)[3] == alone
    # A prefix hit: the needle's first 48 tokens come from another request's blocks (requests
    # with prompt logprobs compute every position, so these ask for none).
    no_plp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=4, ignore_eos=True)
    want = _run(make(), [needle], [no_plp])[0][:2]
    hit = make(block_size=16)
    _run(hit, [needle[:50] + [5, 6, 7]], [no_plp])
    after = hit.generate([{"prompt_token_ids": needle}], no_plp, use_tqdm=False)[0]
    assert after.num_cached_tokens >= 32
    assert [after.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()}
                                         for pos in after.outputs[0].logprobs]] == list(want)
    # Preemption: a pool too small for all four at once.
    tight = make(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    got = _run(tight, [*others, needle], [no_plp] * 4)[3][:2]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


def test_normal_mode_differs_for_the_same_comparison():
    """The negative control at engine level: on the CPUs measured, the needle's logprobs in
    normal mode change with its batch and its chunking (the op-level control above is the
    one that holds by construction)."""
    needle = [(7 * i) % 290 + 1 for i in range(90)]
    others = [[(3 * i) % 290 + 2 for i in range(n)] for n in (5, 33, 130)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=3)
    alone = _run(llama(), [needle], [greedy])[0]
    batched = _run(llama(), [others[0], needle, *others[1:]], [greedy] * 4)[1]
    chunked = _run(llama(max_num_batched_tokens=16, block_size=16), [*others, needle], [greedy] * 4)[3]
    assert batched != alone and chunked != alone


def test_switch_from_env_arg_and_cli(monkeypatch):
    assert build_engine_config("x", hf_config=dict(LLAMA), load_format="dummy", device="cpu").batch_invariant is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert env.batch_invariant() is True
    assert build_engine_config("x", hf_config=dict(LLAMA), load_format="dummy", device="cpu").batch_invariant is True
    assert build_engine_config("x", hf_config=dict(LLAMA), load_format="dummy", device="cpu",
                               batch_invariant=False).batch_invariant is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT='yes'"):
        env.batch_invariant()
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")
    with pytest.raises(ValueError, match="batch_invariant=1 must be True or False"):
        build_engine_config("x", hf_config=dict(LLAMA), load_format="dummy", device="cpu", batch_invariant=1)
    for command in ("generate", "serve"):
        extra = ["--prompt", "hi"] if command == "generate" else []
        on = build_parser().parse_args([command, *extra, "--batch-invariant"])
        off = build_parser().parse_args([command, *extra])
        assert engine_kwargs(on)["batch_invariant"] is True
        assert engine_kwargs(off)["batch_invariant"] is None
    assert llama(batch_invariant=True).engine.config.batch_invariant is True


def test_refused_where_not_built(monkeypatch):
    cuda = torch.device("cuda")          # the device is taken as given (no CUDA needed)
    assert batch_invariant.CUDA_ARCHITECTURES == batch_invariant.CPU_ARCHITECTURES
    for arch in sorted(batch_invariant.CUDA_ARCHITECTURES):
        batch_invariant.check_supported(cuda, arch)
    with pytest.raises(NotImplementedError, match="cuda with GPT2LMHeadModel: this model's CUDA forward"):
        batch_invariant.check_supported(cuda, "GPT2LMHeadModel")
    with pytest.raises(NotImplementedError, match="cuda with 2 ranks"):
        batch_invariant.check_supported(cuda, "LlamaForCausalLM", world_size=2)
    # Speculative decoding is not refused (tests/gpu/test_batch_invariant_gpu.py runs it on CUDA).
    build_engine_config("x", hf_config=dict(LLAMA), load_format="dummy", device=cuda, batch_invariant=True,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    with pytest.raises(NotImplementedError, match="DEEPINFER_KERNEL_BACKEND=torch"):
        batch_invariant.check_supported(cuda, "LlamaForCausalLM")
    with pytest.raises(NotImplementedError, match="built for cpu and cuda only"):
        batch_invariant.check_supported(torch.device("mps"), "LlamaForCausalLM")
    # An architecture whose CPU forward is not covered.
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*not made batch-invariant"):
        batch_invariant.check_supported(torch.device("cpu"), "GPT2LMHeadModel")


@pytest.mark.parametrize("varlen", [pytest.param(False, marks=pytest.mark.slow), True])
def test_speculative_decoding_in_the_mode(varlen):
    """With DSpark drafts, a seeded request's tokens and logprobs are bitwise the same alone,
    in a batch, and without speculation: verification is exact match against the sampler's
    keyed draws, and a position's logits do not depend on the width of the step that
    computed it. With varlen verification the widths follow the batch's confidences, so the
    same holds whatever width each step verified."""
    needle = [(7 * i) % 300 + 1 for i in range(40)]
    others = [[(3 * i) % 300 + 2 for i in range(n)] for n in (5, 33)]
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, logprobs=3)
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=9, logprobs=1)
    spec = {"method": "dspark", "num_speculative_tokens": 4, "varlen": varlen}
    plain = _run(LLM(device="cpu", batch_invariant=True), [needle], [seeded])[0][:2]
    llm = LLM(device="cpu", batch_invariant=True, speculative_config=spec)
    alone = _run(llm, [needle], [seeded])[0][:2]
    assert alone == plain
    assert _run(llm, [others[0], needle, others[1]], [other, seeded, other])[1][:2] == alone
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_deepseek_v3_absorbed_attention_in_the_mode_with_the_kernels(monkeypatch):
    """DeepSeek-V3 with the Triton kernels (the interpreter here, as on CUDA): in the mode every
    token attends in the absorbed form as a row of its own through the MLA kernel's unsplit
    config, so the needle's tokens and logprobs are bitwise the same alone, batched and chunked,
    and prompt tokens took that path too (not only decode steps)."""
    from deepinfer.kernels import backend
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    rows: list[int] = []
    real = backend.mla_decode

    def spy(q, *args):
        rows.append(q.shape[0])
        return real(q, *args)

    monkeypatch.setattr(backend, "mla_decode", spy)
    needle = [(7 * i) % 290 + 1 for i in range(40)]
    others = [[(3 * i) % 290 + 2 for i in range(n)] for n in (5, 21)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=11, logprobs=3)
    arch = "DeepseekV3ForCausalLM"
    alone = _run(llama(arch, batch_invariant=True), [needle], [greedy])[0]
    assert max(rows) == len(needle), "the prompt's tokens attended in the absorbed form, one row each"
    assert _run(llama(arch, batch_invariant=True), [others[0], needle, others[1]], [seeded, greedy, seeded])[1] == alone
    assert _run(llama(arch, batch_invariant=True, max_num_batched_tokens=16, block_size=16),
                [*others, needle], [seeded, seeded, greedy])[2] == alone
