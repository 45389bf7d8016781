"""ModelRunner.allocate_kv_cache with layers of several dtypes in one page buffer (DeepSeek-V4.1 on
the Triton path: packed uint8 records beside float compressor states), and what the groups say a
token costs."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config import EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.models.base import CausalLM
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.scheduler.kv_cache import PAGE_ALIGN, build_groups, kv_bytes_per_token, page_bytes

SPECS = [
    # A window of 66-byte MXFP8 records, a float32 (kv, gate) state, 3 bfloat16 channels (6 bytes:
    # odd for a float32 neighbour), then a ratio-2 group of 36-byte NVFP4 entries and 17-byte keys.
    KVCacheSpec("sliding", 1, 64, torch.uint8, num_tensors=1, sliding_window=8, record="mxfp8"),
    KVCacheSpec("sliding", 1, 64, torch.float32, num_tensors=2, sliding_window=8),
    KVCacheSpec("sliding", 1, 3, torch.bfloat16, num_tensors=1, sliding_window=8),
    KVCacheSpec("compressed", 1, 64, torch.uint8, num_tensors=1, compress_ratio=2, record="nvfp4"),
    KVCacheSpec("compressed", 1, 32, torch.uint8, num_tensors=1, compress_ratio=2, record="mxfp4"),
    KVCacheSpec("sliding", 1, 64, torch.uint8, num_tensors=1, sliding_window=8, record="mxfp8"),
]


class _Caches(CausalLM):
    """Stands in for a model: one module per spec, nothing else."""

    def __init__(self) -> None:
        super().__init__({"vocab_size": 8}, torch.float32)
        self.slots = nn.ModuleList()
        for spec in SPECS:
            m = nn.Module()
            m.kv_spec = spec
            self.slots.append(m)


def runner_with_caches(block_size: int) -> tuple[ModelRunner, list[nn.Module]]:
    model = _Caches()
    hf = {"architectures": ["Caches"], "vocab_size": 8}
    config = EngineConfig(model=ModelConfig(path="<caches>", hf_config=hf, dtype=torch.float32, max_model_len=64),
                          scheduler=SchedulerConfig(async_scheduling=False))
    runner = ModelRunner(config, model, eos_token_ids={1})
    runner.allocate_kv_cache(build_groups(SPECS, block_size), 6)
    return runner, list(model.slots)


def test_layers_of_several_dtypes_share_pages():
    for block_size in (1, 4):
        runner, slots = runner_with_caches(block_size)
        buffer = runner.kv_buffer
        assert buffer.dtype == torch.uint8 and buffer.shape[1] % PAGE_ALIGN == 0
        spans = []
        for slot, spec in zip(slots, SPECS):
            cache = slot.kv_cache
            assert cache.dtype == spec.dtype and cache.shape[2:] == (spec.num_tensors, 1, spec.row_size)
            start = cache.data_ptr() - buffer.data_ptr()
            assert start % spec.dtype.itemsize == 0            # each part aligned to its element size
            spans.append((slot.group_id, start, start + cache[0].numel() * spec.dtype.itemsize))
        for gid in {g for g, _, _ in spans}:                   # a group's parts do not overlap
            parts = sorted((a, b) for g, a, b in spans if g == gid)
            assert all(b <= c for (_, b), (c, _) in zip(parts, parts[1:]))
            assert parts[-1][1] <= buffer.shape[1]
        # Every layer written with its own values in its group's page (block 1 + group id; a
        # block id is one group's at a time): none clobbers another, and a block copy (a fork's
        # partial page) carries them all.
        for i, slot in enumerate(slots):
            slot.kv_cache[1 + slot.group_id].copy_(torch.full_like(slot.kv_cache[0], i + 1))
        for i, slot in enumerate(slots):
            assert (slot.kv_cache[1 + slot.group_id] == i + 1).all()
        for gid in (0, 1):
            buffer[4 + gid].copy_(buffer[1 + gid])
        for i, slot in enumerate(slots):
            assert (slot.kv_cache[4 + slot.group_id] == i + 1).all()


def test_bytes_per_token_count_the_records():
    groups = build_groups(SPECS, 4)
    per_token, per_sequence = kv_bytes_per_token(groups)
    assert per_token == (36 + 17) / 2
    assert per_sequence == 8 * (66 + 2 * 64 * 4 + 3 * 2 + 66)
    assert page_bytes(groups) == -(-max(g.bytes_per_block for g in groups) // PAGE_ALIGN) * PAGE_ALIGN
