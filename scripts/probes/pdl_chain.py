"""Programmatic dependent launch on a chain of small Triton kernels (RMSNorm) and of GEMV+RMSNorm
pairs, captured in a CUDA graph, with and without PDL; checks the PDL chain's result equals the
plain one.

Run from the repository root on a GPU: python scripts/probes/pdl_chain.py (results:
docs/BENCHMARKS.md).
"""
import torch, triton, triton.language as tl, time
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents
print("triton", triton.__version__)

@triton.jit
def k_rms(x_ptr, w_ptr, o_ptr, n, PDL: tl.constexpr, EARLY: tl.constexpr, B: tl.constexpr):
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0)
    c = tl.arange(0, B)
    x = tl.load(x_ptr + r * n + c).to(tl.float32)
    w = tl.load(w_ptr + c).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + 1e-6) * w
    tl.store(o_ptr + r * n + c, y.to(o_ptr.dtype.element_ty))

@triton.jit
def k_gemv(x_ptr, w_ptr, o_ptr, K, PDL: tl.constexpr, PRE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # out[n] = sum_k w[n,k] x[k]; one program per BN rows
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN], tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + rows[:, None] * K + k0 + ks[None, :]).to(tl.float32)
        x = tl.load(x_ptr + k0 + ks).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(o_ptr + rows, acc.to(o_ptr.dtype.element_ty))

dev = "cuda"
n = 4096
xs = [torch.randn(1, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
w = torch.randn(n, device=dev, dtype=torch.bfloat16)

def chain(pdl, early, reps=200):
    a, b = xs
    for i in range(reps):
        k_rms[(1,)](a, w, b, n, PDL=pdl, EARLY=early, B=n, num_warps=4, launch_pdl=pdl)
        a, b = b, a

def graph_time(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3

for pdl, early in ((False, False), (True, False), (True, True)):
    t = graph_time(lambda: chain(pdl, early))
    print(f"rms chain pdl={pdl} early={early}: {t/200:.3f} us/kernel")

# gemv chain: 4096x4096 weights bf16 (32 MB) alternating with rms
W = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(8)]
def gchain(pdl, use_torch=False):
    a, b = xs
    for i in range(8):
        if use_torch:
            b.copy_(torch.nn.functional.linear(a, W[i]))
        else:
            k_gemv[(n // 16,)](a, W[i], b, n, PDL=pdl, PRE=False, BN=16, BK=256, num_warps=4, launch_pdl=pdl)
        k_rms[(1,)](b, w, a, n, PDL=pdl, EARLY=True, B=n, num_warps=4, launch_pdl=pdl)
for pdl in (False, True):
    t = graph_time(lambda: gchain(pdl))
    print(f"gemv+rms x8 pdl={pdl}: {t:.1f} us total ({8*n*n*2/ (t*1e-6)/1e9:.0f} GB/s eff)")
t = graph_time(lambda: gchain(False, True))
print(f"cublas linear+copy+rms x8: {t:.1f} us")
# correctness check of the PDL chain
a0 = xs[0].clone()
chain(True, True, reps=3); torch.cuda.synchronize()
xs[0].copy_(a0); 
chain(False, False, reps=3); r1 = xs[1].clone()
xs[0].copy_(a0); chain(True, True, reps=3); r2 = xs[1].clone()
print("pdl same result:", torch.equal(r1, r2))
