"""A tiny DeepSeek-V4 checkpoint that ships a DSpark drafter as V4-Flash-0731 / V4-Flash-DSpark
do: tests/data/tiny-v4-model plus ``mtp.{0,1,2}.*`` tensors under their shipped names and
formats (FP8 e4m3 projections with float32 128 x 128 block scales, packed FP4 routed experts
with a scale per 32 inputs, the rest float32; the backbone stays float32), random values, and
the DSpark config keys (with ``num_nextn_predict_layers`` 1, as V4-Flash-0731's HF config says
for its 3 stages) and V4's ``quantization_config``.

The names and shapes are written from the shipped inventory (dspark_module.md §1.2), not from
the module, so a loader that expects other names or shapes fails here.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.models.quant import quant_fp4_e2m1, quant_fp8_block

TINY_V4 = Path(__file__).resolve().parent.parent / "data" / "tiny-v4-model"
STAGES = 3
BLOCK = 4
NOISE = 999
TARGET_LAYERS = [1, 2, 3]           # capture-after: the outputs of layers 1..3 (3 is the last)
RANK = 16

_FP8 = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
        ".attn.wo_b.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
        ".shared_experts.w3.weight", "main_proj.weight")


def dspark_config() -> dict:
    config = json.loads((TINY_V4 / "config.json").read_text())
    config.update(dspark_block_size=BLOCK, dspark_noise_token_id=NOISE, dspark_target_layer_ids=TARGET_LAYERS,
                  dspark_markov_rank=RANK, num_nextn_predict_layers=1,
                  quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"})
    return config


def shipped_shapes(config: dict, rank: int = RANK) -> dict[str, tuple[int, ...]]:
    """The V4 DSpark drafter's tensors (mtp.*) and their logical shapes for ``config``."""
    d, n = config["hidden_size"], config["hc_mult"]
    heads, hd, ql = config["num_attention_heads"], config["head_dim"], config["q_lora_rank"]
    groups, ol = config["o_groups"], config["o_lora_rank"]
    experts, inter, vocab = config["n_routed_experts"], config["moe_intermediate_size"], config["vocab_size"]
    mix = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(STAGES):
        p = f"mtp.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "attn.wq_a.weight": (ql, d), p + "attn.q_norm.weight": (ql,),
            p + "attn.wq_b.weight": (heads * hd, ql),
            p + "attn.wkv.weight": (hd, d), p + "attn.kv_norm.weight": (hd,),
            p + "attn.wo_a.weight": (groups * ol, heads * hd // groups), p + "attn.wo_b.weight": (d, groups * ol),
            p + "attn.attn_sink": (heads,),
            p + "ffn.gate.weight": (experts, d), p + "ffn.gate.bias": (experts,),
            p + "ffn.shared_experts.w1.weight": (inter, d), p + "ffn.shared_experts.w3.weight": (inter, d),
            p + "ffn.shared_experts.w2.weight": (d, inter),
        })
        for e in range(experts):
            shapes.update({p + f"ffn.experts.{e}.w1.weight": (inter, d), p + f"ffn.experts.{e}.w3.weight": (inter, d),
                           p + f"ffn.experts.{e}.w2.weight": (d, inter)})
        for hc in ("attn", "ffn"):
            shapes.update({p + f"hc_{hc}_fn": (mix, n * d), p + f"hc_{hc}_base": (mix,), p + f"hc_{hc}_scale": (3,)})
    last = f"mtp.{STAGES - 1}."
    shapes.update({
        "mtp.0.main_proj.weight": (d, len(TARGET_LAYERS) * d), "mtp.0.main_norm.weight": (d,),
        last + "norm.weight": (d,),
        last + "markov_head.markov_w1.weight": (vocab, rank), last + "markov_head.markov_w2.weight": (vocab, rank),
        last + "confidence_head.proj.weight": (1, d + rank),
        last + "hc_head_fn": (n, n * d), last + "hc_head_base": (n,), last + "hc_head_scale": (1,),
    })
    return shapes


def random_tensors(config: dict, seed: int = 0, rank: int = RANK) -> dict[str, torch.Tensor]:
    """Random float32 values of every shipped tensor (norm weights around 1, the rest small)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shipped_shapes(config, rank).items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith(("_scale", "_base")):
            t = 0.5 * t
        else:
            t = t / shape[-1] ** 0.5
        out[name] = t
    return out


def quantised(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As V4 ships them: FP8 projections (float32 128 x 128 block scales), FP4 routed experts."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(_FP8):
            out[name], out[name[:-len("weight")] + "scale"] = quant_fp8_block(t, (128, 128), "float32")
        elif ".ffn.experts." in name:
            out[name], out[name[:-len("weight")] + "scale"] = quant_fp4_e2m1(t, 32, "float32")
        else:
            out[name] = t
    return out


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor] | None = None,
                     config: dict | None = None, quantise: bool = True) -> Path:
    """tests/data/tiny-v4-model plus the drafter's ``tensors`` (random ones by default) in
    ``out``, with the DSpark config keys (``config`` replaces the whole config)."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in TINY_V4.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = dspark_config() if config is None else config
    tensors = random_tensors(config) if tensors is None else tensors
    backbone = load_file(TINY_V4 / "model.safetensors")
    save_file({**backbone, **(quantised(tensors) if quantise else tensors)}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_bigram_checkpoint(out: Path, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Path:
    """A drafter whose Markov head knows the target's bigrams: from (prompt, greedy output)
    pairs, each token's most frequent successor gets a bias of 30 (rank = vocabulary,
    ``markov_w1`` the identity, ``markov_w2`` the bias), the rest random. Its drafts are
    often, not always, right: verification accepts some and rejects others."""
    config = {**dspark_config(), "dspark_markov_rank": dspark_config()["vocab_size"]}
    vocab = config["vocab_size"]
    successors: dict[int, Counter] = {}
    for prompt, output in sequences:
        seq = list(prompt) + list(output)
        for a, b in zip(seq[len(prompt) - 1:], seq[len(prompt):]):
            successors.setdefault(a, Counter())[b] += 1
    bias = torch.zeros(vocab, vocab)
    for a, counts in successors.items():
        bias[counts.most_common(1)[0][0], a] = 30.0
    tensors = random_tensors(config, rank=vocab)
    last = f"mtp.{STAGES - 1}."
    tensors[last + "markov_head.markov_w1.weight"] = torch.eye(vocab)
    tensors[last + "markov_head.markov_w2.weight"] = bias
    return write_checkpoint(out, tensors, config)


PROMPTS = [{"prompt_token_ids": [(7 * i + 13 * j + 3) % 1000 for j in range(n)]}
           for i, n in enumerate([11, 29, 5, 40, 17])]
"""Five token-id prompts of different lengths for the V4 DSpark checkpoints' engine tests."""


def write_bigram_checkpoint_for(out: Path, prompts: Sequence[dict], max_tokens: Sequence[int]) -> Path:
    """A random checkpoint's greedy outputs on ``prompts`` (float32, on the CPU, ``max_tokens``
    each), then the checkpoint whose drafter knows those bigrams
    (:func:`write_bigram_checkpoint`), in ``out``/bigram."""
    from deepinfer import LLM, SamplingParams

    random = write_checkpoint(out / "random")
    base = LLM(model=str(random), device="cpu", dtype="float32")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = base.generate(list(prompts), params, use_tqdm=False)
    return write_bigram_checkpoint(out / "bigram", [(p["prompt_token_ids"], list(o.outputs[0].token_ids))
                                                    for p, o in zip(prompts, outs)])
