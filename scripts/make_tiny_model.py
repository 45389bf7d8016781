"""Build the tiny trained models: the embedded default (deepinfer/assets/tiny-model/,
a DeepSeek-V4.1) and the DeepSeek-V4 test fixture (tests/data/tiny-v4-model/).

A development tool, not part of the package: it needs torch, tokenizers, transformers
(a test dependency; ``--arch deepseek_v4`` trains with it) and no network. It

1. collects a corpus from the docstrings of the Python standard library (the
   same text on every machine with the same Python; sorted, so deterministic),
2. trains a byte-level BPE tokenizer on it (~1000 tokens, with the ChatML
   special tokens <|endoftext|>, <|im_start|>, <|im_end|>),
3. trains a tiny model for a fixed number of steps with fixed seeds on plain
   docstrings plus ChatML question/answer pairs built from them, so greedy
   generation reads as English and chat replies end with <|im_end|>:

   ``--arch deepseek_v41`` (the default): our own DeepseekV41ForCausalLM
   (deepinfer/models/deepseek_v41.py) in training mode, over whole sequences
   without a KV cache (``ForwardContext.no_cache``), KV unrounded
   (``kv_cache_dtype="float32"``). Hidden 128, 7 layers covering every role:
   0 window only, 1 window only with an engram layer (2..4-grams, 2 hash heads,
   tables of ~6000 rows of 32), 2 ratio-2 KV source + indexer, 3 ratio-2 reuse,
   4 ratio-1 KV source + indexer + candidate source, 5 ratio-1 reindex, 6 ratio-1
   reuse; window 32, index_topk 8, 3 candidate blocks of 4; lagged mHC (4 streams);
   8 routed experts top-2 plus the shared one. The indexers' top-k passes no
   gradient, so they learn from an auxiliary loss as in DeepSeek's sparse
   attention (DSA): the KL divergence from the layer's attention distribution
   over all visible entries (detached) to the softmax of its indexer scores.
   ``--arch deepseek_v4``: HF transformers' DeepseekV4ForCausalLM (hidden 128,
   4 layers: sliding, CSA, HCA, CSA; hyper-connections; 8 routed experts top-2
   plus a shared one, the first layer hash-routed); CSA compresses every 4 tokens
   and its indexer keeps 8 entries, HCA compresses every 16 tokens,

4. writes the model with generation_config.json, tokenizer.json and
   tokenizer_config.json (with the chat template):

   deepseek_v41: the release layout, config.json an outer wrapper
   (``architectures``, ``model_type`` deepseek_v41, the special token ids) around
   ``text_config``, model.safetensors in float32 under DeepSeek's raw names
   (``embed.weight``, ``head.weight``, ``layers.1.engram.embed.weight``,
   ``layers.2.attn.wq_a.weight``, ``layers.3.ffn.experts.5.w1.weight``,
   ``layers.0.hc_attn_fn``, ...), which the loader maps itself;
   deepseek_v4: transformers' save_pretrained (config.json in the ``deepseek_v4``
   format; model.safetensors in float32 under the names transformers 5.23 saves,
   DeepSeek's own behind a ``model.`` prefix, e.g. ``model.layers.0.attn.wq_a.weight``),

5. loads the result back with ``LLM(model=out, device="cpu")`` and prints a greedy
   completion and a chat reply.

The sliding window is 32 tokens, so the engine's cache paths all run on short
prompts. The output is bit-for-bit reproducible for the same Python, library
versions and --threads (default: 1 for deepseek_v41, whose many small operations
lose more to a busy second core than they gain, 2 for deepseek_v4). About 10
minutes (deepseek_v41) or 5 minutes (deepseek_v4) on idle CPU cores.

Run:  python scripts/make_tiny_model.py [--arch deepseek_v41|deepseek_v4] [--out DIR]
                                        [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# This checkout's deepinfer (the V4.1 model trains with it), not another one installed.
sys.path.insert(0, str(REPO))

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
VOCAB_SIZE = 1000
SEED = 0

# ChatML; accepts OpenAI-style content lists (text parts are concatenated).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is defined %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Modules not imported for the corpus: side effects on import (a browser, a
# window, printed text), platform-only, or deprecated with noisy warnings.
_SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "ensurepip",
    "venv", "pydoc_data", "lib2to3", "test", "msilib", "winreg", "winsound", "msvcrt", "nt",
    "sre_compile", "sre_parse", "sre_constants", "crypt", "nis", "spwd", "ossaudiodev", "audioop",
    "cgi", "cgitb", "telnetlib", "chunk", "imghdr", "mailcap", "nntplib", "pipes", "sndhdr",
    "sunau", "uu", "xdrlib", "smtpd", "asynchat", "asyncore", "imp", "distutils",
}

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4,
    layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16}, sliding_window=32,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25,
    q_lora_rank=64, o_groups=2, o_lora_rank=32,
    index_n_heads=8, index_head_dim=32, index_topk=8,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=64,
    hc_mult=4, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    # HF transformers builds no MTP layer, so none is trained or saved.
    num_nextn_predict_layers=0,
)
# DeepSeek-V4.1 (text_config of the release layout). Layer roles (deepseek_v41.py layer_roles):
# 0 window only; 1 window only + engram; 2 ratio-2 KV source + indexer (key owner); 3 ratio-2
# reuse (layer 2's entries and selection); 4 ratio-1 KV source + indexer + candidate source;
# 5 ratio-1 reindex (layer 4's keys, inside its candidate blocks); 6 ratio-1 reuse (layer 5's
# selection). Candidate capacity (3 - 1) * 4 + 1 = 9 >= index_topk.
V41_CONFIG = dict(
    model_type="deepseek_v41_text", vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16,
    q_lora_rank=64, o_lora_rank=32, o_groups=2, hidden_act="silu", attention_bias=False,
    moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    gate_temp=1.0, swiglu_limit=10.0, rms_norm_eps=1e-6,
    max_position_embeddings=2048, rope_theta=10000.0, rope_scaling=None, compress_rope_theta=160000.0,
    sliding_window=32, compress_ratios=[0, 0, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 5],
    index_n_heads=8, index_head_dim=32, index_topk=8,
    candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=4,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    # Bucket primes from 1000 up: 3 orders x 2 heads, ~6000 table rows. engram_pad_token_id,
    # engram_compressed_vocab_size and engram_num_embeddings come from the tokenizer (v41_config).
    engram_layer_ids=[1], engram_max_ngram_size=4, engram_vocab_size=1000, engram_n_heads=2,
    engram_head_dim=32,
    # No MTP / DSpark drafter is trained here: scripts/train_dspark_drafter.py trains one on the
    # written model and adds it (run it again after this script).
    num_nextn_predict_layers=0,
)
# Weight of the indexers' distillation loss (KL to the attention distribution over entries).
INDEXER_LOSS_WEIGHT = 0.1
DISTILL_STRIDE = 4
INIT_STD = 0.02
# Speed of the auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): after each
# step a routed layer's bias on an overloaded expert goes down by this much, on an
# underloaded one up.
BIAS_UPDATE_RATE = 1e-3


def collect_docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) of stdlib modules, their public classes, functions
    and methods, in sorted order; only docstrings longer than 40 characters."""
    docs: list[tuple[str, str]] = []
    seen: set[int] = set()

    def add(qual: str, obj: object) -> None:
        if not isinstance(getattr(obj, "__doc__", None), str) or id(obj) in seen:
            return
        doc = inspect.cleandoc(obj.__doc__)
        if len(doc) > 40:
            seen.add(id(obj))
            docs.append((qual, doc))

    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _SKIP_MODULES:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # platform-specific or optional modules that are absent here
            continue
        add(name, module)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            add(f"{name}.{attr}", obj)
            if inspect.isclass(obj):
                for meth, m in sorted(vars(obj).items()):
                    if not meth.startswith("_") and (inspect.isfunction(m) or inspect.ismethoddescriptor(m)):
                        add(f"{name}.{attr}.{meth}", m)
    return docs


def first_paragraph(doc: str, limit: int = 400) -> str:
    para = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return para if len(para) <= limit else para[:limit].rsplit(" ", 1)[0] + " ..."


def build_documents(docs: list[tuple[str, str]]) -> list[str]:
    """Plain docstrings and ChatML question/answer pairs, shuffled with a fixed seed."""
    texts = [doc for _, doc in docs]
    chats = [f"{IM_START}user\nWhat does {qual} do?{IM_END}\n"
             f"{IM_START}assistant\n{first_paragraph(doc)}{IM_END}\n" for qual, doc in docs]
    out = texts + chats
    random.Random(SEED).shuffle(out)
    return out


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def eos_ids(tok) -> list[int]:
    return [tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)]


def token_stream(tok, documents: list[str]) -> torch.Tensor:
    """All documents encoded and joined by <|endoftext|>: [N] long."""
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(documents, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def hash_table(vocab: int, num_experts: int, top_k: int) -> torch.Tensor:
    """tid2eid for the hash-routed layers: top_k distinct experts per token id, [V, K] long."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(vocab)])


def optimizer(model: torch.nn.Module, lr: float, steps: int):
    """AdamW with a linear warm-up over the first 5% of ``steps``, then a cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    return opt, sched


def train_v4_model(tok, stream: torch.Tensor, steps: int, batch: int, seq_len: int, lr: float):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    torch.manual_seed(SEED)
    config = DeepseekV4Config(**MODEL_CONFIG, architectures=["DeepseekV4ForCausalLM"], bos_token_id=None,
                              eos_token_id=eos_ids(tok), pad_token_id=tok.token_to_id(ENDOFTEXT))
    # The grouped-matmul expert kernel is the same math as the default loop, faster on the CPU;
    # it is a runtime choice and is not saved in config.json.
    config._experts_implementation = "grouped_mm"
    model = DeepseekV4ForCausalLM(config).to(torch.float32)
    routers = [m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)]
    with torch.no_grad():
        table = hash_table(config.vocab_size, config.n_routed_experts, config.num_experts_per_tok)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                layer.mlp.gate.tid2eid.copy_(table)
    chosen: list[torch.Tensor] = []                 # each routed layer's expert ids of this step
    for router in routers:
        router.register_forward_hook(lambda _module, _args, out: chosen.append(out[2]))
    model.train()
    opt, sched = optimizer(model, lr, steps)
    gen = torch.Generator().manual_seed(SEED)
    n = stream.numel() - seq_len - 1
    t0 = time.time()
    for step in range(steps):
        starts = torch.randint(0, n, (batch,), generator=gen)                            # [B]
        x = torch.stack([stream[s:s + seq_len] for s in starts.tolist()])               # [B, S]
        chosen.clear()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for router, ids in zip(routers, chosen):
                load = torch.bincount(ids.flatten(), minlength=router.num_experts).float()   # [E]
                router.e_score_correction_bias += BIAS_UPDATE_RATE * torch.sign(load.mean() - load)
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    return model


def write_tokenizer_files(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        # Loads tokenizer.json as is (transformers' generic fast tokenizer).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_v4_model_files(model, tok, out: Path) -> None:
    # Tied embeddings: transformers stores the embedding once (no lm_head.weight).
    model.save_pretrained(out)
    os.chmod(out / "model.safetensors", 0o644)                 # safetensors creates it owner-only
    gen = {"eos_token_id": eos_ids(tok),
           "pad_token_id": tok.token_to_id(ENDOFTEXT), "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# -- DeepSeek-V4.1 ------------------------------------------------------------------------------

def v41_config(tok, tokenizer_json: Path) -> dict:
    """The text_config: V41_CONFIG plus the engram values the tokenizer decides (its
    compressed vocabulary, build_token_map) and the pad token engram hashes before a
    request's start."""
    from deepinfer.layers.engram import EngramLayout, build_token_map

    cfg = dict(V41_CONFIG)
    compressed = int(build_token_map(tokenizer_json).max()) + 1
    layout = EngramLayout.from_config(cfg["engram_layer_ids"], cfg["engram_vocab_size"], cfg["engram_n_heads"],
                                      cfg["engram_max_ngram_size"], compressed)
    cfg.update(engram_pad_token_id=tok.token_to_id(ENDOFTEXT), engram_compressed_vocab_size=compressed,
               engram_num_embeddings=list(layout.num_embeddings))
    return cfg


def release_config(tok, text_config: dict) -> dict:
    """config.json in the release layout: the outer wrapper around text_config."""
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "float32",
            "bos_token_id": None, "eos_token_id": eos_ids(tok), "pad_token_id": tok.token_to_id(ENDOFTEXT),
            "text_config": text_config}


@torch.no_grad()
def init_v41_(model) -> None:
    """HF-style initialisation (transformers' DeepseekV4 _init_weights), in state-dict order
    from the global seed: every tensor of two or more dimensions N(0, INIT_STD) (matrices,
    embeddings, experts, routers, mHC ``fn``, the engram table and its q/k weights); norm
    weights and mHC scales 1; attention sinks, mHC bases and routing biases 0."""
    for name, t in model.state_dict(keep_vars=True).items():
        if t.dim() >= 2:
            t.normal_(0.0, INIT_STD)
        elif "norm" in name or name.endswith("_hc.scale"):
            t.fill_(1.0)
        else:
            t.zero_()


def _grouped_linear_autograd(self, x: torch.Tensor) -> torch.Tensor:
    """GroupedLinear.forward without ``bmm(out=...)``, which autograd refuses; same math."""
    w = self.weight.view(self.groups, -1, x.shape[-1])                          # [g, out/g, in]
    return torch.einsum("tgi,goi->tgo", x, w)                                   # [T, g, out/g]


class IndexerDistillation:
    """DSA's indexer objective on every index layer, collected during a forward.

    The indexer's top-k passes no gradient to it, so (as DeepSeek-V3.2 trains its lightning
    indexer) each index layer adds ``KL(p || softmax(scores))`` per token: ``scores`` its
    indexer's scores over the visible entries, ``p`` the layer's own attention distribution
    over those entries (softmax per head of ``q . entry``, averaged over heads, no gradient).
    Hooks the two reference functions the layer calls in that order: ``indexer_scores``
    (pending scores) then ``sparse_attention`` (queries and the entry cache)."""

    def __init__(self) -> None:
        from deepinfer.kernels import backend, reference

        self.backend, self.reference = backend, reference
        self.orig_scores, self.orig_attention = reference.indexer_scores, backend.sparse_attention
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.losses: list[torch.Tensor] = []

    def __enter__(self) -> "IndexerDistillation":
        self.reference.indexer_scores = self._scores
        self.backend.sparse_attention = self._attention
        return self

    def __exit__(self, *exc) -> None:
        self.reference.indexer_scores = self.orig_scores
        self.backend.sparse_attention = self.orig_attention

    def _scores(self, q, weights, key_cache, slots, scale, key_format=None):
        scores = self.orig_scores(q, weights, key_cache, slots, scale, key_format)   # [T, N]
        self.pending = (scores, slots)
        return scores

    def _attention(self, q, sources, sinks, scale, formats=None):
        if self.pending is not None:
            scores, slots = self.pending
            self.pending = None
            entries = sources[1][0]                        # the entry cache: its slots are the keys'
            # Every DISTILL_STRIDE-th token with a visible entry (the gathers cost as much as
            # the attention itself).
            rows = torch.arange(0, slots.shape[0], DISTILL_STRIDE, device=slots.device)
            rows = rows[(slots[rows] >= 0).any(1)]                                 # [M]
            slots, scores = slots[rows], scores[rows]                              # [M, N]
            with torch.no_grad():
                ok, blk, off = self.reference._slot_rows(entries, slots)           # [M, N]
                kv = entries[blk, off, 0, 0].float()                               # [M, N, D]
                logits = torch.einsum("thd,tnd->thn", q[rows].float(), kv) * scale  # [M, H, N]
                target = logits.masked_fill(~ok[:, None], float("-inf")).softmax(-1).mean(1)
            logp = scores.log_softmax(-1)
            kl = torch.where(ok, target * (target.clamp_min(1e-12).log() - logp), 0.0).sum(-1)   # [M]
            self.losses.append(kl.mean() if kl.numel() else kl.sum())    # sum(): 0 when no token has one
        return self.orig_attention(q, sources, sinks, scale, formats)


def train_v41_model(tok, tokenizer_dir: Path, stream: torch.Tensor, steps: int, batch: int, seq_len: int,
                    lr: float):
    from deepinfer.config import flatten_text_config
    from deepinfer.forward_context import ForwardContext
    from deepinfer.layers.deepseek_v4_attention import GroupedLinear
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

    text_config = v41_config(tok, tokenizer_dir / "tokenizer.json")
    torch.manual_seed(SEED)
    model = DeepseekV41ForCausalLM(flatten_text_config(release_config(tok, text_config)), torch.float32,
                                   kv_cache_dtype="float32")
    init_v41_(model)
    model.load_assets(str(tokenizer_dir))                        # the engram token map
    routers = [layer.mlp.gate for layer in model.model.layers]
    chosen: list[torch.Tensor] = []                 # each routed layer's expert ids of this step
    for router in routers:
        router.register_forward_hook(lambda _module, _args, out: chosen.append(out[1]))
    model.train()
    opt, sched = optimizer(model, lr, steps)
    gen = torch.Generator().manual_seed(SEED)
    n = stream.numel() - seq_len - 1
    ctx_lens = [seq_len] * batch
    vocab = text_config["vocab_size"]
    grouped_forward, GroupedLinear.forward = GroupedLinear.forward, _grouped_linear_autograd
    t0 = time.time()
    try:
        with IndexerDistillation() as distill:
            for step in range(steps):
                starts = torch.randint(0, n, (batch,), generator=gen)                        # [B]
                x = torch.stack([stream[s:s + seq_len] for s in starts.tolist()])           # [B, S]
                chosen.clear()
                distill.losses.clear()
                hidden = model(x.flatten(), ForwardContext.no_cache(ctx_lens, x.device))     # [B*S, Hd]
                logits = model.compute_logits(hidden).view(batch, seq_len, vocab)
                lm_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                                            x[:, 1:].reshape(-1))
                index_loss = torch.stack(distill.losses).mean()
                loss = lm_loss + INDEXER_LOSS_WEIGHT * index_loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if step == 0:
                    dead = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
                    if dead:
                        raise RuntimeError(f"no gradient reaches {dead}")
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                with torch.no_grad():
                    for router, ids in zip(routers, chosen):
                        load = torch.bincount(ids.flatten(), minlength=router.weight.shape[0]).float()  # [E]
                        router.e_score_correction_bias += BIAS_UPDATE_RATE * torch.sign(load.mean() - load)
                if step % 25 == 0 or step == steps - 1:
                    print(f"step {step:5d}  loss {lm_loss.item():.3f}  indexer KL {index_loss.item():.3f}  "
                          f"{time.time() - t0:6.1f}s", flush=True)
    finally:
        GroupedLinear.forward = grouped_forward
    model.eval()
    return model, text_config


def release_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict under DeepSeek's raw names: the inverse of
    DeepseekV41ForCausalLM.remap_weight_name (stacked experts split per expert into w1, w3, w2)."""
    from deepinfer.models.deepseek_v41 import _LAYER_RENAMES, _TOP_RENAMES

    top = {ours: native for native, ours in _TOP_RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32).contiguous()
        if name in top:
            out[top[name]] = t
            continue
        parts = name.split(".", 3)                          # model, layers, L, the rest
        if parts[:2] != ["model", "layers"] or len(parts) < 4:
            raise ValueError(f"no DeepSeek name for {name!r}")
        out.update(raw_block_tensors(f"layers.{parts[2]}", parts[3], t, _LAYER_RENAMES))
    return out


def raw_block_tensors(raw: str, rest: str, t: torch.Tensor,
                      renames: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """One block tensor (our name ``rest`` inside a block, its tensor ``t``) under DeepSeek's
    raw names below ``raw`` (e.g. ``layers.3``, ``mtp.0``): stacked experts split per expert
    into w1, w3, w2; the rest renamed by ``renames`` ((native, ours) prefix pairs)."""
    if rest == "mlp.experts.gate_up_proj":
        inter = t.shape[1] // 2
        return {name: tensor for e in range(t.shape[0]) for name, tensor in
                ((f"{raw}.ffn.experts.{e}.w1.weight", t[e, :inter].clone()),
                 (f"{raw}.ffn.experts.{e}.w3.weight", t[e, inter:].clone()))}
    if rest == "mlp.experts.down_proj":
        return {f"{raw}.ffn.experts.{e}.w2.weight": t[e].clone() for e in range(t.shape[0])}
    for native, ours in renames:
        if rest == ours or rest.startswith(ours + "."):
            rest = native + rest[len(ours):]
            break
    return {f"{raw}.{rest}": t}


def write_v41_model_files(model, tok, text_config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

    tensors = release_tensors(model)
    # The loader must map every raw name back onto the same tensor: load into a fresh model.
    check = DeepseekV41ForCausalLM(model.hf_config, torch.float32, kv_cache_dtype="float32")
    check.load_weights(sorted(tensors.items()))
    theirs = check.state_dict()
    for name, t in model.state_dict().items():
        if not torch.equal(t, theirs[name]):
            raise AssertionError(f"{name} does not round-trip through the DeepSeek names")
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)                 # safetensors creates it owner-only
    (out / "config.json").write_text(json.dumps(release_config(tok, text_config), indent=2) + "\n")
    gen = {"eos_token_id": eos_ids(tok),
           "pad_token_id": tok.token_to_id(ENDOFTEXT), "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def sample(out: Path) -> None:
    """Load the written model with the engine and print a greedy completion and a chat reply."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=str(out), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompt = "The list type"
    print(f"sample: {prompt!r} -> {llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text!r}")
    chat = llm.chat([{"role": "user", "content": "What does json.dumps do?"}],
                    SamplingParams(temperature=0.0, max_tokens=120), use_tqdm=False)[0]
    ids = chat.outputs[0].token_ids
    last = llm.tokenizer.decode(ids[-1:], skip_special_tokens=False)
    print(f"chat: {chat.outputs[0].text!r} (ends with <|im_end|>: {last == IM_END})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("deepseek_v41", "deepseek_v4"), default="deepseek_v41")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: deepinfer/assets/tiny-model (deepseek_v41), "
                             "tests/data/tiny-v4-model (deepseek_v4)")
    parser.add_argument("--steps", type=int, default=None, help="default: 380 (deepseek_v41), 1000 (deepseek_v4)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=None, help="default: 1 (deepseek_v41), 2 (deepseek_v4)")
    args = parser.parse_args()
    v41 = args.arch == "deepseek_v41"
    out = args.out or REPO / ("deepinfer/assets/tiny-model" if v41 else "tests/data/tiny-v4-model")
    steps = args.steps or (380 if v41 else 1000)

    t0 = time.time()
    torch.set_num_threads(args.threads or (1 if v41 else 2))
    with warnings.catch_warnings():
        # Reading attributes of deprecated modules (typing.io, ...) warns; the text is all we want.
        warnings.simplefilter("ignore")
        docs = collect_docstrings()
    documents = build_documents(docs)
    print(f"corpus: {len(docs)} docstrings, {sum(len(d) for d in documents)} characters "
          f"in {len(documents)} documents", flush=True)
    tok = train_tokenizer(documents)
    stream = token_stream(tok, documents)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, corpus {stream.numel()} tokens", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(tok, out)
    if v41:
        model, text_config = train_v41_model(tok, out, stream, steps, args.batch, args.seq_len, args.lr)
        write_v41_model_files(model, tok, text_config, out)
    else:
        model = train_v4_model(tok, stream, steps, args.batch, args.seq_len, args.lr)
        write_v4_model_files(model, tok, out)
    for f in sorted(out.iterdir()):
        print(f"{f.name:24s} {f.stat().st_size:>10,d} bytes")
    print(f"wall time {time.time() - t0:.1f}s", flush=True)
    sample(out)


if __name__ == "__main__":
    main()
