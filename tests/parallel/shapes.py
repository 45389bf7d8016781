"""The tiny checkpoints' shapes and the tolerances the multi-process parallel tests share."""

from __future__ import annotations

from pathlib import Path

LOGPROB_TOL = 1e-5
TINY_V4 = Path(__file__).resolve().parents[1] / "data" / "tiny-v4-model"
# V4.1's default FP8/FP4 KV records round: a last-bit difference in a rounded entry can move a
# logprob past the tolerance, so engines compare with unrounded float32 caches.
ENGINE_OPTIONS = {"DeepseekV41ForCausalLM": dict(kv_cache_dtype="float32")}

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
V3 = dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4,
          q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
          n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
          n_shared_experts=1)
