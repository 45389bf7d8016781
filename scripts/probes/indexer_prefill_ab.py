"""The lightning indexer at an earlier commit against the working tree, in one process on one
GPU, at the V4-Flash prefill benchmark's shape: one 4096-token prompt in a CSA layer (ratio 4, so 1024
candidate entries a row, token p seeing (p + 1) // 4 of them; 64 heads x 128 bf16; top-512),
then four 1024-token prompts in one batch (blocks of one sequence, N = 256).

Inputs are built as the model builds them: a key cache that is a strided view into pages
shared with other layers (block size 16, shuffled block table), candidate rows from the
paged_slots kernel (int64), ``token_seq`` as the groups. Timed with do_bench (median, L2
flushed between runs): the scores (the old per-token kernel; the working tree's token-block
kernel, its default config and a few others), the top-k (old, new, new at 1/2/4 warps) on the
same scores, and the whole ``indexer_topk`` (old scores + old top-k vs ``backend.indexer_topk``
with groups). Checked: scores against reference.indexer_scores (float32), the -inf pattern
equal, and each row's kept set equal to the old kernels' (and to torch.topk's up to ties).

Run from the repository root on an H200 (well under a minute):
    PYTHONPATH=. python scripts/probes/indexer_prefill_ab.py            # old = a27462b
    PYTHONPATH=. python scripts/probes/indexer_prefill_ab.py <rev | directory of the old files>
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

from deepinfer.kernels import backend, reference
from deepinfer.kernels import indexer as current_indexer
from deepinfer.kernels import topk as current_topk
from deepinfer.kernels.indexer import IndexerConfig
from deepinfer.kernels.paged_slots import paged_slots

DEV, BF16 = "cuda", torch.bfloat16
HI, DI, BS, RATIO, TOPK = 64, 128, 16, 4, 512
SCALE = DI ** -0.5
BASE = "a27462b"          # main before the token-block kernel and the top-k early exit
# (block_t, block_n, num_warps, num_stages) of the token-block kernel, default first.
BLOCK_CONFIGS = [(4, 64, 4, 3), (4, 64, 8, 3), (2, 64, 4, 3), (2, 64, 8, 3), (4, 64, 16, 3)]


def module_at(rev: str, path: str):
    """``path`` (deepinfer/kernels/...) as of ``rev``, imported under another name. ``rev`` may
    also be a directory holding the old files by base name (a copy without ``.git``)."""
    if os.path.isdir(rev):
        with open(os.path.join(rev, os.path.basename(path))) as f:
            text = f.read()
        rev = "old"
    else:
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        if shown.returncode:
            raise SystemExit(f"git show {rev}:{path} failed ({shown.stderr.strip()}): pass a revision this "
                             "checkout holds, or a directory of the old files")
        text = shown.stdout
    name = f"{os.path.basename(path)[:-3]}_{rev}"
    file = os.path.join(tempfile.mkdtemp(), name + ".py")        # kept: Triton reads it back
    with open(file, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def inputs(q_lens: list[int], layers: int = 3):
    """(q [T, 64, 128] bf16, weights [T, 64] float32, key cache view, candidates [T, N] int64,
    token_seq [T] int32) for whole prompts of ``q_lens`` tokens."""
    gen = torch.Generator(device=DEV).manual_seed(sum(q_lens))
    n_max = -(-max(q_lens) // RATIO)
    per_seq = -(-n_max // BS)
    num_blocks = per_seq * len(q_lens) + 1
    page = BS * DI
    buffer = torch.randn(num_blocks, layers * page, device=DEV, generator=gen).to(BF16)
    cache = buffer[:, page:2 * page].view(num_blocks, BS, 1, 1, DI)            # a middle layer's part
    table = (torch.randperm(num_blocks - 1, device=DEV, generator=gen) + 1).view(len(q_lens), per_seq).int()
    seq = torch.cat([torch.full((n,), b, dtype=torch.int32, device=DEV) for b, n in enumerate(q_lens)])
    pos = torch.cat([torch.arange(n, device=DEV) for n in q_lens])
    slots = paged_slots(table, BS, seq, pos, n_max, RATIO, False)                # [T, N] int64
    t = seq.shape[0]
    q = torch.randn(t, HI, DI, device=DEV, generator=gen).to(BF16)
    w = torch.randn(t, HI, device=DEV, generator=gen) * HI ** -0.5
    return q, w, cache, slots, seq


def same_sets(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows whose kept sets differ."""
    return int((a.sort(dim=1).values != b.sort(dim=1).values).any(dim=1).sum())


def case(label: str, q_lens: list[int], old_indexer, old_topk) -> None:
    q, w, cache, slots, seq = inputs(q_lens)
    t, n = slots.shape
    visible = int((slots >= 0).sum())
    print(f"=== {label}: T={t}, N={n}, {visible / t:.0f} visible candidates a token "
          f"({2 * visible * HI * DI / 1e9:.1f} GFLOP useful)", flush=True)
    ref = reference.indexer_scores(q, w, cache, slots, SCALE)
    none = ref.isneginf()

    def check(tag: str, out: torch.Tensor) -> None:
        pattern = torch.equal(out.isneginf(), none)
        err = (out.masked_fill(none, 0) - ref.masked_fill(none, 0)).abs().max().item()
        rel = err / ref.masked_fill(none, 0).abs().max().item()
        print(f"  check {tag:34s} -inf pattern {'ok' if pattern else 'DIFFERS'}  max err {err:.3g} "
              f"({rel:.2g} of max |score|)", flush=True)

    old_scores = old_indexer.indexer_scores(q, w, cache, slots, SCALE)
    new_scores = current_indexer.indexer_scores(q, w, cache, slots, SCALE, groups=seq)
    check("old per-token", old_scores)
    check("new token blocks (default)", new_scores)
    new = current_indexer.indexer_scores
    timings = {"old per-token": us(lambda: old_indexer.indexer_scores(q, w, cache, slots, SCALE)),
               "new per-token (groups=None)": us(lambda: new(q, w, cache, slots, SCALE)),
               "new token blocks (default)": us(lambda: new(q, w, cache, slots, SCALE, groups=seq))}
    print(f"  default config: {current_indexer.default_config(q, n, True)}")
    for block_t, block_n, warps, stages in BLOCK_CONFIGS:
        config = IndexerConfig(block_n, 1, warps, stages, block_t=block_t)
        tag = f"blocks T{block_t} N{block_n} w{warps} s{stages}"
        try:
            check(tag, new(q, w, cache, slots, SCALE, config, groups=seq))
            timings[tag] = us(lambda c=config: new(q, w, cache, slots, SCALE, c, groups=seq))
        except Exception as e:           # a config that does not fit the device: reported, not fatal
            print(f"  {tag}: {type(e).__name__}: {str(e)[:120]}")
    print("  scores:")
    for tag, value in timings.items():
        print(f"    {tag:34s} {value:8.1f} us  {2 * visible * HI * DI / value / 1e6:6.1f} TFLOP/s useful")

    old_kept = old_topk.topk_slots(old_scores, slots, TOPK)
    new_kept = current_topk.topk_slots(old_scores, slots, TOPK)
    torch_kept = reference.topk_slots(old_scores, slots, TOPK)
    print(f"  top-k rows differing: new vs old {same_sets(new_kept, old_kept)}, "
          f"new vs torch.topk {same_sets(new_kept, torch_kept)} (ties only)")
    print("  top-k (same scores):")
    print(f"    {'old':34s} {us(lambda: old_topk.topk_slots(old_scores, slots, TOPK)):8.1f} us")
    value = us(lambda: current_topk.topk_slots(old_scores, slots, TOPK))
    print(f"    {'new (default warps)':34s} {value:8.1f} us")
    for warps in (1, 2, 4):
        value = us(lambda nw=warps: current_topk.topk_slots(old_scores, slots, TOPK, nw))
        print(f"    {f'new, {warps} warps':34s} {value:8.1f} us")

    def old_whole() -> torch.Tensor:
        return old_topk.topk_slots(old_indexer.indexer_scores(q, w, cache, slots, SCALE), slots, TOPK)

    def new_whole() -> torch.Tensor:
        return backend.indexer_topk(q, w, cache, slots, SCALE, TOPK, seq)

    print(f"  indexer_topk rows differing, new vs old: {same_sets(new_whole(), old_whole())} "
          f"(ties and float32 summation order near the 512th score only)")
    print(f"  indexer_topk: old {us(old_whole):8.1f} us   new {us(new_whole):8.1f} us", flush=True)


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else BASE
    os.environ.setdefault("DEEPINFER_KERNEL_BACKEND", "triton")
    old_indexer = module_at(rev, "deepinfer/kernels/indexer.py")
    old_topk = module_at(rev, "deepinfer/kernels/topk.py")
    print(f"old = {rev}, new = working tree; {torch.cuda.get_device_name()}")
    case("one prompt of 4096 tokens", [4096], old_indexer, old_topk)
    case("four prompts of 1024 tokens", [1024] * 4, old_indexer, old_topk)


if __name__ == "__main__":
    main()
