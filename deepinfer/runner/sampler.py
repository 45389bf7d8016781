"""Sampler: one row of logits per sequence -> its next token, plus logprobs.

What belongs here: applying the grammar token bitmask, the logits processors
(min_tokens, logit_bias, penalties), temperature and the min-p / top-k / top-p
filters, the random draw, and the logprobs of the raw model distribution. What
does not: which rows are sampled (the runner), stop conditions (the scheduler),
grammars and their matchers (structured/; the runner fills the bitmask), turning
bad words into token ids (the engine, which has the tokenizer).

Semantics follow vLLM v1. Logprobs come from the raw logits (log-softmax before
any processing, the grammar mask included); rank 1 is the most likely token.
Processing order: grammar mask -> allowed_token_ids -> bad_words -> min_tokens ->
logit_bias -> penalties -> (greedy rows: argmax) -> temperature -> min_p -> top_k ->
top_p -> draw.
The three filters are one call through kernels/backend.py: the pure-PyTorch
reference (topk / sort + cumsum) or, on CUDA, the Triton kernel that finds the
thresholds by counting without sorting (kernels/sampling.py, which documents
where the two may differ: ties split by top-p, float32 rounding at a cut).

The draw is an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per
token picks token i with probability probs[i]. A seeded row draws its ``q``
from a generator keyed by (seed, stream_index, output position), so its token
does not depend on which other rows share the batch; unseeded rows draw theirs
from the sampler's own generator in one call.

Plain greedy rows (no processor applies, no top logprobs: the common decode case) take a
fast path: one pass over the raw logits (``backend.greedy_sample``, the split-V kernel of
kernels/greedy.py on CUDA) gives each row's argmax and its logprob, with no float32 copy, no
processed clone and no gathers. They take it in a mixed batch too (the other rows go the
general way), so a row's result never depends on its neighbours: the general path gives the
same tokens, but its logprobs differ in float32 rounding (the kernel sums in another order).

Host syncs: ``Sampler.sample`` leaves its result on the device (``SampleTensors``)
and builds its small index/parameter tensors through deepinfer/transfer.py, so
launching a step does not wait for the device (overlapped scheduling); the one
exception is top-k, whose ``topk`` width comes from the device (``k.max()``).

Shapes: N rows, V vocabulary (``vocab_size``; the logits may carry padding
columns beyond it, which are dropped), M a subset of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kernels import backend
from deepinfer.outputs import Logprob
from deepinfer.transfer import copy_to_host, to_device
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.bitmask import apply_token_bitmask

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the logits to sample."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]    # generated so far: penalties, min_tokens, seed position
    stream_index: int = 0              # which of the request's n samples this is (keys the seeded generator)
    grammar: bool = False              # structured outputs: this row of the token bitmask applies


@dataclass
class SamplerOutput:
    token_ids: list[int]
    sampled_logprobs: list[float]                 # raw logprob of each sampled token
    logprobs: list[dict[int, Logprob] | None]     # top-N plus the sampled token, where params.logprobs is set


@dataclass
class SampleTensors:
    """A sampler result as tensors, before any host sync: the runner feeds ``token_ids``
    to the next step on the device and copies the rest to the host without waiting
    (overlapped scheduling). M of the N rows asked for logprobs (``logprob_rows``, their
    counts ``logprob_nums``), K = max(logprob_nums)."""

    token_ids: torch.Tensor                    # [N] int64
    sampled_logprobs: torch.Tensor             # [N] float32 raw logprob of each sampled token
    logprob_rows: list[int]
    logprob_nums: list[int]
    ranks: torch.Tensor | None = None          # [M] int64 rank of the sampled token, 1 = most likely
    top_logprobs: torch.Tensor | None = None   # [M, K] float32, descending
    top_ids: torch.Tensor | None = None        # [M, K] int64

    def to_host(self) -> SampleTensors:
        """The same result on the host. On CUDA the copies are only started (pinned
        memory): read the result after an event recorded behind them has completed."""
        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else copy_to_host(t)

        return SampleTensors(copy_to_host(self.token_ids), copy_to_host(self.sampled_logprobs),
                             self.logprob_rows, self.logprob_nums, host(self.ranks),
                             host(self.top_logprobs), host(self.top_ids))

    def output(self) -> SamplerOutput:
        """Python values (waits for the device if the tensors are still there)."""
        token_ids = self.token_ids.tolist()
        sampled = self.sampled_logprobs.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(token_ids)
        if self.logprob_rows:
            dicts = _build_dicts([sampled[i] for i in self.logprob_rows], self.ranks.tolist(),
                                 [token_ids[i] for i in self.logprob_rows],
                                 self.top_logprobs.tolist() if self.top_logprobs is not None else [],
                                 self.top_ids.tolist() if self.top_ids is not None else [],
                                 self.logprob_nums)
            for i, d in zip(self.logprob_rows, dicts):
                logprobs[i] = d
        return SamplerOutput(token_ids=token_ids, sampled_logprobs=sampled, logprobs=logprobs)


# -- seeding ----------------------------------------------------------------------------------------

def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, stream_index: int, position: int) -> int:
    """The generator seed of one draw of a seeded request: a 64-bit hash of
    (request seed, sample index, output position), stable across processes."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (stream_index & _MASK64))
    return _splitmix64(h ^ (position & _MASK64))


# -- logprobs ---------------------------------------------------------------------------------------

def _logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, kmax: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per row: the chosen token's logprob [M], its rank [M] (1 = most likely) and the
    row's top-``kmax`` logprobs and ids [M, kmax] (None when kmax is 0).

    logprobs: [M, V] normalised; token_ids: [M] int64.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))               # [M, 1]
    ranks = (logprobs > chosen).sum(-1) + 1                            # [M] 1 = most likely
    top_vals, top_ids = logprobs.topk(kmax, dim=-1) if kmax else (None, None)
    return chosen.squeeze(1), ranks, top_vals, top_ids


def _build_dicts(chosen: list[float], ranks: list[int], ids: list[int], top_vals: list[list[float]],
                 top_ids: list[list[int]], nums: Sequence[int]) -> list[dict[int, Logprob]]:
    """For each row: the chosen token with its rank, then the row's top-``nums[i]``."""
    out = []
    for i, num in enumerate(nums):
        entry = {ids[i]: Logprob(chosen[i], ranks[i])}
        for r in range(num):
            entry[top_ids[i][r]] = Logprob(top_vals[i][r], r + 1)
        out.append(entry)
    return out


def _logprob_dicts(logprobs: torch.Tensor, token_ids: torch.Tensor, nums: Sequence[int]
                   ) -> list[dict[int, Logprob]]:
    """For each row: the chosen token with its rank, then the row's top-``nums[i]``.

    logprobs: [M, V] normalised; token_ids: [M] int64.
    """
    kmax = max(nums, default=0)
    chosen, ranks, top_vals, top_ids = _logprob_tensors(logprobs, token_ids, kmax)
    return _build_dicts(chosen.tolist(), ranks.tolist(), token_ids.tolist(),
                        top_vals.tolist() if kmax else [], top_ids.tolist() if kmax else [], nums)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num: int,
                    vocab_size: int | None = None) -> list[dict[int, Logprob]]:
    """Logprobs of prompt token i+1 given its prefix (logits row i), plus the top-``num``.

    logits: [L, V'] raw model logits; V' may include padding beyond ``vocab_size``
    (when given), which is dropped before normalising.
    """
    if len(next_token_ids) != logits.shape[0]:
        raise ValueError(f"prompt_logprobs: {len(next_token_ids)} next tokens for {logits.shape[0]} logits rows")
    vocab = logits.shape[1] if vocab_size is None else vocab_size
    lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)                        # [L, V]
    ids = to_device(list(next_token_ids), torch.long, logits.device)                 # [L]
    return _logprob_dicts(lp, ids, [num] * len(next_token_ids))


# -- the sampler ------------------------------------------------------------------------------------

def _plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits and nothing but its logprob
    is asked for: greedy, and no processor (grammar, allowed_token_ids, bad_words,
    min_tokens, logit_bias, penalties) and no top logprobs."""
    p = row.params
    return (p.greedy and not row.grammar and len(row.output_token_ids) >= p.min_tokens
            and not p.logit_bias and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and p.logprobs is None
            and not p.allowed_token_ids and not p.bad_words_token_ids)


class Sampler:
    """Samples one token per row; holds the generator shared by unseeded rows."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Logits report cuda:<i>; pin the index so the device check below compares equal.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _MASK64)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [N, V'] float32 with V' >= vocab_size; one SamplingRow per logits row.
        token_bitmask: [N, ceil(vocab_size / 32)] int32 on the logits' device (format of
        structured/bitmask.py); its row i applies where ``rows[i].grammar`` is set."""
        return self.sample(logits, rows, token_bitmask).output()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               token_bitmask: torch.Tensor | None = None) -> SampleTensors:
        """As ``__call__``, with the result left on the logits' device. The rows' host data
        (params, output lengths) is read before this returns, so the caller may change
        them afterwards."""
        self._check(logits, rows, token_bitmask)
        plain = [i for i, r in enumerate(rows) if _plain_greedy(r)]
        if len(plain) == len(rows):
            tokens, sampled = backend.greedy_sample(logits, self.vocab_size)   # [N] int64, [N] float32
            return SampleTensors(tokens, sampled, [], [])
        if not plain:
            return self._sample_general(logits, rows, token_bitmask)
        # A mix: the plain greedy rows still take the greedy pass, so that a row's logprob does
        # not depend on what shares its batch (the two passes sum in different orders).
        plain_set = set(plain)
        other = [i for i in range(len(rows)) if i not in plain_set]
        p_idx, o_idx = self._long(plain, logits), self._long(other, logits)
        g_tokens, g_sampled = backend.greedy_sample(logits[p_idx], self.vocab_size)
        sub = self._sample_general(logits[o_idx], [rows[i] for i in other],
                                   None if token_bitmask is None else token_bitmask[o_idx])
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)        # [N]
        sampled = torch.empty(len(rows), dtype=torch.float32, device=logits.device)    # [N]
        tokens[p_idx], tokens[o_idx] = g_tokens, sub.token_ids
        sampled[p_idx], sampled[o_idx] = g_sampled, sub.sampled_logprobs
        return SampleTensors(tokens, sampled, [other[j] for j in sub.logprob_rows], sub.logprob_nums,
                             sub.ranks, sub.top_logprobs, sub.top_ids)

    def _sample_general(self, logits: torch.Tensor, rows: list[SamplingRow],
                        token_bitmask: torch.Tensor | None) -> SampleTensors:
        """Processors, filters and the draw for rows [N] (``sample``'s shapes)."""
        raw = logits[:, :self.vocab_size].float()                        # [N, V] never written
        tokens = self._sample(self._process(raw, rows, token_bitmask), rows)  # [N] int64
        return self.logprobs_of(raw, rows, tokens)

    def logprobs_of(self, logits: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> SampleTensors:
        """The result for tokens chosen elsewhere (``tokens`` [N] int64, e.g. by speculative
        verification): each one's raw logprob, and the top logprobs where its row asks."""
        raw = logits[:, :self.vocab_size].float()                        # [N, V]
        lse = torch.logsumexp(raw, dim=-1)                                # [N] raw normaliser
        sampled = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse    # [N]
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out = SampleTensors(tokens, sampled, want, [rows[i].params.logprobs for i in want])
        if want:
            sel = self._long(want, raw)
            lp = raw[sel] - lse[sel].unsqueeze(1)                         # [M, V] same arithmetic as `sampled`
            _, out.ranks, out.top_logprobs, out.top_ids = _logprob_tensors(lp, tokens[sel],
                                                                           max(out.logprob_nums))
        return out

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow],
                     token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution each row's token is drawn from: [N, V] float32 after the
        processors, temperature and filters (a greedy row: one-hot at its argmax). What
        speculative verification compares draft tokens against."""
        work = self.process_logits(logits, rows, token_bitmask)             # [N, V]
        probs = torch.zeros_like(work)                                       # [N, V]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            g = self._long(greedy, work)
            probs[g] = torch.zeros_like(work[g]).scatter_(1, work[g].argmax(-1, keepdim=True), 1.0)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            r_idx = self._long(rand, work)
            probs[r_idx] = self._tempered_probs(work[r_idx], [rows[i].params for i in rand])
        return probs

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                       token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits after the grammar mask, min_tokens, logit_bias and penalties, before
        temperature: what greedy rows take the argmax of. logits: [N, V'] -> [N, V] (padding dropped)."""
        self._check(logits, rows, token_bitmask)
        return self._process(logits[:, :self.vocab_size].float(), rows, token_bitmask)

    def _check(self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows: expected "
                             f"[{len(rows)}, >= vocab_size={self.vocab_size}]")
        if logits.device != self.device:
            raise ValueError(f"logits on {logits.device}, sampler built for {self.device}")
        if token_bitmask is None and any(r.grammar for r in rows):
            raise ValueError("rows with grammar=True need a token_bitmask")

    def _process(self, raw: torch.Tensor, rows: list[SamplingRow],
                 token_bitmask: torch.Tensor | None) -> torch.Tensor:
        work = raw.clone()                                                # [N, V] processed in place
        masked = [i for i, r in enumerate(rows) if r.grammar]
        if masked:
            apply_token_bitmask(work, token_bitmask, masked)
        self._keep_allowed_tokens(work, rows)
        self._ban_bad_words(work, rows)
        self._mask_min_tokens(work, rows)
        self._add_logit_bias(work, rows)
        self._apply_penalties(work, rows)
        return work

    # -- logits processors (in place on work [N, V]) ------------------------------------------------
    def _keep_allowed_tokens(self, work: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Rows with ``allowed_token_ids`` keep those logits only (the rest -inf)."""
        sel = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
        if not sel:
            return
        r, c = self._flat_ids([rows[i].params.allowed_token_ids for i in sel], work.device)
        keep = torch.zeros(len(sel), work.shape[1], dtype=torch.bool, device=work.device)   # [M, V]
        keep[r, c] = True
        idx = self._long(sel, work)
        work[idx] = work[idx].masked_fill(~keep, float("-inf"))

    def _ban_bad_words(self, work: torch.Tensor, rows: list[SamplingRow]) -> None:
        """vLLM's rule: a bad word's last token is banned when the row's last output tokens
        equal the word's other tokens (always, for a one-token word)."""
        r_idx: list[int] = []
        c_idx: list[int] = []
        for i, row in enumerate(rows):
            out = row.output_token_ids
            for word in row.params.bad_words_token_ids or ():
                prefix = word[:-1]
                if len(prefix) > len(out):
                    continue
                if not prefix or [int(t) for t in out[len(out) - len(prefix):]] == prefix:
                    r_idx.append(i)
                    c_idx.append(word[-1])
        if r_idx:
            work[self._long(r_idx, work), self._long(c_idx, work)] = float("-inf")

    def _mask_min_tokens(self, work: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Until min_tokens are generated, no token that would end the sequence may be drawn.
        With ignore_eos, EOS does not end it (as in vLLM), so only stop_token_ids are masked.
        A row left with nothing to draw keeps its stop tokens: a complete grammar allows only
        those, and it ends the sequence before min_tokens."""
        r_idx: list[int] = []
        c_idx: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) < p.min_tokens:
                ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(self.eos_token_ids)
                ids = [t for t in ids if t < self.vocab_size]
                r_idx += [i] * len(ids)
                c_idx += ids
        if r_idx:
            r, c = self._long(r_idx, work), self._long(c_idx, work)
            kept = work[r, c]                                                      # [K] before masking
            work[r, c] = float("-inf")
            dead = torch.isneginf(work).all(-1)                                    # [N]
            work[r, c] = torch.where(dead[r], kept, torch.full_like(kept, float("-inf")))

    def _add_logit_bias(self, work: torch.Tensor, rows: list[SamplingRow]) -> None:
        r_idx: list[int] = []
        c_idx: list[int] = []
        vals: list[float] = []
        for i, row in enumerate(rows):
            for tok, bias in (row.params.logit_bias or {}).items():
                r_idx.append(i)
                c_idx.append(tok)
                vals.append(bias)
        if r_idx:
            work.index_put_((self._long(r_idx, work), self._long(c_idx, work)),
                            to_device(vals, work.dtype, work.device), accumulate=True)

    def _apply_penalties(self, work: torch.Tensor, rows: list[SamplingRow]) -> None:
        """repetition (HF/vLLM): a logit of a token seen in prompt or output is divided by the
        penalty when positive and multiplied when negative. frequency/presence (OpenAI), over
        output tokens: logit -= frequency * count + presence * (count > 0)."""
        sel = [i for i, r in enumerate(rows)
               if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty != 0.0
               or r.params.presence_penalty != 0.0]
        if not sel:
            return
        m, v = len(sel), work.shape[1]
        out_r, out_c = self._flat_ids([rows[i].output_token_ids for i in sel], work.device)
        counts = torch.zeros(m, v, dtype=work.dtype, device=work.device)          # [M, V] output counts
        counts.index_put_((out_r, out_c), torch.ones_like(out_c, dtype=work.dtype), accumulate=True)
        seen = counts > 0                                                          # [M, V]
        in_output = seen.to(work.dtype)
        prompt_r, prompt_c = self._flat_ids([rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0
                                             else () for i in sel], work.device)
        seen[prompt_r, prompt_c] = True

        def column(name: str) -> torch.Tensor:                                     # [M, 1]
            return to_device([getattr(rows[i].params, name) for i in sel], work.dtype,
                             work.device).unsqueeze(1)

        idx = self._long(sel, work)
        sub = work[idx]                                                            # [M, V]
        rep = column("repetition_penalty")
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * in_output
        work[idx] = sub

    # -- drawing -------------------------------------------------------------------------------------
    def _sample(self, work: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        tokens = torch.empty(len(rows), dtype=torch.long, device=work.device)      # [N]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            g = self._long(greedy, work)
            tokens[g] = work[g].argmax(-1)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            return tokens
        r_idx = self._long(rand, work)
        probs = self._tempered_probs(work[r_idx], [rows[i].params for i in rand])  # [R, V]
        q = self._exponential_noise(probs, [rows[i] for i in rand])                 # [R, V]
        tokens[r_idx] = (probs / q).argmax(-1)
        return tokens

    def _tempered_probs(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """softmax of processed logits x [R, V] after temperature and the filters (new tensor)."""
        temp = to_device([p.temperature for p in params], x.dtype, x.device)
        # Shift the row max to 0 first: then no positive temperature, however small, overflows to inf.
        x = (x - x.amax(-1, keepdim=True)) / temp.unsqueeze(1)
        self._filter_(x, params)
        return x.softmax(-1)                                                        # [R, V]

    def _filter_(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        """min_p, top_k, top_p in place on x [R, V] (float32, temperature applied): one call
        for all rows, each filter off (0, V, 1) on the rows that do not ask for it. The Triton
        kernel finds the thresholds by counting, without sorting the vocabulary."""
        v = self.vocab_size
        if not any(p.min_p > 0 or 0 < p.top_k < v or p.top_p < 1.0 for p in params):
            return
        dev = x.device
        backend.sampling_filters_(
            x,
            to_device([p.min_p for p in params], torch.float32, dev),                          # [R]
            to_device([p.top_k if 0 < p.top_k < v else v for p in params], torch.long, dev),
            to_device([p.top_p for p in params], torch.float32, dev))

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """q ~ Exp(1) per token: seeded rows from their own keyed generator, the rest
        from the shared one. Clamped away from 0 so probs / q stays finite (0 / q = 0)."""
        v = probs.shape[1]
        seeded = [j for j, row in enumerate(rows) if row.params.seed is not None]
        unseeded = [j for j, row in enumerate(rows) if row.params.seed is None]
        if not seeded:
            return torch.empty_like(probs).exponential_(generator=self.generator).clamp_min_(
                torch.finfo(probs.dtype).tiny)
        q = torch.empty_like(probs)                                                 # [R, V]
        if unseeded:
            u = torch.empty(len(unseeded), v, dtype=probs.dtype, device=probs.device)
            q[self._long(unseeded, q)] = u.exponential_(generator=self.generator)
        for j in seeded:
            row = rows[j]
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(stream_seed(row.params.seed, row.stream_index, len(row.output_token_ids)))
            q[j] = torch.empty(v, dtype=probs.dtype, device=probs.device).exponential_(generator=gen)
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    @staticmethod
    def _flat_ids(seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged token ids as (row index, token id) pairs on ``device``, both [total] int64.
        Goes through numpy: converting long Python lists with torch.tensor is several times
        slower, and rows that already hold arrays or CPU tensors are not copied element-wise."""
        arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
        total = sum(len(a) for a in arrays)
        lengths = to_device([len(a) for a in arrays], torch.long, device)                  # [M]
        ids = to_device(np.concatenate(arrays), torch.long, device)                        # [total]
        rows = torch.repeat_interleave(torch.arange(len(arrays), device=device), lengths,
                                       output_size=total)                                 # [total]
        return rows, ids

    @staticmethod
    def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
        return to_device(values, torch.long, like.device)
