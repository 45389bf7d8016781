"""KV-cache store by slot mapping; reference: :func:`reference.store_kv`.

One program per new token copies its ``num_tensors`` entries (each [Hkv, D])
to ``cache[slot // block_size, slot % block_size]``. The layer's cache is a
strided view into pages shared by several layers (runner/model_runner.py,
``allocate_kv_cache``), so every cache stride is passed, never assumed. A slot
of -1 marks a token with nothing to store (for example a compressed group's
token that completes no entry) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl


@triton.jit
def _store_kv_kernel(
    cache_ptr, slot_ptr, k_ptr, v_ptr,
    stride_cache_block, stride_cache_offset, stride_cache_tensor, stride_cache_head,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    NUM_TENSORS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]                      # [BLOCK_H, 1]
        dims = tl.arange(0, BLOCK_D)[None, :]                       # [1, BLOCK_D]
        mask = (heads < num_heads) & (dims < head_dim)
        dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block
               + (slot % BLOCK_SIZE) * stride_cache_offset + heads * stride_cache_head + dims)
        k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        if NUM_TENSORS == 2:
            v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
            tl.store(dst + stride_cache_tensor, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Write ``cache[slot // bs, slot % bs, i] = tensors[i]`` for each token whose slot is >= 0.

    cache: [NB, bs, nt, Hkv, D] (any strides, D contiguous); slot_mapping: [T] int;
    tensors: nt x [T, Hkv, D] (D contiguous), cast to the cache's dtype.
    """
    if cache.dim() != 5:
        raise ValueError(f"store_kv: cache must be [num_blocks, block_size, num_tensors, H_kv, D], "
                         f"got shape {tuple(cache.shape)}")
    _, block_size, num_tensors, num_heads, head_dim = cache.shape
    if len(tensors) != num_tensors or num_tensors not in (1, 2):
        raise ValueError(f"store_kv: the cache holds {num_tensors} tensors per entry and "
                         f"{len(tensors)} were given; the kernel stores 1 or 2")
    t = slot_mapping.shape[0]
    for i, x in enumerate(tensors):
        if x.shape != (t, num_heads, head_dim):
            raise ValueError(f"store_kv: tensors[{i}] has shape {tuple(x.shape)}, expected "
                             f"({t}, {num_heads}, {head_dim})")
        if x.stride(-1) != 1 or x.device != cache.device:
            raise ValueError(f"store_kv: tensors[{i}] must have a contiguous last dim and be on "
                             f"{cache.device}")
    if cache.stride(-1) != 1:
        raise ValueError("store_kv: the cache's last dim (D) must be contiguous")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: slot_mapping must be a 1-D int32/int64 tensor, got "
                         f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    k = tensors[0]
    v = tensors[-1]  # the same tensor when nt == 1; then never read
    # Tile config: one program per token covering all of its heads and dims;
    # entries are a few KiB at most, so 4 warps move one in a single pass.
    _store_kv_kernel[(t,)](
        cache, slot_mapping.contiguous(), k, v,
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        BLOCK_SIZE=block_size, NUM_TENSORS=num_tensors,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **pdl.flags(cache.device))
