"""Test harness for DeepSeek-V4.1-Flash: tiny random checkpoints in the release layout,
and mlx-lm's implementation as the reference to compare with.

A helper module, not a test file. The pieces:

- :func:`tiny_v41_text_config`: a tiny ``text_config`` in which every layer role of the
  release exists (window only, ratio-2 and ratio-1 kv sources, full indexers, the
  candidate source, reindex and reuse layers), without engram, small enough that top-k,
  candidate blocks and the SwiGLU clamp all select something on ~40-token prompts.
- :func:`random_v41_weights` / :func:`quantize_release` / :func:`dequantized`: float32
  tensors under the raw DeepSeek names, the same tensors in the release's storage
  formats (FP8 E4M3 + UE8M0 32x32 blocks, packed FP4 E2M1 + UE8M0 per 32, BF16, F32;
  dtypes copied from the reference checkpoint in shared/testdata/v41_reference), and the
  exact float32 values a quantised checkpoint stands for.
- :func:`write_checkpoint`: a directory the engine loads (release ``config.json``
  wrapper, one file or shards with an index, the 320-id test tokenizer).
- :class:`MlxV41`: mlx-lm 0.32.2's ``deepseek_v41.Model`` in float32, loaded through its
  own ``ModelArgs.from_dict``/``sanitize``/``load_weights`` so that the name mapping is
  mlx-lm's and not ours, with its KV/indexer fake quantisation switchable.

The model comparisons should feed both sides the values of :func:`dequantized`, so that
weight quantisation is not a difference between them. See
shared/research/deepseek_v41.md §13 for the tolerances to expect.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from deepinfer.models.quant import FP4_E2M1_VALUES, pair_scales

REFERENCE_CHECKPOINT = Path("/work/shared/testdata/v41_reference/checkpoint")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
FP8_BLOCK = 32           # quantization_config.weight_block_size of the release
FP4_GROUP = 32           # one UE8M0 scale per 32 inputs of a routed expert
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "scale_fmt": "ue8m0", "expert_dtype": "fp4"}

# Storage formats of the release, by raw DeepSeek name (the reference checkpoint's dtypes):
# FP8 dense projections, shared experts and the indexer's query projection; packed FP4
# routed experts; F32 sinks, router bias and mHC parameters; BF16 for everything else
# (embed, head, norms, router weight, compressor, indexer wk/weights_proj).
_FP8_NAME = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                       r"|ffn\.shared_experts\.w[123])\.weight")
_FP4_NAME = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_F32_NAME = re.compile(r"layers\.\d+\.(attn\.attn_sink|ffn\.gate\.bias|hc_(attn|ffn)_(fn|base|scale))")


def tiny_v41_text_config(**overrides: Any) -> dict[str, Any]:
    """A tiny V4.1 ``text_config`` (release key names) with every layer role and no engram.

    Layers (10): 0-1 window only (plain RoPE); 2 ratio-2 kv source + full indexer (owns
    index keys); 3 reuses 2; 4 a second ratio-2 kv source + indexer, so "the nearest
    source at or below" matters; 5 reuses 4; 6 ratio-1 kv source (no gate) + full indexer +
    candidate source; 7 reuses 6's top-k; 8 reindexes within 6's candidates; 9 reuses 8.

    Sizes are chosen so that every selection selects on ~40-token prompts: window 8;
    index_topk 6 of up to 20 (ratio 2) or 40 (ratio 1) entries; candidate blocks of 4, 3 of
    them (of up to 10); 8 experts, top-2; swiglu_limit 1.0 clamps ~16% of the gate values
    (from above) and ~32% of the up values (both sides), which are of unit variance. (candidate_topk_blocks - 1) * candidate_block_size + 1 = 9
    >= index_topk keeps the reindex layer from having to pick non-candidates (research
    note §2/§6). YaRN's original length is 64, not the release's 65536, so that the
    interpolated RoPE channels are ones that rotate noticeably within the prompts.
    ``gate_temp`` (an mlx-lm field, absent from the release, default 1) is 0.8 so that an
    engine honouring it is tested. ``num_nextn_predict_layers`` is 0: the harness has no
    MTP/DSpark weights.
    """
    config: dict[str, Any] = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 320,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 1.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64},
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "gate_temp": 0.8,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
        "compress_rope_theta": 160000.0,
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8],
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 6,
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [],
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    }
    config.update(copy.deepcopy(overrides))
    check_text_config(config)
    return config


def check_text_config(config: Mapping[str, Any]) -> None:
    """The invariants that mlx-lm relies on without checking (research note §2)."""
    if config.get("engram_layer_ids"):
        raise ValueError("the harness has no engram: engram_layer_ids must be empty")
    kv, index = set(config["kv_source_layer_ids"]), set(config["index_source_layer_ids"])
    if not kv <= index:
        raise ValueError(f"kv sources {sorted(kv - index)} are not index sources: a reuse layer "
                         "would apply top-k of one stream to another")
    if config["candidate_topk_blocks"] > 0:
        capacity = (config["candidate_topk_blocks"] - 1) * config["candidate_block_size"] + 1
        if capacity < config["index_topk"]:
            raise ValueError(f"(candidate_topk_blocks - 1) * candidate_block_size + 1 = {capacity} "
                             f"< index_topk = {config['index_topk']}")


def release_config(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """The release ``config.json`` around ``text_config`` (no vision_config: the harness has
    no vision weights, and nothing reads it)."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
        "text_config": copy.deepcopy(dict(text_config)),
    }


# -- weights -------------------------------------------------------------------------------

def v41_weight_shapes(text_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every raw DeepSeek tensor name of the text model (no engram, MTP or vision) and its
    shape, as the release lays them out; which layers own a compressor, its gate and the
    indexer parts follows mlx-lm's Attention/Indexer/Compressor constructors."""
    c = text_config
    d, hd, heads = c["hidden_size"], c["head_dim"], c["num_attention_heads"]
    q_rank, o_rank, groups = c["q_lora_rank"], c["o_lora_rank"], c["o_groups"]
    inter, experts, hc = c["moe_intermediate_size"], c["n_routed_experts"], c["hc_mult"]
    i_heads, i_dim = c["index_n_heads"], c["index_head_dim"]
    kv_sources, index_sources = set(c["kv_source_layer_ids"]), set(c["index_source_layer_ids"])
    mix = (2 + hc) * hc

    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c["vocab_size"], d), "head.weight": (c["vocab_size"], d), "norm.weight": (d,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"layers.{layer}."
        ratio = int(c["compress_ratios"][layer])
        shapes.update({
            p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "attn.wq_a.weight": (q_rank, d), p + "attn.q_norm.weight": (q_rank,),
            p + "attn.wq_b.weight": (heads * hd, q_rank),
            p + "attn.wkv.weight": (hd, d), p + "attn.kv_norm.weight": (hd,),
            p + "attn.wo_a.weight": (groups * o_rank, heads * hd // groups),
            p + "attn.wo_b.weight": (d, groups * o_rank),
            p + "attn.attn_sink": (heads,),
            p + "ffn.gate.weight": (experts, d), p + "ffn.gate.bias": (experts,),
            p + "ffn.shared_experts.w1.weight": (inter, d), p + "ffn.shared_experts.w2.weight": (d, inter),
            p + "ffn.shared_experts.w3.weight": (inter, d),
        })
        for part in ("attn", "ffn"):
            shapes.update({f"{p}hc_{part}_fn": (mix, hc * d), f"{p}hc_{part}_base": (mix,),
                           f"{p}hc_{part}_scale": (3,)})
        for e in range(experts):
            shapes.update({f"{p}ffn.experts.{e}.w1.weight": (inter, d),
                           f"{p}ffn.experts.{e}.w2.weight": (d, inter),
                           f"{p}ffn.experts.{e}.w3.weight": (inter, d)})
        if layer in kv_sources:
            shapes.update({p + "attn.compressor.wkv.weight": (hd, d), p + "attn.compressor.norm.weight": (hd,)})
            if ratio > 1:
                shapes[p + "attn.compressor.wgate.weight"] = (hd, d)
        if layer in index_sources:
            shapes.update({p + "attn.indexer.wq_b.weight": (i_heads * i_dim, q_rank),
                           p + "attn.indexer.weights_proj.weight": (i_heads, d)})
            if layer in kv_sources:
                shapes.update({p + "attn.indexer.wk.weight": (i_dim, hd),
                               p + "attn.indexer.k_norm.weight": (i_dim,)})
    return shapes


def random_v41_weights(text_config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random float32 tensors under the raw DeepSeek names, none zero or one-valued.

    Scales follow the reference checkpoint's, which keep activations O(1) through the
    layers: matrices N(0, 1/fan_in) (the mHC ``fn`` too), norm weights 1 + N(0, 0.1^2),
    embedding N(0, 1), head N(0, (2/sqrt(D))^2) (logit std ~2), mHC ``base`` N(0, 0.5^2)
    and ``scale`` U(0.25, 1.5), sinks N(0.5, 0.8^2), router bias N(0, 0.15^2).
    """
    g = torch.Generator().manual_seed(seed)
    d = text_config["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for name, shape in v41_weight_shapes(text_config).items():
        normal = torch.randn(shape, generator=g, dtype=torch.float32)
        if name == "embed.weight":
            t = normal
        elif name == "head.weight":
            t = normal * (2.0 / d ** 0.5)
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * normal
        elif name.endswith(("_base",)):
            t = 0.5 * normal
        elif name.endswith("_scale"):
            t = 0.25 + 1.25 * torch.rand(shape, generator=g)
        elif name.endswith("attn_sink"):
            t = 0.5 + 0.8 * normal
        elif name.endswith("gate.bias"):
            t = 0.15 * normal
        else:
            t = normal * shape[-1] ** -0.5
        out[name] = t
    return out


def storage_format(name: str) -> str:
    """``"fp8"``, ``"fp4"``, ``"f32"`` or ``"bf16"``: how the release stores tensor ``name``."""
    if _FP8_NAME.fullmatch(name):
        return "fp8"
    if _FP4_NAME.fullmatch(name):
        return "fp4"
    if _F32_NAME.fullmatch(name):
        return "f32"
    return "bf16"


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= top (UE8M0 scales are powers of two)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / top)))


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b), ceil(in/b)]):
    each block x block tile divided by the power of two that brings its absmax within 448."""
    rows, cols = w.shape
    pad_r, pad_c = -rows % block, -cols % block
    tiles = torch.nn.functional.pad(w.float(), (0, pad_c, 0, pad_r))
    tiles = tiles.view((rows + pad_r) // block, block, (cols + pad_c) // block, block)
    scale = _pow2_scale(tiles.abs().amax(dim=(1, 3)), FP8_E4M3_MAX)
    q = (tiles / scale[:, None, :, None]).view(rows + pad_r, cols + pad_c)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu)


def quantize_fp4_e2m1(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in/2], float8_e8m0fnu [out, in/group]): each group of
    inputs divided by the power of two that brings its absmax within 6, rounded to the
    nearest E2M1 value and packed two codes a byte, low nibble first (the release's I8)."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"FP4 needs in={cols} to be a multiple of the group size {group}")
    groups = w.float().view(rows, cols // group, group)
    scale = _pow2_scale(groups.abs().amax(dim=-1), FP4_E2M1_MAX)
    v = (groups / scale[..., None]).view(rows, cols)
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8])
    codes = (v.abs()[..., None] - magnitudes).abs().argmin(dim=-1)            # [out, in], 0..7
    codes = torch.where((v < 0) & (codes > 0), codes + 8, codes).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def quantize_release(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (raw DeepSeek names, float) in the release's storage formats: each FP8
    or FP4 ``X.weight`` gains its ``X.scale``; F32 and BF16 tensors are cast."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        fmt = storage_format(name)
        if fmt in ("fp8", "fp4"):
            q, s = quantize_fp8_block(t) if fmt == "fp8" else quantize_fp4_e2m1(t)
            out[name], out[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            out[name] = t.to(torch.float32 if fmt == "f32" else torch.bfloat16).contiguous()
    return out


def dequantized(qweights: Mapping[str, torch.Tensor], fp8_block: int = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """The exact float32 values a (possibly quantised) tensor dict stands for, scale
    tensors consumed: FP8/FP4 decoded by deepinfer.models.quant, BF16 widened."""
    return {name: t.to(torch.float32)
            for name, t in pair_scales(qweights.items(), fp8_block=fp8_block, fp4_group=FP4_GROUP)}


# -- checkpoint directory ------------------------------------------------------------------

def _shard_groups(names: list[str], shards: int) -> list[list[str]]:
    """Sorted names cut into ``shards`` contiguous runs, never between a weight and its
    scale (the release keeps each pair in one file)."""
    modules: dict[str, list[str]] = {}
    for name in sorted(names):
        key = name.removesuffix(".weight").removesuffix(".scale")
        modules.setdefault(key, []).append(name)
    runs = np.array_split(np.arange(len(modules)), shards)
    keys = list(modules)
    return [[n for i in run for n in modules[keys[i]]] for run in runs]


def write_checkpoint(path: str | Path, text_config: Mapping[str, Any],
                     tensors: Mapping[str, torch.Tensor], shards: int = 1) -> Path:
    """A checkpoint directory as the release lays it out: ``config.json`` (the release
    wrapper around ``text_config``), ``model.safetensors`` or ``shards`` files
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``, and the
    reference checkpoint's 320-id tokenizer (tokenizer.json, tokenizer_config.json,
    generation_config.json). ``tensors`` are written in their own dtypes."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if shards < 1 or shards > len(tensors):
        raise ValueError(f"shards={shards} must be in [1, {len(tensors)}]")
    (root / "config.json").write_text(json.dumps(release_config(text_config), indent=2))
    for file in TOKENIZER_FILES:
        # copyfile, not copy: the reference files are read-only and the copies need not be.
        shutil.copyfile(REFERENCE_CHECKPOINT / file, root / file)
    metadata = {"format": "pt"}
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"),
                  metadata=metadata)
        return root
    weight_map: dict[str, str] = {}
    for i, names in enumerate(_shard_groups(list(tensors), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(root / file), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


# -- mlx-lm reference ----------------------------------------------------------------------

@contextmanager
def _kv_rounding(enabled: bool) -> Iterator[None]:
    """mlx-lm 0.32.2 has no switch for its simulated KV formats (FP8 window rows, NVFP4
    compressed entries, MXFP4 index queries and keys): it always rounds. Its model code
    looks the two rounding functions up as module globals on every call, so swapping them
    for the identity while a forward is traced turns the rounding off."""
    if enabled:
        yield
        return
    from mlx_lm.models import deepseek_v41 as mod

    saved = mod._fake_quant_fp8, mod._fake_quant_fp4
    mod._fake_quant_fp8 = lambda x, block_size=32: x
    mod._fake_quant_fp4 = lambda x, *, block_size, e4m3_scale=False: x
    try:
        yield
    finally:
        mod._fake_quant_fp8, mod._fake_quant_fp4 = saved


class MlxV41:
    """mlx-lm's DeepSeek-V4.1 (``mlx_lm.models.deepseek_v41.Model``) as the reference.

    Built from a ``text_config`` and tensors under the raw DeepSeek names (float32, or
    quantised: they are passed through :func:`dequantized` first). The config goes through
    mlx-lm's ``ModelArgs.from_dict`` in the release wrapper, the tensors through its
    ``sanitize`` (renaming, expert stacking, wo_a grouping) and ``load_weights(strict=True)``,
    so a name or shape that mlx-lm reads differently fails here. Everything is float32.

    ``fake_quant`` (default off) is mlx-lm's simulated KV rounding (see ``_kv_rounding``);
    off, the full forward and the cached path agree to ~1e-5, on, isolated rounding flips
    move logits by ~1e-3..1e-2. It may be changed between calls.
    """

    def __init__(self, text_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                 fake_quant: bool = False) -> None:
        import mlx.core as mx
        from mlx_lm.models.deepseek_v41 import Model, ModelArgs

        check_text_config(text_config)
        self.text_config = dict(text_config)
        self.fake_quant = fake_quant
        self.model = Model(ModelArgs.from_dict(release_config(text_config)))
        weights = {k: mx.array(v.numpy()) for k, v in dequantized(tensors).items()}
        self.model.load_weights(list(self.model.sanitize(weights).items()), strict=True)
        mx.eval(self.model.parameters())

    @classmethod
    def from_checkpoint(cls, path: str | Path, fake_quant: bool = False) -> "MlxV41":
        """The checkpoint directory through ``mlx_lm.utils.load_model``: FP8 layers become
        mxfp8 and routed experts mxfp4 QuantizedLinears holding the stored bytes, an
        independent reading of the quantised format. Unquantised parameters (BF16 in the
        release) are widened to float32 so that only the weight formats differ from
        ``MlxV41(text_config, dequantized(...))``."""
        import mlx.core as mx
        from mlx.utils import tree_map
        from mlx_lm.utils import load_model

        model, config = load_model(Path(path))
        model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p,
                              model.parameters()))
        mx.eval(model.parameters())
        ref = cls.__new__(cls)
        ref.text_config = dict(config["text_config"])
        ref.fake_quant = fake_quant
        ref.model = model
        return ref

    def _forward(self, ids: list[int], cache: list | None) -> np.ndarray:
        import mlx.core as mx

        with _kv_rounding(self.fake_quant):
            out = self.model(mx.array([ids], dtype=mx.int32), cache)
            mx.eval(out)
        return np.array(out[0].astype(mx.float32))

    def logits(self, prompt_ids: list[int]) -> np.ndarray:
        """[T, V] float32 logits of one full forward over the prompt (a fresh cache)."""
        return self._forward(list(prompt_ids), None)

    def cached_logits(self, prompt_ids: list[int], chunk: int | None = None) -> np.ndarray:
        """[T, V] logits through mlx-lm's cache, ``chunk`` tokens a call (None: all at once
        into an empty cache; 1: token by token, the decode path)."""
        ids = list(prompt_ids)
        step = chunk or len(ids)
        cache = self.model.make_cache()
        return np.concatenate([self._forward(ids[i:i + step], cache) for i in range(0, len(ids), step)])

    def greedy(self, prompt_ids: list[int], n: int, chunk: int | None = None) -> list[int]:
        """n argmax tokens: prefill (in chunks of ``chunk``), then one cached decode step
        per further token, as mlx-lm's generate_step does."""
        if n < 1:
            return []
        cache = self.model.make_cache()
        ids, step = list(prompt_ids), chunk or len(prompt_ids)
        for i in range(0, len(ids), step):
            last = self._forward(ids[i:i + step], cache)[-1]
        out: list[int] = []
        while True:
            out.append(int(last.argmax()))
            if len(out) == n:
                return out
            last = self._forward(out[-1:], cache)[-1]
