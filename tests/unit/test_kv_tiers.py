"""The KV cache's lower tiers without a model: the tier index (LRU across device, host and
disk; budgets; the ops it emits), the pool's eviction hook, and the byte store (round trips
through host memory and disk, the disk scan, corrupt and truncated files)."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.kv_spec import KVCacheSpec
from deepinfer.runner.kv_offload import SUFFIX, KVTierStore
from deepinfer.scheduler.kv_cache import KVCacheManager, build_groups, page_bytes
from deepinfer.scheduler.kv_tiers import TierEntry, TierIndex
from deepinfer.scheduler.plan import TierOp

NB = 100      # bytes of an entry in these index tests


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def kinds(ops: list[TierOp]) -> list[tuple[str, int, str]]:
    return [(op.kind, int.from_bytes(op.key, "little"), op.tier) for op in ops]


def test_lru_across_host_and_disk():
    tiers = TierIndex(host_bytes=2 * NB, disk_bytes=2 * NB, group_bytes=[NB])
    for i in range(3):
        tiers.evicted(block=i + 1, group=0, keys=[key(i)])
    # The third save pushes the least recently used host entry (0) to disk.
    assert kinds(tiers.take_ops()) == [("save", 0, "host"), ("save", 1, "host"), ("save", 2, "host"),
                                       ("demote", 0, "host")]
    assert list(tiers.host) == [key(1), key(2)] and list(tiers.disk) == [key(0)]
    tiers.touch(tiers.lookup(key(1)))           # a hit: 1 becomes the most recently used
    tiers.evicted(block=4, group=0, keys=[key(3)])
    assert kinds(tiers.take_ops()) == [("save", 3, "host"), ("demote", 2, "host")]
    tiers.evicted(block=5, group=0, keys=[key(4)])
    # Host pushes 1 to disk; disk is over budget and drops its least recently used (0).
    assert kinds(tiers.take_ops()) == [("save", 4, "host"), ("demote", 1, "host"), ("drop", 0, "disk")]
    assert not tiers.has(key(0))
    assert list(tiers.host) == [key(3), key(4)] and list(tiers.disk) == [key(2), key(1)]
    assert tiers.host_used == 2 * NB and tiers.disk_used == 2 * NB


def test_no_disk_drops_and_entries_serve_every_key():
    tiers = TierIndex(host_bytes=NB, disk_bytes=0, group_bytes=[NB])
    tiers.evicted(block=1, group=0, keys=[key(10), key(11)])     # a block with a prefix key and its own
    assert tiers.lookup(key(10)) is tiers.lookup(key(11))
    tiers.evicted(block=2, group=0, keys=[key(12)])
    assert kinds(tiers.take_ops())[-1] == ("drop", 11, "host")
    assert not tiers.has(key(10)) and not tiers.has(key(11))


def test_held_entry_is_not_saved_again_and_slots_are_fresh():
    tiers = TierIndex(host_bytes=NB, disk_bytes=4 * NB, group_bytes=[NB])
    tiers.evicted(block=1, group=0, keys=[key(1)])
    tiers.evicted(block=1, group=0, keys=[key(1)])      # already in host: touched only
    assert kinds(tiers.take_ops()) == [("save", 1, "host")]
    tiers.evicted(block=2, group=0, keys=[key(2)])      # 1 goes to disk
    tiers.take_ops()
    tiers.evicted(block=3, group=0, keys=[key(1)])      # on disk only: a host copy again, a new slot
    ops = tiers.take_ops()
    assert ops[0].kind == "save" and ops[0].slot == 2
    assert tiers.lookup(key(1)).on_disk and tiers.lookup(key(1)).in_host


def test_disk_only_tier_does_not_copy_what_it_holds():
    tiers = TierIndex(host_bytes=0, disk_bytes=4 * NB, group_bytes=[NB])
    tiers.evicted(block=1, group=0, keys=[key(1)])      # through host memory straight to disk
    assert kinds(tiers.take_ops()) == [("save", 1, "host"), ("demote", 1, "host")]
    tiers.evicted(block=2, group=0, keys=[key(1)])      # already on disk: touched only
    assert tiers.take_ops() == [] and tiers.lookup(key(1)).on_disk


def test_budget_errors_and_disk_scan_layout():
    with pytest.raises(ValueError, match="budgets"):
        TierIndex(-1, 0, [NB])
    with pytest.raises(ValueError, match="layout"):
        TierIndex(0, NB, [NB], [TierEntry(key(1), 0, (key(1),), NB + 1)])
    # A scan that found more than the budget keeps the most recent.
    found = [TierEntry(key(i), 0, (key(i),), NB) for i in range(3)]
    tiers = TierIndex(0, 2 * NB, [NB], found)
    assert kinds(tiers.take_ops()) == [("drop", 0, "disk")]
    assert list(tiers.disk) == [key(1), key(2)]


def _manager(num_blocks: int, tiers: TierIndex) -> KVCacheManager:
    spec = KVCacheSpec(kind="full", num_kv_heads=1, head_size=8, dtype=torch.float32, num_tensors=2)
    groups = build_groups([spec], block_size=4)
    return KVCacheManager(groups, num_blocks, enable_prefix_caching=True, tiers=tiers)


def test_pool_evicts_least_recently_used_into_the_host_tier():
    tiers = TierIndex(host_bytes=10**6, disk_bytes=0, group_bytes=[256])
    kv = _manager(5, tiers)
    tokens = {r: [base + i for i in range(8)] for r, base in (("a", 100), ("b", 200))}
    for r, ids in tokens.items():
        assert kv.allocate(r, 0, 8)
        kv.cache_blocks(r, ids, 8)
    kv.free("a")
    kv.free("b")          # free queue, oldest first: a's blocks (tail first), then b's
    assert kv.allocate("c", 0, 12)        # 3 fresh blocks: evicts a's two, then b's last
    saved = [op for op in kv.take_tier_ops() if op.kind == "save"]
    hashes = kv.block_hashes("a2", tokens["a"]), kv.block_hashes("b2", tokens["b"])
    assert [op.key for op in saved] == [hashes[0][0][1], hashes[0][0][0], hashes[1][0][1]]
    assert kv.find_prefix_hit("b3", tokens["b"] + [1]) == 4             # b's first block is still on the device
    kv.free("c")
    load = kv.plan_tier_load("a3", tokens["a"] + [1], None, 0)          # a's are in the host tier
    assert load is not None and load.hit == 8 and len(load.blocks) == 2
    loads = [op for op in kv.take_tier_ops() if op.kind == "load"]
    assert sorted(op.key for op in loads) == sorted(hashes[0][0])
    kv.land_tier_load(load, failed=set())
    assert kv.find_prefix_hit("a3", tokens["a"] + [1]) == 8
    kv.take_prefix_hit("a3", tokens["a"] + [1], 8)
    kv.release_tier_load(load)
    kv.count_tier_hit(load, 8)
    assert kv.tier_hits == {"host": 8, "disk": 0}
    kv.free("a3")
    assert kv.num_free_blocks == 4


def test_failed_load_forgets_the_entry_and_returns_its_block(tmp_path):
    tiers = TierIndex(host_bytes=0, disk_bytes=10**6, group_bytes=[256])
    kv = _manager(4, tiers)
    ids = list(range(8))
    assert kv.allocate("a", 0, 8)
    kv.cache_blocks("a", ids, 8)
    kv.free("a")
    assert kv.allocate("x", 0, 12)                  # evicts a's blocks, through host to disk
    kv.free("x")
    kv.pool.reset_prefix_cache()
    load = kv.plan_tier_load("a2", ids + [1], None, 0)
    assert load.tier == "disk"
    # A step that failed: its loads are not used, but the entries stay.
    kv.land_tier_load(load, failed={e.key for _, _, e in load.blocks}, corrupt=False)
    assert load.landed and not load.blocks and kv.num_free_blocks == 3
    assert all(tiers.has(h) for h in kv.block_hashes("a2", ids)[0])
    load = kv.plan_tier_load("a2", ids + [1], None, 0)
    first = load.blocks[0][2].key
    kv.land_tier_load(load, failed={first})
    assert not tiers.has(first) and tiers.stats.failed_loads == 1
    kv.release_tier_load(load)
    assert kv.num_free_blocks == 3


def _store(tmp_path, groups, num_blocks=6, fingerprint="model-a") -> tuple[KVTierStore, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (num_blocks, page_bytes(groups)), dtype=torch.uint8, generator=g)
    return KVTierStore(buf, groups, fingerprint, str(tmp_path)), buf


def _groups():
    specs = [KVCacheSpec(kind="full", num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
             KVCacheSpec(kind="sliding", num_kv_heads=1, head_size=8, dtype=torch.float32, num_tensors=1,
                         sliding_window=8)]
    return build_groups(specs, block_size=4)


def test_store_round_trips_every_group_through_host_and_disk(tmp_path):
    groups = _groups()
    store, buf = _store(tmp_path, groups)
    want = {g: buf[1 + g, :groups[g].bytes_per_block].clone() for g in range(len(groups))}
    ops = []
    for g in range(len(groups)):
        ops += [TierOp("save", key(g), g, slot=g, block=1 + g, keys=(key(100 + g), key(g))),
                TierOp("demote", key(g), g, slot=g, keys=(key(100 + g), key(g)))]
    store.execute(ops)
    store.flush()
    assert not store.host and len(list(tmp_path.glob("*" + SUFFIX))) == len(groups)
    # A new store (a restarted engine) finds them, and loads them into other blocks bit-exactly.
    store2, buf2 = _store(tmp_path, groups)
    found = {e.key: e for e in store2.scan()}
    assert set(found) == {key(g) for g in range(len(groups))}
    assert found[key(1)].keys == (key(101), key(1)) and found[key(1)].group == 1
    loads = store2.execute([TierOp("load", key(g), g, block=4, tier="disk") for g in range(1)]
                           + [TierOp("load", key(g), g, block=5, tier="disk") for g in range(1, 2)])
    assert store2.wait(loads) == set()
    assert torch.equal(buf2[4, :groups[0].bytes_per_block], want[0])
    assert torch.equal(buf2[5, :groups[1].bytes_per_block], want[1])
    assert store2.stats.bytes["disk_to_device"] == sum(g.bytes_per_block for g in groups)
    # Host only: save then load.
    loads = store2.execute([TierOp("save", key(7), 0, slot=9, block=2),
                            TierOp("load", key(7), 0, slot=9, block=3, tier="host")])
    assert store2.wait(loads) == set()
    assert torch.equal(buf2[3, :groups[0].bytes_per_block], buf2[2, :groups[0].bytes_per_block])
    store.close()
    store2.close()


def test_corrupt_truncated_and_foreign_files_are_never_used(tmp_path):
    groups = _groups()
    store, buf = _store(tmp_path, groups)
    store.execute([op for i in range(4) for op in (TierOp("save", key(i), 0, slot=i, block=1 + i, keys=(key(i),)),
                                                   TierOp("demote", key(i), 0, slot=i, keys=(key(i),)))])
    store.close()
    files = {i: tmp_path / (key(i).hex() + SUFFIX) for i in range(4)}
    with open(files[0], "r+b") as f:          # a flipped payload byte: the checksum fails at load
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(files[1], "r+b") as f:          # truncated: the scan ignores it
        f.truncate(os.path.getsize(files[1]) - 7)
    files[2].write_bytes(b"not an entry")
    (tmp_path / ".partial.tmp").write_bytes(b"x")     # a write that never finished
    store2, buf2 = _store(tmp_path, groups, fingerprint="model-a")
    found = {e.key for e in store2.scan()}
    assert found == {key(0), key(3)}
    before = buf2[5].clone()
    loads = store2.execute([TierOp("load", key(0), 0, block=5, tier="disk")])
    assert store2.wait(loads) == {key(0)}
    assert torch.equal(buf2[5], before) and not files[0].exists()
    loads = store2.execute([TierOp("load", key(3), 0, block=5, tier="disk")])
    assert store2.wait(loads) == set()
    assert torch.equal(buf2[5, :groups[0].bytes_per_block], buf[4, :groups[0].bytes_per_block])
    store2.close()
    # Another model's engine finds none of them.
    store3, _ = _store(tmp_path, groups, fingerprint="model-b")
    assert store3.scan() == []
    store3.close()


def test_config_errors_name_the_field():
    from deepinfer.config import CacheConfig
    from deepinfer.entrypoints.llm import build_engine_config

    with pytest.raises(ValueError, match="kv_offload_gib=-1"):
        build_engine_config(device="cpu", kv_offload_gib=-1)
    with pytest.raises(ValueError, match="kv_disk_dir"):
        CacheConfig(kv_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_disk_dir"):
        CacheConfig(kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    assert CacheConfig(kv_offload_bytes=1).has_lower_tiers and not CacheConfig().has_lower_tiers


def test_failed_disk_write_is_a_failed_load_later(tmp_path, monkeypatch):
    groups = _groups()
    store, _ = _store(tmp_path, groups)

    def full_disk(op, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(store, "_write_file", full_disk)
    store.execute([TierOp("save", key(1), 0, slot=0, block=1, keys=(key(1),)),
                   TierOp("demote", key(1), 0, slot=0, keys=(key(1),))])
    store.flush()
    assert not store.host
    loads = store.execute([TierOp("load", key(1), 0, block=2, tier="disk")])
    assert store.wait(loads) == {key(1)}
    store.close()
