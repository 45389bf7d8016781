"""The DSpark drafter (models/dspark.py) against DeepSeek's official V4.1 reference: the
tiny checkpoint of tests/data/v41_reference (2 stages, block 4, target layers [6, 7],
window 8) and the drafts, confidences and draft logits that code produced for it.

Reference convention (README there): for prompt + greedy_noquant, row j holds the target's
next token at s = P + j (the anchor, greedy[j + 1]) and the 4 drafts after it; the main
hidden states come from one full forward of prompt + greedy. Checked here: s is the last
position whose features are known, the anchor sits at s + 1, the context is positions
s - 7 .. s, the draft logits include the Markov bias, the confidence is the raw logit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v41 import FeatureCapture
from deepinfer.models.dspark import DraftSampling, DSparkConfig, DSparkDrafter, window_positions
from deepinfer.models.loader import load_model

DATA = Path(__file__).resolve().parent.parent / "data" / "v41_reference"
CKPT = DATA / "checkpoint"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "expected.npz"))


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.from_path(CKPT, "float32", None, CPU, kv_cache_dtype="float32")
    return load_model(cfg, CPU)


@pytest.fixture(scope="module")
def drafter(target) -> DSparkDrafter:
    return DSparkDrafter.from_target(target)


@pytest.fixture(scope="module")
def rows(expected, target, drafter) -> list[tuple[int, torch.Tensor]]:
    """Per prompt: (its length P, the context rows [S, P + 20, D] of prompt + greedy_noquant)
    from one full target forward capturing the features of every position."""
    ids, off = expected["prompt_ids"], expected["prompt_offsets"]
    out = []
    with torch.no_grad():
        for i in range(len(off) - 1):
            seq = ids[off[i]:off[i + 1]].tolist() + expected["greedy_noquant"][i].tolist()
            positions = torch.arange(len(seq))
            capture = FeatureCapture.new(drafter.cfg.target_layer_ids, positions, drafter.cfg.hidden_size,
                                         torch.float32)
            target(torch.tensor(seq), ForwardContext.no_cache([len(seq)], CPU), capture=capture)
            out.append((off[i + 1] - off[i], drafter.context_kv(capture.out, positions)))
    return out


def batch(expected, rows, window: int):
    """Every (prompt, row j) of the reference as one batch: anchors [N], their positions [N],
    context [S, N, W, D], valid [N, W], and the positions each context row holds [N, W]."""
    anchors, anchor_pos, contexts, valids, held = [], [], [], [], []
    for i, (p, ctx) in enumerate(rows):
        for j in range(expected["dspark_ids_noquant"].shape[1]):
            s = p + j
            pos, valid = window_positions(torch.tensor([s]), window)
            anchors.append(int(expected["dspark_ids_noquant"][i, j, 0]))
            anchor_pos.append(s + 1)
            contexts.append(ctx[:, pos[0]])
            valids.append(valid[0])
            held.append(pos[0])
    return (torch.tensor(anchors), torch.tensor(anchor_pos), torch.stack(contexts, 1), torch.stack(valids),
            torch.stack(held))


@torch.no_grad()
def test_drafts_match_the_official_reference(expected, rows, drafter):
    anchors, pos, context, valid, _ = batch(expected, rows, drafter.cfg.window)
    # The anchor is the target's greedy token after s = P + j.
    assert (anchors.view(8, -1)[:, :] == torch.as_tensor(expected["greedy_noquant"][:, 1:]).long()).all()
    got = drafter.propose(anchors, pos, context, valid)
    n_prompts, n_rows, g = expected["dspark_confidence_noquant"].shape
    tokens = got.tokens.view(n_prompts, n_rows, g).numpy()
    np.testing.assert_array_equal(tokens, expected["dspark_ids_noquant"][:, :, 1:])
    np.testing.assert_allclose(got.confidence_logits.view(n_prompts, n_rows, g).numpy(),
                               expected["dspark_confidence_noquant"], atol=2e-5, rtol=0)
    ref_logits = expected["dspark_logits_noquant"]
    logits = got.logits.view(n_prompts, n_rows, g, -1)[:, :ref_logits.shape[1]].numpy()
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=0)
    # Greedy drafts are each slot's argmax, drawn from a one-hot distribution.
    assert (got.tokens == got.logits.argmax(-1)).all()
    assert (got.probs.argmax(-1) == got.tokens).all() and (got.probs.sum(-1) == 1).all()


@torch.no_grad()
def test_the_window_is_respected(expected, rows, drafter):
    w = drafter.cfg.window
    anchors, pos, context, valid, held = batch(expected, rows, w)
    want = drafter.propose(anchors, pos, context, valid)
    # Rows marked invalid (positions before 0, in the short prompts) are never read.
    noisy = context.clone()
    noisy[:, ~valid] = 50 * torch.randn_like(noisy[:, ~valid])
    got = drafter.propose(anchors, pos, noisy, valid)
    assert (~valid).any()
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logits, want.logits)
    # Every stage's rows of positions before s - W + 1 leave the drafts unchanged: the
    # reference's window ends there. Swapping the oldest row of each full window for the
    # row of position s - W moves the logits (the swap is seen), and the reference's
    # logits then no longer match.
    full = valid.all(dim=1)
    shifted = context.clone()
    offset = 0
    for i, (p, ctx) in enumerate(rows):
        n = expected["dspark_ids_noquant"].shape[1]
        for j in range(n):
            k = offset + j
            if full[k]:
                shifted[:, k, 0] = ctx[:, held[k, 0] - 1]
        offset += n
    moved = drafter.propose(anchors, pos, shifted, valid)
    assert not torch.allclose(moved.logits[full], want.logits[full], atol=1e-3)
    with pytest.raises(ValueError, match="context must be"):
        drafter.propose(anchors, pos, torch.cat([context, context[:, :, :1]], dim=2),
                        torch.cat([valid, valid[:, :1]], dim=1))


@torch.no_grad()
def test_sampled_drafts_follow_their_distribution(expected, rows, drafter):
    anchors, pos, context, valid, _ = batch(expected, rows, drafter.cfg.window)
    n, g, v = anchors.shape[0], drafter.cfg.block_size, drafter.cfg.vocab_size
    greedy = torch.arange(n) % 3 == 0
    temperature = torch.where(greedy, 0.0, 0.7)
    noise = torch.empty(n, g, v).exponential_(generator=torch.Generator().manual_seed(0))
    sampling = DraftSampling(greedy=greedy, temperature=temperature, noise=noise)
    got = drafter.propose(anchors, pos, context, valid, sampling)
    want = drafter.propose(anchors, pos, context, valid)
    # Greedy rows are unaffected; sampled rows draw argmax(q / e) from q = softmax(z / T),
    # where z carries the Markov bias of the token actually drawn before.
    assert torch.equal(got.tokens[greedy], want.tokens[greedy])
    q = torch.softmax(got.logits[~greedy] / 0.7, dim=-1)
    torch.testing.assert_close(got.probs[~greedy], q)
    assert torch.equal(got.tokens[~greedy], (q / noise[~greedy]).argmax(-1))
    assert not torch.equal(got.tokens[~greedy], want.tokens[~greedy])
    # Same noise, same drafts; top-k 1 makes sampling greedy.
    assert torch.equal(drafter.propose(anchors, pos, context, valid, sampling).tokens, got.tokens)
    top1 = DraftSampling(greedy=greedy, temperature=temperature, noise=noise, min_p=torch.zeros(n),
                         top_k=torch.ones(n, dtype=torch.long), top_p=torch.ones(n))
    assert torch.equal(drafter.propose(anchors, pos, context, valid, top1).tokens, want.tokens)


def test_unknown_drafter_tensors_are_named(target):
    tensors = {**target.drafter_tensors, "mtp.0.attn.mystery.weight": torch.zeros(3)}
    cfg = DSparkConfig.from_target(target.args.cfg, len(target.model.layers))
    drafter = DSparkDrafter(cfg, target.model.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match=r"mtp\.0\.attn\.mystery\.weight"):
        drafter.load_weights(tensors.items())
    missing = {k: t for k, t in target.drafter_tensors.items() if "markov_head.head" not in k}
    with pytest.raises(ValueError, match=r"markov\.head"):
        DSparkDrafter(cfg, target.model.embed_tokens, target.lm_head).load_weights(missing.items())


@torch.no_grad()
def test_features_under_bounded_replay(expected, target, monkeypatch):
    # The engine's exact bounded replay runs layers 5-7 (after the last KV source) on each
    # prompt's last 24 tokens only: the last window's features equal a full forward's, and
    # a row the late layers skipped reads zeros (target layers 6 and 7 are both late).
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=str(CKPT), device="cpu", dtype="float32", kv_cache_dtype="float32",
              yoco_prefill_truncation_mode="exact")
    model = llm.engine.model
    layer_ids, w = (6, 7), 8
    captured = []
    forward_rows = model.forward_rows

    def capturing(input_ids, ctx, select, capture=None):
        if not ctx.decode_only and not captured:
            q = ctx.query_start_loc
            rows = torch.cat([torch.tensor([q[0]]), *(torch.arange(q[b + 1] - w, q[b + 1]) for b in range(len(q) - 1))])
            capture = FeatureCapture.new(layer_ids, rows, 64, torch.float32)
            captured.append((ctx.replay_starts, capture))
        return forward_rows(input_ids, ctx, select, capture)

    monkeypatch.setattr(model, "forward_rows", capturing)
    ids, off = expected["prompt_ids"], expected["prompt_offsets"]
    prompts = [ids[off[i]:off[i + 1]].tolist() for i in (0, 1)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    starts, capture = captured[0]
    assert starts == [len(p) - 24 for p in prompts]
    assert torch.equal(capture.out[0], torch.zeros(2 * 64))         # row 0 of prompt 0: not replayed
    got = capture.out[1:].view(2, w, -1)
    for b, prompt in enumerate(prompts):
        positions = torch.arange(len(prompt) - w, len(prompt))
        full = FeatureCapture.new(layer_ids, positions, 64, torch.float32)
        target(torch.tensor(prompt), ForwardContext.no_cache([len(prompt)], CPU), capture=full)
        torch.testing.assert_close(got[b], full.out, atol=1e-5, rtol=0)


@torch.no_grad()
def test_release_kv_rounding(expected, target, rows, drafter):
    # The release rounds context and block rows to MXFP8. Rounding flips make exact bounds
    # meaningless (README), so: the rows are on the grid, and most drafts stay the same.
    from deepinfer.kernels.reference import round_mxfp8

    rounded = DSparkDrafter(drafter.cfg, target.model.embed_tokens, target.lm_head, round_kv=True)
    rounded.load_weights(target.drafter_tensors.items())
    features = torch.randn(5, drafter.cfg.feature_size)
    ctx = rounded.context_kv(features, torch.arange(5))
    assert torch.equal(round_mxfp8(ctx), ctx)
    assert torch.equal(ctx, round_mxfp8(drafter.context_kv(features, torch.arange(5))))
    anchors, pos, context, valid, _ = batch(expected, rows, drafter.cfg.window)
    got = rounded.propose(anchors, pos, round_mxfp8(context), valid).tokens
    agree = (got.numpy() == expected["dspark_ids_noquant"][:, :, 1:].reshape(got.shape)).mean()
    assert agree > 0.9, agree


@torch.no_grad()
def test_triton_kernels_match_the_official_reference(expected, rows, drafter, monkeypatch):
    # The CUDA path's kernels (sparse attention over the ring and block rows, rope, kv norm,
    # hyper-connections, fused MoE, sampling filters) in Triton's CPU interpreter, on a few
    # rows: prompt 2's first two (a partly empty window) and prompt 0's last.
    anchors, pos, context, valid, _ = batch(expected, rows, drafter.cfg.window)
    picked = torch.tensor([2 * 19, 2 * 19 + 1, 18])
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    got = drafter.propose(anchors[picked], pos[picked], context[:, picked], valid[picked])
    want_ids = expected["dspark_ids_noquant"].reshape(-1, 5)[picked.numpy(), 1:]
    np.testing.assert_array_equal(got.tokens.numpy(), want_ids)
    np.testing.assert_allclose(got.confidence_logits.numpy(),
                               expected["dspark_confidence_noquant"].reshape(-1, 4)[picked.numpy()], atol=1e-4)
