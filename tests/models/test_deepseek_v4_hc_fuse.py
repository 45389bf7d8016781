"""DeepSeek-V4 with the hyper-connections on the Triton kernels (the CPU interpreter here;
the model's other kernels, which the fusion does not touch, on the torch backend) and each hc_post
projecting its new streams for the connection that reads them next (the next layer's
attention connection, the head; ``kernels/hyper_connection.py`` ``hc_post_project``): the
logits and the MTP layer's output equal the unfused forward's, and every expand with a
reader after it takes the fused path.

The fusion starts at ``FUSE_POST_MIN_T`` tokens (257); the interpreter runs the whole model
too slowly at that size, so the test lowers the threshold under its 33 tokens (and runs 3
Sinkhorn iterations, 2 layers: sliding and CSA).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend
from deepinfer.kernels import hyper_connection as hc
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

from .test_deepseek_v4 import HF_STYLE, prompts, randomize, rel_err

CPU = torch.device("cpu")
CONFIG = dict(HF_STYLE, num_hidden_layers=2, layer_types=HF_STYLE["layer_types"][:2],
              mlp_layer_types=HF_STYLE["mlp_layer_types"][:2], hc_sinkhorn_iters=3)
# The projection sums the same products in another order: the mixings differ by float32 ulps.
RTOL = 1e-5


def hc_on_triton(monkeypatch) -> None:
    """The backend's hyper-connection functions on Triton, every other kernel on torch."""
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    for name in ("hc_pre", "hc_post", "hc_head"):
        def on_triton(*args, _real=getattr(backend, name), **kwargs):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
                return _real(*args, **kwargs)
        monkeypatch.setattr(backend, name, on_triton)


@torch.no_grad()
def test_fused_hc_post_projection_gives_the_unfused_forward(monkeypatch):
    model = DeepseekV4ForCausalLM(CONFIG, torch.float32).eval()
    randomize(model, 4, CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"])
    assert len(model.mtp) == 1
    seqs = prompts([20, 13], CONFIG["vocab_size"], seed=2)
    hc_on_triton(monkeypatch)
    calls = []
    project = hc.hc_post_project

    def counted(*args, **kwargs):
        calls.append(args[4].shape[0])                                  # next_fn's mixing rows
        return project(*args, **kwargs)

    monkeypatch.setattr(hc, "hc_post_project", counted)

    def run():
        # The model's forward as DeepseekV4ForCausalLM.forward runs it, keeping its streams for
        # the MTP layer (next ids: each sequence shifted by one, wrapping; any tokens will do).
        ctx = ForwardContext.no_cache([len(s) for s in seqs], CPU)
        streams, partials = model.model(torch.cat(seqs), ctx, head_fn=model.model.hc_head.hc_fn)
        logits = model.compute_logits(model.head(streams, partials))
        hidden, mtp_streams = model.mtp_forward(streams, torch.cat([s.roll(-1) for s in seqs]), ctx)
        return logits, hidden, mtp_streams

    monkeypatch.setattr(hc, "FUSE_POST_MIN_T", 10**9)
    want = run()
    assert calls == []
    monkeypatch.setattr(hc, "FUSE_POST_MIN_T", 32)
    got = run()
    n = CONFIG.get("hc_mult", 4)
    conn, head = (2 + n) * n, n
    # Each layer's two expands, the last one for the head; the MTP layer: its attention
    # expand (its streams come from h_proj, its last expand has no reader in the layer).
    assert calls == [conn, conn, conn, head, conn]
    for name, g, w in zip(("logits", "MTP hidden", "MTP streams"), got, want):
        assert rel_err(g, w) <= RTOL, (name, rel_err(g, w))
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))


def test_expand_projects_only_on_triton_from_the_threshold(monkeypatch):
    """expand returns partials only on the Triton backend, with a next fn, from
    FUSE_POST_MIN_T tokens on."""
    from deepinfer.layers.hyper_connection import HyperConnection
    n, d, t = 4, 64, hc.FUSE_POST_MIN_T
    conn = HyperConnection(n, d, 3, 1e-6, 1e-6)
    torch.nn.init.normal_(conn.fn, std=0.1)
    args = (torch.randn(t, d), torch.randn(t, n, d), torch.rand(t, n), torch.rand(t, n, n))
    short = tuple(a[:t - 1] for a in args)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    assert conn.expand(*args, next_fn=conn.fn)[1] is None
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    assert conn.expand(*short)[1] is None
    assert conn.expand(*short, next_fn=conn.fn)[1] is None
    monkeypatch.setattr(hc, "hc_post_project", lambda *a: (a[1], "partials"))   # the interpreter is slow at t
    assert conn.expand(*args, next_fn=conn.fn)[1] == "partials"
