"""Sampler: processors against hand-computed values and HF transformers' processors,
filters against the kept sets computed independently, the draw against softmax
frequencies, seeded batch invariance, logprobs against log_softmax."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from deepinfer.kernels import backend
from deepinfer.kernels.reference import apply_min_p, apply_top_k, apply_top_p
from deepinfer.runner.sampler import Sampler, SamplingRow, prompt_logprobs, stream_seed
from deepinfer.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 2


def row(prompt=(5, 6), output=(), stream_index=0, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), stream_index)


def rand_logits(n, v, seed=0, scale=2.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * scale).to(device)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def kept_set_top_p(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens with total >= p, in float64."""
    order = probs.double().argsort(descending=True).tolist()
    kept, total = set(), 0.0
    for t in order:
        kept.add(t)
        total += float(probs[t])
        if total >= p:
            break
    return kept


# -- greedy, padding, shape checks ----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_padding_never_chosen(device):
    v, pad = 50, 14
    logits = rand_logits(6, v + pad, device=device)
    logits[:, v:] = 1e4                      # padding columns would win every draw if kept
    s = Sampler(v, {EOS}, seed=1, device=device)
    rows = [row(temperature=0.0), row(temperature=0.0, logprobs=3), row(), row(top_k=3),
            row(temperature=0.0), row(seed=4)]
    out = s(logits, rows)
    expect = logits[:, :v].argmax(-1).tolist()
    for i in (0, 1, 4):
        assert out.token_ids[i] == expect[i]
    assert all(0 <= t < v for t in out.token_ids)
    ref = torch.log_softmax(logits[:, :v].float(), -1)   # normalised over the real vocabulary only
    for i, t in enumerate(out.token_ids):
        assert out.sampled_logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)
    # Many random draws with a flat distribution over the real vocabulary: still never padding.
    flat = torch.zeros(2000, v + pad, device=device)
    flat[:, v:] = 1e4
    toks = s(flat, [row() for _ in range(2000)]).token_ids
    assert max(toks) < v and len(set(toks)) > v // 2


@pytest.fixture
def greedy_calls(monkeypatch) -> list[tuple]:
    """The arguments of each backend.greedy_sample call (the sampler's fast path)."""
    calls: list[tuple] = []
    real = backend.greedy_sample
    monkeypatch.setattr(backend, "greedy_sample", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_plain_greedy_batch_takes_the_fast_path(device, greedy_calls):
    v, pad = 50, 14
    logits = rand_logits(5, v + pad, seed=3, device=device)
    logits[:, v:] = 1e4
    s = Sampler(v, {EOS}, seed=1, device=device)
    rows = [row(temperature=0.0, output=[1] * i, min_tokens=2, repetition_penalty=1.0) for i in range(2, 7)]
    out = s(logits, rows)
    assert len(greedy_calls) == 1
    assert out.token_ids == logits[:, :v].argmax(-1).tolist()
    ref = torch.log_softmax(logits[:, :v], -1)
    for i, t in enumerate(out.token_ids):
        assert out.sampled_logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert out.logprobs == [None] * 5
    # The general path (logprobs asked for, here none) gives the same tokens and logprobs.
    general = s(logits, [row(temperature=0.0, logprobs=0) for _ in range(5)])
    assert len(greedy_calls) == 1
    assert general.token_ids == out.token_ids
    assert general.sampled_logprobs == pytest.approx(out.sampled_logprobs, abs=1e-5)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(logprobs=2), dict(logit_bias={7: 0.5}),
                                dict(min_tokens=1), dict(repetition_penalty=1.2),
                                dict(frequency_penalty=0.5), dict(presence_penalty=-0.5), "grammar"])
def test_rows_that_need_more_go_the_general_way_beside_plain_greedy_rows(kw, greedy_calls):
    """A row beyond plain greedy takes the general path; the plain greedy rows beside it still
    take the greedy pass, so their tokens and logprobs are bit for bit those they get alone,
    wherever they sit in the batch."""
    v = 40
    logits = rand_logits(4, v, seed=5)
    s = Sampler(v, {EOS}, seed=3)
    plain = [row(temperature=0.0) for _ in range(3)]
    fast = s(logits[:3], plain)
    assert len(greedy_calls) == 1
    grammar = kw == "grammar"
    other = row(**{"temperature": 0.0, **({} if grammar else kw)})
    other.grammar = grammar
    bitmask = torch.full((4, (v + 31) // 32), -1, dtype=torch.int32) if grammar else None
    if grammar:
        bitmask[1, 0] = 0                   # the other row (position 1 below) may not take tokens 0..31
    order = [0, 3, 1, 2]                    # the other row second
    out = s(logits[order], [plain[0], other, plain[1], plain[2]], bitmask)
    assert len(greedy_calls) == 2 and greedy_calls[1][0].shape[0] == 3
    assert [out.token_ids[i] for i in (0, 2, 3)] == fast.token_ids
    assert [out.sampled_logprobs[i] for i in (0, 2, 3)] == fast.sampled_logprobs
    assert 0 <= out.token_ids[1] < v
    alone = s(logits[3:], [other], None if bitmask is None else bitmask[1:2])
    if kw != dict(temperature=0.7):         # deterministic: the same as alone
        assert out.token_ids[1] == alone.token_ids[0]
        assert out.sampled_logprobs[1] == alone.sampled_logprobs[0]
    if grammar:
        assert out.token_ids[1] >= 32
    assert [d is not None for d in out.logprobs] == [False, kw == dict(logprobs=2), False, False]
    if kw == dict(logprobs=2):
        assert out.logprobs[1] == alone.logprobs[0]


def test_shape_and_device_errors():
    s = Sampler(10, {EOS})
    with pytest.raises(ValueError, match=r"expected \[2, >= vocab_size=10\]"):
        s(torch.randn(3, 10), [row(), row()])
    with pytest.raises(ValueError, match="vocab_size=10"):
        s(torch.randn(2, 9), [row(), row()])
    with pytest.raises(ValueError, match="next tokens"):
        prompt_logprobs(torch.randn(3, 10), [1, 2], 1)


# -- the draw ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_temperature_frequencies_follow_softmax(temperature):
    v, n = 5, 20000
    base = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.5])
    s = Sampler(v, {EOS}, seed=123)
    toks = torch.tensor(s(base.expand(n, v).clone(), [row(temperature=temperature)] * n).token_ids)
    counts = torch.bincount(toks, minlength=v)
    probs = torch.softmax(base / temperature, -1)
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5.
    assert chi_square(counts, probs) < 25.0
    # The hotter distribution is visibly different: this bound can fail.
    other = torch.softmax(base / (temperature * 2), -1)
    assert chi_square(counts, other) > 100.0


def test_tiny_temperature_is_argmax_without_overflow():
    v = 40
    logits = rand_logits(64, v, seed=12, scale=50.0)
    s = Sampler(v, {EOS})
    out = s(logits, [row(temperature=1e-38, top_p=0.9, min_p=0.1)] * 64)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_follow_softmax():
    v, n = 5, 3000
    base = torch.tensor([0.3, 1.1, -0.4, 0.0, -2.0])
    s = Sampler(v, {EOS}, seed=0)
    rows = [row(seed=7, stream_index=i % 10, output=[0] * (i // 10)) for i in range(n)]
    counts = torch.bincount(torch.tensor(s(base.expand(n, v).clone(), rows).token_ids), minlength=v)
    assert chi_square(counts, torch.softmax(base, -1)) < 25.0


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    v = 300
    s_alone = Sampler(v, {EOS}, seed=1, device=device)
    s_batch = Sampler(v, {EOS}, seed=99, device=device)
    seeded = [row(seed=11, output=[3] * 4, temperature=0.9, top_p=0.95),
              row(seed=11, output=[3] * 4, stream_index=1, min_p=0.01),
              row(seed=-3, output=[], top_k=40, presence_penalty=0.5)]
    for trial in range(20):
        logits = rand_logits(len(seeded), v, seed=trial, scale=0.5, device=device)
        alone = [s_alone(logits[i:i + 1], [r]).token_ids[0] for i, r in enumerate(seeded)]
        # Same rows inside a bigger batch of unseeded and greedy rows, in shuffled positions.
        others = rand_logits(5, v, seed=1000 + trial, device=device)
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(trial)).tolist()
        all_logits = torch.cat([logits, others])[perm]
        all_rows = [(seeded + [row(), row(top_k=5), row(temperature=0.0), row(top_p=0.5), row()])[j]
                    for j in perm]
        batched = s_batch(all_logits, all_rows).token_ids
        for pos, j in enumerate(perm):
            if j < len(seeded):
                assert batched[pos] == alone[j], f"trial {trial}: seeded row {j} changed in the batch"


def test_seeded_streams_differ_by_index_and_position():
    v = 1000
    s = Sampler(v, {EOS})
    flat = torch.zeros(20, v)
    by_index = s(flat, [row(seed=5, stream_index=i) for i in range(20)]).token_ids
    by_pos = s(flat, [row(seed=5, output=[1] * i) for i in range(20)]).token_ids
    by_seed = s(flat, [row(seed=i) for i in range(20)]).token_ids
    for toks in (by_index, by_pos, by_seed):
        assert len(set(toks)) >= 15          # 20 draws from 1000 tokens: repeats are rare
    assert s(flat[:1], [row(seed=5, stream_index=3)]).token_ids[0] == by_index[3]
    assert len({stream_seed(5, i, p) for i in range(10) for p in range(10)}) == 100


def test_unseeded_rows_follow_sampler_seed():
    v = 1000
    flat = torch.zeros(20, v)
    a = Sampler(v, {EOS}, seed=3)(flat, [row()] * 20).token_ids
    b = Sampler(v, {EOS}, seed=3)(flat, [row()] * 20).token_ids
    c = Sampler(v, {EOS}, seed=4)(flat, [row()] * 20).token_ids
    assert a == b and a != c


# -- filters ----------------------------------------------------------------------------------------

def test_filters_match_transformers_warpers():
    logits = rand_logits(4, 64, seed=5)
    for k in (1, 3, 20):
        ours = apply_top_k(logits, torch.full((4,), k))
        assert torch.equal(ours, TopKLogitsWarper(k)(None, logits.clone()))
        assert ((ours > float("-inf")).sum(-1) == k).all()
    for p in (0.3, 0.75, 0.95):
        ours = apply_top_p(logits, torch.full((4,), p))
        assert torch.equal(ours, TopPLogitsWarper(p)(None, logits.clone()))
    for mp in (0.05, 0.3):
        ours = apply_min_p(logits, torch.full((4,), mp))
        assert torch.equal(ours, MinPLogitsWarper(mp)(None, logits.clone()))
    # Per-row parameters: each row as if filtered alone.
    ks, ps = torch.tensor([2, 7, 1, 64]), torch.tensor([0.2, 0.9, 0.5, 1.0])
    tk, tp = apply_top_k(logits, ks), apply_top_p(logits, ps)
    for i in range(4):
        assert torch.equal(tk[i], TopKLogitsWarper(int(ks[i]))(None, logits[i:i + 1].clone())[0])
        assert torch.equal(tp[i], TopPLogitsWarper(float(ps[i]))(None, logits[i:i + 1].clone())[0])


@pytest.mark.parametrize("kw", [dict(top_k=4), dict(top_p=0.7), dict(min_p=0.2),
                                dict(top_k=6, top_p=0.8, min_p=0.05, temperature=0.8),
                                dict(top_k=10_000)])
def test_filtered_sampling_keeps_exactly_the_right_set(kw):
    v, n = 16, 6000
    base = rand_logits(1, v, seed=2, scale=1.0)[0]
    params = SamplingParams(**kw)
    # The kept set, computed step by step in float64: min_p, then top_k, then top_p renormalised.
    probs = torch.softmax(base.double() / params.temperature, -1)
    kept = set(range(v))
    if params.min_p:
        kept = {t for t in kept if probs[t] >= params.min_p * probs.max()}
    if params.top_k:
        kept = set(sorted(kept, key=lambda t: -probs[t])[:params.top_k])
    if params.top_p < 1:
        renorm = torch.zeros(v, dtype=torch.float64)
        renorm[list(kept)] = probs[list(kept)] / probs[list(kept)].sum()
        # No partial sum sits near p, so float32 rounding cannot move a token in or out.
        partial = renorm.sort(descending=True).values.cumsum(0)
        assert (partial - params.top_p).abs().min() > 1e-3
        kept = kept_set_top_p(renorm, params.top_p)
    assert 1 <= len(kept) < v or params.top_k >= v
    s = Sampler(v, {EOS}, seed=0)
    toks = set(s(base.expand(n, v).clone(), [SamplingRow(params, [1], [])] * n).token_ids)
    assert toks == kept


def test_top_p_set_by_hand():
    # probs 0.5, 0.25, 0.125, 0.125 -> top_p=0.6 keeps {0, 1}; top_p=0.8 keeps {0, 1, and one 0.125}.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    out = apply_top_p(logits, torch.tensor([0.6]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    out = apply_top_p(logits, torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    # min_p: threshold 0.5 * 0.5 = 0.25 keeps tokens 0 and 1.
    out = apply_min_p(logits, torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


# -- processors -------------------------------------------------------------------------------------

def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    s = Sampler(6, {EOS})
    r = row(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    out = s.process_logits(logits, [r])
    # repetition over prompt+output {0,1,2,3}: positive / 2, negative * 2;
    # then -0.5 * count and -0.25 * present over output {2: 2, 3: 1}.
    expect = [1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 1.0, 3.0]
    assert out[0].tolist() == pytest.approx(expect, abs=1e-6)
    # Frequency / presence ignore prompt tokens.
    out = s.process_logits(logits, [row(prompt=[0, 5], output=[4], frequency_penalty=1.0, presence_penalty=1.0)])
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5, -0.5, -1.0, 3.0], abs=1e-6)
    # Negative penalties reward repetition.
    out = s.process_logits(logits, [row(prompt=[], output=[1, 1], frequency_penalty=-1.5)])
    assert out[0, 1].item() == pytest.approx(2.0)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    v = 40
    g = torch.Generator().manual_seed(9)
    prompts = torch.randint(0, v, (3, 7), generator=g)
    outputs = torch.randint(0, v, (3, 5), generator=g)
    logits = rand_logits(3, v, seed=10)
    s = Sampler(v, {EOS})
    rows = [row(prompt=prompts[i].tolist(), output=outputs[i].tolist(), repetition_penalty=penalty)
            for i in range(3)]
    ours = s.process_logits(logits, rows)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.cat([prompts, outputs], 1), logits.clone())
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def test_logit_bias_and_rows_without_processing_untouched():
    logits = rand_logits(3, 20, seed=3)
    s = Sampler(20, {EOS})
    rows = [row(logit_bias={4: 100.0, 7: -3.5}, temperature=0.0), row(temperature=0.0), row(logit_bias={0: 0.25})]
    out = s.process_logits(logits, rows)
    expect = logits.clone()
    expect[0, 4] += 100.0
    expect[0, 7] -= 3.5
    expect[2, 0] += 0.25
    assert torch.equal(out, expect)
    toks = s(logits, rows).token_ids
    assert toks[0] == 4 and toks[1] == int(logits[1].argmax())


def test_min_tokens_masks_eos_and_stop_ids():
    v = 12
    logits = rand_logits(4, v, seed=4)
    s = Sampler(v, {EOS, 3})
    rows = [row(output=[1], min_tokens=2, stop_token_ids=[7]),           # masked: eos 2, 3 and stop 7
            row(output=[1, 1], min_tokens=2, stop_token_ids=[7]),        # reached min_tokens: nothing masked
            row(output=[], min_tokens=1, stop_token_ids=[7], ignore_eos=True),  # eos does not end it: only 7
            row(output=[], stop_token_ids=[7])]                          # min_tokens=0: nothing
    out = s.process_logits(logits, rows)
    inf = float("-inf")
    assert out[0, [2, 3, 7]].tolist() == [inf] * 3
    masked0 = torch.isinf(out[0])
    assert masked0.sum() == 3
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert out[2, 7] == inf and torch.isinf(out[2]).sum() == 1
    # Even a huge bias on EOS cannot produce it before min_tokens.
    biased = [row(output=[], min_tokens=3, logit_bias={EOS: 100.0}), row(output=[], min_tokens=3, logit_bias={EOS: 100.0},
                                                                       temperature=0.0)]
    for _ in range(20):
        assert EOS not in s(rand_logits(2, v, seed=_), biased).token_ids
    assert s(logits[:1], [row(output=[0, 0, 0], min_tokens=3, logit_bias={EOS: 100.0})]).token_ids == [EOS]


# -- logprobs ---------------------------------------------------------------------------------------

def test_logprobs_are_raw_with_ranks():
    v = 30
    logits = rand_logits(4, v, seed=6)
    s = Sampler(v, {EOS}, seed=2)
    rows = [row(logprobs=5, temperature=1.5, repetition_penalty=1.8, output=[1, 2]),  # processing does not change them
            row(logprobs=0, top_k=3),
            row(logprobs=3, temperature=0.0, logit_bias={int(logits[2].argmin()): 100.0}),
            row()]
    out = s(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[3] is None
    assert out.token_ids[2] == int(logits[2].argmin())        # the bias made the least likely token win
    for i, num in [(0, 5), (1, 0), (2, 3)]:
        entry, tok = out.logprobs[i], out.token_ids[i]
        order = ref[i].argsort(descending=True).tolist()
        top = order[:num]
        assert set(entry) == set(top) | {tok}
        assert len(entry) == num + (tok not in top)
        for rank, t in enumerate(top, start=1):
            assert entry[t].rank == rank
            assert entry[t].logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert entry[tok].rank == order.index(tok) + 1
        assert entry[tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert entry[tok].logprob == out.sampled_logprobs[i]
    assert out.logprobs[2][out.token_ids[2]].rank == v     # the least likely token has rank V


def test_prompt_logprobs():
    v, pad, n = 25, 7, 6
    logits = rand_logits(n, v + pad, seed=8)
    nxt = [3, 0, 24, 7, 7, 11]
    entries = prompt_logprobs(logits, nxt, 2, vocab_size=v)
    ref = torch.log_softmax(logits[:, :v], -1)
    assert len(entries) == n
    for i, (tok, entry) in enumerate(zip(nxt, entries)):
        order = ref[i].argsort(descending=True).tolist()
        assert set(entry) == set(order[:2]) | {tok}
        assert entry[tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert entry[tok].rank == order.index(tok) + 1
        assert entry[order[0]].rank == 1 and entry[order[1]].rank == 2
    only = prompt_logprobs(logits[:, :v], nxt, 0)
    assert [list(e) for e in only] == [[t] for t in nxt]
    assert math.isclose(only[0][3].logprob, entries[0][3].logprob, abs_tol=1e-6)


# -- allowed_token_ids, bad_words -----------------------------------------------------------------

def bad_words_row(words: list[list[int]], output: tuple[int, ...], **kw) -> SamplingRow:
    r = row(output=output, **kw)
    r.params.bad_words_token_ids = words
    return r


def test_allowed_token_ids_and_bad_words_mask_exactly_their_tokens():
    v = 40
    logits = rand_logits(4, v, seed=3)
    s = Sampler(v, {EOS}, seed=0)
    words = [[7], [11, 12, 13]]       # one token: always banned; three: 13 only after 11, 12
    rows = [row(allowed_token_ids=[3, 9, 30]),
            bad_words_row(words, (1, 11, 12)),
            bad_words_row(words, (11, 1, 12)),
            bad_words_row(words, (12,))]
    processed = s.process_logits(logits, rows)
    expect = logits.clone()
    keep = torch.zeros(v, dtype=torch.bool)
    keep[[3, 9, 30]] = True
    expect[0, ~keep] = float("-inf")
    expect[1, [7, 13]] = float("-inf")
    expect[2, 7] = float("-inf")
    expect[3, 7] = float("-inf")
    assert torch.equal(processed, expect)
    # Greedy rows with either option leave the fast path and draw from what is left.
    greedy = [row(temperature=0.0, allowed_token_ids=[3, 9, 30]), bad_words_row(words, (11, 12), temperature=0.0)]
    out = s(logits[:2], greedy)
    assert out.token_ids[0] == int(expect[0].argmax()) and out.token_ids[1] == int(expect[1].argmax())
