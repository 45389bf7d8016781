"""DeepSeek-V4 mixture of experts: sqrtsoftplus routing with a selection bias
(noaux_tc) or a frozen token -> experts table (hash layers), clamped SwiGLU
experts and one shared expert.

Routing (float32): scores ``s = sqrt(softplus(x @ W_gate^T))``; the top-K
experts by ``s + bias`` are chosen (hash layers: ``tid2eid[token]``); their
weights are ``s`` renormalised over the K chosen, times ``routed_scaling_factor``.
Experts: ``down(silu(min(gate, L)) * clamp(up, -L, L))`` with ``L = swiglu_limit``.
Routing and experts run through ``kernels/backend.py`` (references on the CPU,
fused Triton kernels on CUDA). Under expert parallelism (layers/moe.py, parallel/expert.py)
each rank routes its own tokens (hash layers by their own token ids) before the pairs are
dispatched; the shared expert stays local.

Shapes: T tokens, H hidden, E routed experts, K experts per token, I expert width.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import backend
from deepinfer.layers import side_stream
from deepinfer.layers.fused_linear import FusedProjection
from deepinfer.layers.moe import FusedMoE
from deepinfer.layers.quant_linear import fp8_input

_SCORE_FUNCS = ("sqrtsoftplus", "sigmoid")


class DeepseekV4Router(nn.Module):
    """Top-K by biased score (``hash_vocab_size`` None) or by ``tid2eid[token]`` (hash layers)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str,
                 routed_scaling_factor: float, hash_vocab_size: int | None, gate_temp: float = 1.0) -> None:
        super().__init__()
        if gate_temp <= 0:
            raise ValueError(f"gate_temp={gate_temp} must be > 0")
        if scoring_func not in _SCORE_FUNCS:
            raise NotImplementedError(f"scoring_func={scoring_func!r} is not supported for DeepSeek-V4; "
                                      f"supported: {', '.join(_SCORE_FUNCS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={num_experts}]")
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        # DeepSeek-V4.1's router temperature divides the logits (1 everywhere in the release).
        self.gate_temp = gate_temp
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.is_hash = hash_vocab_size is not None
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H], input_ids: [T] -> weights [T, K] float32, expert ids [T, K] int64
        logits = backend.router_logits(x, self.weight)                            # [T, E] float32
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        if self.is_hash:
            return backend.hash_route(logits, self.tid2eid, input_ids, self.scoring_func,
                                      self.routed_scaling_factor)
        return backend.biased_topk(logits, self.e_score_correction_bias, self.top_k, self.scoring_func,
                                   self.routed_scaling_factor)


class DeepseekV4Experts(FusedMoE):
    """Stacked routed experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) with clamped SwiGLU."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.swiglu_limit = swiglu_limit

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_weights, topk_ids (local slots): [T, K] -> [T, H]
        if self.fp4:
            return self.fp4_experts(x, topk_weights, topk_ids, self.swiglu_limit)
        return backend.clamped_moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                           self.swiglu_limit, packed=self.packed)


class DeepseekV4SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit
        # gate and up: one GEMM once fuse_projections() has run (layers/fused_linear.py).
        self.gate_up = FusedProjection([self.gate_proj, self.up_proj])
        # (group, pow2_scale) of an FP8 down projection, set after load (note_fp8_inputs): the
        # SwiGLU launch then quantises the activation for it.
        self.fp8_act: tuple[int, bool] | None = None

    def note_fp8_inputs(self) -> None:
        """Have the SwiGLU quantise its output when the down projection is FP8."""
        self.fp8_act = fp8_input(self.down_proj)

    def fp8_input(self) -> tuple[int, bool] | None:
        """(group, pow2_scale) of the FP8 projections of the input x (gate and up), or None."""
        return fp8_input(self.gate_proj)

    def fuse_projections(self) -> None:
        """Store gate_proj and up_proj in one buffer and compute them as one GEMM; called
        once the weights are loaded (``CausalLM.after_load``)."""
        self.gate_up.fuse()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H], plus ``residual`` [T, H] added in the down projection's GEMM
        return self.down(self.activation(x), residual)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> clamped SwiGLU of the gate and up projections [T, I]
        gate, up = self.gate_up(x)                                                # [T, I] each
        return backend.clamped_swiglu(gate, up, self.swiglu_limit, fp8=self.fp8_act)

    def down(self, act: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # act: [T, I] -> [T, H], plus ``residual`` [T, H] added in the same GEMM, in place:
        # the caller hands over ``residual``. (torch.addmm would first copy it into a new
        # output, a pass over [T, H]: 16 us a layer at T=4096 on the H200.)
        if residual is None:
            return self.down_proj(act)
        if not isinstance(self.down_proj, nn.Linear):       # an FP8 projection: the add in its GEMM
            return self.down_proj(act, residual=residual)
        return residual.addmm_(act, self.down_proj.weight.t())


class DeepseekV4MoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 scoring_func: str, routed_scaling_factor: float, swiglu_limit: float,
                 hash_vocab_size: int | None, gate_temp: float = 1.0) -> None:
        super().__init__()
        self.gate = DeepseekV4Router(hidden_size, num_experts, top_k, scoring_func,
                                     routed_scaling_factor, hash_vocab_size, gate_temp)
        self.experts = DeepseekV4Experts(num_experts, hidden_size, intermediate_size, swiglu_limit)
        self.shared_experts = DeepseekV4SharedExpert(hidden_size, intermediate_size, swiglu_limit)

    def fp8_input(self) -> tuple[int, bool] | None:
        """(group, pow2_scale) of the FP8 projections that read the input (the shared expert's)."""
        return self.shared_experts.fp8_input()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H], input_ids: [T] (hash layers route by token) -> [T, H]
        # At decode sizes the shared expert's gate/up GEMM streams its weights on a side
        # stream while routing (a chain of small launches) and the routed experts run;
        # its down projection then adds the routed output in one GEMM, as inline.
        side = side_stream.fork(x)
        with side_stream.on(side):
            act = self.shared_experts.activation(x)                               # [T, I]
        weights, ids = self.gate(x, input_ids)
        routed = self.experts(x, weights, ids)
        side_stream.join(side)
        return self.shared_experts.down(act, residual=routed)
