"""min-p / top-k / top-p sampling filters without a vocabulary sort, one Triton
program per row; reference: :func:`reference.sampling_filters_`.

Shapes: R rows, V vocabulary.

All three filters keep an upper set of the row: min-p keeps ``prob >= min_p *
max_prob`` (an element-wise test once the row's max and normaliser are known),
top-k keeps the values >= the k-th largest, top-p keeps the values >= a
threshold found from cumulative masses. So each row needs two thresholds, and a
threshold is found by counting, never by sorting:

1. One pass for the row max ``m`` and normaliser ``Z = sum exp(x - m)`` (and,
   when min-p is off, the smallest finite value and the finite count); with
   min-p on, a second pass for them over the min-p survivors ``y``.
2. Narrowing (one pass per round): keep a key interval ``[kL, kH)`` known to
   hold the threshold, count (top-k: elements >= pivot; top-p: mass below the
   pivot) at one pivot per pass, keep the half that holds it. Keys are the
   float bits mapped to integers in value order. The first rounds take the
   midpoint in value, later ones the midpoint in key, which halves any interval
   so the loop ends within 32 more rounds.
3. As soon as the interval holds at most ``CAP`` elements, one pass gathers
   them into a per-row scratch row and the exact threshold is found in
   registers by bisection over keys. When top-k's gather could take every
   element above its interval (k small: the usual case), top-p is then solved
   in registers from those, with no further pass.
4. One pass writes -inf over the dropped elements, in place.

Ties and rounding, against the torch path (sort, softmax, cumsum):
- top-k keeps every value tied with the k-th largest, exactly as the torch path.
- top-p keeps a group of tied values whole: the group stays when the torch path
  keeps any of its members (the torch path keeps the later ones in its sort
  order, which is arbitrary among equal values). With distinct values the kept
  sets are the same.
- Masses are summed in another order than torch's cumsum, and ``exp`` is the
  GPU's fast exponential: a token whose cumulative mass (top-p) or probability
  ratio (min-p) lies within float32 rounding of the cut can land on the other
  side. Away from ties and such boundaries the kept sets are identical, so the
  exponential race draws the same tokens for the same noise.

Host-sync free: per-row parameters are device tensors, every decision is on the
device, the launch has a fixed grid. The row is read about 5-15 times
(min-p on: one more, narrowing rounds depend on the data); a sort-based filter
moves the row several times as well and sorts it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

_VALUE_ROUNDS = 8        # narrowing rounds that bisect in value before switching to keys


@triton.jit
def _key(v):
    """float32 -> int32 in the same order (-0.0 folded onto +0.0, as they compare equal)."""
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _value(k):
    """Inverse of :func:`_key`."""
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _min_p(x, m, z, min_p):
    """x after min-p: a value whose probability ``exp(x - m) / Z`` is below ``min_p`` times
    the largest (``1 / Z``) becomes -inf, as the torch path's ``probs < amax * min_p``."""
    if min_p > 0:
        x = tl.where(tl.exp(x - m) / z < (1.0 / z) * min_p, float("-inf"), x)
    return x


@triton.jit
def _load_y(xr, offs, V, m, z, min_p):
    """A tile of the row after min-p (-inf past the end)."""
    return _min_p(tl.load(xr + offs, mask=offs < V, other=float("-inf")), m, z, min_p)


@triton.jit
def _pivot(kl, kh, rounds, VALUE_ROUNDS: tl.constexpr):
    """A key strictly inside (kl, kh), which needs kh - kl >= 2: the value midpoint of the
    interval's ends for the first rounds, then the key midpoint."""
    top = kh - 1
    key_mid = ((kl.to(tl.int64) + top.to(tl.int64) + 1) >> 1).to(tl.int32)
    value_mid = _key(_value(kl) * 0.5 + _value(top) * 0.5)
    value_mid = tl.minimum(tl.maximum(value_mid, kl + 1), top)
    return tl.where(rounds < VALUE_ROUNDS, value_mid, key_mid)


@triton.jit
def _count_mass(xr, V, m, z, min_p, lo, c, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """One pass: (count of y >= c, sum of exp(y - m) over lo <= y < c)."""
    cv = tl.zeros([BLOCK], tl.int32)
    mv = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        y = _load_y(xr, start + tl.arange(0, BLOCK), V, m, z, min_p)
        cv += (y >= c).to(tl.int32)
        if MASS:
            mv += tl.where((y >= lo) & (y < c), tl.exp(y - m), 0.0)
    return tl.sum(cv, axis=0), tl.sum(mv, axis=0)


@triton.jit
def _gather(xr, V, m, z, min_p, lo, hi, scratch, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """One pass: the values lo <= y < hi (at most CAP of them), packed into a [CAP] tile
    padded with -inf, through the row's scratch buffer."""
    tl.debug_barrier()                                                  # earlier reads of scratch first
    n = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        y = _load_y(xr, start + tl.arange(0, BLOCK), V, m, z, min_p)
        sel = (y >= lo) & (y < hi)
        pos = n + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(scratch + pos, y, mask=sel & (pos < CAP))
        n += tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()                                                  # the stores before the loads
    idx = tl.arange(0, CAP)
    return tl.load(scratch + idx, mask=idx < n, other=float("-inf"))


@triton.jit
def _kth_key(gk, above, k, lo, hi):
    """Largest key c in [lo, hi] with ``above + count(gk >= c) >= k`` (lo satisfies it)."""
    while lo < hi:
        mid = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) >> 1).to(tl.int32)
        if above + tl.sum((gk >= mid).to(tl.int32), axis=0) >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _top_p_key(gk, ge, below, zp, budget, lo, hi):
    """Largest key c in [lo, hi] with ``(below + sum of ge over lo <= gk < c) / zp <= budget``
    (lo satisfies it): the smallest key top-p keeps."""
    base = lo
    while lo < hi:
        mid = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) >> 1).to(tl.int32)
        mass = below + tl.sum(tl.where((gk >= base) & (gk < mid), ge, 0.0), axis=0)
        if mass / zp <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _filters_kernel(
    x_ptr, x_stride, V,
    min_p_ptr, top_k_ptr, top_p_ptr, scratch_ptr,
    BLOCK: tl.constexpr, CAP: tl.constexpr, VALUE_ROUNDS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * x_stride
    scratch = scratch_ptr + row * CAP
    min_p = tl.load(min_p_ptr + row)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row)
    inf = float("inf")
    if (min_p > 0) | (k < V) | (p < 1.0):
        # Pass 1: max and normaliser (online), smallest finite value and finite count.
        m = tl.full([], -inf, tl.float32)
        z = tl.zeros([], tl.float32)
        lo_v = tl.full([BLOCK], inf, tl.float32)
        n_v = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(xr + offs, mask=offs < V, other=-inf)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            if m_new > -inf:
                z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
            finite = x > -inf
            lo_v = tl.minimum(lo_v, tl.where(finite, x, inf))
            n_v += finite.to(tl.int32)
        if m > -inf:
            y_min = tl.min(lo_v, axis=0)
            n_surv = tl.sum(n_v, axis=0)
            if min_p > 0:
                lo_v = tl.full([BLOCK], inf, tl.float32)
                n_v = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    y = _load_y(xr, start + tl.arange(0, BLOCK), V, m, z, min_p)
                    lo_v = tl.minimum(lo_v, tl.where(y > -inf, y, inf))
                    n_v += (y > -inf).to(tl.int32)
                y_min = tl.min(lo_v, axis=0)
                n_surv = tl.sum(n_v, axis=0)
            k_top = _key(m) + 1                                        # exclusive bound over all keys

            # top-k: the k-th largest y; fewer than k survivors leave the row alone, as the
            # torch path's -inf k-th value does.
            tau_k = tl.full([], -inf, tl.float32)
            g = tl.full([CAP], -inf, tl.float32)
            have_top = tl.zeros([], tl.int32)                          # 1: g holds every y >= tau_k
            if (k < V) & (k < n_surv):
                kl = _key(y_min)
                kh = k_top
                cl = n_surv                                            # count(y >= value(kl))
                ch = tl.zeros([], tl.int32)                            # count(y >= value(kh))
                rounds = tl.zeros([], tl.int32)
                while (cl - ch > CAP) & (kh - kl > 1):
                    kc = _pivot(kl, kh, rounds, VALUE_ROUNDS)
                    cnt, _unused = _count_mass(xr, V, m, z, min_p, -inf, _value(kc), BLOCK, False)
                    if cnt >= k:
                        kl = kc
                        cl = cnt
                    else:
                        kh = kc
                        ch = cnt
                    rounds += 1
                if cl - ch > CAP:
                    # More than CAP elements share one value: it is the k-th largest.
                    tau_k = _value(kl)
                else:
                    # Everything >= value(kl) when it fits (then top-p needs no pass), else the interval.
                    have_top = (cl <= CAP).to(tl.int32)
                    hi = tl.where(have_top != 0, inf, _value(kh))
                    g = _gather(xr, V, m, z, min_p, _value(kl), hi, scratch, BLOCK, CAP)
                    above = tl.where(have_top != 0, 0, ch)
                    tau_k = _value(_kth_key(_key(g), above, k, kl, kh - 1))

            # top-p over the survivors of min-p and top-k.
            tau_p = tl.full([], -inf, tl.float32)
            if p < 1.0:
                budget = 1.0 - p
                if have_top != 0:
                    gk = _key(g)
                    ge = tl.where(g >= tau_k, tl.exp(g - m), 0.0)
                    tau_p = _value(_top_p_key(gk, ge, 0.0, tl.sum(ge, axis=0), budget, _key(tau_k), k_top - 1))
                else:
                    # Start above the values whose mass underflows (< e^-80 each, far below any
                    # 1 - p > 0 in float32), with the mass below counted exactly.
                    lower = tl.maximum(tl.maximum(tau_k, y_min), m - 80.0)
                    zp = tl.zeros([BLOCK], tl.float32)
                    mb = tl.zeros([BLOCK], tl.float32)
                    cv = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, V, BLOCK):
                        y = _load_y(xr, start + tl.arange(0, BLOCK), V, m, z, min_p)
                        e = tl.where(y >= tau_k, tl.exp(y - m), 0.0)
                        zp += e
                        mb += tl.where(y < lower, e, 0.0)
                        cv += (y >= lower).to(tl.int32)
                    zp_s = tl.sum(zp, axis=0)
                    ml = tl.sum(mb, axis=0)                            # mass below value(kl)
                    cl = tl.sum(cv, axis=0)
                    kl = _key(lower)
                    kh = k_top
                    ch = tl.zeros([], tl.int32)
                    rounds = tl.zeros([], tl.int32)
                    while (cl - ch > CAP) & (kh - kl > 1):
                        kc = _pivot(kl, kh, rounds, VALUE_ROUNDS)
                        cnt, mass = _count_mass(xr, V, m, z, min_p, tau_k, _value(kc), BLOCK, True)
                        if mass / zp_s <= budget:
                            kl = kc
                            cl = cnt
                            ml = mass
                        else:
                            kh = kc
                            ch = cnt
                        rounds += 1
                    if cl - ch > CAP:
                        tau_p = _value(kl)
                    else:
                        g = _gather(xr, V, m, z, min_p, _value(kl), _value(kh), scratch, BLOCK, CAP)
                        tau_p = _value(_top_p_key(_key(g), tl.exp(g - m), ml, zp_s, budget, kl, kh - 1))

            # Final pass: -inf over everything below the thresholds or dropped by min-p.
            tau = tl.maximum(tau_k, tau_p)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(xr + offs, mask=offs < V, other=-inf)
                y = _min_p(x, m, z, min_p)
                tl.store(xr + offs, tl.full([BLOCK], -inf, tl.float32),
                         mask=(offs < V) & (x > -inf) & ((y < tau) | (y == -inf)))


def sampling_filters_(x: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      cap: int = 4096) -> None:
    """min-p, then top-k, then top-p, in place: filtered-out tokens become -inf.

    x: [R, V] float32 (temperature-scaled logits, unit column stride); min_p: [R] float32
    (0 = off); top_k: [R] integer, >= 1 (>= V = off); top_p: [R] float32 in (0, 1] (1 = off).
    ``cap`` (a power of two) is how many elements a row gathers for the exact in-register
    search; smaller values force more narrowing passes (tests use that).
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"sampling_filters_: x must be float32 [R, V] with unit column stride, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    r, v = x.shape
    for name, t, kind in (("min_p", min_p, torch.float32), ("top_p", top_p, torch.float32)):
        if t.shape != (r,) or t.dtype != kind:
            raise ValueError(f"sampling_filters_: {name} must be {kind} [{r}], got {t.dtype} {tuple(t.shape)}")
    if top_k.shape != (r,) or top_k.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sampling_filters_: top_k must be int32/int64 [{r}], got {top_k.dtype} "
                         f"{tuple(top_k.shape)}")
    if any(t.device != x.device for t in (min_p, top_k, top_p)):
        raise ValueError(f"sampling_filters_: min_p, top_k and top_p must be on x's device {x.device}")
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f"sampling_filters_: cap={cap} must be a power of two >= 16")
    if v >= 2 ** 31 - 1:
        raise ValueError(f"sampling_filters_: vocabulary of {v} exceeds the kernel's int32 counts")
    if r == 0:
        return
    # Tile config: one program streams its row in 8192-element tiles over 16 warps (16 float32,
    # four 16-byte loads per thread): 32 KiB in flight per iteration, since a row is one
    # program's and the loop is latency-bound. The gathered [CAP] tile stays in registers.
    block = min(8192, triton.next_power_of_2(v))
    scratch = torch.empty(r, cap, dtype=torch.float32, device=x.device)   # [R, CAP] gathered values
    _filters_kernel[(r,)](x, x.stride(0), v, min_p.contiguous(), top_k.contiguous(), top_p.contiguous(),
                          scratch, BLOCK=block, CAP=cap, VALUE_ROUNDS=_VALUE_ROUNDS, num_warps=16,
                          **pdl.flags(x.device))
