"""The prefix scheduler and STS (deepinfer/spec/scheduling.py): a hand-worked
example, properties against a literal Algorithm 1 and a brute-force optimum, and a
toy end-to-end run (Markov target, drafter, scheduler choosing ℓ per request across
a batch, rejection sampling) whose output is distributed as the target. The same
check catches the two known ways to lose losslessness: the scheduler without its
early stop, and a confidence computed from the sampled token's own probability."""

import itertools
import math

import numpy as np
import pytest
import torch

from deepinfer.spec.rejection import random_draws, rejection_sample
from deepinfer.spec.scheduling import (
    SPSTable,
    apply_sts,
    expected_calibration_error,
    fit_sts,
    full_search,
    schedule,
    survival,
    take_top,
)
from tests.unit.test_spec_rejection import ALPHA, chi2_pvalue, race, sequence_codes, softmax_table


def throughput(confidences: np.ndarray, lengths: np.ndarray, sps: SPSTable) -> float:
    """Θ of a choice of lengths, straight from the definition."""
    a = survival(confidences)
    tau = len(lengths) + sum(a[r, :lengths[r]].sum() for r in range(len(lengths)))
    return float(tau * sps(len(lengths) + lengths.sum()))


def literal_algorithm_1(confidences: np.ndarray, sps: SPSTable) -> np.ndarray:
    """Algorithm 1 as written in the paper, one candidate at a time."""
    a = survival(confidences)
    r_count, gamma = a.shape
    cands = sorted(((a[r, j], j, r) for r in range(r_count) for j in range(gamma) if a[r, j] > 0),
                   key=lambda t: (-t[0], t[1], t[2]))
    lengths, best = np.zeros(r_count, dtype=np.int64), np.zeros(r_count, dtype=np.int64)
    batch, tau = r_count, float(r_count)
    theta_best = tau * float(sps(batch))
    for value, j, r in cands:
        lengths[r], batch, tau = j + 1, batch + 1, tau + value
        theta = tau * float(sps(batch))
        if theta <= theta_best:
            break
        theta_best, best = theta, lengths.copy()
    return best


def random_table(rng: np.random.Generator, max_batch: int) -> SPSTable:
    """Decreasing on average but jagged: steps per second at every B up to max_batch."""
    sps = 100 / (1 + 0.3 * np.arange(1, max_batch + 1)) * rng.uniform(0.8, 1.2, max_batch)
    return SPSTable(tuple((b, float(s)) for b, s in zip(range(1, max_batch + 1), sps)))


# -- the table and the walk -------------------------------------------------------------------------

def test_sps_table_takes_the_next_bucket():
    table = SPSTable(((2, 10.0), (4, 8.0), (8, 5.0)))
    assert list(table(np.array([1, 2, 3, 4, 5, 8, 9]))) == [10.0, 10.0, 8.0, 8.0, 5.0, 5.0, 0.0]
    for bad in [(), ((2, 1.0), (2, 2.0)), ((3, 1.0), (2, 2.0)), ((0, 1.0),), ((1, 0.0),)]:
        with pytest.raises(ValueError):
            SPSTable(bad)


def test_hand_worked_example():
    # a = [[0.9, 0.45], [0.6, 0.54]]; walk order (0,1) 0.9, (1,1) 0.6, (1,2) 0.54, (0,2) 0.45.
    # Θ: 2·10 = 20 -> 2.9·9 = 26.1 -> 3.5·8 = 28 -> 4.04·6 = 24.24 (stop) -> 4.49·7 = 31.43.
    c = np.array([[0.9, 0.5], [0.6, 0.9]])
    table = SPSTable(((2, 10.0), (3, 9.0), (4, 8.0), (5, 6.0), (6, 7.0)))
    assert schedule(c, table).tolist() == [1, 1]
    assert full_search(c, table).tolist() == [2, 2]        # the jagged table's later peak
    assert take_top(c, 3).tolist() == [1, 2]
    # A candidate that leaves Θ unchanged (1.5·2 = 1·3) is not taken.
    assert schedule(np.array([[0.5]]), SPSTable(((1, 3.0), (2, 2.0)))).tolist() == [0]
    assert math.isclose(throughput(c, np.array([1, 1]), table), 28.0)
    assert math.isclose(throughput(c, np.array([2, 2]), table), 31.43)


def test_schedule_properties_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        r_count, gamma = rng.integers(1, 5), rng.integers(1, 5)
        c = rng.uniform(0.05, 1.0, (r_count, gamma))
        c[rng.uniform(size=c.shape) < 0.1] = 0.0                 # some dead positions
        table = random_table(rng, max(1, r_count * (gamma + 1) + int(rng.integers(-2, 3))))
        lengths = schedule(c, table)
        assert lengths.tolist() == literal_algorithm_1(c, table).tolist()
        assert ((lengths >= 0) & (lengths <= gamma)).all()
        a = survival(c)
        assert all(a[r, :lengths[r]].min(initial=1) > 0 for r in range(r_count))   # no dead candidate taken
        zero = throughput(c, np.zeros(r_count, dtype=np.int64), table)
        ours = throughput(c, lengths, table)
        live = (a > 0).sum(1)              # candidates with a = 0 are never taken (they add no τ)
        best = max(throughput(c, np.array(ls), table)
                   for ls in itertools.product(*(range(m + 1) for m in live)))
        full = throughput(c, full_search(c, table), table)
        assert zero <= ours <= full + 1e-9
        assert math.isclose(full, best, rel_tol=1e-12)              # top-B per B is optimal
        budget = int(rng.integers(0, r_count * gamma + 1))
        top = take_top(c, budget)
        assert top.sum() == min(budget, int((a > 0).sum()))


def test_early_stop_is_optimal_when_throughput_is_unimodal():
    """With step time affine in B, Θ = τ(B) / (t0 + t1·B) with τ concave: the first
    non-improvement is the global optimum, so the early stop loses nothing."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        c = rng.uniform(0.05, 1.0, (int(rng.integers(1, 9)), int(rng.integers(1, 7))))
        t0, t1 = rng.uniform(0.5, 2.0), rng.uniform(0.01, 0.5)
        table = SPSTable(tuple((b, 1 / (t0 + t1 * b)) for b in range(1, c.size + len(c) + 1)))
        assert math.isclose(throughput(c, schedule(c, table), table),
                            throughput(c, full_search(c, table), table), rel_tol=1e-12)


def test_prefixes_with_tied_survival():
    """Equal survivals across positions (c = 1) and requests: ties go by position, so
    every request's selection is still a prefix, whatever the cut."""
    c = np.array([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.8, 1.0, 1.0]])
    a = survival(c)
    for budget in range(c.size + 1):
        lengths = take_top(c, budget)
        taken = np.arange(3)[None] < lengths[:, None]
        assert (a[taken].min(initial=2) >= a[~taken].max(initial=-1))        # the top ones
    assert take_top(c, 2).tolist() == [1, 1, 0]


# -- STS ----------------------------------------------------------------------------------------------

def test_expected_calibration_error_by_hand():
    # bin 2 holds 0.10 and 0.12 (outcomes 0, 1): |0.22 − 1|; bin 18 holds 0.9 (outcome 1): |0.9 − 1|.
    assert math.isclose(expected_calibration_error([0.1, 0.12, 0.9], [0, 1, 1]), (0.78 + 0.1) / 3)


def test_sts_recovers_the_temperatures():
    """Logged logits are the true conditional-acceptance logits times a per-position
    scale; the fit must find each scale, position by position."""
    rng = np.random.default_rng(2)
    n, scales = 40_000, np.array([3.0, 0.5, 2.0, 1.3])
    true_logits = rng.normal(1.0, 1.5, (n, len(scales)))
    survived = np.cumprod(rng.uniform(size=true_logits.shape) < 1 / (1 + np.exp(-true_logits)), axis=1)
    temps = fit_sts(true_logits * scales, survived)
    assert np.all(np.abs(np.log(temps / scales)) < 0.15), temps
    raw = np.cumprod(apply_sts(true_logits * scales, np.ones(len(scales))), axis=1)
    fitted = np.cumprod(apply_sts(true_logits * scales, temps), axis=1)
    for k in range(len(scales)):
        ece_raw = expected_calibration_error(raw[:, k], survived[:, k])
        ece_fit = expected_calibration_error(fitted[:, k], survived[:, k])
        assert ece_fit < 0.02 and ece_fit < ece_raw
    assert np.allclose(apply_sts(true_logits, temps), torch.sigmoid(torch.tensor(true_logits / temps)).numpy())


# -- toy end-to-end: scheduler in the loop ----------------------------------------------------------

def run_toy(target: torch.Tensor, draft: torch.Tensor, confidence: torch.Tensor | None,
            anchors: list[int], gamma: int, sps: SPSTable, scheduler, trials: int, rounds: int,
            gen: torch.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """Each trial is one batch of len(anchors) requests on an order-1 Markov target
    ``target[prev]``. Per round the drafter samples gamma tokens from ``draft[prev]``,
    the confidence of position k is ``confidence[x_{k-1}]`` (None: the sampled token's
    own draft probability q(x_k), the leaky choice), the scheduler picks ℓ per
    request from the batch's confidences, and rejection sampling commits tokens.
    Returns the first ``rounds`` tokens per request [trials, R, rounds] and every
    ℓ chosen [trials * rounds * R]."""
    r_count = len(anchors)
    n = trials * r_count
    rows = torch.arange(n)
    seq = torch.full((n, 1 + rounds * (gamma + 1)), -1, dtype=torch.long)
    seq[:, 0] = torch.tensor(anchors).repeat(trials)
    filled = torch.ones(n, dtype=torch.long)
    chosen = []
    for _ in range(rounds):
        ctx = [seq[rows, filled - 1]]
        draft_probs = []
        for _ in range(gamma):
            draft_probs.append(draft[ctx[-1]])                                          # [n, V]
            ctx.append(race(draft_probs[-1], gen))
        ctx, draft_probs = torch.stack(ctx, 1), torch.stack(draft_probs, 1)             # [n, γ+1], [n, γ, V]
        if confidence is None:
            conf = draft_probs.gather(2, ctx[:, 1:, None]).squeeze(2)                    # [n, γ] q(x_k)
        else:
            conf = confidence[ctx[:, :-1]]                                              # [n, γ] c(x_{k-1})
        conf = conf.double().numpy().reshape(trials, r_count, gamma)
        num_draft = torch.from_numpy(np.concatenate([scheduler(conf[t], sps) for t in range(trials)]))
        chosen.append(num_draft.numpy())
        uniforms, noise = random_draws(n, gamma, target.shape[0], gen)
        tokens, num = rejection_sample(target[ctx], draft_probs, ctx[:, 1:], num_draft, uniforms, noise)
        seq.scatter_(1, filled[:, None] + torch.arange(gamma + 1), tokens)
        filled += num
    return seq[:, 1:1 + rounds].reshape(trials, r_count, rounds), np.concatenate(chosen)


def markov_exact(target: torch.Tensor, anchor: int, length: int) -> torch.Tensor:
    """P(y_1..y_length | anchor) as a flat [V**length] over sequence_codes."""
    t = target.double() / target.double().sum(1, keepdim=True)
    probs = t[anchor]                                                     # [V] over y_1
    for _ in range(length - 1):
        last = torch.arange(t.shape[0]).repeat(len(probs) // t.shape[0])  # each code's last token
        probs = (probs[:, None] * t[last]).reshape(-1)
    return probs


def test_toy_end_to_end_is_distributed_as_the_target():
    gen = torch.Generator().manual_seed(10)
    v, gamma, anchors = 5, 3, [0, 3, 3]
    target, draft = softmax_table((v, v), gen, scale=1.0), softmax_table((v, v), gen, scale=1.0)
    draft = 0.5 * draft + 0.5 * target                           # a drafter worth scheduling for
    confidence = torch.rand(v, generator=gen) * 0.9 + 0.05       # c_k depends on x_{k-1} only
    sps = SPSTable(((3, 1.0), (5, 0.85), (6, 0.8), (8, 0.66), (12, 0.55)))   # jagged buckets
    stopped_early = []

    def scheduler(c: np.ndarray, table: SPSTable) -> np.ndarray:
        lengths = schedule(c, table)
        stopped_early.append(not np.array_equal(lengths, full_search(c, table)))
        return lengths

    trials, rounds = 30_000, 2
    tokens, lengths = run_toy(target, draft, confidence, anchors, gamma, sps, scheduler, trials, rounds, gen)
    counts = np.bincount(lengths, minlength=gamma + 1)
    assert (counts >= 0.05 * len(lengths)).sum() >= 3, counts     # the scheduler really varies ℓ
    assert np.mean(stopped_early) > 0.05                          # and its early stop matters
    tests = [chi2_pvalue(sequence_codes(tokens[:, r], v), markov_exact(target, a, rounds))
             for r, a in enumerate(anchors)]
    # Requests 1 and 2 share an anchor: their first tokens must also be independent.
    first = markov_exact(target, anchors[1], 1)
    tests.append(chi2_pvalue(tokens[:, 1, 0] * v + tokens[:, 2, 0], (first[:, None] * first[None]).reshape(-1)))
    assert min(tests) > ALPHA / len(tests), tests


def appendix_a(scheduler, trials: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's Appendix A: first token p_t = (0.7, 0.3), p_d = (0.5, 0.5). Verifying
    one token is not worth it (c_1 = 0.6) but two are when c_2 is high, and c_2 = 0.9
    after A, 0.05 after B. Token 2 is only the anchor. Returns the first tokens and the
    exact first-token distribution."""
    target = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.8, 0.0], [0.7, 0.3, 0.0]])
    draft = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    confidence = torch.tensor([0.9, 0.05, 0.6])
    # Θ(0) = 1; Θ(1) = 1.6·0.6 = 0.96; Θ(2) = 2.14·0.6 = 1.28 after A, 1.63·0.6 = 0.98 after B.
    sps = SPSTable(((1, 1.0), (3, 0.6)))
    tokens, _ = run_toy(target, draft, confidence, [2], 2, sps, scheduler, trials, 1, gen)
    return tokens[:, 0, 0], target[2]


def test_appendix_a_early_stop_is_lossless_and_full_search_is_biased():
    tokens, exact = appendix_a(schedule, 20_000, torch.Generator().manual_seed(11))
    assert chi2_pvalue(tokens, exact) > ALPHA
    tokens, exact = appendix_a(full_search, 20_000, torch.Generator().manual_seed(11))
    assert chi2_pvalue(tokens, exact) < ALPHA
    share = (tokens == 0).double().mean().item()
    assert abs(share - 0.85) < 5 * math.sqrt(0.85 * 0.15 / len(tokens))     # the paper's 0.85


def test_confidence_from_the_sampled_token_is_biased():
    """p_t = (0.3, 0.7), p_d = (0.8, 0.2), one draft position, and verifying it pays
    only for c_1 > 3/7. With c_1 = q(x_1) the draft is verified iff it is A, giving
    P(A) = 0.8·(0.3/0.8) + 0.2·0.3 = 0.36; with a pre-token confidence it is exact."""
    target = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.3, 0.7, 0.0]])
    draft = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.8, 0.2, 0.0]])
    sps = SPSTable(((1, 1.0), (2, 0.7)))
    for confidence, biased in [(torch.tensor([0.5, 0.5, 0.6]), False), (None, True)]:
        tokens, lengths = run_toy(target, draft, confidence, [2], 1, sps, schedule, 20_000, 1,
                                  torch.Generator().manual_seed(12))
        assert set(lengths.tolist()) == ({0, 1} if biased else {1})
        assert (chi2_pvalue(tokens[:, 0, 0], target[2]) < ALPHA) == biased
