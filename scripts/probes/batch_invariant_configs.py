"""The batch-invariant mode's fixed configs at DeepSeek-V4-Flash widths, against the normal mode.

Matmul (``kernels/batch_invariant_ops.py``): projections x [M, K] @ w[N, K].T in bf16 at M = 1, 16,
64 and 4,096 over the V4-Flash (N, K) shapes, timed for torch's own ``x @ w.T`` (cuBLAS, the normal
mode), the first invariant config (``LEGACY_MATMUL``) and each candidate tile config with K split
at most S = 1, 2, 4, 8 ways within one or two waves of programs (the S a shape gets follows from
(N, K) and the SM count alone, ``matmul_split``; configs that give a shape the same launch are
timed once). The lm_head is timed at M = 4,096 too, though serving computes
logits only for the positions it samples. Fused MoE (bf16, H 4,096,
I 2,048, E 256, top 6, packed weights as served) at T = 1, 16, 64, 4,096: the normal
``pick_config(T)`` against candidate fixed configs through ``fused_moe(..., invariant=True)`` with
``fused_moe.INVARIANT_CONFIG`` set (timed first: its few cases must not wait behind the matmul's).

Each line: µs per call (median of CUDA-graph replays; a graph holds several calls, which rotate
over enough weight copies that the weights stream from HBM, not L2, as a model's layers do), the
ratio to the normal mode, GB/s of the bytes that must move (weights + activations + output; the
MoE's touched experts), and BAD when the output is off the normal mode's by more than 2% of its
largest value. The invariance check: row 0 (token 0) is the same input at every M (T); its output
bits must be the same at every M for a config to be invariant (they are by construction: the
config never follows M).

The last lines, per family, name the fixed config with the smallest score: the mean over the four
M (T) of (sum over shapes of its time) / (sum over shapes of the normal time), so decode at 1, 16,
64 and the 4,096-token prefill weigh equally whatever their absolute times; also the raw sums
and the per-(N, K) best matmul config.

    python scripts/probes/batch_invariant_configs.py                # on a GPU, under 4 minutes
    python scripts/probes/batch_invariant_configs.py --budget 120   # start no case after 120 s
    python scripts/probes/batch_invariant_configs.py --dry-run      # CPU, tiny shapes, Triton interpreter
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--dry-run", action="store_true", help="tiny shapes in the Triton interpreter on the CPU")
ARGS.add_argument("--budget", type=float, default=170.0, help="seconds after which no new case starts")
ARGS.add_argument("--replays", type=int, default=5, help="timed graph replays per case")
ARGS.add_argument("--families", default="moe,matmul", help="which families to time (moe, matmul)")
OPTS = ARGS.parse_args()
if OPTS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"                   # read when the kernels are first decorated
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from deepinfer.kernels import batch_invariant_ops as ops  # noqa: E402
from deepinfer.kernels import fused_moe as fm  # noqa: E402
from deepinfer.kernels.launch import sm_count  # noqa: E402

DEV = torch.device("cpu" if OPTS.dry_run else "cuda")
START = time.perf_counter()
SKIPPED = 0
NOT_INVARIANT: set[str] = set()         # labels whose row 0 changed with M (T)
NORMAL = "normal"

if OPTS.dry_run:
    DTYPE = torch.float32                                  # the interpreter multiplies bf16 tiles as integers
    MS = (1, 16, 40)
    SHAPES = [("kv", 96, 1024), ("wide", 640, 128)]          # kv splits K
    MOE = dict(h=256, i=64, e=8, k=2)
    TS = (1, 16, 40)
    STREAM_BYTES = 0
else:
    DTYPE = torch.bfloat16
    MS = (1, 16, 64, 4096)
    SHAPES = [("q_a", 1024, 4096), ("kv", 512, 4096), ("q_b", 32768, 1024), ("o_b", 4096, 8192),
              ("gate_up", 4096, 4096), ("down", 4096, 2048), ("lm_head", 129280, 4096)]
    MOE = dict(h=4096, i=2048, e=256, k=6)
    TS = (1, 16, 64, 4096)
    STREAM_BYTES = 256 << 20                               # weight copies per graph: past the 50 MB L2

# (block_m, block_n, block_k, num_warps, num_stages); each with max_split 1, 2, 4, 8, and the split
# ones also with two waves of programs (S up to 2 x SMs / tiles).
TILES = [(64, 64, 32, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3),
         (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 256, 64, 8, 3), (64, 64, 128, 4, 3),
         (128, 256, 64, 8, 3)]
SPLITS = (1, 2, 4, 8)
POLICIES = [ops.MatmulConfig(*tile, max_split=s, waves=w) for tile in TILES for s in SPLITS for w in (1, 2)
            if s > 1 or w == 1]
# The decode tiles with a large tile from 256 rows on (the same K steps and slices, walked in order).
LARGE_TILES = [ops.MatmulTile(128, 256, 8, 3), ops.MatmulTile(128, 128, 8, 4), ops.MatmulTile(128, 256, 8, 4),
               ops.MatmulTile(128, 128, 8, 3)]
POLICIES += [ops.MatmulConfig(64, 128, 64, w, st, max_split=s, large=large)
             for w, st in ((8, 3), (4, 4)) for s in (4, 8) for large in LARGE_TILES]
MoEConfig = fm.MoEConfig
MOE_CONFIGS = {
    "decode (first)": fm.FIRST_INVARIANT_CONFIG,
    "rows16 group8": MoEConfig(16, 32, 128, 64, 128, 8, num_warps=4, num_stages=4),
    "rows16 tma": MoEConfig(16, 32, 64, 64, 64, 8, num_warps=4, num_stages=4, tma=True, sorted_act=True),
    "rows32 (medium)": fm.pick_config(400, 6, 256, 4096, 2048),
    "rows32 tma": MoEConfig(32, 64, 64, 128, 64, 8, num_warps=4, num_stages=4, tma=True, sorted_act=True),
    "rows64 tma": fm.ROWS64_INVARIANT_CONFIG,
    "rows64 pointer": MoEConfig(64, 64, 128, 64, 128, 8, num_warps=4, num_stages=4),
    "rows64 tma w8": fm.DEFAULT_INVARIANT_CONFIG,
    "rows128 (prefill)": fm.pick_config(4096, 6, 256, 4096, 2048),
}


def over_budget() -> bool:
    global SKIPPED
    if time.perf_counter() - START > OPTS.budget:
        SKIPPED += 1
        return True
    return False


def time_us(calls: list) -> float:
    """Median µs per call: on CUDA, graph replays of ``calls`` (each graph runs every call once,
    several graphs' worth for short calls); on the CPU, one pass timed by the host."""
    if DEV.type == "cpu":
        t = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    calls[0]()
    b.record()
    torch.cuda.synchronize()
    once = max(a.elapsed_time(b) * 1e3, 1.0)
    rounds = max(1, min(20, int(2000 / (once * len(calls)))))     # about 2 ms of work a replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(OPTS.replays):
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def line(case: str, label: str, us: float, normal_us: float | None, nbytes: float, flag: str = "") -> None:
    ratio = f"{us / normal_us:6.2f}x" if normal_us else "   -   "
    print(f"{case:34s} {label:34s} {us:10.1f} us {ratio} {nbytes / us / 1e3:7.0f} GB/s{flag}", flush=True)


# -- matmul --------------------------------------------------------------------------------------

def matmul_family() -> dict:
    """{(M, shape): {label: us}} with the normal mode's time under NORMAL."""
    sms = sm_count(DEV)
    results: dict = {}
    row0: dict = {}                                        # (shape, config label) -> {M: row 0's output}
    gen = torch.Generator(device=DEV).manual_seed(0)
    k_max = max(k for _, _, k in SHAPES)
    x_all = torch.randn(max(MS), k_max, generator=gen, device=DEV).to(DTYPE)
    # Pass 1: the normal mode, the first invariant config and the default everywhere; pass 2 the rest.
    default = ops.matmul_config(0, 0, DTYPE)
    first = list(dict.fromkeys([ops.LEGACY_MATMUL, default, dataclasses.replace(default, tma=True),
                                ops.SPLIT_MATMUL]))
    launch_row0: dict = {}                                 # (shape, launch) -> {M: row 0's output}
    for pass_policies in (first, [p for p in POLICIES if p not in first]):
        for name, n, k in SHAPES:
            nbytes_w = n * k * x_all.element_size()
            copies = max(1, min(32, -(-STREAM_BYTES // nbytes_w)))
            # The same weights in both passes (row 0 is compared across them), so a generator per shape.
            wgen = torch.Generator(device=DEV).manual_seed(n * 7919 + k)
            ws = [torch.randn(n, k, generator=wgen, device=DEV, dtype=DTYPE).div_(k ** 0.5) for _ in range(copies)]
            for m in MS:
                x = x_all[:m, :k].contiguous()
                key = (m, name)
                case = f"mm {name} M={m} N={n} K={k}"
                got = results.setdefault(key, {})
                nbytes = nbytes_w + (m * k + m * n) * x.element_size()
                if NORMAL not in got:
                    if over_budget():
                        continue
                    got[NORMAL] = time_us([lambda w=w: x @ w.t() for w in ws])
                    line(case, "torch x @ w.T (normal)", got[NORMAL], None, nbytes)
                ref = x @ ws[0].t()
                row0.setdefault((name, NORMAL), {})[m] = ref[0].clone()
                for cfg in pass_policies:
                    bm, bn, warps, stages, split, split_launch = ops.matmul_launch(cfg, m, n, k, sms)
                    measured = (f"tile {bm}x{bn}x{cfg.block_k} w{warps} s{stages} S={split}"
                                + ("" if split_launch or split == 1 else " in order") + (" tma" if cfg.tma else ""))
                    if cfg.label in got:
                        continue
                    done = got.get(measured)
                    if done is None:
                        if over_budget():
                            continue
                        try:
                            out = ops.mm(x, ws[0].t(), config=cfg)
                            us = time_us([lambda w=w: ops.mm(x, w.t(), config=cfg) for w in ws])
                        except Exception as exc:          # a config the compiler refuses: say so, go on
                            print(f"{case:34s} {measured:34s} FAILED {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                            got[measured] = float("inf")
                            got[cfg.label] = float("inf")
                            continue
                        bad = (out.float() - ref.float()).abs().max().item() > 0.02 * ref.float().abs().max().item()
                        launch_row0.setdefault((name, measured), {})[m] = out[0].clone()
                        got[measured] = done = us
                        line(case, measured, us, got[NORMAL], nbytes, "  BAD" if bad else "")
                    got[cfg.label] = done
                    if m in launch_row0.get((name, measured), {}):
                        # A config's row 0 at every M, whichever launch each M took.
                        row0.setdefault((name, cfg.label), {})[m] = launch_row0[(name, measured)][m]
            del ws
    differ = []
    for (name, measured), rows in row0.items():
        if not all(torch.equal(r, rows[min(rows)]) for r in rows.values()):
            differ.append((name, measured))
            if measured != NORMAL:
                NOT_INVARIANT.add(measured)
            why = " (expected: cuBLAS picks its kernel by M)" if measured == NORMAL else "  NOT INVARIANT"
            print(f"# row 0 differs across M={sorted(rows)}: mm {name} {measured}{why}", flush=True)
    # (Keyed by config label: a config with a large tile is checked across its two launches.)
    bad = [d for d in differ if d[1] != NORMAL]
    print(f"# matmul invariance: row 0 compared across M for {len(row0) - len(SHAPES)} (shape, config) pairs: "
          f"{'all bitwise equal' if not bad else f'{len(bad)} DIFFER (above)'}; normal mode differs on "
          f"{len(differ) - len(bad)} of {len(SHAPES)} shapes", flush=True)
    return results


# -- fused MoE -----------------------------------------------------------------------------------

def moe_family() -> dict:
    h, i, e, k = MOE["h"], MOE["i"], MOE["e"], MOE["k"]
    gen = torch.Generator(device=DEV).manual_seed(1)
    gate_up = fm.pack_expert_weights(torch.randn(e, 2 * i, h, generator=gen, device=DEV, dtype=DTYPE).div_(h ** 0.5),
                                     *fm.GATE_UP_TILE)
    down = fm.pack_expert_weights(torch.randn(e, h, i, generator=gen, device=DEV, dtype=DTYPE).div_(i ** 0.5),
                                  *fm.DOWN_TILE)
    t_max = max(TS)
    x_all = torch.randn(t_max, h, generator=gen, device=DEV).to(DTYPE)
    ids_all = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(j))[:k]
                           for j in range(t_max)]).to(DEV)
    tw_all = (torch.rand(t_max, k, generator=gen, device=DEV) + 0.1).float()
    expert_bytes = 3 * h * i * x_all.element_size()
    results: dict = {}
    row0: dict = {}
    saved = fm.INVARIANT_CONFIG
    try:
        for t in TS:
            x, ids, tw = x_all[:t], ids_all[:t], tw_all[:t]
            nbytes = ids.unique().numel() * expert_bytes + 2 * t * h * x.element_size()
            case = f"moe T={t} H={h} I={i} E={e} K={k}"
            got = results.setdefault((t, "moe"), {})
            if over_budget():
                continue
            ref = fm.fused_moe(x, gate_up, down, tw, ids, packed=True)
            got[NORMAL] = time_us([lambda: fm.fused_moe(x, gate_up, down, tw, ids, packed=True)])
            line(case, f"normal pick_config(T={t})", got[NORMAL], None, nbytes)
            for label, cfg in MOE_CONFIGS.items():
                if over_budget():
                    continue
                fm.INVARIANT_CONFIG = cfg
                try:
                    out = fm.fused_moe(x, gate_up, down, tw, ids, packed=True, invariant=True)
                    us = time_us([lambda: fm.fused_moe(x, gate_up, down, tw, ids, packed=True, invariant=True)])
                except Exception as exc:
                    print(f"{case:34s} {label:34s} FAILED {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    got[label] = float("inf")
                    continue
                bad = (out.float() - ref.float()).abs().max().item() > 0.02 * ref.float().abs().max().item()
                row0.setdefault(label, {})[t] = out[0].clone()
                got[label] = us
                line(case, label, us, got[NORMAL], nbytes, "  BAD" if bad else "")
    finally:
        fm.INVARIANT_CONFIG = saved
    for label, rows in row0.items():
        same = all(torch.equal(r, next(iter(rows.values()))) for r in rows.values())
        if not same:
            NOT_INVARIANT.add(label)
        print(f"# moe {label}: token 0 across T={sorted(rows)} {'bitwise equal' if same else 'DIFFERS: NOT INVARIANT'}",
              flush=True)
    return results


# -- scores --------------------------------------------------------------------------------------

def report(family: str, results: dict, sizes: tuple[int, ...], labels: list[str], current: str) -> None:
    """Per label with every case timed: the mean over sizes of (its time summed over shapes) /
    (the normal time summed over shapes); the smallest wins."""
    scores = {}
    for label in labels:
        per_size, raw = [], 0.0
        for size in sizes:
            keys = [key for key in results if key[0] == size]
            if not keys or any(label not in results[key] or NORMAL not in results[key] for key in keys):
                break
            total = sum(results[key][label] for key in keys)
            per_size.append(total / sum(results[key][NORMAL] for key in keys))
            raw += total
        else:
            scores[label] = (statistics.mean(per_size), per_size, raw)
    if not scores:
        print(f"# {family}: no config timed at every size (raise --budget)")
        return
    normal_raw = sum(r[NORMAL] for key, r in results.items() if NORMAL in r)
    ranked = sorted(scores.items(), key=lambda kv: kv[1][0])
    print(f"# {family}: score = mean over sizes {sizes} of (config time / normal time), each summed over "
          f"shapes; normal total {normal_raw:.0f} us")
    # Configs that run the same launches on every shape (a larger max_split no shape can use) tie:
    # one line for each group, the first (smallest max_split) named.
    shown, ties = [], {}
    for label, (score, per_size, raw) in ranked:
        if shown and (score, raw) == scores[shown[-1]][::2] and label != current:
            ties[shown[-1]] = ties.get(shown[-1], 0) + 1
        else:
            shown.append(label)
    for label in shown[:6] + [lab for lab in shown[6:] if lab == current]:
        score, per_size, raw = scores[label]
        sizes_txt = " ".join(f"{s}:{r:.2f}x" for s, r in zip(sizes, per_size))
        tied = f"  (+{ties[label]} tied)" if label in ties else ""
        print(f"#   {label:40s} score {score:5.2f}x  ({sizes_txt})  total {raw:.0f} us{tied}"
              f"{'  <- current default' if label == current else ''}")
    best = ranked[0][0]
    size = "M" if family == "matmul" else "T"
    print(f"BEST {family}: {best}  score {ranked[0][1][0]:.2f}x  invariant: "
          f"{'NO, row 0 changed with ' + size if best in NOT_INVARIANT else 'yes'} (by construction the config "
          f"never follows {size}; checked: row 0's bits at every {size} timed)")


def main() -> None:
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (interpreter)"
    print(f"# {dev}; SMs {sm_count(DEV)}; dtype {DTYPE}; budget {OPTS.budget:.0f} s", flush=True)
    # The MoE first: its few cases must not wait behind the matmul's many.
    families = OPTS.families.split(",")
    moe_results = moe_family() if "moe" in families else {}
    if DEV.type == "cuda":
        torch.cuda.empty_cache()                           # the MoE's 13 GB of weights go back
    mm_results = matmul_family() if "matmul" in families else {}
    print(f"# {SKIPPED} cases skipped past the budget; {time.perf_counter() - START:.0f} s in all", flush=True)
    default_mm = ops.matmul_config(0, 0, DTYPE)
    default_tma = dataclasses.replace(default_mm, tma=True)
    labels = list(dict.fromkeys(p.label for p in [ops.LEGACY_MATMUL, default_mm, default_tma, *POLICIES]))
    report("matmul", mm_results, MS, labels, default_mm.label)
    default_moe = next(label for label, cfg in MOE_CONFIGS.items() if cfg == fm.DEFAULT_INVARIANT_CONFIG)
    report("moe", moe_results, TS, list(MOE_CONFIGS), default_moe)
    # Per (N, K): the best measured matmul launch at each M (a config by weight shape is invariant too).
    for name, n, k in SHAPES:
        for m in MS:
            got = {lab: us for lab, us in mm_results.get((m, name), {}).items() if lab.startswith("tile")}
            if got and NORMAL in mm_results[(m, name)]:
                lab = min(got, key=got.get)
                print(f"best mm {name:8s} M={m:5d}: {lab:34s} {got[lab]:9.1f} us  "
                      f"{got[lab] / mm_results[(m, name)][NORMAL]:.2f}x normal")


if __name__ == "__main__":
    main()
