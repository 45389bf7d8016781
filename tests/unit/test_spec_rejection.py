"""Speculative verification (deepinfer/spec/rejection.py) is lossless: generating
with random draft lengths gives the target's own distribution over the first
token and over 3-token sequences, checked by a chi-square test against exact
enumeration, for sampled drafts, deterministic drafts and greedy verification.
Seeded draws make a request's tokens independent of the rest of the batch.

The target is a random order-2 lookup table (p_t at a position depends on the
two tokens before it, drafts included), the drafter a different order-1 table,
so the verified distributions change with every drafted token."""

import math

import pytest
import torch

from deepinfer.spec.rejection import greedy_verify, random_draws, rejection_sample

V, K, LENGTH = 6, 3, 3
TRIALS = 1_000_000
ALPHA = 1e-3          # chi-square significance; every generator is seeded, so the outcome is fixed
ANCHOR = (2, 4)       # the two tokens before generation starts


# -- statistics (also used by test_spec_scheduling.py) -----------------------------------------------

def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test that ``samples`` (category codes [N]) are
    i.i.d. draws from ``probs`` [C]. Categories expected fewer than 5 times are pooled
    into one, as the test's chi-square approximation needs."""
    probs = probs.double()
    assert abs(probs.sum().item() - 1) < 1e-9
    n = samples.numel()
    observed = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    assert observed[~keep].sum() == 0, "samples in a category of probability 0"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def sequence_codes(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] token sequences -> [N] integers in [0, vocab**L)."""
    weights = vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens * weights).sum(1)


def race(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of probs [..., V] (exponential race)."""
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1)


def softmax_table(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).softmax(-1)


# -- the toy target and drafter ---------------------------------------------------------------------

class Toy:
    """target[a, b] = p_t(. | a, b); draft[b] = p_d(. | b); lookup[b] a deterministic draft."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.target = softmax_table((V, V, V), gen)                                  # [V, V, V]
        self.draft = softmax_table((V, V), gen)                                      # [V, V]
        self.lookup = torch.randint(0, V, (V,), generator=gen)                       # [V]

    def exact(self, length: int) -> torch.Tensor:
        """P(y_1..y_length) under the target, as a flat [V**length] over sequence_codes."""
        probs = torch.ones(1, dtype=torch.float64)
        ctx = torch.tensor([ANCHOR])                                                 # [S, 2] all contexts
        for _ in range(length):
            step = self.target[ctx[:, -2], ctx[:, -1]].double()                      # [S, V]
            step = step / step.sum(1, keepdim=True)                                  # float32 sums to 1 ± 1e-7
            probs = (probs[:, None] * step).reshape(-1)
            ctx = torch.cat([ctx.repeat_interleave(V, 0), torch.arange(V).repeat(len(ctx))[:, None]], 1)
        return probs

    def greedy_chain(self, length: int) -> list[int]:
        ctx = list(ANCHOR)
        for _ in range(length):
            ctx.append(int(self.target[ctx[-2], ctx[-1]].argmax()))
        return ctx[2:]


def generate(toy: Toy, mode: str, n: int, gen: torch.Generator, per_position_noise: bool = False
             ) -> tuple[torch.Tensor, float]:
    """LENGTH rounds of draft-then-verify for n independent trials, each round with a
    random draft length in 0..K per trial. Returns the first LENGTH generated tokens
    [n, LENGTH] and the mean number of tokens committed per round.

    mode: "sampled" (drafts drawn from toy.draft, verified with draft_probs),
    "lookup" (deterministic drafts toy.lookup, draft_probs=None) or "greedy" (sampled
    drafts, greedy_verify against the target's argmax)."""
    rows = torch.arange(n)
    seq = torch.full((n, 2 + LENGTH * (K + 1)), -1, dtype=torch.long)
    seq[:, 0], seq[:, 1] = ANCHOR
    filled = torch.full((n,), 2)
    committed = 0
    for _ in range(LENGTH):
        num_draft = torch.randint(0, K + 1, (n,), generator=gen)                       # [n]
        ctx = [seq[rows, filled - 2], seq[rows, filled - 1]]
        draft_probs = []
        for _ in range(K):
            if mode == "lookup":
                ctx.append(toy.lookup[ctx[-1]])
            else:
                draft_probs.append(toy.draft[ctx[-1]])                                 # [n, V]
                x = race(draft_probs[-1], gen)
                if mode == "greedy":   # often the target's argmax, so long prefixes are accepted
                    x = torch.where(torch.rand(n, generator=gen) < 0.6,
                                    toy.target[ctx[-2], ctx[-1]].argmax(-1), x)
                ctx.append(x)
        ctx = torch.stack(ctx, 1)                                                      # [n, K+2]
        target_probs = toy.target[ctx[:, :-1], ctx[:, 1:]]                             # [n, K+1, V]
        drafts = ctx[:, 2:]                                                            # [n, K]
        if mode == "greedy":
            tokens, num = greedy_verify(target_probs.argmax(-1), drafts, num_draft)
        else:
            uniforms, noise = random_draws(n, K, V, gen)
            if per_position_noise:
                noise = torch.empty(n, K + 1, V).exponential_(generator=gen)
            tokens, num = rejection_sample(target_probs, torch.stack(draft_probs, 1) if draft_probs else None,
                                           drafts, num_draft, uniforms, noise)
        seq.scatter_(1, filled[:, None] + torch.arange(K + 1), tokens)
        filled += num
        committed += num.sum().item()
    return seq[:, 2:2 + LENGTH], committed / (n * LENGTH)


@pytest.mark.parametrize("mode,per_position_noise", [("sampled", False), ("sampled", True), ("lookup", False)])
def test_generation_is_distributed_as_the_target(mode, per_position_noise):
    toy = Toy(seed=1)
    tokens, per_round = generate(toy, mode, TRIALS, torch.Generator().manual_seed(2), per_position_noise)
    assert per_round > 1.15, "too few drafts accepted to exercise the rule"
    assert chi2_pvalue(tokens[:, 0], toy.exact(1)) > ALPHA
    assert chi2_pvalue(sequence_codes(tokens, V), toy.exact(LENGTH)) > ALPHA


def test_greedy_verify_gives_the_target_greedy_chain():
    toy = Toy(seed=3)
    tokens, per_round = generate(toy, "greedy", 100_000, torch.Generator().manual_seed(4))
    assert per_round > 1.3
    assert (tokens == torch.tensor(toy.greedy_chain(LENGTH))).all()


def test_rejection_catches_a_wrong_rule():
    """The chi-square check has power: verifying against a p_d other than the one the
    drafts were drawn from (here uniform) is caught."""
    toy = Toy(seed=1)
    wrong = Toy(seed=1)
    wrong.draft = torch.full((V, V), 1.0 / V)        # claims a uniform p_d, drafts from toy.draft
    gen = torch.Generator().manual_seed(5)
    n = 200_000
    anchor = torch.full((n,), ANCHOR[1])
    drafts = race(toy.draft[anchor], gen)[:, None]                                      # [n, 1]
    target_probs = torch.stack([toy.target[ANCHOR[0], anchor], toy.target[anchor, drafts[:, 0]]], 1)
    uniforms, noise = random_draws(n, 1, V, gen)
    tokens, _ = rejection_sample(target_probs, wrong.draft[anchor][:, None], drafts,
                                 torch.ones(n, dtype=torch.long), uniforms, noise)
    assert chi2_pvalue(tokens[:, 0], toy.exact(1)) < ALPHA


# -- edge cases and the draws -----------------------------------------------------------------------

def random_batch(r: int, gen: torch.Generator):
    target = softmax_table((r, K + 1, V), gen)
    draft = softmax_table((r, K, V), gen)
    drafts = race(draft, gen)
    num_draft = torch.randint(0, K + 1, (r,), generator=gen)
    return target, draft, drafts, num_draft


def test_layout_and_no_drafts():
    gen = torch.Generator().manual_seed(6)
    target, draft, drafts, num_draft = random_batch(64, gen)
    uniforms, noise = random_draws(64, K, V, gen)
    tokens, num = rejection_sample(target, draft, drafts, num_draft, uniforms, noise)
    pos = torch.arange(K + 1)
    assert ((num >= 1) & (num <= num_draft + 1)).all()
    assert ((tokens >= 0) == (pos < num[:, None])).all()                 # committed, then -1
    kept = pos < (num - 1)[:, None]
    assert (tokens[:, :K][kept[:, :K]] == drafts[kept[:, :K]]).all()     # accepted drafts verbatim
    # Without drafts the step is the plain sampler: the race over p_t at position 0.
    tokens0, num0 = rejection_sample(target[:, :1], draft[:, :0], drafts[:, :0],
                                     torch.zeros(64, dtype=torch.long), uniforms[:, :0], noise)
    assert (num0 == 1).all() and (tokens0[:, 0] == (target[:, 0] / noise).argmax(1)).all()


def test_residual_without_mass_falls_back_to_the_target():
    """A rejection where p_t == p_d (possible only through rounding) samples from p_t."""
    gen = torch.Generator().manual_seed(7)
    target, _, drafts, _ = random_batch(32, gen)
    uniforms = torch.rand(32, K, generator=gen)
    # Push p_t(x_0) just below p_d(x_0) = p_t(x_0) so u * p_d < p_t can fail.
    draft = target[:, :K].clone()
    target[:, 0] = target[:, 0] * (1 - 1e-7)
    uniforms[:, 0] = 1 - 6e-8                          # the largest float32 below 1
    noise = torch.empty(32, V).exponential_(generator=gen)
    tokens, num = rejection_sample(target, draft, drafts, torch.full((32,), K), uniforms, noise)
    rejected = num == 1
    assert rejected.any()
    assert (tokens[rejected, 0] == (target[rejected, 0] / noise[rejected]).argmax(1)).all()


def test_random_draws_ranges():
    u, q = random_draws(1000, K, V, torch.Generator().manual_seed(9))
    assert u.shape == (1000, K) and q.shape == (1000, V)
    assert ((u >= 0) & (u < 1)).all() and (q > 0).all()
    assert math.isclose(q.mean().item(), 1.0, abs_tol=6 / math.sqrt(q.numel()))   # Exp(1): mean 1, sd 1
