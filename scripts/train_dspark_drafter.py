"""Train a DSpark drafter for the embedded default model (deepinfer/assets/tiny-model) and
write it into that model in place, so that ``speculative_config={"method": "dspark"}`` runs a
trained drafter on it.

A development tool like make_tiny_model.py (whose corpus code it reuses): torch, tokenizers,
safetensors, no network. It

1. builds the corpus of make_tiny_model.py (stdlib docstrings plus ChatML question/answer
   pairs) and splits it by docstring text: the ~5% whose CRC-32 is 0 mod 20 are held out
   (with their chat pairs), the rest is the drafter's training text. (The *target* was
   trained on the whole corpus; held out means unseen by the drafter only.)
2. loads the embedded model frozen (``kv_cache_dtype="auto"``: the KV rounding the engine
   runs it with) and builds a :class:`DSparkDrafter` (models/dspark.py) with random
   initialisation and the config of :data:`DRAFTER_CONFIG`;
3. trains it with the paper's recipe (dspark.md §1): per step, windows of the training text
   go through one cache-free target forward (``ForwardContext.no_cache``) that captures the
   features of every row (``FeatureCapture``) and gives the target's next-token
   distributions p_t. Random anchors s are drawn in each window; the drafter's context is
   the ``context_kv`` rows of positions max(0, s-W+1)..s, its block ``[x_{s+1}, n, ..]`` sits
   at positions s+1.., and its draft distribution p_d for slot k (the token of position
   s+2+k) is compared with p_t there, the Markov bias teacher-forced with the true tokens:

       loss_k = 0.1 CE(p_d, x_{s+2+k}) + 0.9 ||p_d - p_t||_1 + BCE(sigmoid(l_k), c*_k),
       c*_k = 1 - ||p_d - p_t||_1 / 2 (no gradient),

   averaged over slots with the paper's position weights exp(-k/G) (k = 0..G-1; the
   DeepSpec config's decay constant is 4.0, which equals G = 4 here) and over anchors.
   AdamW, linear warm-up then cosine decay, gradients clipped to 1; the routers'
   selection biases balanced as make_tiny_model.py does (auxiliary-loss-free);
4. writes the ``mtp.*`` tensors (float32, DeepSeek's release names: ``main_proj``/
   ``main_norm`` in ``mtp.0``, ``norm``/``markov_head``/``confidence_head`` in the last
   stage) into model.safetensors next to the target's (unchanged; any earlier ``mtp.*``
   replaced) and the drafter's keys into config.json's ``text_config``, then checks that
   the target's tensors are bit-identical and its greedy output unchanged;
5. measures acceptance through the engine on held-out text (greedy, ``num_speculative_tokens``
   = the block size, one request at a time): per-position acceptance, tau (tokens committed
   per verification, the target's own included) and output tokens per engine step.

Deterministic (fixed seeds; the same Python, library versions and ``--threads`` give the same
drafter). At the defaults (1000 steps of 8 windows x 32 anchors, one thread) training takes
about 9 minutes (~0.5 s a step on a shared core), writing and evaluation under a minute.

Run:  python scripts/train_dspark_drafter.py [--steps N] [--lr LR] [--threads N] [--eval-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import make_tiny_model as tiny  # noqa: E402  (the corpus and the autograd GroupedLinear)

MODEL_DIR = REPO / "deepinfer" / "assets" / "tiny-model"
SEED = 0
# The token of the block's noise slots: '¡', the byte-level token of byte 0xA1. The BPE merges
# absorb that byte into every character it occurs in, so the token never occurs in the encoded
# corpus (checked at start): like the release's reserved 128799, it means nothing as text.
NOISE_TOKEN_ID = 97
# The drafter's text_config keys (dspark_module.md §1.1, V4.1 semantics): two stages, a block
# of 4, the streams entering the target's last three layers (4: ratio-1 KV source, 5: reindex,
# 6: reuse; the final layer's own output is not read, as in the release), Markov rank 32,
# 4 routed experts top-2 plus the shared one (the target has 8 top-2).
DRAFTER_CONFIG = {
    "num_nextn_predict_layers": 2,
    "dspark_block_size": 4,
    "dspark_noise_token_id": NOISE_TOKEN_ID,
    "dspark_target_layer_ids": [4, 5, 6],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}
# Loss weights (DeepSpec's loss.py) and the position-weight decay constant.
CE_WEIGHT, L1_WEIGHT, CONF_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0
HOLDOUT_MOD = 20
# Held-out evaluation: prompts of EVAL_PROMPT_TOKENS tokens, EVAL_NEW_TOKENS generated greedily.
EVAL_PROMPTS, EVAL_PROMPT_TOKENS, EVAL_NEW_TOKENS = 24, 24, 48
# Prompts whose greedy output must not change when the drafter is written.
CHECK_PROMPTS = ["The list type", "Return a new dictionary with keys from iterable and",
                 "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"]
CPU = torch.device("cpu")


# -- corpus ---------------------------------------------------------------------------------

def held_out(doc: str) -> bool:
    return zlib.crc32(doc.encode()) % HOLDOUT_MOD == 0


def corpus(tok) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """(the training token stream [N] int64, the held-out (qualified name, docstring) pairs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        docs = tiny.collect_docstrings()
    train = [(q, d) for q, d in docs if not held_out(d)]
    test = [(q, d) for q, d in docs if held_out(d)]
    stream = tiny.token_stream(tok, tiny.build_documents(train))
    if (stream == NOISE_TOKEN_ID).any():
        raise AssertionError(f"the noise token {NOISE_TOKEN_ID} occurs in the corpus: pick another")
    print(f"corpus: {len(train)} training docstrings ({stream.numel()} tokens), {len(test)} held out",
          flush=True)
    return stream, test


def eval_prompts(tok, test: list[tuple[str, str]]) -> list[list[int]]:
    """Held-out prompts: the first EVAL_PROMPT_TOKENS tokens of the longest held-out docstrings
    (half of them) and chat questions about held-out names (the other half)."""
    docs = sorted(test, key=lambda qd: (-len(qd[1]), qd[0]))
    plain = [tok.encode(d).ids[:EVAL_PROMPT_TOKENS] for _, d in docs[:EVAL_PROMPTS // 2]]
    chats = [tok.encode(f"{tiny.IM_START}user\nWhat does {q} do?{tiny.IM_END}\n{tiny.IM_START}assistant\n").ids
             for q, _ in docs[:EVAL_PROMPTS - len(plain)]]
    return plain + chats


# -- models ---------------------------------------------------------------------------------

def load_target():
    from deepinfer.config import ModelConfig
    from deepinfer.models.loader import load_model

    cfg = ModelConfig.from_path(MODEL_DIR, "float32", None, CPU, kv_cache_dtype="auto")
    target = load_model(cfg, CPU)
    target.requires_grad_(False)
    return target


def build_drafter(target):
    """A randomly initialised drafter on the target (make_tiny_model's initialisation: matrices
    N(0, 0.02), norm weights and mHC scales 1, sinks, mHC bases and routing biases 0)."""
    from deepinfer.models.dspark import DSparkConfig, DSparkDrafter

    cfg = DSparkConfig.from_target({**target.args.cfg, **DRAFTER_CONFIG}, len(target.model.layers))
    torch.manual_seed(SEED)
    drafter = DSparkDrafter(cfg, target.model.embed_tokens, target.lm_head, round_kv=True)
    tiny.init_v41_(drafter)
    return drafter


# -- training -------------------------------------------------------------------------------

def position_weights(g: int) -> torch.Tensor:
    """[G] the paper's exp(-(k-1)/decay) for slots k = 1..G."""
    return torch.exp(-torch.arange(g, dtype=torch.float32) / POSITION_DECAY)


def drafter_loss(target, drafter, x: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """x [N, L] training windows; anchors [N, A] positions s (s + G + 1 < L) -> (loss, stats).

    One cache-free target forward over the windows gives every row's features and p_t; the
    drafter drafts the block after each anchor from its window of context rows."""
    from deepinfer.forward_context import ForwardContext
    from deepinfer.models.deepseek_v41 import FeatureCapture
    from deepinfer.models.dspark import window_positions

    cfg = drafter.cfg
    n, seq = x.shape
    g, w = cfg.block_size, cfg.window
    rows = torch.arange(n * seq)
    with torch.no_grad():
        capture = FeatureCapture.new(cfg.target_layer_ids, rows, cfg.hidden_size, torch.float32)
        hidden = target(x.flatten(), ForwardContext.no_cache([seq] * n, CPU), capture=capture)
        p_target = target.compute_logits(hidden).float().softmax(-1).view(n, seq, -1)    # [N, L, V]
    positions = torch.arange(seq).repeat(n)                                             # [N*L]
    context = drafter.context_kv(capture.out, positions)                                # [S, N*L, D]
    seq_idx = torch.arange(n)[:, None].expand_as(anchors).flatten()                     # [B]
    s = anchors.flatten()                                                               # [B]
    pos, valid = window_positions(s, w)                                                 # [B, W]
    ctx_rows = context[:, seq_idx[:, None] * seq + pos]                                 # [S, B, W, D]
    hidden_d, base = drafter.block_states(x[seq_idx, s + 1], s + 1, ctx_rows, valid)  # [B, G, Hd], [B, G, V]
    span = s[:, None] + 1 + torch.arange(g)                                             # [B, G] s+1 .. s+G
    prev = x[seq_idx[:, None], span]                                                    # teacher forcing
    labels = x[seq_idx[:, None], span + 1]                                              # [B, G]
    p_t = p_target[seq_idx[:, None], span]                                              # [B, G, V]
    z, conf = drafter.markov_logits(base, hidden_d, prev)                               # [B, G, V], [B, G]
    logp = z.log_softmax(-1)
    ce = F.nll_loss(logp.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)   # [B, G]
    l1 = (logp.exp() - p_t).abs().sum(-1)                                               # [B, G]
    soft = (1 - 0.5 * l1).detach().clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf, soft, reduction="none")              # [B, G]
    weights = position_weights(g)
    per_slot = (CE_WEIGHT * ce + L1_WEIGHT * l1 + CONF_WEIGHT * bce).mean(0)            # [G]
    loss = (per_slot * weights).sum() / weights.sum()
    with torch.no_grad():
        # Greedy agreement with the target under teacher forcing, and the implied tau
        # (1 + sum over k of P(slots 0..k all agree)).
        agree = z.argmax(-1) == p_t.argmax(-1)                                          # [B, G]
        tau = 1 + agree.long().cumprod(1).float().mean(0).sum()
    return loss, {"ce": ce.mean().item(), "l1": l1.mean().item(), "bce": bce.mean().item(),
                  "agree": agree.float().mean(0).tolist(), "tau": tau.item()}


def train(target, drafter, stream: torch.Tensor, steps: int, windows: int, seq_len: int, anchors: int,
          lr: float) -> None:
    from deepinfer.layers.deepseek_v4_attention import GroupedLinear

    g = drafter.cfg.block_size
    routers = [stage.mlp.gate for stage in drafter.stages]
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: chosen.append(out[1])) for r in routers]
    opt, sched = tiny.optimizer(drafter, lr, steps)
    gen = torch.Generator().manual_seed(SEED)
    high = stream.numel() - seq_len
    grouped_forward, GroupedLinear.forward = GroupedLinear.forward, tiny._grouped_linear_autograd
    drafter.train()
    t0 = time.time()
    try:
        for step in range(steps):
            starts = torch.randint(0, high, (windows,), generator=gen)                      # [N]
            x = torch.stack([stream[i:i + seq_len] for i in starts.tolist()])               # [N, L]
            s = torch.stack([torch.randperm(seq_len - g - 1, generator=gen)[:anchors]
                             for _ in range(windows)])                                      # [N, A]
            chosen.clear()
            loss, stats = drafter_loss(target, drafter, x, s)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                dead = [name for name, p in drafter.named_parameters() if p.grad is None or not p.grad.any()]
                if dead:
                    raise RuntimeError(f"no gradient reaches {dead}")
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                for router, ids in zip(routers, chosen):
                    load = torch.bincount(ids.flatten(), minlength=router.weight.shape[0]).float()
                    router.e_score_correction_bias += tiny.BIAS_UPDATE_RATE * torch.sign(load.mean() - load)
            if step % 25 == 0 or step == steps - 1:
                agree = " ".join(f"{a:.2f}" for a in stats["agree"])
                print(f"step {step:5d}  loss {loss.item():.3f}  ce {stats['ce']:.3f}  l1 {stats['l1']:.3f}  "
                      f"bce {stats['bce']:.3f}  agree [{agree}]  tau(tf) {stats['tau']:.2f}  "
                      f"{time.time() - t0:6.1f}s", flush=True)
    finally:
        GroupedLinear.forward = grouped_forward
        for h in hooks:
            h.remove()
    drafter.eval()


# -- writing ----------------------------------------------------------------------------------

def release_tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's state dict under the checkpoint's ``mtp.*`` names: the inverse of
    DSparkDrafter.remap_weight_name (stacked experts split per expert into w1, w3, w2)."""
    from deepinfer.models.deepseek_v4 import BLOCK_RENAMES

    last = drafter.cfg.num_stages - 1
    top = {"main_proj.weight": "mtp.0.main_proj.weight", "main_norm.weight": "mtp.0.main_norm.weight",
           "norm.weight": f"mtp.{last}.norm.weight", "markov.embed": f"mtp.{last}.markov_head.embed.weight",
           "markov.head": f"mtp.{last}.markov_head.head.weight",
           "confidence.weight": f"mtp.{last}.confidence_head.proj.weight"}
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        t = t.detach().to(torch.float32).contiguous()
        if name in top:
            out[top[name]] = t
            continue
        _, i, rest = name.split(".", 2)                          # stages, i, the rest
        out.update(tiny.raw_block_tensors(f"mtp.{i}", rest, t, BLOCK_RENAMES))
    return out


def greedy_outputs(prompts: list[str]) -> list[list[int]]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=str(MODEL_DIR), device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def write(target, drafter) -> None:
    """The drafter's tensors into model.safetensors (the target's kept as they are) and its
    keys into config.json; checks the tensors round-trip through the loader's names and that
    the target is unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepinfer.models.dspark import DSparkDrafter

    tensors = release_tensors(drafter)
    check = DSparkDrafter(drafter.cfg, target.model.embed_tokens, target.lm_head, round_kv=True)
    check.load_weights(sorted(tensors.items()))
    theirs = check.state_dict()
    for name, t in drafter.state_dict().items():
        if not torch.equal(t, theirs[name]):
            raise AssertionError(f"{name} does not round-trip through the mtp.* names")

    before = greedy_outputs(CHECK_PROMPTS)
    path = MODEL_DIR / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")}
    old_size = path.stat().st_size
    save_file(dict(sorted({**kept, **tensors}.items())), str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)
    config_path = MODEL_DIR / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"].update(DRAFTER_CONFIG)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    with safe_open(str(path), "pt") as f:
        for k, t in kept.items():
            if not torch.equal(f.get_tensor(k), t):
                raise AssertionError(f"target tensor {k} changed")
    after = greedy_outputs(CHECK_PROMPTS)
    if after != before:
        raise AssertionError(f"the target's greedy output changed: {before} -> {after}")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {len(tensors)} mtp.* tensors ({size:,d} bytes of data) into {path.name}: "
          f"{old_size:,d} -> {path.stat().st_size:,d} bytes; target greedy output unchanged", flush=True)


# -- evaluation -------------------------------------------------------------------------------

def evaluate(prompts: list[list[int]], device: str = "cpu", profile: str | None = None) -> dict:
    """Greedy generation of each held-out prompt alone, with the drafter verifying a full
    block each step: per-position acceptance (P(slot k accepted) over verifications), tau, and
    output tokens per engine step (the prefill step included); then the same prompts without
    speculation on an engine of the same settings: per-user speed (output tokens / wall time of
    each request, alone) in both, measured in one run, and that the outputs are equal. With
    ``profile``, one more request of each engine runs under torch.profiler after its timed
    run: DSpark's to ``profile``, plain decode's to ``profile`` with ``.plain`` before the suffix."""
    import time

    from deepinfer import LLM, SamplingParams

    config = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]
    g = int(config["dspark_block_size"])
    params = SamplingParams(temperature=0.0, max_tokens=EVAL_NEW_TOKENS, ignore_eos=True)

    def run(llm: LLM) -> tuple[list[list[int]], int, float]:
        engine, outputs, steps = llm.engine, [], 0
        engine.add_request(prompts[0], params)            # warm-up (compilation, first-call costs)
        while engine.has_unfinished():
            engine.step()
        engine.scheduler.spec_stats.__init__()
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs.append(out.outputs[0].token_ids)
                steps += 1
        return outputs, steps, time.perf_counter() - start

    def profiled(llm: LLM, path: str | None) -> None:
        if path is None:
            return
        from deepinfer.bench.common import profile_to_file

        def one_request() -> None:
            llm.engine.add_request(prompts[1], params)
            while llm.engine.has_unfinished():
                llm.engine.step()
        profile_to_file(path, f"requests of {EVAL_NEW_TOKENS} tokens", 1, one_request)

    spec = LLM(model=str(MODEL_DIR), device=device,
               speculative_config={"method": "dspark", "num_speculative_tokens": g})
    spec_out, steps, spec_s = run(spec)
    stats = spec.engine.scheduler.spec_stats
    graph_steps = {"verify_graph_steps": spec.engine.runner.verify_graph_steps,
                   "drafter_graph_steps": spec.engine.runner.drafter_graph_steps}
    profiled(spec, profile)
    spec.close()        # frees its KV cache and graphs for the next engine
    with LLM(model=str(MODEL_DIR), device=device) as plain:
        plain_out, _, plain_s = run(plain)
        if profile is not None:
            path = Path(profile)
            profiled(plain, str(path.with_name(f"{path.stem}.plain{path.suffix}")))
    tokens = len(prompts) * EVAL_NEW_TOKENS
    per_pos = [a / stats.num_drafts for a in stats.accepted_per_pos] + [0.0] * (g - len(stats.accepted_per_pos))
    result = {"prompts": len(prompts), "new_tokens": EVAL_NEW_TOKENS, "device": device,
              "verifications": stats.num_drafts, "acceptance_rate": stats.acceptance_rate,
              "accepted_per_position": per_pos, "tau": stats.mean_committed, "tokens_per_step": tokens / steps,
              "per_user_tok_s": tokens / spec_s, "per_user_tok_s_without": tokens / plain_s,
              "outputs_equal": spec_out == plain_out, **graph_steps}
    print(f"held-out eval on {device} ({len(prompts)} prompts x {EVAL_NEW_TOKENS} tokens, greedy, each alone, "
          f"num_speculative_tokens={g}): tau {result['tau']:.3f}, acceptance {result['acceptance_rate']:.3f}, "
          f"per position [{' '.join(f'{a:.3f}' for a in per_pos)}], tokens/step {result['tokens_per_step']:.3f}; "
          f"per-user {result['per_user_tok_s']:.1f} tok/s with DSpark, {result['per_user_tok_s_without']:.1f} "
          f"without ({result['per_user_tok_s'] / result['per_user_tok_s_without']:.2f}x); outputs equal: "
          f"{result['outputs_equal']}; steps whose verification / drafter forward replayed a CUDA graph: "
          f"{graph_steps['verify_graph_steps']} / {graph_steps['drafter_graph_steps']} of {steps}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--windows", type=int, default=8, help="training windows per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=32, help="anchors per window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-only", action="store_true", help="only measure the written drafter")
    parser.add_argument("--eval-device", default="cpu", help="where the evaluation runs (cpu, cuda)")
    parser.add_argument("--eval-json", default=None, help="also write the evaluation as JSON to this path")
    parser.add_argument("--eval-profile", default=None,
                        help="profile one more request with DSpark (to this text file) and without (NAME.plain.EXT)")
    args = parser.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    stream, test = corpus(tok)
    prompts = eval_prompts(tok, test)
    if not args.eval_only:
        target = load_target()
        drafter = build_drafter(target)
        n_params = sum(p.numel() for p in drafter.parameters())
        print(f"drafter: {drafter.cfg.num_stages} stages, block {drafter.cfg.block_size}, "
              f"{n_params:,d} parameters", flush=True)
        train(target, drafter, stream, args.steps, args.windows, args.seq_len, args.anchors, args.lr)
        print(f"training took {time.time() - t0:.1f}s", flush=True)
        write(target, drafter)
    result = evaluate(prompts, args.eval_device, args.eval_profile)
    if args.eval_json:
        Path(args.eval_json).write_text(json.dumps(result, indent=2))
    print(f"wall time {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
