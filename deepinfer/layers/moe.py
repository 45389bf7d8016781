"""Mixture-of-experts building blocks: a softmax top-k router and stacked SwiGLU experts.

Expert weights are stacked per projection (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], the layout HF transformers 5 keeps in memory and a
grouped-GEMM kernel wants). Checkpoints that store one tensor per expert
(``experts.{e}.gate_proj.weight``) load into slices of them; see
:meth:`FusedMoE.expert_weight_index` and ``CausalLM.remap_weight_name``.

Both run through ``kernels/backend.py``: the pure-PyTorch references on the CPU,
the fused Triton kernels (``kernels/moe_routing.py``, ``kernels/fused_moe.py``) on
CUDA, which never synchronise with the host (CUDA-graph safe).

Packed weights. Once loaded (``CausalLM.after_load``), experts that the Triton kernels run
(CUDA, 16-bit weights whose widths divide the tiles) are re-laid out in place by
:meth:`FusedMoE.pack_weights`: each [128, 64] tile of gate_up_proj and [256, 64] tile of
down_proj becomes one contiguous run (``fused_moe.pack_expert_weights``), which the kernels
stream faster at prefill; the parameters keep their names but take the packed shapes
[E, 2I*H/64, 64] and [E, H*I/64, 64] (also in ``state_dict``). Loading into a packed
layer is refused (:meth:`FusedMoE.unpack_weights` first); the torch references unpack a
copy per call.

FP4 experts. :meth:`FusedMoE.quantize_fp4` replaces both projections by packed e2m1 codes
(``uint8``, two a byte: gate_up_proj [E, 2I, H/2], down_proj [E, H, I/2]) with one scale per 32
inputs (``gate_up_proj_scale`` [E, 2I, H/32], ``down_proj_scale`` [E, H, I/32]; float32 or UE8M0
bytes), the layout DeepSeek ships its routed experts in; the forward then runs
``backend.fp4_moe_experts`` (the FP4 Triton kernels on CUDA, dequantising per call elsewhere).
:meth:`FusedMoE.make_fp4` gives the same layout uninitialised, for a checkpoint that ships it:
the loader then copies each expert's shipped codes and scales into its rows
(:meth:`FusedMoE.expert_weight_index` indexes codes and scales as it does 16-bit weights, the
rows being the same), and the 16-bit weights never exist.

Expert parallelism. Built under an expert-parallel group of more than one rank
(``parallel.groups.current_groups().ep``) or with redundant expert slots
(``parallel.expert.current_expert_parallel()``), a :class:`FusedMoE` holds only its rank's S
physical slots (``gate_up_proj`` [S, 2I, H], ``down_proj`` [S, H, I]) and its forward routes
through ``parallel/expert.py``'s dispatch/combine (``self.ep``); otherwise ``self.ep`` is None
and it is the plain single-device layer. Loading fills only the local slots (per-expert
checkpoint tensors of other ranks' experts are skipped).

Shapes: T tokens, H hidden, E experts, K experts per token, I expert intermediate size,
S physical expert slots this rank holds (E without expert parallelism).
"""

from __future__ import annotations

import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import backend
from deepinfer.parallel.expert import ExpertParallel, current_expert_parallel
from deepinfer.parallel.groups import current_groups

# True while a model is built for loading (``models.quantize.deferred_weights``): expert stacks
# are then created on the meta device, since allocating even one layer's 16-bit stack for an
# instant would raise the load peak by gigabytes on a large model.
EXPERTS_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar("experts_on_meta", default=False)


class SoftmaxTopKRouter(nn.Module):
    """Router logits ``x @ weight.T``, softmax, top-k (optionally renormalised)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int64
        logits = F.linear(x, self.weight)                         # [T, E]
        return backend.softmax_topk(logits, self.top_k, self.renormalize)


class FusedMoE(nn.Module):
    """E SwiGLU experts applied to the tokens routed to them, outputs weighted and summed
    (expert-parallel when built under an EP group: see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        group, config = current_groups().ep, current_expert_parallel()
        self.ep = (ExpertParallel(num_experts, group, config)
                   if group.size > 1 or config.num_redundant_experts else None)
        slots = num_experts if self.ep is None else self.ep.slots_per_rank
        device = "meta" if EXPERTS_ON_META.get() else None
        self.gate_up_proj = nn.Parameter(torch.empty(slots, 2 * intermediate_size, hidden_size, device=device))
        self.down_proj = nn.Parameter(torch.empty(slots, hidden_size, intermediate_size, device=device))
        # Whether the parameters hold the fused kernels' tile-packed layout (pack_weights).
        self.packed = False
        # Whether the parameters hold packed FP4 codes with scales (quantize_fp4).
        self.fp4 = False
        # Every UE8M0 scale of the FP4 weights is at most 2^1 (set by note_fp4_scales after load):
        # the FP4 kernel may then decode codes straight to bf16 (kernels/fp4_moe.py).
        self.fp4_small_scales = False

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_weights, topk_ids: [T, K] (logical experts) -> [T, H]
        if self.ep is None:
            return self.run_experts(x, topk_weights, topk_ids)
        return self.ep(x, topk_weights, topk_ids, self.run_experts)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts this module holds: x [T, H], topk_weights / topk_ids [T, K] (ids of
        local slots) -> [T, H]."""
        if self.fp4:
            return self.fp4_experts(x, topk_weights, topk_ids, 0.0)
        return backend.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                   packed=self.packed)

    def fp4_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    swiglu_limit: float) -> torch.Tensor:
        # x: [T, H]; topk_weights, topk_ids: [T, K] -> [T, H], over the FP4 weights of quantize_fp4
        return backend.fp4_moe_experts(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                       self.down_proj_scale, topk_weights, topk_ids, swiglu_limit,
                                       small_scales=self.fp4_small_scales)

    @torch.no_grad()
    def note_fp4_scales(self) -> None:
        """Record whether every UE8M0 scale is at most 2^1 (byte 128), once the FP4 weights are in
        place (``CausalLM.after_load``; one host sync). Reloaded weights must call it again."""
        self.fp4_small_scales = (self.fp4 and self.gate_up_proj_scale.dtype == torch.uint8
                                 and bool((self.gate_up_proj_scale.max() <= 128) & (self.down_proj_scale.max() <= 128)))

    @torch.no_grad()
    def quantize_fp4(self, scale_format: str = "ue8m0", experts_per_chunk: int = 16) -> None:
        """Quantise both projections to packed FP4 with one scale per 32 inputs
        (``models.quant.quant_fp4_e2m1``), ``experts_per_chunk`` experts at a time so the float32
        temporaries stay small; the stacked Parameters are replaced. Raises ValueError if the
        weights are tile-packed or already FP4, or a width is not a multiple of 32."""
        from deepinfer.models.quant import quant_fp4_e2m1
        self._check_fp4_widths("quantize_fp4")
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name).data
            parts = [quant_fp4_e2m1(w[e:e + experts_per_chunk], 32, scale_format)
                     for e in range(0, self.num_experts, experts_per_chunk)]
            del w
            setattr(self, name, nn.Parameter(torch.cat([q for q, _ in parts]), requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(torch.cat([s for _, s in parts]), requires_grad=False))
            del parts
        self.fp4 = True

    def make_fp4(self, scale_format: str, device: torch.device) -> None:
        """Replace both projections by uninitialised FP4 codes and scales on ``device`` (the
        layout of :meth:`quantize_fp4`), for the loader to fill with a checkpoint's shipped ones;
        the 16-bit weights are dropped unread (they may be on the meta device). Raises
        ValueError as :meth:`quantize_fp4` does."""
        from deepinfer.models.quant import SCALE_FORMATS
        self._check_fp4_widths("make_fp4")
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"make_fp4: scale_format={scale_format!r} is not one of {SCALE_FORMATS}")
        scale_dtype = torch.float32 if scale_format == "float32" else torch.uint8
        for name in ("gate_up_proj", "down_proj"):
            slots, rows, cols = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(slots, rows, cols // 2, dtype=torch.uint8, device=device),
                                             requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(
                torch.empty(slots, rows, cols // 32, dtype=scale_dtype, device=device), requires_grad=False))
        self.fp4 = True

    def _check_fp4_widths(self, caller: str) -> None:
        if self.packed or self.fp4:
            raise ValueError(f"{caller}: the expert weights are already "
                             + ("tile-packed (unpack_weights first)" if self.packed else "FP4"))
        if self.hidden_size % 32 or self.intermediate_size % 32:
            raise ValueError(f"{caller}: hidden_size={self.hidden_size} and intermediate_size="
                             f"{self.intermediate_size} must be multiples of the scale group 32")

    def packing_helps(self) -> bool:
        """Whether :meth:`pack_weights` pays: the Triton kernels run these weights (CUDA, Triton
        backend), they are 16-bit (the layout was measured on bf16 prefill) and the expert widths
        divide the tiles. Checked by ``CausalLM.after_load``."""
        w = self.gate_up_proj
        if self.packed or not w.is_cuda or w.element_size() != 2 or not backend.use_triton(w):
            return False
        from deepinfer.kernels.fused_moe import DOWN_TILE, GATE_UP_TILE
        h, i = self.hidden_size, self.intermediate_size
        return ((2 * i) % GATE_UP_TILE[0] == 0 and h % GATE_UP_TILE[1] == 0
                and h % DOWN_TILE[0] == 0 and i % DOWN_TILE[1] == 0)

    @torch.no_grad()
    def pack_weights(self) -> None:
        """Re-lay out gate_up_proj and down_proj in place into the fused kernels' tile-packed
        layout (``fused_moe.pack_expert_weights``); the Parameter objects stay, their data is
        replaced. One projection at a time, so the peak extra memory is one projection of one
        layer. Raises ValueError if already packed or the widths do not divide the tiles."""
        from deepinfer.kernels.fused_moe import DOWN_TILE, GATE_UP_TILE, pack_expert_weights
        if self.packed:
            raise ValueError("pack_weights: this layer's expert weights are already packed")
        self.gate_up_proj.data = pack_expert_weights(self.gate_up_proj.data, *GATE_UP_TILE)
        self.down_proj.data = pack_expert_weights(self.down_proj.data, *DOWN_TILE)
        self.packed = True

    @torch.no_grad()
    def unpack_weights(self) -> None:
        """Back to the stacked layout ([E, 2I, H], [E, H, I]), e.g. to load weights again."""
        from deepinfer.kernels.fused_moe import DOWN_TILE, GATE_UP_TILE, unpack_expert_weights
        if not self.packed:
            raise ValueError("unpack_weights: this layer's expert weights are not packed")
        h, i = self.hidden_size, self.intermediate_size
        self.gate_up_proj.data = unpack_expert_weights(self.gate_up_proj.data, 2 * i, h, *GATE_UP_TILE)
        self.down_proj.data = unpack_expert_weights(self.down_proj.data, h, i, *DOWN_TILE)
        self.packed = False

    def expert_weight_index(self, proj: str, expert: int) -> tuple[str, tuple[int | slice, ...]] | None:
        """Where logical expert ``expert``'s ``{proj}.weight`` lives: (parameter name, index into
        it), or None when this rank holds no slot of it (expert parallelism). In an FP4 layer the
        index selects the same rows of the codes and of ``{parameter name}_scale``."""
        if self.packed:
            raise ValueError("the expert weights are tile-packed for the fused MoE kernels "
                             "(after_load); call unpack_weights() before loading into them")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: this layer has "
                             f"num_experts={self.num_experts}")
        if self.ep is not None:
            local = [s for s, e in enumerate(self.ep.local_experts()) if e == expert]
            if not local:
                return None
            if len(local) > 1:
                raise NotImplementedError(f"expert {expert} has {len(local)} slots on this rank; loading "
                                          "a checkpoint into such a placement is not yet supported (load "
                                          "before rebalancing)")
            expert = local[0]
        i = self.intermediate_size
        if proj == "gate_proj":
            return "gate_up_proj", (expert, slice(0, i))
        if proj == "up_proj":
            return "gate_up_proj", (expert, slice(i, 2 * i))
        if proj == "down_proj":
            return "down_proj", (expert,)
        raise ValueError(f"unknown expert projection {proj!r}; expected gate_proj, up_proj or down_proj")
