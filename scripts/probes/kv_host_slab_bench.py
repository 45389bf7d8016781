"""The KV host tier's transfers through ``KVTierStore`` (runner/kv_offload.py) on one device.

A KV buffer of ``--blocks`` pages holds two groups (entries of ``--entry-kib`` and half that).
Each round saves ``--batch`` blocks in one ``execute`` call (as a plan evicting them would),
then loads them back into other blocks in one call, and checks the loaded bytes equal the
saved ones. The first round grows the slab (its chunks are taken then); the rounds after it
reuse freed buffers: each drops its entries at the end. Printed per phase: GB/s by the
store's own counters (``stats``: transfer time only) and by wall time around the calls
(issue to completion, synchronized), and the slab's held bytes against its limit.

    python scripts/probes/kv_host_slab_bench.py                    # on a GPU, seconds
    python scripts/probes/kv_host_slab_bench.py --device cpu --blocks 64 --entry-kib 64   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from deepinfer.kv_spec import KVCacheSpec
from deepinfer.runner.kv_offload import KVTierStore
from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.scheduler.plan import TierOp


def _groups(entry_kib: int) -> list[KVCacheGroup]:
    """Two full-attention groups (16 KV heads of 128, bf16, K and V: 8 KiB a token) whose
    blocks hold ``entry_kib`` KiB and half that."""
    spec = KVCacheSpec(kind="full", num_kv_heads=16, head_size=128, dtype=torch.bfloat16)
    tokens = (entry_kib << 10) // spec.entry_bytes
    assert tokens >= 2 and tokens * spec.entry_bytes == entry_kib << 10, "--entry-kib: a multiple of 16"
    return [KVCacheGroup(kind="full", layer_ids=(0,), specs=(spec,), block_size=tokens),
            KVCacheGroup(kind="full", layer_ids=(1,), specs=(spec,), block_size=tokens // 2)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--entry-kib", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dev = torch.device(args.device)
    groups = _groups(args.entry_kib)
    sizes = [g.bytes_per_block for g in groups]
    half = args.blocks // 2
    assert args.batch <= half, "--batch must be at most half of --blocks"
    buf = torch.randint(0, 256, (args.blocks, sizes[0]), dtype=torch.uint8, device=dev)
    store = KVTierStore(buf, groups, "probe", tempfile.mkdtemp(prefix="kv-slab-probe-"),
                        host_bytes=args.batch * sizes[0])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results = []
    slot = 0
    for rnd in range(args.rounds):
        ids = list(range(slot, slot + args.batch))
        slot += args.batch
        want = {s: buf[i, :sizes[i % 2]].clone() for i, s in enumerate(ids)}
        before = {d: (store.stats.bytes[d], store.stats.seconds[d]) for d in ("device_to_host", "host_to_device")}
        sync()
        t0 = time.perf_counter()
        store.execute([TierOp("save", s.to_bytes(32, "little"), i % 2, slot=s, block=i) for i, s in enumerate(ids)])
        sync()
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        loads = store.execute([TierOp("load", s.to_bytes(32, "little"), i % 2, slot=s, block=half + i, tier="host")
                               for i, s in enumerate(ids)])
        failed = store.wait(loads)
        t_load = time.perf_counter() - t0
        exact = not failed and all(torch.equal(buf[half + i, :sizes[i % 2]], want[s]) for i, s in enumerate(ids))
        store.execute([TierOp("drop", s.to_bytes(32, "little"), i % 2, slot=s, tier="host")
                       for i, s in enumerate(ids)])
        store.flush()
        nbytes = sum(sizes[i % 2] for i in range(len(ids)))
        row = {"round": rnd, "bytes": nbytes, "exact": exact, "held": store.slab.held_bytes,
               "limit": store.slab.limit_bytes, "wall_save_GB_s": nbytes / t_save / 1e9,
               "wall_load_GB_s": nbytes / t_load / 1e9}
        for d in ("device_to_host", "host_to_device"):
            b = store.stats.bytes[d] - before[d][0]
            s = store.stats.seconds[d] - before[d][1]
            row[f"stats_{d}_GB_s"] = b / s / 1e9 if s > 0 else None
        results.append(row)
        print(f"round {rnd}{' (slab grows)' if rnd == 0 else ''}: {nbytes / 2**20:.1f} MiB, exact={exact}; "
              f"save {row['wall_save_GB_s']:.2f} GB/s wall, "
              f"{row['stats_device_to_host_GB_s'] or 0:.2f} by stats; load {row['wall_load_GB_s']:.2f} GB/s wall, "
              f"{row['stats_host_to_device_GB_s'] or 0:.2f} by stats; "
              f"held {row['held'] / 2**20:.0f} / limit {row['limit'] / 2**20:.0f} MiB", flush=True)
    free_full = all(store.slab.num_free(s) == store.slab.num_buffers(s) for s in sizes)
    print(f"all buffers free after the drops: {free_full}; all rounds exact: {all(r['exact'] for r in results)}")
    store.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_host_slab_bench.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                   "args": vars(args), "rounds": results, "free_full": free_full}, f, indent=1)


if __name__ == "__main__":
    main()
