"""Prefill configs of the routed-expert grouped GEMMs (kernels/fused_moe.py) on DeepSeek-V4-Flash
widths: E=256, K=6, H=4096, I=2048, bf16, swiglu_limit 10, random routing.

For T=4096 every config in SWEEP (the current pick_config default first) is checked against the
default's output and against reference.clamped_moe_experts on the first 128 tokens, checked to be
bitwise equal run to run, then timed: gate_up (moe_gate_up), down (moe_down) and the whole fused_moe, each the median of triton.testing.do_bench
(L2 flushed between runs). GB/s counts the touched experts' weight bytes only, against the copy
rate measured here (a 4 GiB device-to-device copy_, read + write bytes). The best three configs,
the T=4096 default and each T's own default are then timed at T=2048 and 8192, and the best is replayed from a CUDA graph.
PDL is off (DEEPINFER_PDL=0) so no kernel's time includes its wait on the one before.

Run from the repository root on an H200 (about 3 minutes, mostly Triton compiles; the sweep stops
early after SWEEP_BUDGET_S and says which configs it skipped):
    PYTHONPATH=. python scripts/probes/fused_moe_prefill_sweep.py
The last line names the best config at T=4096.
"""
from __future__ import annotations

import os
import time

os.environ["DEEPINFER_PDL"] = "0"

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from deepinfer.bench.floors import measure_hbm_bandwidth  # noqa: E402
from deepinfer.kernels import reference  # noqa: E402
from deepinfer.kernels.fused_moe import MoEConfig, fused_moe, moe_align, moe_down, moe_gate_up, pick_config  # noqa: E402

START = time.time()
SWEEP_BUDGET_S = 150
E, K, H, I, LIMIT = 256, 6, 4096, 2048, 10.0
DEV, BF16 = "cuda", torch.bfloat16

BASE = pick_config(4096, K, E, H, I)
T = dict(tma=True)
TA = dict(tma=True, sorted_act=True)


def cfg(block_m, n1, k1, n2, k2, group_m, warps, stages, **flags) -> MoEConfig:
    return MoEConfig(block_m, n1, k1, n2, k2, group_m, num_warps=warps, num_stages=stages, **flags)


# Most promising first: the sweep may stop early.
SWEEP = [
    BASE,
    cfg(128, 128, 64, 256, 64, 8, 8, 3),          # pointer loads: the default before the sweep
    MoEConfig(**{**BASE.__dict__, "sorted_act": False}),
    MoEConfig(**{**BASE.__dict__, "tma": False}),
    cfg(128, 128, 64, 256, 64, 1, 8, 3, **TA),
    cfg(128, 128, 64, 256, 64, 16, 8, 3, **TA),
    cfg(128, 64, 64, 128, 64, 8, 4, 4, **TA),
    cfg(128, 64, 64, 128, 64, 8, 8, 4, **TA),
    cfg(128, 64, 64, 128, 64, 8, 4, 5, **TA),
    cfg(128, 64, 128, 128, 128, 8, 8, 3, **TA),
    cfg(128, 128, 128, 256, 128, 8, 8, 2, **TA),
    cfg(128, 128, 64, 128, 64, 8, 8, 3, **TA),
    cfg(64, 128, 64, 256, 64, 8, 4, 4, **TA),
    cfg(64, 128, 64, 256, 64, 8, 8, 4, **TA),
    cfg(64, 64, 64, 128, 64, 8, 4, 5, **TA),
    cfg(64, 128, 64, 256, 64, 8, 4, 4, **T),
    cfg(32, 128, 64, 256, 64, 8, 4, 4, **TA),
]


def short(c: MoEConfig) -> str:
    flags = [f for f in ("tma", "sorted_act") if getattr(c, f)]
    return (f"m{c.block_m} n{c.block_n1}/{c.block_n2} k{c.block_k1}/{c.block_k2} g{c.group_m} "
            f"w{c.num_warps} s{c.num_stages}" + (" " + "+".join(flags) if flags else ""))


class Case:
    """Routing, inputs and the default's output for T tokens."""

    def __init__(self, t: int, seed: int):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.t = t
        self.x = torch.randn(t, H, device=DEV, dtype=BF16, generator=g)
        logits = torch.randn(t, E, device=DEV, generator=g)
        self.weights, self.ids = reference.biased_topk(logits, torch.zeros(E, device=DEV), K, "sqrtsoftplus", 1.5)
        counts = torch.bincount(self.ids.flatten(), minlength=E)
        touched = int((counts > 0).sum())
        self.gate_up_bytes = touched * 2 * I * H * 2
        self.down_bytes = touched * H * I * 2
        self.note = (f"T={t}: {touched} experts touched, pairs per expert {counts.float().mean():.1f} "
                     f"(min {int(counts.min())}, max {int(counts.max())}), weights "
                     f"{(self.gate_up_bytes + self.down_bytes) / 1e9:.2f} GB; padded rows "
                     + ", ".join(f"{bm}-row blocks {int(((counts + bm - 1) // bm * bm).sum())}" for bm in (32, 64, 128)))

    def run(self, c: MoEConfig | None) -> torch.Tensor:
        return fused_moe(self.x, gate_up, down, self.weights, self.ids, LIMIT, config=c)

    def time_parts(self, c: MoEConfig) -> tuple[float, float, float]:
        """Median µs of gate_up, down and the whole fused_moe."""
        out = torch.empty(self.t * K, H, dtype=BF16, device=DEV)
        sorted_pairs, block_expert, num_padded = moe_align(self.ids, E, c.block_m, out)
        act = moe_gate_up(self.x, gate_up, sorted_pairs, block_expert, num_padded, K, LIMIT, c)
        us_gu = 1e3 * do_bench(lambda: moe_gate_up(self.x, gate_up, sorted_pairs, block_expert, num_padded,
                                                   K, LIMIT, c), warmup=10, rep=60, return_mode="median")
        us_dn = 1e3 * do_bench(lambda: moe_down(act, down, self.weights, sorted_pairs, block_expert, num_padded,
                                                out, c), warmup=10, rep=40, return_mode="median")
        us_all = 1e3 * do_bench(lambda: self.run(c), warmup=10, rep=80, return_mode="median")
        return us_gu, us_dn, us_all

    def line(self, c: MoEConfig, us: tuple[float, float, float], copy: float) -> str:
        gu, dn, whole = us
        w = self.gate_up_bytes + self.down_bytes
        return (f"gate_up {gu:7.0f} us {self.gate_up_bytes / gu / 1e3:5.0f} GB/s ({self.gate_up_bytes / gu / 1e3 / copy:4.0%})"
                f" | down {dn:6.0f} us {self.down_bytes / dn / 1e3:5.0f} GB/s ({self.down_bytes / dn / 1e3 / copy:4.0%})"
                f" | gate_up+down {gu + dn:7.0f} us ({w / (gu + dn) / 1e3 / copy:4.0%} of copy)"
                f" | fused_moe {whole:7.0f} us")


def check(case: Case, out: torch.Tensor, default: torch.Tensor, ref: torch.Tensor, n_ref: int) -> str:
    """'' when the output is within tolerance of the default's and of the reference's; else why."""
    problems = []
    if out.isnan().any():
        problems.append("NaN in the output")
    for name, want, got in (("default", default, out), ("reference", ref, out[:n_ref])):
        err = (got.float() - want.float()).abs()
        atol = 2e-2 * want.float().abs().max().item()
        if (err > atol + 2e-2 * want.float().abs()).any():
            problems.append(f"off the {name} (max abs err {err.max().item():.3e}, atol {atol:.3e})")
    return "; ".join(problems)


print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
      f"triton {__import__('triton').__version__}")
copy = measure_hbm_bandwidth(torch.device(DEV), 4 << 30)
print(f"copy rate (4 GiB device copy_, read + write): {copy:.0f} GB/s")
g0 = torch.Generator(device=DEV).manual_seed(0)
gate_up = torch.randn(E, 2 * I, H, device=DEV, dtype=BF16, generator=g0) / H ** 0.5
down = torch.randn(E, H, I, device=DEV, dtype=BF16, generator=g0) / I ** 0.5

case = Case(4096, seed=1)
print(case.note)
N_REF = 128
ref = reference.clamped_moe_experts(case.x[:N_REF], gate_up, down, case.weights[:N_REF], case.ids[:N_REF], LIMIT)
default_out = case.run(BASE)
print(f"default (pick_config) T=4096: {BASE}")
bad = check(case, default_out, default_out, ref, N_REF)
print(f"  default vs reference (first {N_REF} tokens): {'ok' if not bad else 'FAIL ' + bad}")

results: list[tuple[MoEConfig, tuple[float, float, float]]] = []
for n, c in enumerate(SWEEP):
    if time.time() - START > SWEEP_BUDGET_S:
        print(f"sweep budget of {SWEEP_BUDGET_S} s spent: skipped {len(SWEEP) - n} configs: "
              + "; ".join(short(s) for s in SWEEP[n:]))
        break
    t0 = time.time()
    try:
        out = case.run(c)
        bad = check(case, out, default_out, ref, N_REF)
        if not bad and not torch.equal(out, case.run(c)):
            bad = "not bitwise equal run to run"
        if bad:
            print(f"[{n:2d}] {short(c)}: FAIL {bad}")
            continue
        us = case.time_parts(c)
        results.append((c, us))
        print(f"[{n:2d}] {short(c)}: {case.line(c, us, copy)}  ({time.time() - t0:.0f} s)")
    except Exception as exc:                                      # noqa: BLE001 - one config's failure
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        print(f"[{n:2d}] {short(c)}: ERROR {msg}")
        if "CUDA error" in str(exc) or "illegal" in str(exc).lower():
            print("a CUDA error leaves the context unusable: stopping the sweep")
            break

if not results:
    raise SystemExit("no config ran")
base_us = next((us for c, us in results if c == BASE), None)
best_gu = min(results, key=lambda r: r[1][0])
best_dn = min(results, key=lambda r: r[1][1])
ranked = sorted(results, key=lambda r: r[1][0] + r[1][1])
print(f"best gate_up: {short(best_gu[0])} {best_gu[1][0]:.0f} us; best down: {short(best_dn[0])} {best_dn[1][1]:.0f} us")
if base_us:
    print(f"default gate_up+down {base_us[0] + base_us[1]:.0f} us; best {ranked[0][1][0] + ranked[0][1][1]:.0f} us "
          f"({(base_us[0] + base_us[1]) / (ranked[0][1][0] + ranked[0][1][1]):.2f}x)")

for t in (2048, 8192):
    other = Case(t, seed=t)
    print(other.note)
    other_default = other.run(None)
    other_ref = reference.clamped_moe_experts(other.x[:N_REF], gate_up, down, other.weights[:N_REF],
                                              other.ids[:N_REF], LIMIT)
    own = pick_config(t, K, E, H, I)                              # the default at this T
    print(f"  T={t} default: {short(own)}")
    for c in dict.fromkeys([own, BASE] + [c for c, _ in ranked[:3]]):
        try:
            bad = check(other, other.run(c), other_default, other_ref, N_REF)
            status = f"FAIL {bad}" if bad else other.line(c, other.time_parts(c), copy)
            print(f"  T={t} {short(c)}: {status}")
        except Exception as exc:                                  # noqa: BLE001
            print(f"  T={t} {short(c)}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
    del other

best = ranked[0][0]
try:
    x_static = case.x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x_static, gate_up, down, case.weights, case.ids, LIMIT, config=best)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fused_moe(x_static, gate_up, down, case.weights, case.ids, LIMIT, config=best)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(graph_out, case.run(best))
    us = 1e3 * do_bench(graph.replay, warmup=5, rep=60, return_mode="median")
    print(f"best config from a CUDA graph: {us:.0f} us per replay, bitwise equal to eager: {same}")
except Exception as exc:                                          # noqa: BLE001
    print(f"CUDA graph of the best config: ERROR {type(exc).__name__}: {str(exc)[:200]}")

gu, dn, whole = ranked[0][1]
print(f"BEST T=4096: {best} | gate_up {gu:.0f} us + down {dn:.0f} us = {gu + dn:.0f} us "
      f"({(case.gate_up_bytes + case.down_bytes) / (gu + dn) / 1e3 / copy:.0%} of copy) | fused_moe {whole:.0f} us "
      f"| total {time.time() - START:.0f} s")
