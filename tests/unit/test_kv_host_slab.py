"""The KV host tier's slab (runner/kv_host_slab.py) and the store's use of it: buffers come
back to the free lists when entries go, the memory held stays within the limit under churn
driven by the tier index, packing keeps the moved bytes, and a step's loads land bit-exactly."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kv_spec import KVCacheSpec
from deepinfer.runner.kv_host_slab import HostSlab, default_chunk_bytes
from deepinfer.runner.kv_offload import KVTierStore
from deepinfer.scheduler.kv_cache import build_groups, page_bytes
from deepinfer.scheduler.kv_tiers import TierIndex
from deepinfer.scheduler.plan import TierOp


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _groups():
    # Two entry sizes (a full group and a smaller sliding group).
    specs = [KVCacheSpec(kind="full", num_kv_heads=4, head_size=8, dtype=torch.bfloat16),
             KVCacheSpec(kind="sliding", num_kv_heads=3, head_size=8, dtype=torch.float32, num_tensors=1,
                         sliding_window=8)]
    groups = build_groups(specs, block_size=4)
    assert len({g.bytes_per_block for g in groups}) == 2
    return groups


def _fill(buf: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))


def test_chunk_size_is_a_power_of_two_within_the_budget():
    assert default_chunk_bytes(64 << 30, [1000, 3000]) == 128 << 20       # 256 MiB shared by two sizes
    assert default_chunk_bytes(40 << 20, [1000]) == 32 << 20              # the capacity, rounded down
    assert default_chunk_bytes(0, [1000]) == 16 << 20                     # disk only: 16 MiB
    assert default_chunk_bytes(0, [40 << 20]) == 64 << 20                 # at least one entry
    with pytest.raises(ValueError, match="must hold the largest entry"):
        HostSlab([5000], capacity=0, pinned=False, chunk_bytes=4096)
    with pytest.raises(ValueError, match="must be a power of two"):
        HostSlab([5000], capacity=0, pinned=False, chunk_bytes=6000)


def test_store_frees_every_buffer_and_stays_within_the_limit_under_index_churn(tmp_path):
    groups = _groups()
    sizes = [g.bytes_per_block for g in groups]
    capacity = 7 * sizes[0] + 5 * sizes[1]
    num_blocks = 8
    buf = torch.empty(num_blocks, page_bytes(groups), dtype=torch.uint8)
    store = KVTierStore(buf, groups, "fp", str(tmp_path), host_bytes=capacity, chunk_bytes=2048)
    index = TierIndex(capacity, 20 * max(sizes), sizes)
    rng = random.Random(3)
    want: dict[bytes, torch.Tensor] = {}
    # The budget (each 2048-byte chunk holds 4 entries of 384 bytes at a 512-byte stride, or 4
    # of 512), plus one chunk per entry size.
    assert store.slab.limit_bytes <= capacity * 2048 // (4 * 384) + 2 * 2048
    for step in range(150):
        # A step evicts a few device blocks of random groups, and loads back a few entries.
        _fill(buf, step)
        for _ in range(rng.randint(1, 4)):
            group, block = rng.randrange(2), rng.randrange(num_blocks // 2)
            k = key(len(want))
            index.evicted(block, group, [k])
            want[k] = buf[block, :sizes[group]].clone()
        ops = index.take_ops()
        targets = {}
        for entry in rng.sample(list(index.by_key.values()), min(3, len(index.by_key))):
            tier = index.loaded(entry)
            block = num_blocks // 2 + len(targets)
            targets[entry.key] = (block, entry.group)
            ops.append(TierOp("load", entry.key, entry.group, slot=entry.slot, block=block, tier=tier))
        loads = store.execute(ops)
        assert store.wait(loads) == set()
        assert store.slab.held_bytes <= store.slab.limit_bytes
        for k, (block, group) in targets.items():
            assert torch.equal(buf[block, :sizes[group]], want[k])
        store.flush()
        assert sorted(store.host) == sorted(e.slot for e in index.host.values())
    # The churn filled the slab, and a mix of sizes needed it packed.
    assert store.slab.held_bytes == store.slab.limit_bytes and store.slab.num_packed > 0
    assert store.stats.bytes["host_to_device"] > 0
    assert store.stats.bytes["disk_to_device"] > 0 and store.stats.bytes["host_to_disk"] > 0
    index.clear_host()
    store.execute(index.take_ops())
    store.flush()
    assert not store.host
    for s in sizes:
        assert store.slab.num_free(s) == store.slab.num_buffers(s)
    store.close()


def test_packing_moves_entries_bit_exactly_to_free_a_chunk_for_another_size():
    small, large = 300, 1000
    slab = HostSlab([small, large], capacity=8 * small, pinned=False, chunk_bytes=2048)
    per_chunk = 2048 // 512          # 300-byte entries at a 512-byte stride
    data = {}
    slot = 0
    while (view := slab.alloc(slot, small)) is not None:
        view.copy_(torch.randint(0, 256, (small,), dtype=torch.uint8))
        data[slot] = view.clone()
        slot += 1
    assert slab.held_bytes == slab.limit_bytes and slot == slab.max_chunks * per_chunk
    # Free all but one entry of each chunk but the first: a large entry still finds no buffer
    # until the slab is packed.
    for s in list(data):
        if s % per_chunk and s >= per_chunk:
            slab.free(s)
            del data[s]
    assert slab.alloc(10_000, large) is None
    assert slab.compact(large)
    assert slab.alloc(10_000, large) is not None and slab.held_bytes == slab.limit_bytes
    for s, want in data.items():
        assert torch.equal(slab.views[s], want)
    with pytest.raises(ValueError, match="no host tier entries of 7 bytes"):
        slab.alloc(20_000, 7)
    with pytest.raises(ValueError, match="slot 10000 is held already"):
        slab.alloc(10_000, large)


def test_a_full_slab_lets_the_queued_evictions_run_first(tmp_path):
    """Without a host budget every save passes through host memory on its way to disk: with
    room for two buffers, each save from the third on waits for the previous one's demote instead of allocating."""
    groups = _groups()
    size = groups[0].bytes_per_block
    buf = torch.empty(6, page_bytes(groups), dtype=torch.uint8)
    _fill(buf, 3)
    store = KVTierStore(buf, groups, "fp", str(tmp_path), host_bytes=0, chunk_bytes=512)
    assert store.slab.max_chunks == 2 and 512 // size == 1
    ops = []
    for i in range(5):
        ops += [TierOp("save", key(i), 0, slot=i, block=i, keys=(key(i),)),
                TierOp("demote", key(i), 0, slot=i, keys=(key(i),))]
    store.execute(ops)
    store.flush()
    assert store.slab.held_bytes == 1024 and not store.host
    assert store.stats.bytes["host_to_disk"] == 5 * size
    loads = store.execute([TierOp("load", key(i), 0, block=5, tier="disk") for i in range(4, 5)])
    assert store.wait(loads) == set() and torch.equal(buf[5, :size], buf[4, :size])
    store.close()


def test_failed_disk_loads_of_a_batch_report_their_keys(tmp_path):
    groups = _groups()
    size = groups[1].bytes_per_block
    buf = torch.empty(6, page_bytes(groups), dtype=torch.uint8)
    _fill(buf, 4)
    store = KVTierStore(buf, groups, "fp", str(tmp_path), host_bytes=4 * size)
    store.execute([TierOp("save", key(0), 1, slot=0, block=0, keys=(key(0),)),
                   TierOp("demote", key(0), 1, slot=0, keys=(key(0),)),
                   TierOp("save", key(1), 1, slot=1, block=1)])
    store.flush()
    loads = store.execute([TierOp("load", key(9), 1, block=3, tier="disk"),      # no such file
                           TierOp("load", key(0), 1, block=4, tier="disk"),
                           TierOp("load", key(1), 1, slot=1, block=5, tier="host")])
    assert store.wait(loads) == {key(9)}
    assert torch.equal(buf[4, :size], buf[0, :size]) and torch.equal(buf[5, :size], buf[1, :size])
    assert store.stats.bytes["disk_to_device"] == size and store.stats.bytes["host_to_device"] == size
    store.close()


@pytest.mark.gpu
def test_cuda_round_trip_of_two_entry_sizes_is_bit_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    groups = _groups()
    sizes = [g.bytes_per_block for g in groups]
    n = 64
    buf = torch.randint(0, 256, (2 * n, page_bytes(groups)), dtype=torch.uint8, device="cuda")
    store = KVTierStore(buf, groups, "fp", str(tmp_path), host_bytes=n * sum(sizes), chunk_bytes=8192)
    want = {i: buf[i, :sizes[i % 2]].clone() for i in range(n)}
    store.execute([TierOp("save", key(i), i % 2, slot=i, block=i) for i in range(n)])
    buf[:n].random_(0, 256)                       # the evicted blocks are overwritten at once
    assert all(store.host[i].is_pinned() for i in range(n))
    loads = store.execute([TierOp("load", key(i), i % 2, slot=i, block=n + i, tier="host") for i in range(n)])
    assert store.wait(loads) == set()
    for i in range(n):
        assert torch.equal(buf[n + i, :sizes[i % 2]], want[i])
    store.execute([TierOp("drop", key(i), i % 2, slot=i, tier="host") for i in range(n)])
    store.flush()
    assert all(store.slab.num_free(s) == store.slab.num_buffers(s) for s in sizes)
    stats = store.stats
    assert stats.bytes["device_to_host"] == stats.bytes["host_to_device"] == n // 2 * sum(sizes)
    assert stats.seconds["device_to_host"] > 0 and stats.seconds["host_to_device"] > 0
    store.close()


def test_buffers_taken_in_inference_mode_are_written_outside_it(tmp_path):
    """The engine's steps run in inference mode, its shutdown does not: a chunk taken during a
    step must still take a save at shutdown."""
    groups = _groups()
    size = groups[0].bytes_per_block
    buf = torch.empty(4, page_bytes(groups), dtype=torch.uint8)
    _fill(buf, 5)
    store = KVTierStore(buf, groups, "fp", str(tmp_path), host_bytes=4 * size)
    with torch.inference_mode():
        store.execute([TierOp("save", key(0), 0, slot=0, block=0, keys=(key(0),)),
                       TierOp("demote", key(0), 0, slot=0, keys=(key(0),))])
        store.flush()
        loads = store.execute([TierOp("load", key(0), 0, block=1, tier="disk")])
        assert store.wait(loads) == set()
    loads = store.execute([TierOp("save", key(1), 0, slot=1, block=2),
                           TierOp("load", key(0), 0, block=3, tier="disk")])
    assert store.wait(loads) == set()
    assert torch.equal(store.host[1], buf[2, :size]) and torch.equal(buf[3, :size], buf[0, :size])
    store.close()


def test_imports_past_the_budget_reuse_the_evicted_entries_buffers(tmp_path):
    """Imported blocks (prefill/decode hand-over) go through the same slab: with the index's
    evictions run before each import's bytes are put, the slab never grows past its limit."""
    groups = _groups()
    size = groups[1].bytes_per_block
    capacity = 3 * size
    buf = torch.empty(2, page_bytes(groups), dtype=torch.uint8)
    store = KVTierStore(buf, groups, "fp", None, host_bytes=capacity, chunk_bytes=1024)
    index = TierIndex(capacity, 0, [g.bytes_per_block for g in groups])
    g = torch.Generator().manual_seed(6)
    payloads = {}
    for i in range(12):
        entry = index.imported(1, [key(i)])
        store.execute(index.take_ops())
        payloads[entry.slot] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        store.put_host(entry.slot, payloads[entry.slot].numpy().tobytes() if i % 2 else payloads[entry.slot])
        assert store.slab.held_bytes <= store.slab.limit_bytes
    store.flush()
    assert sorted(store.host) == sorted(e.slot for e in index.host.values()) and len(store.host) == 3
    for slot, view in store.host.items():
        assert torch.equal(view, payloads[slot])
    store.close()
