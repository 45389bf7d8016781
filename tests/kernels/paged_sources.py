"""Random paged caches and slot rows for the sparse-attention and indexer kernel tests.

Caches are strided views into one page buffer, as ``ModelRunner.allocate_kv_cache``
makes them: each page holds a foreign layer's part and then every cache's
``bs x nt x D`` part. Only tensor 0 of a cache is read by the kernels; everything
else in the buffer (the foreign part, the other tensors of an entry) is NaN, so a
kernel that addresses outside tensor 0 of its own cache shows NaN. Packed record caches
(:func:`page_buffer_records`) are byte pages poisoned the same way.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import reference
from deepinfer.kv_spec import record_bytes

FOREIGN = 48   # elements of another layer at the start of each page


def page_buffer_caches(num_blocks: int, specs: list[tuple[int, int, int]], dtype: torch.dtype,
                       device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """One view ``[num_blocks, bs, nt, 1, D]`` per ``(bs, nt, D)`` spec into a shared page buffer;
    tensor 0 random, all else NaN."""
    sizes = [bs * nt * d for bs, nt, d in specs]
    buffer = torch.full((num_blocks, FOREIGN + sum(sizes)), float("nan"), dtype=dtype)
    offsets = [FOREIGN + sum(sizes[:i]) for i in range(len(specs))]
    for (bs, nt, d), off, n in zip(specs, offsets, sizes):
        view = buffer[:, off:off + n].view(num_blocks, bs, nt, 1, d)
        view[:, :, 0] = torch.randn(num_blocks, bs, 1, d, generator=gen).to(dtype)
    buffer = buffer.to(device)
    return [buffer[:, off:off + n].view(num_blocks, bs, nt, 1, d)
            for (bs, nt, d), off, n in zip(specs, offsets, sizes)]


def random_slots(t: int, k: int, capacity: int, gen: torch.Generator, pad: float = 0.25,
                 empty_rows: tuple[int, ...] = (), dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[t, k] distinct random slots per row out of ``capacity``; a ``pad`` share of them and every
    slot of ``empty_rows`` replaced by -1."""
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:k] for _ in range(t)]).to(dtype)
    slots[torch.rand(t, k, generator=gen) < pad] = -1
    slots[list(empty_rows)] = -1
    return slots


def pad_runs(slots: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A copy of ``slots`` with a random leading and trailing run of -1 in every row (as window
    slots before position 0 and top-k padding give); some runs cover half the row or more."""
    out = slots.clone()
    k = slots.shape[1]
    for row in out:
        a = int(torch.randint(0, k // 2 + 1, (1,), generator=gen))
        b = int(torch.randint(k // 2, k + 1, (1,), generator=gen))
        row[:a] = -1
        row[b:] = -1
    return out


POISON = 0xFF   # an E4M3 byte of -480 and an E8M0 scale of +inf: a stray read shows


def page_buffer_records(num_blocks: int, specs: list[tuple[int, int, int, str]], dtype: torch.dtype,
                        device: torch.device, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Packed record caches as the runner lays them out: one uint8 view ``[num_blocks, bs, nt, 1, R]``
    per ``(bs, nt, D, fmt)`` spec into a shared page buffer (R = ``record_bytes(fmt, D)``), tensor 0
    the records of random rows (per-row magnitudes over 2 ** -2 .. 2 ** 2), every other byte
    POISON. Returns (the record caches, the same caches decoded: ``[num_blocks, bs, nt, 1, D]``
    in ``dtype`` with tensor 0 the records' values and NaN elsewhere)."""
    rows = [record_bytes(fmt, d) for _, _, d, fmt in specs]
    sizes = [bs * nt * r for (bs, nt, _, _), r in zip(specs, rows)]
    buffer = torch.full((num_blocks, FOREIGN + sum(sizes)), POISON, dtype=torch.uint8)
    offsets = [FOREIGN + sum(sizes[:i]) for i in range(len(specs))]
    records, values = [], []
    for (bs, nt, d, fmt), off, n, r in zip(specs, offsets, sizes, rows):
        view = buffer[:, off:off + n].view(num_blocks, bs, nt, 1, r)
        x = torch.randn(num_blocks, bs, 1, d, generator=gen) * torch.exp2(
            torch.randint(-2, 3, (num_blocks, bs, 1, 1), generator=gen).float())
        view[:, :, 0] = reference.pack_record(x, fmt)
        plain = torch.full((num_blocks, bs, nt, 1, d), float("nan"), dtype=dtype)
        plain[:, :, 0] = reference.unpack_record(view[:, :, 0], fmt, d, dtype)
        values.append(plain.to(device))
    buffer = buffer.to(device)
    for (bs, nt, _, _), off, n, r in zip(specs, offsets, sizes, rows):
        records.append(buffer[:, off:off + n].view(num_blocks, bs, nt, 1, r))
    return records, values
