"""The chained MTP drafter (spec/mtp.py) through the whole engine, on a tiny random
DeepSeek-V3 checkpoint with MTP tensors: greedy output with MTP drafts equals greedy output
without speculation through batching, chunked prefill with small pages, prefix-cache hits
and preemption; the engine's drafts equal the MTP module's run directly (no cache) on the
same hidden states and tokens, chain included; seeded sampling is reproducible; every block
returns to the pool; the counters count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import flatten_text_config
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.forward_context import ForwardContext

from ..models.test_deepseek_v3 import add_tensors, hf_mtp_model, mtp_checkpoint_tensors
from .test_deepseek_engine import save_with_tokenizer

VOCAB = flatten_text_config(json.loads((Path(DEFAULT_MODEL) / "config.json").read_text()))["vocab_size"]
MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SETTINGS = {
    "batched": {},
    # Chunks of 16 tokens and pages of 4: chains cross page boundaries, into lookahead blocks.
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    # A pool small enough to preempt (and to refuse lookahead blocks at times).
    "preempting": {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 26, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def v3_mtp_dir(tmp_path_factory) -> Path:
    """A tiny random DeepSeek-V3 with one MTP module (random, HF MtpModel's layout), saved
    with the embedded model's tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                           topk_group=1, first_k_dense_replace=1, max_position_embeddings=512,
                           tie_word_embeddings=False, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = save_with_tokenizer(model, tmp_path_factory.mktemp("v3mtp") / "ckpt")
    add_tensors(path, mtp_checkpoint_tensors(model, hf_mtp_model(model), cfg.num_hidden_layers))
    return path


@pytest.fixture(scope="module")
def v3_repeat_dir(v3_mtp_dir, tmp_path_factory) -> Path:
    """The same target with an MTP module that drafts "the anchor again": its block adds
    nothing (o_proj and every down_proj zero), eh_proj passes the token's normed embedding
    through, and its head is the embedding matrix, so draft k is the anchor. The target's
    greedy text runs into repeated tokens, where these drafts are accepted, and leaves them,
    where they are rejected: steps commit varying numbers of drafts (the random module
    accepts none)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("v3repeat") / "ckpt"
    shutil.copytree(v3_mtp_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.2."
    for name, t in tensors.items():
        if name.startswith(prefix) and (name.endswith("down_proj.weight") or name.endswith("o_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    h = tensors[prefix + "enorm.weight"].shape[0]
    tensors[prefix + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    tensors[prefix + "shared_head.head.weight"] = tensors[prefix + "embed_tokens.weight"].clone()
    for norm in ("enorm.weight", "shared_head.norm.weight"):
        tensors[prefix + norm] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def prompts(count: int = 4) -> list[list[int]]:
    lengths = [11, 29, 5, 40, 17, 23][:count]
    return [[(7 * i + 13 * j + 3) % VOCAB for j in range(n)] for i, n in enumerate(lengths)]


def run(llm: LLM, ps, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks - 1


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_mtp_greedy_equals_no_speculation(v3_mtp_dir, settings):
    ps = prompts()
    want = tokens(run(LLM(model=str(v3_mtp_dir), device="cpu", **settings), ps))
    spec = LLM(model=str(v3_mtp_dir), device="cpu", speculative_config=MTP, **settings)
    assert type(spec.engine.runner.drafter).__name__ == "MTPEngineDrafter"
    for _ in range(2):                                   # the second run hits the prefix cache
        assert tokens(run(spec, ps)) == want
    assert spec.engine.kv.prefix_hits > 0
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts   # chains of several
    if "num_kv_blocks" in settings:
        assert spec.engine.scheduler.num_preemptions > 0
    assert all_blocks_free(spec)


@pytest.mark.parametrize("settings", [pytest.param(v, marks=pytest.mark.slow) if k == "preempting" else v
                                      for k, v in SETTINGS.items()], ids=SETTINGS.keys())
def test_mtp_greedy_equal_with_accepted_drafts(v3_repeat_dir, settings):
    """With drafts that are often right (see ``v3_repeat_dir``): steps accept some drafts and
    reject others, the MTP KV rolls back with the target's, and greedy output is unchanged."""
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = tokens(run(LLM(model=str(v3_repeat_dir), device="cpu", **settings), ps, params))
    spec = LLM(model=str(v3_repeat_dir), device="cpu", speculative_config=MTP, **settings)
    for _ in range(2):                                   # the second run hits the prefix cache
        assert tokens(run(spec, ps, params)) == want
    stats = spec.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if "num_kv_blocks" in settings:
        assert spec.engine.scheduler.num_preemptions > 0
    assert all_blocks_free(spec)


@torch.no_grad()
def reference_drafts(model, full: list[int], s: int, n: int) -> tuple[list[int], list[float]]:
    """The chained greedy drafts after position ``s`` of ``full`` (its token at s + 1 the
    anchor), from cache-free forwards: the target over ``full[:s+1]``, then MTP module 0
    over rows 0..s+k-1 with hidden [h_0..h_s, o_s, o_{s+1}, ..] and next tokens
    [x_1..x_{s+1}, d_1, ..]. Also each draft's top-2 logit margin."""
    ids = torch.tensor(full[:s + 1])
    hidden = model(ids, ForwardContext.no_cache([s + 1], ids.device))                  # [s+1, H]
    nxt = torch.tensor(full[1:s + 2])
    drafts, margins = [], []
    for k in range(n):
        ctx = ForwardContext.no_cache([len(nxt)], ids.device)
        out = model.mtp(nxt, ctx, previous_hidden=hidden, step=0)                       # [s+1+k, H]
        logits = model.mtp.compute_logits(out[-1:], 0)[0]
        top = logits.topk(2).values
        d = int(logits.argmax())
        drafts.append(d)
        margins.append(float(top[0] - top[1]))
        hidden = torch.cat([hidden, out[-1:]])
        nxt = torch.cat([nxt, torch.tensor([d])])
    return drafts, margins


@pytest.mark.parametrize("settings", [SETTINGS["batched"], SETTINGS["chunked"]], ids=["batched", "chunked"])
def test_mtp_drafts_equal_the_module_run_directly(v3_mtp_dir, settings):
    """Every proposal (its context rows written by the engine's steps into the paged cache,
    through chunks, steps that commit nothing, page boundaries and prefix hits, also one that
    ends where the sequences differ; its chain over lookahead slots) equals MTP module 0
    chained by hand over cache-free forwards at the same position."""
    spec = LLM(model=str(v3_mtp_dir), device="cpu", speculative_config=MTP, **settings)
    drafter = spec.engine.runner.drafter
    seen: list[tuple[str, int, int, list[int]]] = []
    propose = drafter.propose

    def recording(state, commit, ctx, generator, **kwargs):
        drafts = propose(state, commit, ctx, generator, **kwargs)
        lasts = ctx.positions[commit.last_rows]
        seen.extend(zip(commit.req_ids, lasts.tolist(), commit.anchors.tolist(), drafts.tolist()))
        return drafts

    drafter.propose = recording
    ps = prompts()
    lone = [[(5 * j + 1) % VOCAB for j in range(45)]]    # alone: its first chunks commit nothing
    # Shares lone's first 20 tokens, then differs: a hit ending at 20 would bring an MTP entry
    # (position 19) written with lone's token at 20.
    variant = [lone[0][:20] + [(3 * j + 2) % VOCAB for j in range(10)]]
    full = {}
    for batch in (ps, ps, lone, variant):                # the second run hits the prefix cache
        outs = run(spec, batch)
        full.update({o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs})
    if settings.get("block_size") == 4:                  # the hit stops a page short of 20
        assert outs[0].num_cached_tokens == 16
    model = spec.engine.model
    checked = 0
    for req_id, s, anchor, drafts in seen:
        seq = full[req_id]
        assert seq[s + 1] == anchor
        if s + 2 > len(seq) - 1:
            continue
        want, margins = reference_drafts(model, seq, s, len(drafts))
        for d, w, m in zip(drafts, want, margins):
            if m < 1e-3:                                 # a near tie: either token is right
                break
            assert d == w
            checked += 1
    assert checked >= 100


def test_mtp_seeded_sampling_is_reproducible(v3_mtp_dir):
    """A seeded request's tokens with sampled MTP drafts depend only on its prompt and seed:
    the same alone and among other requests, run after run."""
    llm = LLM(model=str(v3_mtp_dir), device="cpu", speculative_config=MTP)
    ps = prompts()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = tokens(run(llm, ps[:1], seeded))[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], [seeded, other, other, seeded], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert tokens(run(llm, ps[:1], seeded))[0] == alone
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    assert all_blocks_free(llm)


def test_mtp_needs_a_v3_checkpoint_with_the_module(tmp_path, v3_mtp_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(v3_mtp_dir, bare)
    tensors = load_file(str(bare / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")},
              str(bare / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no MTP module"):
        LLM(model=str(bare), device="cpu", speculative_config=MTP)
    with pytest.raises(NotImplementedError, match="method='mtp'"):
        LLM(device="cpu", speculative_config=MTP)        # the embedded DeepSeek-V4.1
