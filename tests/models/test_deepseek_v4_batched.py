"""DeepSeek-V4 attention batched over sequences, and CUDA-graph safe in decode.

- Mixed batches (decode rows, chunked-prefill rows, rows that complete no
  compressor window, an empty row) through the paged caches give the logits of
  each sequence run alone, and of the cache-free one-shot forward.
- A ``decode_only`` forward never waits for the device and never reads the
  context's host lists: every attention layer runs under a dispatch mode that
  fails on each op that makes the host read device data (``.item()``,
  ``.tolist()``, ``nonzero``, boolean-mask indexing, ``torch.tensor(host
  data)``, ...) and with unreadable host lists; the check is itself checked to
  catch each of those.
- On CUDA (``pytest -m gpu``): the layer's decode forward under
  ``torch.cuda.set_sync_debug_mode("error")``, and captured in a CUDA graph and
  replayed on other lengths, equals the eager forward.

Model: the tiny HF-style config of test_deepseek_v4 (window 8, CSA ratio 4 with
top-3 entries, HCA ratio 8), random weights, no HF model needed.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend
from deepinfer.layers.deepseek_v4_attention import DeepseekV4Attention, completing_tokens
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

from .test_deepseek_v4 import HF_STYLE, RTOL, PagedHarness, our_logits, prompts, randomize, rel_err

aten = torch.ops.aten
BLOCKS = {"sliding": 4, "compressed": 2}
RATIOS = tuple(HF_STYLE["compress_rates"].values())          # CSA 4, HCA 8


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    ours = DeepseekV4ForCausalLM(HF_STYLE, torch.float32).eval()
    randomize(ours, seed=21, num_experts=HF_STYLE["n_routed_experts"], top_k=HF_STYLE["num_experts_per_tok"])
    return ours


def run_paged(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor], schedule: list[list[int]],
              decode_only_max_len: int | None = None) -> list[torch.Tensor]:
    """Each sequence's logits [S, V] after running ``schedule`` through fresh paged caches.
    With ``decode_only_max_len``, steps of one token per sequence run as decode_only
    contexts padded to that max_seq_len, under :class:`attention_checked_for_syncs`."""
    harness = PagedHarness(model, seqs, BLOCKS)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    try:
        with torch.no_grad():
            for chunks in schedule:
                ids, ctx = harness.context(chunks)
                if decode_only_max_len is not None and all(c == 1 for c in chunks):
                    ctx.decode_only, ctx.max_seq_len = True, decode_only_max_len
                    with attention_checked_for_syncs():
                        hidden = model(ids, ctx)
                else:
                    hidden = model(ids, ctx)
                for b, logits in enumerate(model.compute_logits(hidden).split(chunks)):
                    outs[b].append(logits)
                    harness.done[b] += chunks[b]
    finally:
        harness.release()
    return [torch.cat(o) for o in outs]


# Lengths and steps: row 1 is a whole prompt then idle (empty rows), row 3 decodes
# throughout; step 3 gives row 2 positions 8..9, which complete no window of ratio 4 or 8.
MIXED_LENS = [30, 23, 17, 12]
MIXED_SCHEDULE = [[13, 23, 5, 1], [1, 0, 3, 1], [9, 0, 2, 1], [1, 0, 7, 1], [6, 0, 0, 8]]


def test_mixed_batches_match_each_sequence_alone(model):
    assert [sum(col) for col in zip(*MIXED_SCHEDULE)] == MIXED_LENS
    assert all((p + 1) % r for p in (8, 9) for r in RATIOS)
    seqs = prompts(MIXED_LENS, HF_STYLE["vocab_size"], seed=31)
    batched = run_paged(model, seqs, MIXED_SCHEDULE)
    one_shot = our_logits(model, seqs)
    for b, seq in enumerate(seqs):
        alone = run_paged(model, [seq], [[step[b]] for step in MIXED_SCHEDULE if step[b]])[0]
        assert rel_err(batched[b], alone) <= 1e-5, (b, rel_err(batched[b], alone))
        assert rel_err(batched[b], one_shot[b]) <= RTOL, (b, rel_err(batched[b], one_shot[b]))


def test_completing_tokens_from_host_lists():
    # Rows: seq 0 positions 5..13, seq 1 empty, seq 2 positions 0..2, seq 3 position 7.
    ctx = ForwardContext(positions=torch.tensor([*range(5, 14), 0, 1, 2, 7]),
                         query_start_loc=[0, 9, 9, 12, 13], seq_lens=[14, 4, 3, 8])
    for ratio, seqs, positions in ((4, [0, 0, 3], [7, 11, 7]), (8, [0, 3], [7, 7]), (16, [], [])):
        seq, pos = completing_tokens(ctx, ratio)
        assert (seq.tolist(), pos.tolist()) == (seqs, positions)
        assert seq.dtype == torch.int32 and pos.dtype == torch.int64
        # The same tokens as read from the device positions.
        rows = ((ctx.positions + 1) % ratio == 0).nonzero().flatten()
        assert torch.equal(seq, ctx.token_seq[rows]) and torch.equal(pos, ctx.positions[rows])
    assert completing_tokens(ctx, 4) is ctx.memo[("completing", 4)]      # shared by the forward's layers
    ctx.decode_only = True
    assert completing_tokens(ctx, 4) is None


# -- host syncs ------------------------------------------------------------------------------------
class GraphUnsafe(AssertionError):
    """A decode_only forward did something a CUDA graph cannot replay."""


class _HostList(list):
    """A host list of the context that a decode_only forward must not read."""

    def _refuse(self, *args):
        raise GraphUnsafe("a decode_only forward read a host list of the context "
                          "(query_start_loc / seq_lens): a replayed graph would keep the old values")

    __getitem__ = __iter__ = __len__ = _refuse


_BACKEND_ROPE_ATTENTION = backend.rope_attention


def triton_rope_attention(q, positions, inv_freq, scaling, eps, sources, sinks, scale, formats=None):
    """backend.rope_attention with the Triton rope kernels around the attention (what a CUDA
    run launches below the Gluon threshold)."""
    from deepinfer.kernels import deepseek_v4_rope
    q = deepseek_v4_rope.q_norm_rope(q, positions, inv_freq, scaling, eps)
    out = backend.sparse_attention(q, sources, sinks, scale, formats=formats)
    return deepseek_v4_rope.interleaved_rope_(out, positions, inv_freq, scaling, inverse=True)


class SyncDetector(TorchDispatchMode):
    """Fails on every op that makes the host wait for device data or copies host data to
    the device: on CUDA each would stall the CPU or break CUDA-graph capture."""

    FLAGGED = {
        aten._local_scalar_dense.default: ".item() / int() / bool() of a tensor",
        aten.nonzero.default: "nonzero",
        aten.masked_select.default: "masked_select",
        aten._unique2.default: "unique",
        aten.unique_dim.default: "unique",
        aten.unique_consecutive.default: "unique_consecutive",
        aten.equal.default: "torch.equal",
        aten.lift_fresh.default: "torch.tensor(host data)",
    }
    INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FLAGGED:
            raise GraphUnsafe(f"{func}: {self.FLAGGED[func]}")
        if func in self.INDEXING and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            raise GraphUnsafe(f"{func}: indexing with a boolean mask")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise GraphUnsafe("repeat_interleave without output_size")
        if (func is aten._to_copy.default and kwargs.get("device") is not None
                and torch.device(kwargs["device"]).type != args[0].device.type):
            raise GraphUnsafe(f"copy from {args[0].device} to {kwargs['device']}")
        if func is aten.copy_.default and args[0].device.type != args[1].device.type:
            raise GraphUnsafe(f"copy from {args[1].device} to {args[0].device}")
        return func(*args, **kwargs)


class attention_checked_for_syncs:
    """Runs every DeepseekV4Attention forward (only those: the reference MoE syncs by
    design) of a decode_only context under :class:`SyncDetector`, with ``Tensor.tolist`` /
    ``numpy`` (invisible to dispatch) failing there too and the context's host lists
    unreadable. The cache stores, the compressor's pooling and the fused norm/rope steps go
    to the Triton kernels, as in a captured CUDA graph (on the CPU in Triton's interpreter,
    which passes the detector): the reference store drops slots of -1 with a boolean mask, a sync."""

    def __enter__(self) -> "attention_checked_for_syncs":
        from deepinfer.kernels import deepseek_v4_rope
        from deepinfer.kernels.compressor import compress_entries_ as triton_compress_entries_
        from deepinfer.kernels.store_kv import store_kv as triton_store_kv

        self.mp = pytest.MonkeyPatch()
        real_forward = DeepseekV4Attention.forward
        inside = [False]

        def forward(layer, x, ctx, *args, **kwargs):
            assert ctx.decode_only
            host = ctx.query_start_loc, ctx.seq_lens
            ctx.query_start_loc, ctx.seq_lens = _HostList(host[0]), _HostList(host[1])
            inside[0] = True
            try:
                with SyncDetector():
                    return real_forward(layer, x, ctx, *args, **kwargs)
            finally:
                inside[0] = False
                ctx.query_start_loc, ctx.seq_lens = host

        def refuse(name):
            real = getattr(torch.Tensor, name)

            def method(self, *args, **kwargs):
                if inside[0]:
                    raise GraphUnsafe(f"Tensor.{name}")
                return real(self, *args, **kwargs)
            return method

        self.mp.setattr(DeepseekV4Attention, "forward", forward)
        self.mp.setattr(backend, "store_kv", triton_store_kv)
        self.mp.setattr(backend, "compress_entries_", triton_compress_entries_)
        self.mp.setattr(backend, "kv_norm_rope", deepseek_v4_rope.kv_norm_rope)
        if backend.rope_attention is _BACKEND_ROPE_ATTENTION:    # not a test's own wrapper
            self.mp.setattr(backend, "rope_attention", triton_rope_attention)
        for name in ("tolist", "numpy", "__array__"):
            self.mp.setattr(torch.Tensor, name, refuse(name))
        return self

    def __exit__(self, *exc) -> None:
        self.mp.undo()


# Prefill to these lengths, then 8 decode_only steps: some steps mix tokens that
# complete a window of ratio 4 and/or 8 with tokens that complete none, two complete none.
DECODE_PREFILL = [13, 15, 4, 20]
DECODE_STEPS = 8


def test_decode_only_forward_has_no_host_sync_and_matches(model):
    lens = [n + DECODE_STEPS for n in DECODE_PREFILL]
    seqs = prompts(lens, HF_STYLE["vocab_size"], seed=41)
    schedule = [list(DECODE_PREFILL)] + [[1] * len(lens)] * DECODE_STEPS
    # A max_seq_len above every length, as a CUDA graph captured for longer sequences has.
    got = run_paged(model, seqs, schedule, decode_only_max_len=max(lens) + 13)
    one_shot = our_logits(model, seqs)
    for b in range(len(seqs)):
        assert rel_err(got[b], one_shot[b]) <= RTOL, (b, rel_err(got[b], one_shot[b]))


SYNCS = {   # (q, ctx) -> a graph-unsafe read
    "item": lambda q, ctx: q.sum().item(),
    "bool": lambda q, ctx: bool(q.sum() > 0),
    "tolist": lambda q, ctx: q[0, 0].tolist(),
    "nonzero": lambda q, ctx: (q > 0).nonzero(),
    "mask": lambda q, ctx: q[q > 0],
    "host_tensor": lambda q, ctx: torch.tensor([1, 2], device=q.device),
    "unique": lambda q, ctx: q.round().unique(),
    "repeat_interleave": lambda q, ctx: torch.repeat_interleave(ctx.seq_lens_t),
    "host_list": lambda q, ctx: ctx.seq_lens[0],
}


@pytest.mark.parametrize("sync", sorted(SYNCS))
def test_sync_detector_catches_a_sync_in_the_layer(model, monkeypatch, sync):
    """A sync added to the layer's decode forward fails the check above."""
    real_forward, real_attention = DeepseekV4Attention.forward, backend.rope_attention
    step = {}

    def forward(layer, x, ctx, ropes):
        step["ctx"] = ctx
        return real_forward(layer, x, ctx, ropes)

    def rope_attention(q, *args):
        SYNCS[sync](q, step["ctx"])
        return real_attention(q, *args)

    monkeypatch.setattr(DeepseekV4Attention, "forward", forward)
    monkeypatch.setattr(backend, "rope_attention", rope_attention)
    seqs = prompts([6, 9], HF_STYLE["vocab_size"], seed=51)
    with pytest.raises(GraphUnsafe):
        run_paged(model, seqs, [[5, 8], [1, 1]], decode_only_max_len=16)


# -- CUDA -----------------------------------------------------------------------------------------
# DeepSeek-V4-Flash widths (as in test_deepseek_v4.test_v4_flash_cache_specs).
FLASH = dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, qk_rope_head_dim=64,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})


def _cuda_layer(layer_type: str, num_blocks: int, block_size: int):
    """(a bf16 layer of DeepSeek-V4-Flash widths with random weights and random paged caches,
    one group per spec group_key, its group keys, the ropes), built as the loader builds it."""
    from deepinfer.models.deepseek_v4 import DeepseekV4Args, DeepseekV4Rope

    args = DeepseekV4Args.from_hf(FLASH)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = DeepseekV4Attention(args.attention_config(args.layer_types.index(layer_type),
                                                              torch.bfloat16))
            ropes = DeepseekV4Rope(args).by_type()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, t in layer.named_parameters():
            if t.dim() >= 2:
                t.copy_(torch.randn_like(t) * t.shape[-1] ** -0.5)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn_like(t))
            else:
                t.copy_(torch.randn_like(t) * 0.5)
    keys: list[tuple] = []
    for slot in layer.cache_slots():
        spec = slot.kv_spec
        if spec.group_key not in keys:
            keys.append(spec.group_key)
        slot.group_id = keys.index(spec.group_key)
        slot.kv_cache = torch.randn(num_blocks, block_size, spec.num_tensors, 1, spec.head_size,
                                    device="cuda", dtype=torch.bfloat16)
    return layer, keys, ropes


def _decode_ctx(keys: list[tuple], lens: list[int], block_size: int, max_seq_len: int,
                num_blocks: int) -> ForwardContext:
    """A decode_only context: sequence b's new token at position lens[b] - 1; each sequence
    holds its own random blocks (the same ids in every group: the groups' caches differ)."""
    from deepinfer.forward_context import GroupMetadata

    b = len(lens)
    width = -(-max_seq_len // block_size)
    g = torch.Generator().manual_seed(sum(lens))
    tables = torch.randperm(num_blocks - 1, generator=g)[: b * width].view(b, width).int() + 1
    pos = torch.tensor(lens) - 1
    rows = torch.arange(b)
    groups = []
    for kind, _window, ratio in keys:
        if kind == "sliding":
            slots = tables[rows, pos // block_size].long() * block_size + pos % block_size
        else:
            e = ((pos + 1) // ratio - 1).clamp(min=0)
            slots = torch.where((pos + 1) % ratio == 0,
                                tables[rows, e // block_size].long() * block_size + e % block_size, -1)
        groups.append(GroupMetadata(block_size, tables.cuda(), slots.cuda()))
    return ForwardContext(positions=pos.cuda(), query_start_loc=list(range(b + 1)), seq_lens=list(lens),
                          groups=groups, max_seq_len=max_seq_len, decode_only=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"])
def test_cuda_decode_no_sync_and_graph_replay(layer_type):
    """Real widths on the GPU: the decode forward does not sync (sync debug mode "error"),
    and a CUDA graph captured on one batch replays other lengths as the eager forward runs
    them, output and every cache."""
    num_blocks, block_size, max_len, b = 1024, 64, 2048, 16
    layer, keys, ropes = _cuda_layer(layer_type, num_blocks, block_size)
    initial = {id(s): s.kv_cache.clone() for s in layer.cache_slots()}

    def reset_caches() -> None:
        for s in layer.cache_slots():
            s.kv_cache.copy_(initial[id(s)])

    def random_lens(seed: int) -> list[int]:
        lens = torch.randint(1, max_len + 1, (b,), generator=torch.Generator().manual_seed(seed)).tolist()
        lens[:3] = [128, 127, max_len]       # completes an HCA and a CSA window; completes none; longest
        return lens

    x = torch.randn(b, layer.q_a_proj.in_features, device="cuda", dtype=torch.bfloat16)
    ctx = _decode_ctx(keys, random_lens(1), block_size, max_len, num_blocks)
    with torch.no_grad():
        layer(x, ctx, ropes)                                          # compiles every kernel
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, ctx, ropes)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, ctx, ropes)
        for seed in (2, 3):
            new = _decode_ctx(keys, random_lens(seed), block_size, max_len, num_blocks)
            ctx.positions.copy_(new.positions)
            ctx.seq_lens_t.copy_(new.seq_lens_t)
            for g, n in zip(ctx.groups, new.groups):
                g.block_table.copy_(n.block_table)
                g.slot_mapping.copy_(n.slot_mapping)
            x.copy_(torch.randn_like(x))
            reset_caches()
            graph.replay()
            replayed = out.clone()
            replayed_caches = {id(s): s.kv_cache.clone() for s in layer.cache_slots()}
            reset_caches()
            eager = layer(x, new, ropes)
            torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
            for s in layer.cache_slots():
                assert torch.equal(replayed_caches[id(s)], s.kv_cache), (seed, s.kv_spec)
