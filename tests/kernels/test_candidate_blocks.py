"""DeepSeek-V4.1 candidate blocks (deepinfer/kernels/candidate_blocks.py) against
:func:`reference.candidate_block_mask` on random index scores (distinct, so the reference's
torch.topk has one answer), both against a direct per-row transcription, and the kernel's tie
rule (earliest runs first) on scores with ties."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.candidate_blocks import candidate_block_mask


def make_scores(t: int, n: int, gen: torch.Generator, visible: list[int] | None = None,
                levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [t, n] float32, -inf at keys >= visible; visible [t] int64). ``levels``: scores
    drawn from that many values (ties), else continuous."""
    if visible is None:
        visible = torch.randint(1, n + 1, (t,), generator=gen).tolist()
    if levels is None:
        scores = torch.randn(t, n, generator=gen)
    else:
        scores = torch.randint(0, levels, (t, n), generator=gen).float()
    vis = torch.tensor(visible, dtype=torch.int64)
    scores = scores.masked_fill(torch.arange(n)[None, :] >= vis[:, None], float("-inf"))
    return scores, vis


def direct_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """Row by row: runs scored by their best key, the newest visible key's run first, then by
    score, ties by run index; the first num_blocks runs that hold a visible key."""
    t, n = scores.shape
    out = torch.zeros(t, n, dtype=torch.bool)
    for r in range(t):
        runs = [(float(scores[r, b:b + block].max()), b // block) for b in range(0, n, block)]
        newest = (int(visible[r]) - 1) // block if visible[r] > 0 else -1
        ranked = sorted((0 if i == newest else 1, -s, i) for s, i in runs)
        kept = [i for _, neg, i in ranked[:num_blocks] if i == newest or -neg > float("-inf")]
        for i in kept:
            out[r, i * block:(i + 1) * block] = True
    return out


@pytest.mark.parametrize("t, n, block, num_blocks", [
    (5, 37, 4, 3),        # odd T; N and the visible counts not multiples of the block
    (3, 100, 8, 20),      # fewer runs (13) than num_blocks: every visible run kept
    (7, 64, 3, 2),
    (2, 5, 8, 4),         # a single short run
    (4, 2000, 8, 30),
    (3, 2600, 2, 700),    # 1300 runs: the keep pass walks two chunks of 1024
    (2, 50, 1, 7),        # runs of one key: plain top-k with the newest key pinned
])
def test_mask_matches_reference(device, t, n, block, num_blocks):
    gen = torch.Generator().manual_seed(t * 1000 + n + block)
    scores, visible = make_scores(t, n, gen)
    visible[0] = 0                                  # a row with nothing visible keeps nothing
    scores[0] = float("-inf")
    got = candidate_block_mask(scores.to(device), visible.to(device), block, num_blocks).cpu()
    want = reference.candidate_block_mask(scores, visible, block, num_blocks)
    assert got.dtype == torch.bool and got.shape == (t, n)
    assert torch.equal(got, want)
    assert not want[0].any() and want[1:].any()


def test_int32_visible_and_edge_counts(device):
    gen = torch.Generator().manual_seed(1)
    n, block = 45, 4
    # Visible counts at a run's end, just past it, the whole row, and one key.
    scores, visible = make_scores(4, n, gen, visible=[8, 9, n, 1])
    for num_blocks in (1, 2, 12, 0):
        got = candidate_block_mask(scores.to(device), visible.int().to(device), block, num_blocks).cpu()
        assert torch.equal(got, reference.candidate_block_mask(scores, visible, block, num_blocks))
    # num_blocks = 1 keeps the newest run only.
    newest = candidate_block_mask(scores.to(device), visible.to(device), block, 1).cpu()
    assert newest[0, 4:8].all() and newest[0].sum() == 4 and newest[3, :4].all() and newest[3].sum() == 4


def test_reference_matches_direct_transcription():
    gen = torch.Generator().manual_seed(2)
    for t, n, block, num_blocks in [(6, 41, 4, 3), (3, 30, 8, 10), (5, 23, 1, 6)]:
        scores, visible = make_scores(t, n, gen)
        assert torch.equal(reference.candidate_block_mask(scores, visible, block, num_blocks),
                           direct_mask(scores, visible, block, num_blocks))


def test_ties_keep_the_earliest_runs(device):
    gen = torch.Generator().manual_seed(3)
    scores, visible = make_scores(9, 90, gen, levels=4)
    got = candidate_block_mask(scores.to(device), visible.to(device), 3, 5).cpu()
    assert torch.equal(got, direct_mask(scores, visible, 3, 5))


def test_nan_scores_count_as_invisible(device):
    gen = torch.Generator().manual_seed(4)
    scores, visible = make_scores(3, 24, gen, visible=[24, 24, 24])
    scores[:, 4:12] = float("nan")                  # runs 1 and 2 of 4 keys
    got = candidate_block_mask(scores.to(device), visible.to(device), 4, 6).cpu()
    assert torch.equal(got, direct_mask(scores.nan_to_num(float("-inf")), visible, 4, 6))
    assert not got[:, 4:12].any()


def test_launcher_checks_shapes():
    scores = torch.randn(3, 10)
    with pytest.raises(ValueError, match="visible must be"):
        candidate_block_mask(scores, torch.zeros(2, dtype=torch.int64), 4, 2)
    with pytest.raises(ValueError, match="scores must be"):
        candidate_block_mask(scores.double(), torch.zeros(3, dtype=torch.int64), 4, 2)
    with pytest.raises(ValueError, match="block must be"):
        candidate_block_mask(scores, torch.zeros(3, dtype=torch.int64), 0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_sizes_in_a_cuda_graph():
    """The release's 8-key runs and 2048 kept runs over 131072 keys (a ratio-1 stream at 128K
    tokens: 16 chunks a counting pass), captured once and replayed with new scores."""
    from tests.kernels.conftest import capture
    gen = torch.Generator().manual_seed(8)
    scores, visible = make_scores(4, 131072, gen, visible=[131072, 100000, 16381, 9])
    scores, visible = scores.cuda(), visible.cuda()
    graph, out = capture(lambda: candidate_block_mask(scores, visible, 8, 2048))
    for _ in range(2):
        new, new_visible = make_scores(4, 131072, gen)
        scores.copy_(new)
        visible.copy_(new_visible)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference.candidate_block_mask(new, new_visible, 8, 2048))
