"""Block pool, group managers and prefix cache, without a model."""

import pytest
import torch

from deepinfer.kv_spec import KVCacheSpec
from deepinfer.scheduler.kv_cache import MAX_BLOCK_SCALE, NULL_BLOCK, KVCacheManager, build_groups

F32 = torch.float32


def full(h=2, d=8):
    return KVCacheSpec("full", h, d, F32)


def sliding(w, h=2, d=8):
    return KVCacheSpec("sliding", h, d, F32, sliding_window=w)


def manager(specs, num_blocks=64, bs=4, caching=True):
    return KVCacheManager(build_groups(specs, bs), num_blocks, caching)


def test_groups_and_page_sizes():
    specs = [full(), sliding(8), full(), KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=4)]
    groups = build_groups(specs, 4)
    kinds = {g.kind: g for g in groups}
    assert kinds["full"].layer_ids == (0, 2)
    assert kinds["sliding"].layer_ids == (1,)
    # The full group (2 layers) sets the page; the 1-layer sliding group doubles its
    # block; the compressed group (1/4 of the bytes per entry of one layer) would fit
    # 8x but is capped at MAX_BLOCK_SCALE.
    assert kinds["full"].block_size == 4
    assert kinds["sliding"].block_size == 8
    assert kinds["compressed"].block_size == 4 * MAX_BLOCK_SCALE
    assert kinds["compressed"].tokens_per_block == 4 * MAX_BLOCK_SCALE * 4
    page = max(g.bytes_per_block for g in groups)
    assert all(g.bytes_per_block <= page for g in groups)


def test_allocate_and_free_return_every_block():
    kv = manager([full()], num_blocks=10)
    assert kv.num_free_blocks == 9  # block 0 is the null block
    assert kv.allocate("a", 0, 10)  # 3 blocks of 4
    assert kv.num_free_blocks == 6
    assert NULL_BLOCK not in kv.block_tables("a")[0]
    assert not kv.allocate("b", 0, 40)  # 10 blocks: refused, nothing changes
    assert kv.num_free_blocks == 6
    kv.free("a")
    assert kv.num_free_blocks == 9


def test_sliding_window_bounds_blocks_held():
    kv = manager([sliding(8)], num_blocks=64, bs=4)
    group = kv.managers[0].group
    held = []
    for n in range(1, 200):
        assert kv.allocate("a", n - 1, n)
        held.append(sum(b != NULL_BLOCK for b in kv.block_tables("a")[0]))
    assert max(held) <= -(-8 // group.block_size) + 1
    kv.free("a")
    assert kv.num_free_blocks == 63


def test_prefix_hit_full_attention():
    kv = manager([full()], num_blocks=32, bs=4)
    tokens = list(range(100, 114))  # 14 tokens: 3 full blocks
    assert kv.find_prefix_hit("a", tokens) == 0
    assert kv.allocate("a", 0, 14)
    kv.cache_blocks("a", tokens, 14)
    kv.free("a")
    # Same prefix, different tail: 3 full blocks hit (12 tokens).
    other = tokens[:12] + [7, 7, 7]
    assert kv.find_prefix_hit("b", other) == 12
    kv.take_prefix_hit("b", other, 12)
    assert kv.allocate("b", 12, 15)
    # An exact repeat keeps at least one token to compute.
    assert kv.find_prefix_hit("c", tokens[:12]) == 8
    # A different first token shares nothing (chained hashes).
    assert kv.find_prefix_hit("d", [1] + tokens[1:]) == 0


def test_prefix_hit_sliding_needs_only_window_blocks():
    kv = manager([full(), sliding(4)], num_blocks=64, bs=4)
    tokens = list(range(40))
    for n in range(1, 41):
        assert kv.allocate("a", n - 1, n)
        kv.cache_blocks("a", tokens, n)
    kv.free("a")
    hit = kv.find_prefix_hit("b", tokens + [1])
    assert hit == 40
    kv.take_prefix_hit("b", tokens + [1], hit)
    sliding_table = kv.block_tables("b")[1]
    # Only the blocks holding the last window's tokens are referenced.
    live = [b for b in sliding_table if b != NULL_BLOCK]
    assert 1 <= len(live) <= 2


def test_evicted_sliding_block_limits_hit():
    kv = manager([sliding(4)], num_blocks=64, bs=4)
    tokens = list(range(32))
    assert kv.allocate("a", 0, 32)
    kv.cache_blocks("a", tokens, 32)
    kv.free("a")
    # Evict everything cached by allocating the whole pool.
    assert kv.allocate("x", 0, 63 * 4)
    kv.free("x")
    assert kv.find_prefix_hit("b", tokens + [0]) == 0


def test_lru_evicts_least_recent_unreferenced():
    kv = manager([full()], num_blocks=5, bs=4)  # 4 usable blocks
    a, b = list(range(8)), list(range(50, 58))
    for rid, toks in (("a", a), ("b", b)):
        assert kv.allocate(rid, 0, 8)
        kv.cache_blocks(rid, toks, 8)
        kv.free(rid)
    # Touch "a" again so that "b" is older.
    kv.take_prefix_hit("a2", a + [1], 8)
    kv.free("a2")
    assert kv.allocate("c", 0, 8)  # needs 2 blocks: evicts b's first
    assert kv.find_prefix_hit("q", a + [1]) == 8
    assert kv.find_prefix_hit("q2", b + [1]) == 0


def test_fork_shares_full_blocks_and_copies_partial():
    kv = manager([full()], num_blocks=16, bs=4)
    assert kv.allocate("p", 0, 10)
    free_before = kv.num_free_blocks
    copies = kv.fork("p", "c", 10)
    assert copies is not None and len(copies) == 1
    tp, tc = kv.block_tables("p")[0], kv.block_tables("c")[0]
    assert tp[:2] == tc[:2] and tp[2] != tc[2]
    assert copies[0] == (tp[2], tc[2])
    assert kv.num_free_blocks == free_before - 1
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 15


def test_truncate_rolls_back():
    kv = manager([full()], num_blocks=16, bs=4)
    assert kv.allocate("a", 0, 13)
    kv.truncate("a", 5)
    assert len(kv.block_tables("a")[0]) == 2
    assert kv.num_free_blocks == 13


def test_compressed_group_one_entry_per_ratio():
    spec = KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=4)
    kv = manager([spec], num_blocks=16, bs=4)
    assert kv.allocate("a", 0, 15)  # 3 entries -> 1 block of 4 entries
    assert len(kv.block_tables("a")[0]) == 1
    assert kv.allocate("a", 15, 17)  # 4 entries
    assert len(kv.block_tables("a")[0]) == 1
    assert kv.allocate("a", 17, 20)  # 5 entries -> 2 blocks
    assert len(kv.block_tables("a")[0]) == 2


def test_bad_pool_size():
    with pytest.raises(ValueError, match="at least 2"):
        manager([full()], num_blocks=1)


def v4_like(window=128, ratios=(4, 128), d=8):
    """DeepSeek-V4-like groups: a sliding window (with the compressors' open-window state)
    and compressed groups whose blocks span block_size x scale x ratio tokens."""
    specs = [sliding(window, h=1, d=d), sliding(max(window, 2 * max(ratios)), h=1, d=d)]
    specs += [KVCacheSpec("compressed", 1, d, F32, num_tensors=1, compress_ratio=r) for r in ratios]
    return specs


def compute(kv, rid, tokens, n, step=7):
    """Allocate and register ``n`` tokens of ``tokens`` the way the scheduler does, in chunks."""
    done = 0
    while done < n:
        new = min(n, done + step)
        assert kv.allocate(rid, done, new)
        kv.cache_blocks(rid, tokens, new)
        done = new


@pytest.mark.parametrize("ratios", [(4, 128), (4,), (128,)])
def test_prefix_hit_granularity_is_the_base_block(ratios):
    """A shared prefix of 1.5 base blocks hits one base block (16 tokens), whatever the
    compressed groups' block spans; a group whose block holds entries of the hit copies it."""
    kv = manager(v4_like(ratios=ratios), num_blocks=256, bs=16)
    assert kv.hit_step == 16
    assert all(g.tokens_per_block >= 16 for g in kv.groups)
    assert any(g.tokens_per_block >= 16 * 4 for g in kv.groups)      # hits finer than a block
    shared = list(range(1000, 1024))                                   # 1.5 x 16 tokens
    a, b = shared + list(range(40)), shared + list(range(500, 540))
    compute(kv, "a", a, len(a))
    hit = kv.find_prefix_hit("b", b)
    assert hit == 16
    copies = kv.take_prefix_hit("b", b, hit)
    # The 16 tokens' entries: 4 at ratio 4 in a block of 64+ entries (copied); none at ratio
    # 128 (nothing to take); 16 rows of a sliding group: a whole block of 16 (shared) or part
    # of a larger one (copied).
    want = sum(1 for g in kv.groups
               if (g.kind == "compressed" and g.compress_ratio == 4) or (g.kind == "sliding" and g.block_size > 16))
    assert len(copies) == want
    held_by_a = {blk for table in kv.block_tables("a") for blk in table}
    for src, dst in copies:
        assert src in held_by_a and dst not in held_by_a
    assert kv.allocate("b", hit, len(b))
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 255


def test_prefix_hit_inside_a_running_sequences_open_block():
    kv = manager(v4_like(), num_blocks=256, bs=16)
    a = list(range(300))
    compute(kv, "a", a, 100)                         # "a" still runs: its blocks are open
    b = a[:90] + [5, 6, 7]
    assert kv.find_prefix_hit("b", b) == 80          # the last boundary both share
    assert kv.find_prefix_hit("c", a[:100] + [1]) == 96
    compute(kv, "a", a, 300)
    assert kv.find_prefix_hit("d", a + [1]) == 288   # limited by the 300-token prompt, minus one


def test_prefix_hit_equals_full_blocks_when_aligned():
    kv = manager(v4_like(ratios=(4,)), num_blocks=256, bs=16)
    a = list(range(256))
    compute(kv, "a", a, 256)
    kv.free("a")
    copies = kv.take_prefix_hit("b", a + [1], kv.find_prefix_hit("b", a + [1]))
    # 256 tokens: whole blocks of the ratio-4 group (tokens_per_block 256): shared, not copied.
    ratio4 = next(i for i, g in enumerate(kv.groups) if g.kind == "compressed")
    assert all(src not in kv.block_tables("b")[ratio4] for src, _ in copies)


def test_evicting_an_open_block_limits_the_hit():
    # 13 blocks: 12 usable, exactly "a"'s 10 + 1 blocks and the copy of its open block.
    kv = manager([full(), KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=4)],
                 num_blocks=13, bs=4)
    a = list(range(40))
    compute(kv, "a", a, 40)
    kv.free("a")
    assert kv.find_prefix_hit("b", a + [1]) == 40
    # Evict everything by holding the whole pool, then free it: nothing hits.
    assert kv.allocate("x", 0, kv.num_free_blocks * 4 // 2)
    kv.free("x")
    assert kv.find_prefix_hit("c", a + [1]) < 40


def test_a_hit_fits_the_pool_with_its_unheld_blocks_and_copies():
    """Adopting a hit takes its cached blocks that nobody holds out of the free pool, and a
    fresh block per group it ends inside: with one block fewer than that, it is shortened;
    and no group's copy takes another group's source block."""
    specs = [full(), KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=4),
             KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=8)]
    a = list(range(40))
    for extra, want in ((0, 40), (-1, 36)):
        kv = manager(specs, num_blocks=15 + extra, bs=4)    # "a": 10 + 1 + 1 blocks; 2 copies
        compute(kv, "a", a, 40)
        kv.free("a")
        hit = kv.find_prefix_hit("b", a + [1])
        assert hit <= want and (hit == want or extra)
        copies = kv.take_prefix_hit("b", a + [1], hit)
        sources = {src for src, _ in copies}
        assert all(dst not in sources for _, dst in copies)
        assert sum(len([b for b in t if b]) for t in kv.block_tables("b")) <= kv.pool.num_blocks - 1


def test_hit_shortened_when_the_copies_do_not_fit():
    kv = manager([full(), KVCacheSpec("compressed", 1, 8, F32, num_tensors=1, compress_ratio=4)],
                 num_blocks=16, bs=4)
    a = list(range(24))
    compute(kv, "a", a, 24)           # "a" keeps running: every block it holds is referenced
    while kv.num_free_blocks:
        kv.allocate(f"x{kv.num_free_blocks}", 0, 4)
    # A hit inside an open block needs a fresh block for its copy; with none free the hit
    # falls back to one made of whole shared blocks only (or none).
    hit = kv.find_prefix_hit("b", a[:22] + [9])
    assert all(not m.open_entries(hit) for m in kv.managers)


def test_truncate_inside_a_shared_block_copies_it():
    kv = manager([full()], num_blocks=16, bs=4)
    a = list(range(12))
    compute(kv, "a", a, 12)
    hit = kv.find_prefix_hit("b", a + [1])
    assert hit == 12
    assert kv.take_prefix_hit("b", a + [1], hit) == []
    shared = kv.block_tables("b")[0][2]
    copies = kv.truncate("a", 10)                     # "a" rewrites tokens 10, 11: not b's block
    assert copies == [(shared, kv.block_tables("a")[0][2])]
    assert kv.block_tables("b")[0][2] == shared
    # An unshared block is rewritten in place and loses its keys.
    compute(kv, "c", list(range(50, 62)), 12)
    block = kv.block_tables("c")[0][2]
    assert kv.truncate("c", 9) == []
    assert kv.pool.block_keys[block] == []
    assert kv.find_prefix_hit("d", list(range(50, 62)) + [1]) == 8
