"""The Gluon prefill sparse-attention kernel against older copies of its file, and where its time
goes. T=4096, 64 heads x 512, window 128 + top-512 and window only, the query's norm +
rope inside the kernel (the model's path); each variant checked against the reference, two
alternated rounds, the faster kept.

    git show REV:deepinfer/kernels/sparse_attention_gluon.py > /tmp/old_gluon.py
    PYTHONPATH=. python3 scripts/probes/gluon_attention_ab.py [/tmp/old_gluon.py ...] [--ablations]

With --ablations, the current kernel also without the PV product, without the QK product,
without the key gathers, and without the query prologue (rope=None: the norm + rope not done at
all); timing only, their outputs are wrong.

Tile loops measured with it (H200, 2026-12-04, window + top-512 / window, us; 4cdb3b8 and its
successor held them side by side behind a constexpr):
  the loop before: 1,046 / 470; softmax sums kept per column and reduced once: 1,016 / 464;
  that plus each gather's slot ids loaded a tile ahead: 1,004 / 463 (kept); that plus each
  tile's mask loaded before its QK: 1,039 / 461; PV(i) left running while tile i + 1's keys
  were awaited and QK(i + 1) queued behind it: 1,132 / 490 (tile i + 1's gather could then
  start only once PV(i - 1) was done, and its latency showed).
Ablations of the loop before (us, window + top-512 / window): all 1,038 / 472; no PV 887 /
434; no QK 797 / 407; no gathers 936 / 449; no query prologue 975 / 402.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

from triton.testing import do_bench

sys.path.insert(0, "scripts")
import gpu_kernel_check as g  # noqa: E402

from deepinfer.kernels import reference  # noqa: E402
from deepinfer.kernels import sparse_attention_gluon as sag  # noqa: E402

T, H, D, BS = 4096, 64, 512, 16
SRC = open(sag.__file__).read()

ABLATIONS = {
    "no PV": ("        acc = warpgroup_mma(p_smem, kv, acc, is_async=True)\n"
              "        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))\n"
              "    return m, l_acc, acc\n", "    return m, l_acc, acc\n"),
    "no QK": ("        s = warpgroup_mma(q_smem, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)\n"
              "        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))\n",
              "        s = gl.full([64, BLOCK_N], 0.5, gl.float32, S_LAYOUT)\n"),
    "no gather": ("    async_copy.async_copy_global_to_shared(kv_buf, cache_ptr + row[:, None] + dims[None, :], "
                  "mask=valid[:, None])\n", ""),
}


def load_variant(name: str, src: str):
    path = os.path.join(tempfile.mkdtemp(), f"_gv_{abs(hash(name))}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    case = g.v4_prefill_attention_case(T, BS)
    positions, win, top, wc, ec = case["positions"], case["win"], case["top"], case["wc"], case["ec"]
    q, sinks, inv_freq, scale = case["q"], case["sinks"], case["inv_freq"], case["scale"]
    rope = sag.QueryRope(positions, inv_freq, 1.0, 1e-6)
    ablations = "--ablations" in sys.argv
    mods = {"current": sag}
    for path in (a for a in sys.argv[1:] if not a.startswith("--")):
        mods[os.path.basename(path)] = load_variant(path, open(path).read())
    for name, (old, new) in ABLATIONS.items() if ablations else ():
        assert old in SRC, name
        mods[name] = load_variant(name, SRC.replace(old, new))
    for case, sources in (("window + top-512", [(wc, win), (ec, top)]), ("window", [(wc, win)])):
        keys = sum(int((s >= 0).sum()) for _, s in sources)
        qn = reference.q_norm_rope(q, positions, inv_freq, 1.0, 1e-6)
        want = reference.sparse_attention(qn, sources, sinks, scale).float()
        results = {}
        for rnd in range(2):                      # two alternated rounds: clocks drift under load
            for tag, mod in list(mods.items()) + ([("no prologue", sag)] if ablations else []):
                r = None if tag == "no prologue" else rope
                fn = (lambda mod=mod, r=r: mod.sparse_attention_prefill(q, sources, sinks, scale, rope=r))
                err = (fn().float() - want).abs().max().item()
                ms = do_bench(fn, warmup=5, rep=40, return_mode="median")
                results.setdefault(tag, []).append((ms, err))
        for tag, runs in results.items():
            ms = min(r[0] for r in runs)
            print(f"{case:17s} {tag:12s} {ms * 1e3:8.1f} us (rounds {' / '.join(f'{r[0] * 1e3:.1f}' for r in runs)})"
                  f" {4 * H * D * keys / ms / 1e9:6.1f} TFLOP/s max err {runs[0][1]:.3g}", flush=True)


if __name__ == "__main__":
    main()
