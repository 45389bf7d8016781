"""Random and hand-made float32 inputs for the KV-record format tests (FP8 / FP4 rounding and
packing): block maxima at the formats' edges, ties, subnormals and heavy tails."""

from __future__ import annotations

import torch


def special_rows(gen: torch.Generator) -> torch.Tensor:
    """[R, 128] float32 rows of hand-made 32-channel blocks (each also two 16-channel blocks)."""
    blocks = [torch.zeros(32), torch.full((32,), -0.0)]
    one = torch.zeros(32)
    one[5] = -3.0                                                          # one nonzero, negative
    blocks.append(one)
    # E2M1 ties at unit scale (amax 6 gives the scale 1 in all three formats) and their neighbours.
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(7.0))])
    blocks.append(torch.cat([near, -near[:8]]))
    # E4M3 ties at unit scale (amax 448): the midpoints of random neighbouring codes.
    codes = torch.randint(0, 125, (31,), generator=gen, dtype=torch.int32).to(torch.uint8)
    lo, hi = codes.view(torch.float8_e4m3fn).float(), (codes + 1).view(torch.float8_e4m3fn).float()
    signs = torch.where(torch.rand(31, generator=gen) < 0.5, -1.0, 1.0)
    blocks.append(torch.cat([torch.tensor([448.0]), (lo + hi) / 2 * signs]))
    # Block maxima a few ulps above top * 2**k, where float32 log2 keeps the scale 2**k, with
    # companions down to 2**-12 of the maximum (the E4M3 / E2M1 subnormal range).
    for top in (448.0, 6.0):
        for k in (-20, -6, -1, 0, 3, 4, 9, 40):
            peak = torch.tensor(top * 2.0**k)
            for _ in range(4):
                peak = peak.nextafter(torch.tensor(float("inf")))
                shrink = 2.0 ** -torch.randint(0, 12, (31,), generator=gen)
                rest = peak * torch.rand(31, generator=gen) * shrink
                blocks.append(torch.cat([peak[None], rest * signs]))
    # NVFP4 scales past E4M3's 448 (mlx saturates), and the subnormal scales.
    for amax in (2687.0, 2700.0, 3e4, 1e9, 0.0175, 0.019, 0.05, 1e-3):
        blocks.append(torch.cat([torch.tensor([amax]), torch.randn(31, generator=gen) * amax / 3]))
    rows = torch.stack(blocks)
    return torch.cat([rows, torch.zeros((-len(rows)) % 4, 32)]).reshape(-1, 128)


def random_inputs(gen: torch.Generator) -> list[torch.Tensor]:
    """float32 inputs [..., C] of several shapes and magnitudes."""
    xs = [special_rows(gen)]
    for shape, scale in [((3, 512), 1.0), ((2, 5, 128), 1e-30), ((2, 3, 4, 128), 1e-5), ((7, 64), 0.02),
                         ((4, 512), 30.0), ((3, 96), 1e4), ((2, 256), 1e30), ((4, 128), 1e-39)]:
        xs.append(torch.randn(shape, generator=gen) * scale)
    xs[-1][:, ::32] = 1e-37                    # float32 subnormals, in blocks above the MXFP4 floor
    # Heavy tails: per-element magnitudes spread over about 2**-20 .. 2**20, and per-row magnitudes.
    xs.append(torch.randn(16, 512, generator=gen) * torch.exp2(torch.randn(16, 512, generator=gen) * 7))
    xs.append(torch.randn(64, 128, generator=gen) * 10.0 ** torch.randint(-12, 12, (64, 1), generator=gen))
    return xs
