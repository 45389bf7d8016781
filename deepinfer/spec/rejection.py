"""Verification of draft tokens: which of them a request keeps, and the one token
the target adds, so that the committed tokens are distributed exactly as if the
target had sampled them one at a time (lossless speculative decoding).

What belongs here: the accept/reject rule over a ragged batch (``rejection_sample``),
its greedy form (``greedy_verify``, also the exact-match rule of seeded requests), and
the random draws the rule consumes (``random_draws``). What does not: producing the probabilities
(the caller applies the request's sampling transforms to the target logits, and
passes the exact distribution each draft token was sampled from), choosing how
many tokens to verify (scheduling.py), KV rollback, the runner.

Everything stays on the device with no host sync, vectorised over requests. The
randomness is an argument. (Seeded requests are not verified here: spec/verify.py
verifies them by exact match against the sampler's own keyed draws, which makes their
output independent of the drafts and of the batch.)

Shapes: R requests, K the batch's draft width (request r drafts ``num_draft[r]``
<= K tokens; rows past that are padding), V vocabulary. Position k = 0..K of a
request's K+1 verified positions is the output position ``start + k``, where
``start`` is the number of tokens the request had output before this step.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed tokens of each request: its longest accepted draft prefix,
    then one token from the target (a correction at the first rejection, else
    the bonus).

    target_probs: [R, K+1, V] float32, p_t at each verified position (after the
        request's sampling transforms); rows past ``num_draft[r]`` are ignored.
    draft_probs: [R, K, V] float32, the distribution each draft token was
        sampled from, or None for a deterministic draft (greedy, n-gram lookup):
        p_d is then one-hot at the draft token.
    draft_token_ids: [R, K] int64; num_draft: [R] int64, 0 <= num_draft <= K.
    uniforms: [R, K] float32 in [0, 1), one per draft token.
    noise: [R, V] or [R, K+1, V] float32 Exp(1) draws for the one token sampled
        from a distribution; [R, V] suffices (its position is chosen without
        looking at the noise) and is what ``random_draws`` makes.

    Returns token_ids [R, K+1] int64 (committed tokens, -1 after them) and
    num_tokens [R] int64 (accepted drafts + 1).
    """
    r_count, k = draft_token_ids.shape
    rows = torch.arange(r_count, device=draft_token_ids.device)                      # [R]
    in_draft = torch.arange(k, device=draft_token_ids.device) < num_draft.unsqueeze(1)  # [R, K]

    # Accept x_k with probability min(1, p_t(x_k) / p_d(x_k)), left to right. For a
    # token sampled from p_d this keeps P(x_k = v, accepted) = min(p_d(v), p_t(v)).
    # u < p_t/p_d is tested as u * p_d < p_t: no division, and u < 1 accepts every
    # ratio >= 1. A deterministic draft has p_d(x_k) = 1: accept with p_t(x_k).
    ids = draft_token_ids.unsqueeze(2)                                               # [R, K, 1]
    p_t_x = target_probs[:, :k].gather(2, ids).squeeze(2)                            # [R, K]
    p_d_x = 1.0 if draft_probs is None else draft_probs.gather(2, ids).squeeze(2)   # [R, K]
    accept = (uniforms * p_d_x < p_t_x) & in_draft                                  # [R, K]
    n = accept.long().cumprod(1).sum(1)                                              # [R] accepted prefix

    # At the first rejection (n < num_draft) sample from the residual
    # normalise(max(0, p_t - p_d)). A rejection happens with probability
    # 1 - Σ_v min(p_d(v), p_t(v)) = Σ_v max(0, p_t(v) - p_d(v)), so the token at n is
    # v with probability min(p_d(v), p_t(v)) + max(0, p_t(v) - p_d(v)) = p_t(v); and
    # since a draft at n is only looked at if x_<n were accepted, i.e. equal the
    # committed prefix, every committed token follows p_t given the tokens before.
    # (For a one-hot p_d the residual is p_t with x_n zeroed.) If the residual has
    # no mass (p_t == p_d up to rounding, so the rejection was a float artefact)
    # use p_t. With every draft accepted (n == num_draft), the bonus comes from p_t
    # at n.
    p_t_n = target_probs[rows, n]                                                    # [R, V]
    rejected = n < num_draft                                                         # [R]
    if k == 0:
        dist = p_t_n
    else:
        at = n.clamp(max=k - 1)                                                      # [R] a valid draft row
        if draft_probs is None:
            residual = p_t_n.scatter(1, draft_token_ids[rows, at].unsqueeze(1), 0.0)  # [R, V]
        else:
            residual = (p_t_n - draft_probs[rows, at]).clamp_min(0.0)                # [R, V]
        use_residual = rejected & (residual.sum(1) > 0)                              # [R]
        dist = torch.where(use_residual.unsqueeze(1), residual, p_t_n)               # [R, V]
    # Exponential race: argmax(dist / q), q ~ Exp(1), picks v with probability
    # dist(v) / sum(dist), so dist need not be normalised.
    q = noise if noise.dim() == 2 else noise[rows, n]                                # [R, V]
    token = (dist / q).argmax(1)                                                     # [R]
    return _commit(draft_token_ids, n, token)


def greedy_verify(target_argmax: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-hot case of ``rejection_sample``: keep drafts while they equal the
    target's argmax, then commit the target's argmax at the first mismatch (or
    as the bonus). target_argmax: [R, K+1] int64; other shapes and the result as
    in ``rejection_sample``."""
    r_count, k = draft_token_ids.shape
    in_draft = torch.arange(k, device=draft_token_ids.device) < num_draft.unsqueeze(1)  # [R, K]
    accept = (draft_token_ids == target_argmax[:, :k]) & in_draft                      # [R, K]
    n = accept.long().cumprod(1).sum(1)                                                # [R]
    token = target_argmax[torch.arange(r_count, device=n.device), n]                   # [R]
    return _commit(draft_token_ids, n, token)


def _commit(draft_token_ids: torch.Tensor, n: torch.Tensor, token: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[first n drafts, token, -1 ...] per row: token_ids [R, K+1], num_tokens [R]."""
    r_count, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=n.device)                                         # [K+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((r_count, 1), -1)], 1)  # [R, K+1]
    out = torch.where(pos < n.unsqueeze(1), padded, -1)                                # [R, K+1]
    out.scatter_(1, n.unsqueeze(1), token.unsqueeze(1))
    return out, n + 1


# -- the draws --------------------------------------------------------------------------------------

def random_draws(num_rows: int, max_draft: int, vocab_size: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws for unseeded rows from one generator, on its device:
    uniforms [R, K] in [0, 1) and noise [R, V] Exp(1), clamped away from 0."""
    dev = generator.device
    uniforms = torch.rand(num_rows, max_draft, generator=generator, device=dev)          # [R, K]
    noise = torch.empty(num_rows, vocab_size, device=dev).exponential_(generator=generator)  # [R, V]
    return uniforms, noise.clamp_min_(torch.finfo(noise.dtype).tiny)
