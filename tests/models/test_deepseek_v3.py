"""DeepSeek-V3 vs HF transformers: MLA (low-rank and direct q, YaRN and plain rope,
interleaved and rotate-half), grouped sigmoid MoE with shared experts, dense first
layers, the paged latent cache (chunked prefill, decode, greedy generation), the
MTP module (vs HF's MtpModel) and FP8 checkpoints."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.layers.mlp import GatedMLP
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE, DeepseekV3MTP
from deepinfer.models.loader import iter_checkpoint
from tests.models.conftest import (CPU, GREEDY_TOKENS, LOGITS_RTOL, hf_greedy, hf_logits,
                                   load_ours, make_hf_model, our_logits, random_prompts, rel_err,
                                   save)

ARCH = "DeepseekV3ForCausalLM"
COMMON = dict(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
              n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
              v_head_dim=24, num_nextn_predict_layers=1)
CONFIGS = {
    # Low-rank q, YaRN with mscale != mscale_all_dim (both the cos/sin factor and
    # the softmax scale move), interleaved rope; prompts reach past the 32-token
    # pretraining length.
    "yarn": dict(COMMON, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                 num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=1.7, rope_interleave=True,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=32, mscale=1.0,
                                      mscale_all_dim=0.7, beta_fast=32, beta_slow=1)),
    # Direct q_proj, plain rope in rotate-half layout, attention biases, two shared
    # experts, unnormalised top-k, two dense layers.
    "q_direct": dict(COMMON, q_lora_rank=None, n_shared_experts=2, n_group=2, topk_group=1,
                     num_experts_per_tok=2, first_k_dense_replace=2, norm_topk_prob=False,
                     routed_scaling_factor=2.5, rope_interleave=False, attention_bias=True,
                     rope_parameters=dict(rope_type="default", rope_theta=5000.0)),
}
SEQ_LENS = [41, 9, 23]
BLOCK_SIZE = 4


def perturb_router_biases(model: torch.nn.Module, seed: int) -> None:
    """e_score_correction_bias is a buffer (make_hf_model only perturbs parameters);
    make it large enough to change which experts win."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)


def hf_mtp_model(hf_model):
    """HF's MTP drafter for ``hf_model`` (embedding and head shared with it), with random
    weights: MtpModel leaves some of its own uninitialised (the stacked experts), so
    every one is set here (norm weights around 1)."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(hf_model, 1).to(torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    perturb_router_biases(mtp.layers, seed=6)
    return mtp


def mtp_checkpoint_tensors(hf_model, mtp, num_layers: int) -> dict[str, torch.Tensor]:
    """HF's MTP module in DeepSeek's checkpoint names (``model.layers.{N}.*``, one
    tensor per expert), with the embedding and head it shares with the main model."""
    prefix = f"model.layers.{num_layers}."
    out = {prefix + "embed_tokens.weight": hf_model.model.embed_tokens.weight,
           prefix + "shared_head.head.weight": hf_model.lm_head.weight}
    for name, t in mtp.layers[0].state_dict().items():
        if name.startswith("post_norm."):
            out[prefix + "shared_head.norm." + name.split(".", 1)[1]] = t
        elif not name.startswith("mtp_block."):
            out[prefix + name] = t
        elif name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[prefix + f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[prefix + f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[prefix + f"mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name[len("mtp_block."):]] = t
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def add_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def v3(request, tmp_path_factory):
    """(name, hf_model, hf_mtp, our model, checkpoint path) with MTP tensors in the checkpoint."""
    hf_model = make_hf_model(ARCH, seed=3, **CONFIGS[request.param])
    perturb_router_biases(hf_model, seed=4)
    mtp = hf_mtp_model(hf_model)
    path = save(hf_model, tmp_path_factory.mktemp(request.param) / "ckpt")
    add_tensors(path, mtp_checkpoint_tensors(hf_model, mtp, hf_model.config.num_hidden_layers))
    return request.param, hf_model, mtp, load_ours(path), path


# -- a hand-built paged cache ------------------------------------------------------------------
class PagedCache:
    """One KV-cache group over ``layers``: random (never zero) cache contents, blocks handed
    out in shuffled order so sequences' blocks interleave, block 0 left as the null block."""

    def __init__(self, layers: list[torch.nn.Module], num_blocks: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for layer in layers:
            spec = layer.kv_spec
            assert (spec.kind, spec.num_kv_heads, spec.num_tensors) == ("full", 1, 1)
            layer.kv_cache = torch.randn(num_blocks, BLOCK_SIZE, 1, 1, spec.head_size, generator=g)
            layer.group_id = 0
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = []

    def context(self, chunks: list[tuple[int, int]]) -> ForwardContext:
        """Context for sequence b running tokens ``start .. start+n-1`` for each (start, n)."""
        while len(self.tables) < len(chunks):
            self.tables.append([])
        positions, slots, starts = [], [], [0]
        for b, (start, n) in enumerate(chunks):
            table = self.tables[b]
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free.pop())
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            starts.append(starts[-1] + n)
        width = max(len(t) for t in self.tables[:len(chunks)])
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables[:len(chunks)]],
                             dtype=torch.int32)
        meta = GroupMetadata(block_size=BLOCK_SIZE, block_table=table,
                             slot_mapping=torch.tensor(slots, dtype=torch.long))
        return ForwardContext(positions=torch.tensor(positions, dtype=torch.long),
                              query_start_loc=starts,
                              seq_lens=[s + n for s, n in chunks], groups=[meta])


def unbind(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        layer.kv_cache, layer.group_id = None, None


# -- tests ---------------------------------------------------------------------------------------
def test_structure(v3):
    name, hf_model, _, ours, _ = v3
    dense = CONFIGS[name]["first_k_dense_replace"]
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert kinds == [GatedMLP] * dense + [DeepseekV3MoE] * (3 - dense)
    layers = ours.kv_cache_layers()
    assert len(layers) == 3 and all(layer.kv_spec.head_size == 32 + 16 for layer in layers)
    assert isinstance(ours.mtp, DeepseekV3MTP) and len(ours.mtp.kv_cache_layers()) == 1
    assert ours.model.layers[0].self_attn.scale == hf_model.model.layers[0].self_attn.scaling


@torch.no_grad()
def test_logits_match_hf(v3):
    _, hf_model, _, ours, _ = v3
    prompts = random_prompts(SEQ_LENS, hf_model.config.vocab_size)
    refs = [hf_logits(hf_model, p) for p in prompts]
    single = our_logits(ours, prompts[:1])[0]
    assert rel_err(single, refs[0]) <= LOGITS_RTOL
    for b, (got, ref) in enumerate(zip(our_logits(ours, prompts), refs)):
        assert rel_err(got, ref) <= LOGITS_RTOL, f"sequence {b} (len {SEQ_LENS[b]})"


@torch.no_grad()
def test_router_bias_changes_the_output(v3):
    """The test would pass vacuously if e_score_correction_bias never changed a routing choice."""
    _, hf_model, _, ours, _ = v3
    prompt = random_prompts([SEQ_LENS[0]], hf_model.config.vocab_size)[0]
    ref = hf_logits(hf_model, prompt)
    biases = [m.gate.e_score_correction_bias for m in ours.modules() if isinstance(m, DeepseekV3MoE)]
    saved = [b.clone() for b in biases]
    try:
        for b in biases:
            b.zero_()
        assert rel_err(our_logits(ours, [prompt])[0], ref) > 1e-2
    finally:
        for b, s in zip(biases, saved):
            b.copy_(s)


@torch.no_grad()
def test_paged_chunked_prefill_and_decode_match_one_shot(v3):
    """Three sequences prefilled in uneven chunks (batched together), then the rest of
    their tokens one per step: every row's logits equal the one-shot no-cache forward."""
    _, hf_model, _, ours, _ = v3
    prompts = random_prompts(SEQ_LENS, hf_model.config.vocab_size, seed=2)
    one_shot = our_logits(ours, prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    cache = PagedCache(ours.kv_cache_layers())
    try:
        done = [0] * len(prompts)
        prefill_len = [30, 5, 14]
        chunk = [7, 5, 3]
        while True:       # chunked prefill; a sequence whose prefill is over runs 0 tokens
            steps = [(done[b], min(chunk[b], prefill_len[b] - done[b])) for b in range(len(prompts))]
            if not any(n for _, n in steps):
                break
            run(ours, prompts, steps, cache, got, done)
        while any(d < len(p) for d, p in zip(done, prompts)):
            steps = [(done[b], min(1, len(prompts[b]) - done[b])) for b in range(len(prompts))]
            run(ours, prompts, steps, cache, got, done)
    finally:
        unbind(ours.kv_cache_layers())
    for b, ref in enumerate(one_shot):
        assert rel_err(torch.cat(got[b]), ref) <= LOGITS_RTOL, f"sequence {b}"


def run(model, prompts, steps, cache: PagedCache, got, done) -> None:
    ids = torch.tensor([t for (s, n), p in zip(steps, prompts) for t in p[s:s + n]])
    logits = model.compute_logits(model(ids, cache.context(steps)))
    for b, rows in enumerate(logits.split([n for _, n in steps])):
        got[b].append(rows)
        done[b] += steps[b][1]


@torch.no_grad()
def test_paged_greedy_matches_hf_generate(v3):
    _, hf_model, _, ours, _ = v3
    prompt = random_prompts([13], hf_model.config.vocab_size, seed=3)[0]
    cache = PagedCache(ours.kv_cache_layers())
    tokens: list[int] = []
    try:
        ids, ctx = torch.tensor(prompt), cache.context([(0, len(prompt))])
        for _ in range(GREEDY_TOKENS):
            tokens.append(int(ours.compute_logits(ours(ids, ctx))[-1].argmax()))
            ids, ctx = torch.tensor(tokens[-1:]), cache.context([(len(prompt) + len(tokens) - 1, 1)])
    finally:
        unbind(ours.kv_cache_layers())
    assert tokens == hf_greedy(hf_model, prompt, GREEDY_TOKENS)


@torch.no_grad()
def test_mtp_matches_hf(v3):
    """Module 0 reads the main model's final hidden at token i and the embedding of
    token i+1, as HF's MtpModel.forward_layer does."""
    _, hf_model, hf_mtp, ours, _ = v3
    ids = random_prompts([SEQ_LENS[0] + 1], hf_model.config.vocab_size, seed=4)[0]
    main_ids, next_ids = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    n = len(main_ids)
    ctx = ForwardContext.no_cache([n], CPU)
    hidden = ours(main_ids, ctx)                                       # [n, H]
    ref_hidden = hf_model.model(main_ids[None]).last_hidden_state
    assert rel_err(hidden, ref_hidden[0]) <= LOGITS_RTOL

    got = ours.mtp.compute_logits(ours.mtp(next_ids, ctx, previous_hidden=hidden))
    ref_h = hf_mtp.forward_layer(0, ref_hidden, torch.arange(n)[None], None, input_ids=next_ids[None])
    ref = hf_mtp._project_to_logits(ref_h)[0].float()
    assert ref.std() > 0.1
    assert rel_err(got, ref) <= LOGITS_RTOL

    # The same through its own paged cache, in two chunks.
    cache = PagedCache(ours.mtp.kv_cache_layers(), seed=1)
    try:
        cut = 17
        parts = [ours.mtp.compute_logits(ours.mtp(next_ids[s:e], cache.context([(s, e - s)]),
                                                  previous_hidden=hidden[s:e]))
                 for s, e in ((0, cut), (cut, n))]
    finally:
        unbind(ours.mtp.kv_cache_layers())
    assert rel_err(torch.cat(parts), ref) <= LOGITS_RTOL


def test_checkpoint_without_mtp_loads(tmp_path):
    hf_model = make_hf_model(ARCH, seed=7, **CONFIGS["yarn"])
    perturb_router_biases(hf_model, seed=8)
    ours = load_ours(save(hf_model, tmp_path / "no_mtp"))
    assert ours.mtp is None
    prompt = random_prompts([SEQ_LENS[1]], hf_model.config.vocab_size)[0]
    assert rel_err(our_logits(ours, [prompt])[0], hf_logits(hf_model, prompt)) <= LOGITS_RTOL


def test_without_mtp_module_skips_mtp_tensors(v3):
    _, hf_model, _, ours, path = v3
    model = DeepseekV3ForCausalLM(json.loads((path / "config.json").read_text()), torch.float32,
                                  with_mtp=False)
    model.load_weights(iter_checkpoint(str(path)))
    assert model.mtp is None
    prompt = random_prompts([SEQ_LENS[1]], hf_model.config.vocab_size)[0]
    assert torch.equal(our_logits(model, [prompt])[0], our_logits(ours, [prompt])[0])


def test_partial_mtp_tensors_raise(v3):
    *_, path = v3
    tensors = dict(iter_checkpoint(str(path)))
    del tensors["model.layers.3.eh_proj.weight"]
    model = DeepseekV3ForCausalLM(json.loads((path / "config.json").read_text()), torch.float32)
    with pytest.raises(ValueError, match="eh_proj"):
        model.load_weights(tensors.items())


def fp8_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 as DeepSeek stores it: (fp8 weight, float32 scale_inv per tile)."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(gr * block, gc * block)
    padded[:rows, :cols] = w
    tiles = padded.view(gr, block, gc, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0     # [gr, gc]
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(gr * block, gc * block)[:rows, :cols].contiguous(), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * s


@torch.no_grad()
def test_fp8_checkpoint_matches_hf_on_dequantised_weights(v3, tmp_path):
    """Projection weights (main model and MTP) stored as FP8 with 16x16-tile
    ``weight_scale_inv`` load dequantised: our logits match HF running the
    dequantised weights."""
    name, hf_model, _, _, path = v3
    block = 16
    tensors = load_file(str(path / "model.safetensors"))
    out, dequantised = {}, {}
    for key, t in tensors.items():
        quantise = key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight")
        if quantise and t.dim() == 2:
            q, s = fp8_quantize(t, block)
            out[key], out[key[:-len("weight")] + "weight_scale_inv"] = q, s
            dequantised[key] = fp8_dequantize(q, s, block)
        else:
            out[key] = t
    assert any(".experts." in k for k in dequantised) and any(".layers.3." in k for k in dequantised)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    ckpt = tmp_path / "fp8"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    save_file(out, str(ckpt / "model.safetensors"), metadata={"format": "pt"})

    ours = DeepseekV3ForCausalLM(config, torch.float32)
    ours.load_weights(iter_checkpoint(str(ckpt)))
    mtp_eh = ours.mtp.layers[0].eh_proj.weight
    assert torch.equal(mtp_eh, dequantised["model.layers.3.eh_proj.weight"])

    # HF on the same dequantised weights, through a plain checkpoint.
    plain = tmp_path / "dequantised"
    plain.mkdir()
    (plain / "config.json").write_text((path / "config.json").read_text())
    save_file({**tensors, **dequantised}, str(plain / "model.safetensors"), metadata={"format": "pt"})
    hf_deq = type(hf_model).from_pretrained(plain, dtype=torch.float32).eval()
    prompt = random_prompts([SEQ_LENS[2]], hf_model.config.vocab_size)[0]
    ref = hf_logits(hf_deq, prompt)
    assert rel_err(our_logits(ours, [prompt])[0], ref) <= LOGITS_RTOL
    # The quantisation error is visible: the comparison is with the dequantised weights.
    assert rel_err(ref, hf_logits(hf_model, prompt)) > 10 * LOGITS_RTOL


@pytest.mark.parametrize("field,value,error", [
    ("topk_method", "greedy", NotImplementedError),
    ("scoring_func", "softmax", NotImplementedError),
    ("n_group", 3, ValueError),
    ("num_experts_per_tok", 5, ValueError),
])
def test_unsupported_config_raises(field, value, error):
    hf_config = {"architectures": [ARCH], "vocab_size": 32, "hidden_size": 16,
                 "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "max_position_embeddings": 64,
                 **CONFIGS["yarn"], field: value}
    with pytest.raises(error, match=field):
        DeepseekV3ForCausalLM(hf_config, torch.float32)


def test_v3_config_layout_rope_matches_hf():
    """DeepSeek-V3's own config.json layout (``rope_scaling`` with ``type``, top-level
    ``rope_theta``, no ``head_dim``): same YaRN frequencies, cos/sin factor and softmax
    scale as HF, at V3's real sizes."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                      yarn_apply_mscale)

    from deepinfer.layers.mla import MLAConfig, MLARotaryEmbedding

    for mscale_all_dim in (1.0, 0.707):
        cfg = {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                "mscale_all_dim": mscale_all_dim,
                                "original_max_position_embeddings": 4096, "type": "yarn"}}
        hf_config = DeepseekV3Config(**cfg)
        ref = DeepseekV3RotaryEmbedding(hf_config)
        mla = MLAConfig.from_hf(cfg)
        ours = MLARotaryEmbedding(mla.qk_rope_head_dim, mla.rope)
        assert torch.equal(ours.inv_freq, ref.inv_freq)
        assert ours.attention_scaling == ref.attention_scaling
        assert mla.scale == yarn_apply_mscale(hf_config.rope_parameters, 192 ** -0.5)
        assert mla.scale > 1.3 * 192 ** -0.5      # the mscale correction is really there
