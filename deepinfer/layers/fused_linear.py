"""Several bias-free projections of the same input as one GEMM.

At batch 1 a decode step is bound by kernel launches, not bytes: a layer that runs
seven small GEMVs on one input pays seven launches. :class:`FusedProjection` keeps
the projections as the separate ``nn.Linear`` modules the checkpoint names (module
tree, parameter names and ``state_dict`` unchanged) and, once :meth:`fuse` has run,
computes them as ``F.linear(x, W)`` with ``W = cat(W_1, ..., W_n)`` [sum_out, in],
returning the pieces as column views of the one output.

Contract:

- Before :meth:`fuse` (a model built and filled through ``load_state_dict`` or
  ``load_weights`` without the loader's ``after_load`` hook) every call computes the
  projections one by one: correct, only slower. Fusion is never implicit.
- :meth:`fuse` copies the weights into one new buffer and points each piece's
  parameter at its rows of it (``param.data`` = a view; the Parameter objects stay),
  so the weights are stored once. In-place writes to a piece (``copy_``,
  ``load_state_dict``, ``load_weights``, random fills) write into the fused buffer
  and are seen by the next call.
- A piece whose storage was replaced after :meth:`fuse` (``module.weight = ...``,
  ``param.data = ...``, ``model.to(other dtype or device)``) would make the fused
  buffer stale: every call checks the pieces' addresses (host-side, no device sync)
  and raises, asking for :meth:`fuse` again.

FP8 pieces (``layers/quant_linear.Fp8Linear``, swapped in by ``models/quantize.py``): pieces of
one kind fuse together, the 16-bit ones into one ``F.linear`` and the FP8 ones (same block and
scale format, each output width a multiple of the block's rows) into one FP8 GEMM over their
stacked weights and scales; a projection of mixed kinds runs one GEMM per kind, and the pieces
come back in their order.

Numerics: each output column is the same dot product over ``in`` as in its own
projection; the GEMM library may still block the reduction differently for a wider
output, so bf16 results can differ from the unfused ones by rounding.

Shapes: T tokens, K input width, N_i output width of piece i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.layers.quant_linear import Fp8Linear


class FusedProjection:
    """The projections ``linears`` (bias-free ``nn.Linear`` or ``Fp8Linear`` over the same input
    width), computed unfused until :meth:`fuse`, then as one GEMM per weight kind. Not an
    ``nn.Module``: the linears stay registered where they are, under their own names."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        if not linears:
            raise ValueError("FusedProjection needs at least one projection")
        widths = {lin.in_features for lin in linears}
        if len(widths) != 1:
            raise ValueError(f"FusedProjection: the projections read inputs of different widths {widths}")
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            raise NotImplementedError("FusedProjection: projections with a bias are not supported")
        self.linears = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        # Once fused: per weight kind, (piece indices, the GEMM over their stacked weights).
        self._groups: list[tuple[list[int], nn.Module]] = []
        self._addresses: tuple[int, ...] = ()

    @property
    def fused(self) -> bool:
        return bool(self._groups)

    @property
    def weight(self) -> torch.Tensor | None:
        """The fused 16-bit weight [sum N_i, K] when every piece is 16-bit and fused, else None."""
        if len(self._groups) == 1 and isinstance(self._groups[0][1], nn.Linear):
            return self._groups[0][1].weight
        return None

    def replace(self, old: nn.Module, new: nn.Module) -> None:
        """Put ``new`` in the place of piece ``old`` (a layer swapped for its FP8 version); the
        projection is unfused until :meth:`fuse` runs again."""
        if new.in_features != old.in_features or new.out_features != old.out_features:
            raise ValueError("FusedProjection.replace: the new projection has other widths")
        self.linears = tuple(new if lin is old else lin for lin in self.linears)
        self._groups, self._addresses = [], ()

    @torch.no_grad()
    def fuse(self) -> None:
        """Per weight kind, copy the pieces into one buffer and make each piece's parameters views
        of their rows of it. Running it again re-fuses from the pieces' current values."""
        fp8 = [i for i, lin in enumerate(self.linears) if isinstance(lin, Fp8Linear)]
        dense = [i for i in range(len(self.linears)) if i not in fp8]
        groups = []
        if dense:
            groups.append((dense, self._fuse_dense([self.linears[i] for i in dense])))
        if fp8:
            groups.extend(self._fuse_fp8(fp8))
        self._groups = groups
        self._addresses = tuple(lin.weight.data_ptr() for lin in self.linears)

    @staticmethod
    def _fuse_dense(pieces: list[nn.Module]) -> nn.Linear:
        weights = [lin.weight for lin in pieces]
        kinds = {(w.dtype, w.device) for w in weights}
        if len(kinds) != 1:
            raise ValueError(f"FusedProjection: the projections' weights differ in dtype/device: {kinds}")
        fused = nn.Linear(pieces[0].in_features, sum(lin.out_features for lin in pieces), bias=False,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights], dim=0), requires_grad=False)
        for param, rows in zip(weights, fused.weight.data.split([lin.out_features for lin in pieces], dim=0)):
            param.data = rows
        return fused

    def _fuse_fp8(self, indices: list[int]) -> list[tuple[list[int], nn.Module]]:
        """The FP8 pieces stacked when they share a block and scale format and each output width is
        a multiple of the block's rows (so the scale rows stack too); otherwise each alone."""
        pieces = [self.linears[i] for i in indices]
        first = pieces[0]
        if any(p.block != first.block or p.scale_format != first.scale_format
               or p.out_features % first.block[0] for p in pieces):
            return [([i], self.linears[i]) for i in indices]
        with torch.device(first.weight.device):
            fused = Fp8Linear(first.in_features, sum(p.out_features for p in pieces), first.block,
                              first.scale_format)
        fused.weight.data = torch.cat([p.weight.data for p in pieces], dim=0)
        fused.scale.data = torch.cat([p.scale.data for p in pieces], dim=0)
        rows = [p.out_features for p in pieces]
        scale_rows = [p.scale.shape[0] for p in pieces]
        for p, w, sc in zip(pieces, fused.weight.data.split(rows, dim=0), fused.scale.data.split(scale_rows, dim=0)):
            p.weight.data, p.scale.data = w, sc
        return [(indices, fused)]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, K] -> n pieces [T, N_i] (column views of one output per weight kind once fused)
        if not self._groups:
            return tuple(lin(x) for lin in self.linears)
        current = tuple(lin.weight.data_ptr() for lin in self.linears)
        if current != self._addresses:
            stale = [i for i, (a, b) in enumerate(zip(current, self._addresses)) if a != b]
            raise RuntimeError(f"FusedProjection: the weight of projection(s) {stale} (out widths "
                               f"{[self.sizes[i] for i in stale]}) was replaced after fuse(), so the "
                               "fused buffer is stale; call fuse_projections() again")
        if len(self._groups) == 1:
            return self._groups[0][1](x).split(self.sizes, dim=-1)
        out: list[torch.Tensor | None] = [None] * len(self.linears)
        for indices, gemm in self._groups:
            for i, piece in zip(indices, gemm(x).split([self.sizes[i] for i in indices], dim=-1)):
                out[i] = piece
        return tuple(out)
