"""Host-side step inputs: the vectorised slot mapping of long chunks against the per-token
rule, and prefix-cache block hashes that do not depend on how a prompt arrived."""

from __future__ import annotations

import random

import pytest

from deepinfer.runner.inputs import seq_slots, token_slot
from deepinfer.scheduler.kv_cache import hash_block, token_bytes


@pytest.mark.parametrize("block_size,ratio", [(16, 1), (1, 1), (64, 4), (4, 128), (16, 4)])
def test_seq_slots_match_token_slot(block_size, ratio):
    rng = random.Random(block_size * 1000 + ratio)
    for _ in range(30):
        start, n = rng.randrange(0, 3000), rng.choice([1, 5, 63, 64, 65, 700])
        table = [rng.randrange(1, 10_000) for _ in range((start + n) // ratio // block_size + 2)]
        expected = [token_slot(table, p, block_size, ratio) for p in range(start, start + n)]
        assert seq_slots(table, start, n, block_size, ratio) == expected


def test_seq_slots_of_a_chunk_that_completes_no_entry():
    """A long chunk before a compressed group's first entry: its table holds no block yet."""
    assert seq_slots([], 0, 100, 4, 128) == [-1] * 100
    assert seq_slots([7], 100, 100, 4, 128) == [-1] * 27 + [7 * 4] + [-1] * 72


def test_token_bytes_are_little_endian_uint32():
    ids = [0, 1, 255, 256, 129_279, 2**32 - 1]
    assert token_bytes(ids) == b"".join(t.to_bytes(4, "little") for t in ids)
    # One conversion of a whole prompt, sliced per block, hashes as block-by-block conversion.
    raw = token_bytes(ids)
    assert hash_block(None, 3, raw[8:16]) == hash_block(None, 3, token_bytes(ids[2:4]))
    assert hash_block(None, 3, raw[8:16]) != hash_block(None, 2, raw[8:16])


def test_token_ids_between_equals_the_slice():
    from deepinfer.request import Request
    from deepinfer.sampling_params import SamplingParams

    req = Request("r", "r", 0, [5, 6, 7, 8], SamplingParams(), 0, output_token_ids=[9, 10, 11])
    everything = req.all_token_ids
    for start in range(8):
        for end in range(start, 9):
            assert req.token_ids_between(start, end) == everything[start:end]
