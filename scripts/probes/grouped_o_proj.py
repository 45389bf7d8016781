"""Layouts of DeepSeek-V4's grouped o_a projection at T=4096 and T=1 (bmm then flatten, bmm into a
strided out=, 8 mm calls, contiguous copy then bmm).

Run from the repository root on a GPU: python scripts/probes/grouped_o_proj.py (results:
docs/BENCHMARKS.md).
"""
import torch
dev = "cuda"; bf = torch.bfloat16
T, G, IN, O = 4096, 8, 4096, 1024
x = torch.randn(T, 64, 512, device=dev, dtype=bf)
w = torch.randn(G * O, IN, device=dev, dtype=bf) / 64
def t_ms(fn, iters=20):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(iters): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3
def cur():
    xv = x.view(T, G, -1)
    wv = w.view(G, -1, IN).transpose(1, 2)
    return torch.bmm(xv.transpose(0, 1), wv).transpose(0, 1).flatten(1)
def bmm_out():
    xv = x.view(T, G, -1)
    wv = w.view(G, -1, IN).transpose(1, 2)
    y = torch.empty(T, G, O, device=dev, dtype=bf)
    torch.bmm(xv.transpose(0, 1), wv, out=y.transpose(0, 1))
    return y.flatten(1)
def mm_loop():
    xv = x.view(T, G, -1)
    y = torch.empty(T, G, O, device=dev, dtype=bf)
    for g in range(G):
        torch.mm(xv[:, g], w[g * O:(g + 1) * O].t(), out=y[:, g])
    return y.flatten(1)
def contig():
    xv = x.view(T, G, -1).transpose(0, 1).contiguous()
    wv = w.view(G, -1, IN).transpose(1, 2)
    return torch.bmm(xv, wv).transpose(0, 1).flatten(1)
ref = cur()
for name, fn in (("current bmm+flatten", cur), ("bmm out=strided", bmm_out), ("8 mm out=slices", mm_loop), ("contig x + bmm", contig)):
    y = fn()
    print(f"{name}: {t_ms(fn):.1f} us  max|d|={(y.float()-ref.float()).abs().max().item():.3g}")
fl = 2 * T * G * IN * O
print(f"flops {fl/1e9:.1f} GFLOP; at 780 TFLOP/s {fl/780e12*1e6:.1f} us")
# B=1
x1 = torch.randn(1, 64, 512, device=dev, dtype=bf)
def cur1():
    xv = x1.view(1, G, -1); wv = w.view(G, -1, IN).transpose(1, 2)
    return torch.bmm(xv.transpose(0, 1), wv).transpose(0, 1).flatten(1)
def loop1():
    xv = x1.view(1, G, -1); y = torch.empty(1, G, O, device=dev, dtype=bf)
    for g in range(G): torch.mm(xv[:, g], w[g * O:(g + 1) * O].t(), out=y[:, g])
    return y.flatten(1)
def bmmo1():
    xv = x1.view(1, G, -1); wv = w.view(G, -1, IN).transpose(1, 2)
    y = torch.empty(1, G, O, device=dev, dtype=bf)
    torch.bmm(xv.transpose(0, 1), wv, out=y.transpose(0, 1)); return y.flatten(1)
for name, fn in (("B1 current", cur1), ("B1 bmm out", bmmo1), ("B1 mm loop", loop1)):
    print(f"{name}: {t_ms(fn):.1f} us (floor {w.numel()*2/4.2e12*1e6:.1f})")
