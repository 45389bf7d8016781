"""DeepSeek-V4's own DSpark drafter in the engine (speculative_config method="dspark" on a V4
checkpoint that ships it), on the tiny V4 DSpark checkpoint of tests/models/v4_dspark_checkpoint.py.
No official V4 DSpark outputs exist, so: output with speculation equals output without it
(greedy and seeded sampling, through chunked prefill, small pages, prefix-cache hits and the
FP8 KV records), the acceptance counters move, and every proposal the engine makes equals the
drafter module's run standalone on a full forward's features at that position.

Random drafts are almost never right, so the acceptance tests use a drafter whose Markov head
knows the target's greedy bigrams (``write_bigram_checkpoint``): its drafts are often, not
always, right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v4 import FeatureCapture
from deepinfer.models.dspark import window_positions

from ..models.v4_dspark_checkpoint import BLOCK, write_bigram_checkpoint, write_checkpoint

VOCAB = 1000
DSPARK = {"method": "dspark", "num_speculative_tokens": BLOCK}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=20, ignore_eos=True)
SETTINGS = {
    "default": {},
    # Chunks of 16 tokens and pages of 4: drafts cross page boundaries, the 32-token window slides.
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
}


def prompts(count: int = 4) -> list[list[int]]:
    lengths = [11, 29, 5, 40, 17, 23][:count]
    return [[(7 * i + 13 * j + 3) % VOCAB for j in range(n)] for i, n in enumerate(lengths)]


def run(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("v4dspark") / "random")


@pytest.fixture(scope="module")
def bigram_ckpt(tmp_path_factory, random_ckpt) -> Path:
    base = LLM(model=str(random_ckpt), device="cpu", dtype="float32")
    return write_bigram_checkpoint(tmp_path_factory.mktemp("v4dspark") / "bigram",
                                   list(zip(prompts(), run(base, prompts()))))


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_greedy_output_with_v4_dspark_equals_without(bigram_ckpt, settings):
    base = LLM(model=str(bigram_ckpt), device="cpu", dtype="float32", **settings)
    want = run(base, prompts())
    spec = LLM(model=str(bigram_ckpt), device="cpu", dtype="float32", speculative_config=DSPARK, **settings)
    assert spec.engine.runner.drafter.module.round_kv == (settings.get("kv_cache_dtype") == "fp8")
    assert run(spec, prompts()) == want
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Again: the prompts hit the prefix cache, whose pages bring the drafter's context rows.
    again = spec.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0
    kv = spec.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_seeded_sampling_with_v4_dspark_equals_without(bigram_ckpt):
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    base = LLM(model=str(bigram_ckpt), device="cpu", dtype="float32")
    ps = prompts()
    want = run(base, [ps[0], ps[3]], SEEDED)
    spec = LLM(model=str(bigram_ckpt), device="cpu", dtype="float32", speculative_config=DSPARK)
    assert run(spec, [ps[0]], SEEDED)[0] == want[0]
    # Among other requests (unseeded ones drawing from the engine's generator).
    outs = spec.generate([{"prompt_token_ids": p} for p in ps], [SEEDED, other, other, SEEDED], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == want
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_rejected_drafts_leave_no_trace_in_the_target_logprobs(bigram_ckpt, monkeypatch):
    """Every draft replaced by a random token (all rejected): greedy tokens equal plain decode's and
    the target's logprobs agree with it to float32 summation order (the verification layout alone
    differs), so nothing a rejected draft wrote (KV rows, compressor windows, the drafter's context
    rows) reaches a later step."""
    from deepinfer.spec.dspark import DSparkEngineDrafter

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    ps = prompts()

    def taken(llm: LLM) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    want = taken(LLM(model=str(bigram_ckpt), device="cpu", dtype="float32"))
    real = DSparkEngineDrafter.draft
    gen = torch.Generator().manual_seed(1)

    def random_drafts(self, rows):
        out = real(self, rows)
        out.tokens.copy_(torch.randint(0, VOCAB, out.tokens.shape, generator=gen))
        return out

    monkeypatch.setattr(DSparkEngineDrafter, "draft", random_drafts)
    spec = LLM(model=str(bigram_ckpt), device="cpu", dtype="float32", speculative_config=DSPARK)
    got = taken(spec)
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 40 and stats.num_accepted_tokens <= stats.num_draft_tokens // 20
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("settings", [pytest.param(v, id=k, marks=() if k == "default" else pytest.mark.slow)
                                      for k, v in SETTINGS.items()])
def test_engine_drafts_equal_the_module_standalone(random_ckpt, settings):
    """Every proposal (its context rows written by the target's steps into the paged cache,
    through chunked prefill, page boundaries and prefix hits) equals the drafter module's from
    one full forward of the sequence (its features, context rows of positions s - 31 .. s,
    anchor at s + 1), and not the one a context shifted by a position would give."""
    llm = LLM(model=str(random_ckpt), device="cpu", dtype="float32", speculative_config=DSPARK, **settings)
    drafter = llm.engine.runner.drafter
    seen: list[tuple[str, int, int, list[int]]] = []
    propose = drafter.propose

    def recording(state, commit, ctx, generator, **kwargs):
        tokens = propose(state, commit, ctx, generator, **kwargs)
        lasts = ctx.positions[commit.last_rows]
        seen.extend(zip(commit.req_ids, lasts.tolist(), commit.anchors.tolist(), tokens.tolist()))
        return tokens

    drafter.propose = recording
    ps = prompts()
    outs = run(llm, ps)
    assert run(llm, ps) == outs                           # the second run hits the prefix cache
    module, model, w = drafter.module, llm.engine.model, drafter.window
    rows = {}
    for i, (p, out) in enumerate(zip(ps, outs)):
        seq = torch.tensor(p + out)
        capture = FeatureCapture.new(module.cfg.target_layer_ids, torch.arange(len(seq)), 128, torch.float32)
        model.forward_streams(seq, ForwardContext.no_cache([len(seq)], torch.device("cpu")), capture)
        rows[i] = (seq, module.context_kv(capture.out, torch.arange(len(seq))))          # [S, L, D]
    checked = shifted = 0
    for req_id, last, anchor, tokens in seen:
        seq, context = rows[int(req_id) % len(ps)]
        if last + 1 >= len(seq):
            continue                                     # the last proposal drafts past the output
        assert anchor == seq[last + 1]
        for s, count in ((last, False), (last - 1, True)):
            pos, valid = window_positions(torch.tensor([s]), w)
            got = module.propose(torch.tensor([anchor]), torch.tensor([last + 1]), context[:, pos], valid)
            if count:
                shifted += got.tokens[0].tolist() != tokens
            else:
                assert got.tokens[0].tolist() == tokens, (req_id, last)
        checked += 1
    assert checked >= 2 * 4 * 20 and shifted > checked // 2


def test_methods_refused_by_checkpoint(random_ckpt):
    """A V4 DSpark checkpoint refuses method='mtp' (its mtp.* blocks are the DSpark drafter, not
    MTP layers); a V4 checkpoint without DSpark refuses method='dspark'."""
    from ..models.v4_dspark_checkpoint import TINY_V4

    with pytest.raises(NotImplementedError, match="DSpark drafter.*method='dspark'"):
        LLM(model=str(random_ckpt), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no DSpark module.*dspark_block_size"):
        LLM(model=str(TINY_V4), device="cpu", speculative_config=DSPARK)
