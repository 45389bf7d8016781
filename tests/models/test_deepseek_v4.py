"""DeepSeek-V4 vs HF transformers 5.23 (``deepseek_v4``) on tiny random configs.

Covered: hyper-connections, sliding/CSA/HCA attention with sinks (sequences
longer than the window, more compressed entries than index_topk, 8 indexer
heads), hash and biased sqrtsoftplus routing with clamped SwiGLU, HF-style and
DeepSeek-style configs, HF and DeepSeek checkpoint names, FP8/FP4 checkpoints
written to safetensors, the MTP layer (vs HF's decoder blocks composed as
DeepSeek's MTPBlock), and the paged caches: chunked prefill and decode equal
the one-shot forward and HF's own cached decode. Buffers that HF initialises to
zeros (tid2eid, sinks, position biases, the score-correction bias) are random.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.layers.deepseek_v4_attention import DeepseekV4Attention
from deepinfer.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from deepinfer.models.loader import iter_checkpoint

transformers = pytest.importorskip("transformers")
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402
from transformers.core_model_loading import WeightRenaming, rename_source_key  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

CPU = torch.device("cpu")
RTOL = 1e-4
SL, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# HF-style config: explicit layer types, HCA at ratio 8 so short prompts get HCA entries.
HF_STYLE = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=96, hidden_size=64, moe_intermediate_size=32,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=6,
    layer_types=[SL, CSA, HCA, CSA, HCA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=12, index_n_heads=8,
    index_head_dim=16, index_topk=3, swiglu_limit=1.0, max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    num_nextn_predict_layers=1, bos_token_id=None, eos_token_id=None)
SEQ_LENS = [40, 13, 27]   # CSA: 10 entries > index_topk=3; window 8

# DeepSeek's own config.json layout: compress_ratios (0/4/128, last entry = MTP layer),
# num_hash_layers, qk_rope_head_dim, rope_scaling; FP8 blocks of 32 for the tiny shapes.
NATIVE = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=96, hidden_size=64,
    moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=6,
    n_shared_experts=1, compress_ratios=[4, 128, 0, 4, 0], num_hash_layers=1, sliding_window=16,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, swiglu_limit=1.0,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=512,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1},
    num_nextn_predict_layers=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
NATIVE_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}
NATIVE_SEQ_LENS = [137, 50]   # one HCA entry (ratio 128); CSA: 34 entries > index_topk=4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def randomize(module: torch.nn.Module, seed: int, num_experts: int, top_k: int) -> None:
    """Every parameter and persistent buffer random (no zeros, no ones): tid2eid rows are
    distinct expert ids, matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                                     for _ in range(t.shape[0])]))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)


def hf_model(config: dict, seed: int):
    cfg = hf_v4.DeepseekV4Config(**copy.deepcopy(config))   # HF edits nested dicts in place
    cfg._attn_implementation = "eager"
    model = hf_v4.DeepseekV4ForCausalLM(cfg).eval()
    randomize(model, seed, cfg.n_routed_experts, cfg.num_experts_per_tok)
    return model


def prompts(lens: list[int], vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids[None], use_cache=False).logits[0]


@torch.no_grad()
def our_logits(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    ctx = ForwardContext.no_cache([len(s) for s in seqs], CPU)
    logits = model.compute_logits(model(torch.cat(seqs), ctx))
    return list(logits.split([len(s) for s in seqs]))


@pytest.fixture(scope="module")
def hf_style():
    """(HF model, our model loaded from HF's state dict, HF-saved config dict)."""
    torch.manual_seed(0)
    ref = hf_model(HF_STYLE, seed=0)
    config = ref.config.to_dict()
    ours = DeepseekV4ForCausalLM(config, torch.float32).eval()
    ours.load_weights(ref.state_dict().items())
    return ref, ours, config


def test_prefill_matches_hf_with_hf_names(hf_style):
    ref, ours, _ = hf_style
    seqs = prompts(SEQ_LENS, HF_STYLE["vocab_size"])
    refs = [hf_logits(ref, s) for s in seqs]
    for b, got in enumerate(our_logits(ours, seqs)):           # three sequences in one forward
        assert rel_err(got, refs[b]) <= RTOL, (b, rel_err(got, refs[b]))
        assert torch.equal(got.argmax(-1), refs[b].argmax(-1))
    # HF's checkpoints have no MTP tensors: the MTP layer is dropped, not left random.
    assert len(ours.mtp) == 0


def test_forward_rows_runs_the_head_on_the_selected_rows(hf_style):
    """The runner's path: the head mixing and final norm on the sampled rows only give those
    rows' logits from the full forward (and HF's), and on no rows an empty result."""
    ref, ours, _ = hf_style
    seqs = prompts(SEQ_LENS, HF_STYLE["vocab_size"])
    ctx = ForwardContext.no_cache([len(s) for s in seqs], CPU)
    ids = torch.cat(seqs)
    rows = torch.tensor([len(seqs[0]) - 1, sum(SEQ_LENS) - 1, 0])
    with torch.no_grad():
        full = ours(ids, ctx)
        picked = ours.forward_rows(ids, ctx, lambda t: t.index_select(0, rows))
        none = ours.forward_rows(ids, ctx, lambda t: t[:0])
    assert picked.shape == (3, full.shape[1]) and none.shape == (0, full.shape[1])
    torch.testing.assert_close(picked, full[rows], rtol=1e-5, atol=1e-5)
    last = hf_logits(ref, seqs[-1])[-1]
    assert rel_err(ours.compute_logits(picked[1:2])[0], last) <= RTOL


def test_hf_style_sensitive_to_sparse_selection(hf_style):
    """The test above would notice a wrong top-k: keeping every entry changes the logits."""
    ref, ours, config = hf_style
    seqs = prompts(SEQ_LENS[:1], HF_STYLE["vocab_size"])
    wide = DeepseekV4ForCausalLM({**config, "index_topk": 64}, torch.float32).eval()
    wide.load_weights(ref.state_dict().items())
    assert rel_err(our_logits(wide, seqs)[0], hf_logits(ref, seqs[0])) > 100 * RTOL


# -- DeepSeek's names, FP8/FP4 checkpoints, MTP --------------------------------------------
# Our test-side map from HF names to DeepSeek's; checked against HF's own conversion rules.
_TO_DEEPSEEK = (
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.sinks", "attn.attn_sink"), ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."), ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."), ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."), ("self_attn.o_b_proj.", "attn.wo_b."),
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
)
_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
# Which DeepSeek weights ship FP8 (FP4: the routed experts).
_FP8 = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "attn.indexer.wq_b.",
        "ffn.shared_experts.", "e_proj.", "h_proj.")


def layer_to_deepseek(rest: str) -> str:
    for hf_name, ds_name in _TO_DEEPSEEK:
        if rest.startswith(hf_name):
            return ds_name + rest[len(hf_name):]
    raise KeyError(rest)


def check_hf_maps_back(ds_name: str, hf_name: str) -> None:
    """HF transformers' own deepseek_v4 conversion rules turn our DeepSeek name back into HF's."""
    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if not isinstance(r, WeightRenaming)]
    got, _ = rename_source_key(ds_name, renamings, converters)
    assert "model." + got == hf_name or got == hf_name, (ds_name, got, hf_name)


def fp8_quantize(w: torch.Tensor, block: int, float_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    tiles = w.view(rows // block, block, cols // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))                 # [rows/b, cols/b]
    q = (tiles / scale[:, None, :, None]).view(rows, cols).to(torch.float8_e4m3fn)
    return q, scale if float_scale else scale.to(torch.float8_e8m0fnu)


def fp4_random(rows: int, cols: int, g: torch.Generator, fp4_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    exponents = torch.randint(120, 124, (rows, cols // 32), generator=g, dtype=torch.uint8)
    return packed.view(fp4_dtype), exponents.view(torch.float8_e8m0fnu)


def reference_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)


def deepseek_checkpoint(ref, mtp_parts: dict[str, torch.Tensor], block: int, seed: int
                        ) -> dict[str, torch.Tensor]:
    """HF model (+ MTP tensors) in DeepSeek's names, FP8/FP4 quantised; the HF model's and
    MTP tensors' weights are replaced by the reference dequantisation of what is stored."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    hf_sd = ref.state_dict()
    n_fp8 = 0

    def put(ds_name: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal n_fp8
        if ds_name.endswith(".weight") and any(k in ds_name for k in _FP8):
            q, s = fp8_quantize(t.float(), block, float_scale=n_fp8 % 3 == 0)
            n_fp8 += 1
            out[ds_name], out[ds_name[: -len(".weight")] + ".scale"] = q, s
            return reference_dequant(q, s)
        out[ds_name] = t.clone()
        return t

    with torch.no_grad():
        for name, t in hf_sd.items():
            if name in _TOP:
                check_hf_maps_back(_TOP[name], name)
                put(_TOP[name], t)
                continue
            _, _, idx, rest = name.split(".", 3)
            if rest.startswith("mlp.experts."):
                if rest.endswith("down_proj"):
                    continue
                gate_up, down = t, hf_sd[name.replace("gate_up_proj", "down_proj")]
                inter = down.shape[-1]
                for e in range(t.shape[0]):
                    fp4_dtype = torch.int8 if e % 2 else torch.float4_e2m1fn_x2
                    for proj, rows in (("w1", gate_up[e, :inter]), ("w3", gate_up[e, inter:]),
                                       ("w2", down[e])):
                        packed, scale = fp4_random(*rows.shape, g, fp4_dtype)
                        base = f"layers.{idx}.ffn.experts.{e}.{proj}"
                        out[base + ".weight"], out[base + ".scale"] = packed, scale
                        rows.copy_(reference_dequant(packed, scale))
                check_hf_maps_back(f"layers.{idx}.ffn.experts.0.w1.weight", name)
                continue
            ds_name = f"layers.{idx}.{layer_to_deepseek(rest)}"
            check_hf_maps_back(ds_name, name)
            t.copy_(put(ds_name, t))
        for name, t in mtp_parts.items():
            t.copy_(put(name, t))
    return out


def mtp_reference(ref, native: dict, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """DeepSeek's MTPBlock from HF's V4 blocks: a decoder layer of the MTP layer's type
    (compress_ratios[n]) plus e_proj/h_proj, enorm/hnorm, norm and its own hc_head."""
    n = native["num_hidden_layers"]
    cfg = hf_v4.DeepseekV4Config(**copy.deepcopy({**native, "num_hidden_layers": n + 1}))
    cfg._attn_implementation = "eager"
    d = cfg.hidden_size
    parts = torch.nn.ModuleDict(dict(
        layer=hf_v4.DeepseekV4DecoderLayer(cfg, n), e_proj=torch.nn.Linear(d, d, bias=False),
        h_proj=torch.nn.Linear(d, d, bias=False), enorm=hf_v4.DeepseekV4RMSNorm(d),
        hnorm=hf_v4.DeepseekV4RMSNorm(d),
        norm=hf_v4.DeepseekV4RMSNorm(d), hc_head=hf_v4.DeepseekV4HyperHead(cfg))).eval()
    randomize(parts, seed, cfg.n_routed_experts, cfg.num_experts_per_tok)
    tensors = {}
    for name, t in parts.state_dict().items():
        if name.startswith("layer."):
            rest = name[len("layer."):]
            if rest.startswith("mlp.experts."):
                continue   # routed experts: FP4 below
            tensors[f"mtp.0.{layer_to_deepseek(rest)}"] = t
        elif name.startswith("hc_head."):
            tensors[f"mtp.0.{name.replace('hc_head.hc_', 'hc_head_')}"] = t
        else:
            tensors[f"mtp.0.{name}"] = t
    return dict(cfg=cfg, parts=parts), tensors


def add_mtp_experts(ckpt: dict[str, torch.Tensor], mtp: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    experts = mtp["parts"]["layer"].mlp.experts
    inter = experts.down_proj.shape[-1]
    with torch.no_grad():
        for e in range(experts.gate_up_proj.shape[0]):
            gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]
            for proj, rows in (("w1", gate_up[:inter]), ("w3", gate_up[inter:]), ("w2", down)):
                packed, scale = fp4_random(*rows.shape, g, torch.int8)
                ckpt[f"mtp.0.ffn.experts.{e}.{proj}.weight"] = packed
                ckpt[f"mtp.0.ffn.experts.{e}.{proj}.scale"] = scale
                rows.copy_(reference_dequant(packed, scale))


@torch.no_grad()
def hf_mtp_logits(ref, mtp: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits of DeepSeek's MTPBlock at positions 0..S-2 (next tokens ids[1:])."""
    captured = {}
    hook = ref.model.hc_head.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    ref(input_ids=ids[None], use_cache=False)
    hook.remove()
    parts, cfg = mtp["parts"], mtp["cfg"]
    streams = captured["x"][:, :-1]                                          # [1, S-1, n, D]
    nxt = ids[None, 1:]
    pos = torch.arange(nxt.shape[1])[None]
    e = parts["enorm"](ref.model.embed_tokens(nxt))
    x = parts["e_proj"](e).unsqueeze(2) + parts["h_proj"](parts["hnorm"](streams))
    rope = {k: ref.model.rotary_emb(e, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=e, attention_mask=None,
                                             past_key_values=None, position_ids=pos)
    x = parts["layer"](x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=nxt)
    return ref.lm_head(parts["norm"](parts["hc_head"](x)))[0]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(HF model with dequantised weights, our model from a DeepSeek-named FP8/FP4 safetensors
    file, MTP reference parts)."""
    hf_config = {k: v for k, v in NATIVE.items() if k not in ("architectures", "model_type")}
    ref = hf_model(hf_config, seed=2)
    mtp, mtp_tensors = mtp_reference(ref, hf_config, seed=3)
    ckpt = deepseek_checkpoint(ref, mtp_tensors, block=NATIVE_QUANT["weight_block_size"][0], seed=4)
    add_mtp_experts(ckpt, mtp, seed=5)
    path = tmp_path_factory.mktemp("dsv4") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ckpt.items()}, str(path))
    ours = DeepseekV4ForCausalLM({**NATIVE, "quantization_config": NATIVE_QUANT}, torch.float32).eval()
    ours.load_weights(iter_checkpoint(str(path.parent)))
    return ref, ours, mtp, ckpt


def test_deepseek_config_resolves_like_hf():
    hf_cfg = hf_v4.DeepseekV4Config(**copy.deepcopy({k: v for k, v in NATIVE.items() if k != "model_type"}))
    args = DeepseekV4Args.from_hf(NATIVE)
    assert list(args.layer_types[: args.num_layers]) == hf_cfg.layer_types
    assert args.layer_types[args.num_layers:] == (SL,)        # compress_ratios[4] describes the MTP layer
    assert list(args.mlp_layer_types[: args.num_layers]) == hf_cfg.mlp_layer_types
    assert args.rope_parameters == hf_cfg.rope_parameters
    hf_saved = DeepseekV4Args.from_hf(hf_cfg.to_dict())
    assert hf_saved.layer_types[: hf_saved.num_layers] == args.layer_types[: args.num_layers]
    assert hf_saved.rope_parameters == args.rope_parameters


def test_deepseek_names_fp8_fp4_checkpoint_matches_hf(native):
    ref, ours, _, ckpt = native
    assert any(t.dtype == torch.float8_e4m3fn for t in ckpt.values())
    assert any(t.dtype == torch.float4_e2m1fn_x2 for t in ckpt.values())
    assert any(t.dtype == torch.int8 for t in ckpt.values())
    # The loaded (dequantised) weights equal the reference dequantisation exactly.
    hf_sd = ref.state_dict()
    ours_sd = ours.state_dict()
    for name in ("model.layers.0.self_attn.q_b_proj.weight",
                 "model.layers.3.mlp.shared_experts.down_proj.weight",
                 "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj",
                 "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight"):
        assert torch.equal(ours_sd[name], hf_sd[name]), name
    seqs = prompts(NATIVE_SEQ_LENS, NATIVE["vocab_size"], seed=7)
    for b, got in enumerate(our_logits(ours, seqs)):
        want = hf_logits(ref, seqs[b])
        assert rel_err(got, want) <= RTOL, (b, rel_err(got, want))


def test_mtp_layer_matches_deepseek_mtp_block(native):
    ref, ours, mtp, _ = native
    assert len(ours.mtp) == 1
    seqs = prompts([30, 21], NATIVE["vocab_size"], seed=8)
    ctx = ForwardContext.no_cache([len(s) - 1 for s in seqs], CPU)
    with torch.no_grad():
        streams = ours.forward_streams(torch.cat([s[:-1] for s in seqs]), ctx)
        hidden, out_streams = ours.mtp_forward(streams, torch.cat([s[1:] for s in seqs]), ctx)
        got = ours.compute_logits(hidden).split([len(s) - 1 for s in seqs])
    assert out_streams.shape == streams.shape
    for b, s in enumerate(seqs):
        want = hf_mtp_logits(ref, mtp, s)
        assert rel_err(got[b], want) <= RTOL, (b, rel_err(got[b], want))
    with pytest.raises(ValueError, match="MTP layer 1 does not exist"):
        ours.mtp_forward(streams, torch.cat([s[1:] for s in seqs]), ctx, k=1)


def test_load_errors_name_the_tensor(hf_style):
    ref, _, config = hf_style
    sd = dict(ref.state_dict())

    def load(items):
        DeepseekV4ForCausalLM(config, torch.float32).load_weights(items)

    with pytest.raises(ValueError, match="'model.layers.0.self_attn.bogus.weight' has no matching"):
        load([*sd.items(), ("model.layers.0.self_attn.bogus.weight", torch.zeros(2))])
    bad = dict(sd, **{"model.layers.1.self_attn.sinks": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"sinks' has shape \(5,\), but .* has shape \(4,\)"):
        load(bad.items())
    missing = {k: v for k, v in sd.items() if k != "model.layers.2.self_attn.compressor.position_bias"}
    with pytest.raises(ValueError, match="missing 1 tensor.*compressor.position_bias"):
        load(missing.items())
    fp8 = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    q = dict(sd, **{"model.layers.0.self_attn.kv_proj.weight": fp8})
    with pytest.raises(ValueError, match="no scale tensor.*kv_proj.weight"):
        load(q.items())


# -- paged KV cache ------------------------------------------------------------------------------
class PagedHarness:
    """Caches and GroupMetadata built by hand, as the runner would: one group per spec
    group_key, consecutive blocks per sequence, sliding blocks that left the window replaced
    by the null block 0. Every cache starts as NaN, so reading anything unwritten shows."""

    def __init__(self, model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor], block_sizes: dict) -> None:
        self.model, self.seqs = model, seqs
        self.keys: list[tuple] = []
        for slot in model.kv_cache_layers():
            if slot.kv_spec.group_key not in self.keys:
                self.keys.append(slot.kv_spec.group_key)
        self.block_size = {k: block_sizes[k[0]] for k in self.keys}
        per_seq = max(len(s) for s in seqs) // min(block_sizes.values()) + 2
        for slot in model.kv_cache_layers():
            key, spec = slot.kv_spec.group_key, slot.kv_spec
            slot.group_id = self.keys.index(key)
            slot.kv_cache = torch.full((1 + per_seq * len(seqs), self.block_size[key], spec.num_tensors, 1,
                                        spec.head_size), float("nan"))
        self.tables = [[1 + b * per_seq + i for i in range(per_seq)] for b in range(len(seqs))]
        self.done = [0] * len(seqs)

    def release(self) -> None:
        for slot in self.model.kv_cache_layers():
            slot.kv_cache = slot.group_id = None

    def context(self, chunks: list[int]) -> tuple[torch.Tensor, ForwardContext]:
        ids, pos, starts, seq_lens = [], [], [0], []
        for b, c in enumerate(chunks):
            d = self.done[b]
            ids.append(self.seqs[b][d:d + c])
            pos += range(d, d + c)
            starts.append(starts[-1] + c)
            seq_lens.append(d + c)
        groups = []
        for kind, window, _ratio in self.keys:
            bs = self.block_size[(kind, window, _ratio)]
            rows, slots = [], []
            for b, c in enumerate(chunks):
                d, row = self.done[b], list(self.tables[b])
                if kind == "sliding":
                    for i in range(max(0, d - window + 1) // bs):
                        row[i] = 0
                    slots += [self.tables[b][p // bs] * bs + p % bs for p in range(d, d + c)]
                else:
                    slots += [-1] * c
                rows.append(row)
            groups.append(GroupMetadata(bs, torch.tensor(rows, dtype=torch.int32),
                                        torch.tensor(slots, dtype=torch.long)))
        return torch.cat(ids), ForwardContext(torch.tensor(pos), starts, seq_lens, groups)

    @torch.no_grad()
    def run(self, schedule: list[list[int]]) -> list[torch.Tensor]:
        """Runs steps of per-sequence chunk sizes; returns each sequence's logits [S, V]."""
        outs: list[list[torch.Tensor]] = [[] for _ in self.seqs]
        for chunks in schedule:
            ids, ctx = self.context(chunks)
            logits = self.model.compute_logits(self.model(ids, ctx)).split(chunks)
            for b, c in enumerate(chunks):
                outs[b].append(logits[b])
                self.done[b] += c
        return [torch.cat(o) for o in outs]


def random_schedule(lens: list[int], seed: int, sizes=(1, 1, 2, 3, 5, 9)) -> list[list[int]]:
    rng = random.Random(seed)
    done, schedule = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        chunks = [min(rng.choice(sizes), n - d) for d, n in zip(done, lens)]
        schedule.append(chunks)
        done = [d + c for d, c in zip(done, chunks)]
    return schedule


def test_chunked_prefill_and_decode_match_one_shot(hf_style):
    _, ours, _ = hf_style
    seqs = prompts(SEQ_LENS, HF_STYLE["vocab_size"], seed=11)
    one_shot = our_logits(ours, seqs)
    harness = PagedHarness(ours, seqs, {"sliding": 4, "compressed": 2})
    try:
        # Whole prompts through the cache, then the same with mixed chunks and decode steps.
        for b, got in enumerate(harness.run([list(SEQ_LENS)])):
            assert rel_err(got, one_shot[b]) <= RTOL, b
        harness.done = [0] * len(seqs)
        for b, got in enumerate(harness.run(random_schedule(SEQ_LENS, seed=3))):
            assert rel_err(got, one_shot[b]) <= RTOL, (b, rel_err(got, one_shot[b]))
    finally:
        harness.release()


def test_decode_matches_hf_cached_decode(hf_style):
    """Prefill 11 tokens then decode one at a time, against HF's DynamicCache decode."""
    ref, ours, _ = hf_style
    seq = prompts([36], HF_STYLE["vocab_size"], seed=12)[0]
    with torch.no_grad():
        cache = transformers.DynamicCache(config=ref.config)
        want = [ref(input_ids=seq[None, :11], past_key_values=cache, use_cache=True).logits[0]]
        for p in range(11, len(seq)):
            want.append(ref(input_ids=seq[None, p:p + 1], past_key_values=cache, use_cache=True).logits[0])
    harness = PagedHarness(ours, [seq], {"sliding": 8, "compressed": 4})
    try:
        got = harness.run([[11]] + [[1]] * (len(seq) - 11))[0]
    finally:
        harness.release()
    assert rel_err(got, torch.cat(want)) <= RTOL


def test_native_chunked_with_mtp_caches(native):
    """DeepSeek-style model (HCA at 128, separate state-window group) and its MTP layer
    through the paged caches in chunks."""
    _, ours, _, _ = native
    seqs = prompts([140], NATIVE["vocab_size"], seed=13)
    one_shot = our_logits(ours, seqs)[0]
    ctx = ForwardContext.no_cache([139], CPU)
    with torch.no_grad():
        streams = ours.forward_streams(seqs[0][:-1], ctx)
        mtp_one_shot = ours.compute_logits(ours.mtp_forward(streams, seqs[0][1:], ctx)[0])
    harness = PagedHarness(ours, seqs, {"sliding": 8, "compressed": 4})
    assert {k for k in harness.keys} == {("sliding", 16, 1), ("sliding", 128, 1), ("compressed", None, 4),
                                         ("compressed", None, 128)}
    try:
        got, mtp_got = [], []
        with torch.no_grad():
            for c in (61, 67, 3, 1, 7, 1):
                ids, ctx = harness.context([c])
                streams = ours.forward_streams(ids, ctx)
                got.append(ours.compute_logits(ours.head(streams)))
                d = harness.done[0]
                n = min(c, 139 - d)      # the last position has no next token for the MTP layer
                if n < c:
                    _, ctx = harness.context([n])
                if n:
                    hidden, _ = ours.mtp_forward(streams[:n], seqs[0][d + 1:d + 1 + n], ctx)
                    mtp_got.append(ours.compute_logits(hidden))
                harness.done[0] += c
    finally:
        harness.release()
    assert rel_err(torch.cat(got), one_shot) <= RTOL
    assert rel_err(torch.cat(mtp_got), mtp_one_shot) <= RTOL


def test_v4_flash_cache_specs():
    """The KV-cache layout of DeepSeek-V4-Flash (built on the meta device)."""
    flash = dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, qk_rope_head_dim=64,
                 rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    args = DeepseekV4Args.from_hf(flash)
    assert args.layer_types.count(CSA) == 21 and args.layer_types.count(HCA) == 20
    bytes_per_token: dict[str, dict[tuple, int]] = {}
    with torch.device("meta"):
        for layer_type in (SL, CSA, HCA):
            idx = args.layer_types.index(layer_type)
            attn = DeepseekV4Attention(args.attention_config(idx, torch.bfloat16))
            specs = [s.kv_spec for s in attn.cache_slots()]
            per: dict[tuple, int] = {}
            for s in specs:
                per[s.group_key] = per.get(s.group_key, 0) + s.entry_bytes // s.compress_ratio
            bytes_per_token[layer_type] = per
    window = ("sliding", 128, 1)
    assert bytes_per_token[SL] == {window: 1024}
    # CSA: window kv 1024 + compressor state 2*1024*2 + indexer state 2*256*2 (live for 128 tokens);
    # compressed entries 1024/4 + indexer keys 256/4 per token.
    assert bytes_per_token[CSA] == {window: 1024 + 4096 + 1024, ("compressed", None, 4): 256 + 64}
    assert bytes_per_token[HCA] == {window: 1024 + 2048, ("compressed", None, 128): 8}
