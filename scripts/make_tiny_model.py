"""Build the embedded default model in deepinfer/assets/tiny-model/.

A development tool, not part of the package: it needs torch, tokenizers and
transformers (a test dependency) and no network. It

1. collects a corpus from the docstrings of the Python standard library (the
   same text on every machine with the same Python; sorted, so deterministic),
2. trains a byte-level BPE tokenizer on it (~1000 tokens, with the ChatML
   special tokens <|endoftext|>, <|im_start|>, <|im_end|>),
3. trains a tiny DeepSeek-V4 with HF transformers' DeepseekV4ForCausalLM
   (hidden 128, 4 layers: sliding, CSA, HCA, CSA; hyper-connections; 8 routed
   experts top-2 plus a shared one, the first layer hash-routed) for a fixed
   number of steps with fixed seeds on plain docstrings plus ChatML
   question/answer pairs built from them, so greedy generation reads as English
   and chat replies end with <|im_end|>,
4. writes the model with transformers' save_pretrained (config.json in the
   ``deepseek_v4`` format; model.safetensors in float32 under the names
   transformers 5.23 saves, which are DeepSeek's own behind a ``model.`` prefix,
   e.g. ``model.layers.0.attn.wq_a.weight``, ``model.layers.1.ffn.experts.3.w1.weight``,
   ``model.layers.1.hc_attn_fn``; the loader maps them like the HF names),
   generation_config.json, tokenizer.json and
   tokenizer_config.json (with the chat template).

The shapes are chosen so that the engine's cache paths all run on short
prompts: the sliding window is 32 tokens, CSA compresses every 4 tokens and its
indexer keeps 8 entries, HCA compresses every 16 tokens.

The output is bit-for-bit reproducible for the same Python, library versions
and --threads. About 5 minutes on 2 idle CPU cores.

Run:  python scripts/make_tiny_model.py [--out DIR] [--steps N] [--threads N]
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


def train_model(tok, stream: torch.Tensor, steps: int, batch: int, seq_len: int, lr: float):
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
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
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


def write_model_files(model, tok, out: Path) -> None:
    # Tied embeddings: transformers stores the embedding once (no lm_head.weight).
    model.save_pretrained(out)
    os.chmod(out / "model.safetensors", 0o644)                 # safetensors creates it owner-only
    gen = {"eos_token_id": eos_ids(tok),
           "pad_token_id": tok.token_to_id(ENDOFTEXT), "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent.parent / "deepinfer" / "assets" / "tiny-model")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
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
    model = train_model(tok, stream, args.steps, args.batch, args.seq_len, args.lr)

    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(tok, args.out)
    write_model_files(model, tok, args.out)
    for f in sorted(args.out.iterdir()):
        print(f"{f.name:24s} {f.stat().st_size:>10,d} bytes")
    print(f"wall time {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
