"""Same-host KV hand-over (engine/kv_share.py): the prefill engine stages an export's blocks in
a buffer the decode engine maps (shared memory on the CPU; CUDA IPC on a GPU, in
tests/gpu/test_pd_cuda.py), and only the handle travels. The decode engine's output equals a
single engine's; the buffer is gone after its release or its expiry; handles that cannot be
opened are refused by name."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from deepinfer.engine import kv_transfer
from deepinfer.engine.kv_share import Opened, ShareError, ShareRegistry

from .test_kv_transfer import PARAMS, PREFILL, assert_no_leaks, assert_same, llm_for, prompts


def segment_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


def test_shared_export_gives_a_single_engines_output_and_is_freed():
    want = llm_for(None, enable_prefix_caching=False).generate(prompts(), PARAMS, use_tqdm=False)
    prefill = llm_for(None)
    prefill.generate(prompts(), PREFILL, use_tqdm=False)
    shares = ShareRegistry(ttl_s=60)
    export = kv_transfer.export_prompts(prefill.engine, prompts(), shares)
    inline = kv_transfer.export_prompts(prefill.engine, prompts())
    blob = kv_transfer.encode(export)
    # Only the header travels: no payload bytes.
    assert len(blob) < 64 * len(export.blocks) + 4096 < len(kv_transfer.encode(inline))
    name = export.share["name"]
    assert export.share["kind"] == "shm" and segment_exists(name) and len(shares) == 1

    decode = llm_for(None, kv_offload_gib=0.01)
    result = kv_transfer.import_blocks(decode.engine, kv_transfer.decode(blob))
    assert result.opened and result.imported == len(export.blocks) > 0
    assert result.nbytes == sum(b.nbytes for b in inline.blocks)
    got = decode.generate(prompts(), PARAMS, use_tqdm=False)
    for g, w, hit in zip(got, want, export.num_tokens):
        assert_same(g, w)
        assert g.num_cached_tokens == hit
    assert shares.release(export.share["id"], opened=True)
    assert not segment_exists(name) and len(shares) == 0
    assert not shares.release(export.share["id"], opened=True)      # once only
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_staged_bytes_equal_the_inline_export():
    prefill = llm_for(None)
    prefill.generate(prompts(), PREFILL, use_tqdm=False)
    shares = ShareRegistry()
    shared = kv_transfer.export_prompts(prefill.engine, prompts(), shares)
    inline = kv_transfer.export_prompts(prefill.engine, prompts())
    opened = Opened(shared.share)
    try:
        assert [(b.group, b.keys) for b in shared.blocks] == [(b.group, b.keys) for b in inline.blocks]
        for s, i in zip(shared.blocks, inline.blocks):
            assert opened.tensor[s.offset:s.offset + s.nbytes].numpy().tobytes() == i.data
    finally:
        opened.close()
    shares.close()


def test_unreleased_buffers_expire_and_bad_handles_are_refused():
    shares = ShareRegistry(ttl_s=30)
    staged = shares.stage(1000, torch.device("cpu"))
    staged.tensor.copy_(torch.randint(0, 255, (1000,), dtype=torch.uint8))
    handle = dict(staged.handle)
    opened = Opened(handle)
    assert torch.equal(opened.tensor, staged.tensor)
    opened.close()
    assert shares.expire(now=time.time() + 10) == 0
    assert shares.expire(now=time.time() + 31) == 1
    assert not segment_exists(handle["name"]) and len(shares) == 0
    with pytest.raises(ShareError, match="does not exist on this host"):
        Opened(handle)
    with pytest.raises(ShareError, match="expired"):
        Opened({**handle, "expires": time.time() - 1})
    with pytest.raises(ShareError, match="kind 'rdma'"):
        Opened({**handle, "kind": "rdma"})
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        ShareRegistry(ttl_s=0)


def test_a_shared_export_past_its_buffer_is_refused():
    shares = ShareRegistry()
    staged = shares.stage(64, torch.device("cpu"))
    export = kv_transfer.KVExport("f", [16], [kv_transfer.ExportedBlock(0, [b"k" * 32], b"", 64, 8)],
                                  share=staged.handle)
    back = kv_transfer.decode(kv_transfer.encode(export))
    assert back.share == staged.handle and back.blocks[0].offset == 8 and back.blocks[0].nbytes == 64
    decode = llm_for(None, kv_offload_gib=0.01)
    back.fingerprint = kv_transfer.engine_fingerprint(decode.engine)
    back.blocks[0].nbytes = decode.engine.runner.groups[0].bytes_per_block
    with pytest.raises(ValueError, match="outside its"):
        kv_transfer.import_blocks(decode.engine, back)
    shares.close()
