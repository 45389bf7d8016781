"""Greedy sampling in one pass over the logits: the most likely token of each row and
its raw logprob; reference: :func:`reference.greedy_sample`.

For a plain greedy row the sampler needs only ``argmax(x)`` and
``x[argmax] - logsumexp(x)`` = ``-log(sum_j exp(x_j - max))``: one read of the row.

Split-V. Grid (N, S): program (r, s) walks columns [s * chunk, (s + 1) * chunk) of
row r in tiles of BLOCK, keeping per lane a running max m, the first column where
it occurred, and z = sum exp(x - m) over the lane's columns so far. One exponential
per element: a larger x rescales z by exp(m - x) and adds 1; any other adds
exp(x - m), which is 0 for x = -inf (a -inf max counts as 0 in the difference, so a
-inf pair gives exp(-inf) rather than nan). The lanes then fold into the program's
partial (max, first index of the max, z relative to the max), stored in a small
float32/int32 scratch, and a second one-program-per-row launch combines the S
partials::

    m = max_s m_s      token = min { i_s : m_s = m }      z = sum_s z_s exp(m_s - m)
    logprob = -log(z)  (= x[token] - (m + log z))

Ties go to the lowest column, as ``torch.argmax``: within a lane columns come in
increasing order and only a strictly larger value moves the index; across lanes
and splits the lowest index among equal maxima wins. A row that is -inf
throughout gives token 0 and logprob nan, as the reference (-inf - -inf). NaN
logits are not supported (the reference takes the first NaN as the argmax; the
kernel's token and logprob are then unspecified). Float32 throughout; bfloat16
and float16 logits are widened on load.

S is one program per tile of the row (about 64 at DeepSeek's vocabulary), whatever
the number of rows: a row's token and logprob then do not depend on what shares its
launch (batch invariance; the partials are combined in a fixed order). A single row
still spreads over about half the SMs, and more rows only add programs. The scratch
comes from the caching allocator and nothing is read back: the two launches are
CUDA-graph safe and never synchronise with the host. Rows may have any stride (a
slice of a wider logits buffer is read in place); columns past ``vocab_size``
(padding) are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

_NO_INDEX = tl.constexpr(2 ** 31 - 1)    # above every column: loses every min


@triton.jit
def _finite(m):
    """m, with -inf as 0: ``x - _finite(m)`` is -inf rather than nan where x = m = -inf."""
    return tl.where(m > float("-inf"), m, 0.0)


@triton.jit
def _partials_kernel(
    x_ptr, x_stride, V, chunk, S,
    part_ptr, index_ptr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    xr = x_ptr + row * x_stride
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    lanes = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, tl.float32)                          # [BLOCK] lane max
    z = tl.zeros([BLOCK], tl.float32)                                  # [BLOCK] sum exp(x - m)
    idx = start + lanes                                                # [BLOCK] first column of m
    for tile in range(start, end, BLOCK):
        offs = tile + lanes
        x = tl.load(xr + offs, mask=offs < end, other=neg_inf).to(tl.float32)
        m_new = tl.maximum(m, x)
        d = tl.exp(tl.minimum(m, x) - _finite(m_new))                  # exp(smaller - larger); 0 for -inf
        gt = x > m
        z = tl.where(gt, z * d + 1.0, z + d)
        idx = tl.where(gt, offs, idx)
        m = m_new
    m_p = tl.max(m, axis=0)
    i_p = tl.min(tl.where(m == m_p, idx, _NO_INDEX), axis=0)
    z_p = tl.sum(z * tl.exp(m - _finite(m_p)), axis=0)                 # a -inf lane has z = 0
    out = row * S + split
    tl.store(part_ptr + out * 2, m_p)
    tl.store(part_ptr + out * 2 + 1, z_p)
    tl.store(index_ptr + out, i_p)


@triton.jit
def _combine_kernel(
    part_ptr, index_ptr, S,
    token_ptr, logprob_ptr,
    SPLITS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    valid = s < S
    neg_inf = float("-inf")
    m_s = tl.load(part_ptr + (row * S + s) * 2, mask=valid, other=neg_inf)       # [SPLITS]
    z_s = tl.load(part_ptr + (row * S + s) * 2 + 1, mask=valid, other=0.0)       # [SPLITS]
    i_s = tl.load(index_ptr + row * S + s, mask=valid, other=_NO_INDEX)         # [SPLITS]
    m = tl.max(m_s, axis=0)
    token = tl.min(tl.where(m_s == m, i_s, _NO_INDEX), axis=0)
    z = tl.sum(z_s * tl.exp(m_s - _finite(m)), axis=0)
    # z >= 1 (the max counts itself) unless the row is -inf throughout: the floor keeps log off 0.
    logprob = tl.where(m > neg_inf, -tl.log(tl.maximum(z, 1.0)), float("nan"))
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


def greedy_sample(logits: torch.Tensor, vocab_size: int, block: int = 2048,
                  splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax over the first ``vocab_size`` columns and its logprob, per row.

    logits: [N, V'] float32 / bfloat16 / float16, unit column stride, any row stride,
    V' >= vocab_size -> (token ids [N] int64, logprobs [N] float32). ``block`` (a power
    of two) is the tile width; ``splits`` overrides the programs per row (tests use both
    to get several tiles and splits out of small rows).
    """
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"greedy_sample: logits must be float32/bfloat16/float16 [N, V'], got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"greedy_sample: logits must have unit column stride, got strides {logits.stride()}")
    n, width = logits.shape
    if not 1 <= vocab_size <= width:
        raise ValueError(f"greedy_sample: vocab_size={vocab_size} must be in [1, {width}] (logits' columns)")
    if vocab_size >= 2 ** 31 - 1:
        raise ValueError(f"greedy_sample: vocab_size={vocab_size} exceeds the kernel's int32 indices")
    if block < 16 or block & (block - 1):
        raise ValueError(f"greedy_sample: block={block} must be a power of two >= 16")
    if splits is not None and splits < 1:
        raise ValueError(f"greedy_sample: splits={splits} must be >= 1")
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)              # [N]
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)         # [N]
    if n == 0:
        return tokens, logprobs
    # Tile config: BLOCK columns per iteration, 8 per thread (two 16-byte float32 loads);
    # by default one tile per program, S from the vocabulary alone (never from N: batch
    # invariance); ``splits`` gives each program a whole number of tiles, none empty.
    tiles = triton.cdiv(vocab_size, block)
    chunk = block * (1 if splits is None else triton.cdiv(tiles, min(splits, tiles)))    # columns a program
    s = triton.cdiv(vocab_size, chunk)
    part = torch.empty(n, s, 2, dtype=torch.float32, device=logits.device)       # [N, S, (max, z)]
    index = torch.empty(n, s, dtype=torch.int32, device=logits.device)           # [N, S]
    _partials_kernel[(n, s)](logits, logits.stride(0), vocab_size, chunk, s, part, index,
                             BLOCK=block, num_warps=max(1, min(16, block // 256)), **pdl.flags(logits.device))
    _combine_kernel[(n,)](part, index, s, tokens, logprobs,
                          SPLITS=max(16, triton.next_power_of_2(s)), num_warps=1, **pdl.flags(part.device))
    return tokens, logprobs
