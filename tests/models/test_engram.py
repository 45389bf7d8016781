"""DeepSeek-V4.1 Engram (layers/engram.py): the release hashing constants and hash vectors of
research/engram_v41.md, the tiny reference checkpoint's token map and hash ids (DeepSeek's own
reference code, tests/data/v41_reference), chunk invariance of the hashing, and the module
against an independent float32 transcription of the gate, random and with the checkpoint's
dequantised tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepinfer.layers.engram import Engram, EngramLayout, _is_prime, build_token_map, engram_hash_ids
from deepinfer.models.quant import dequant_engram_table, dequant_fp8_block

REF = Path(__file__).parents[1] / "data" / "v41_reference"
CKPT = REF / "checkpoint"

RELEASE = dict(layer_ids=[1, 14], vocab_base=16_000_000, n_heads=8, max_ngram=4,
               compressed_vocab_size=99092)
RELEASE_PRIMES = {
    1: [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
        16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
        16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
    14: [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
         16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
         16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889],
}
RELEASE_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


# -- helpers ---------------------------------------------------------------------------------------

def lookback(history: torch.Tensor, positions: torch.Tensor, max_ngram: int, pad: int) -> torch.Tensor:
    """[T, N] compressed ids at positions p, p-1, .., p-N+1 of a request's history (pad before 0)."""
    idx = positions[:, None] - torch.arange(max_ngram)[None, :]
    return torch.where(idx >= 0, history[idx.clamp(min=0)], pad)


def layer_tensors(layout: EngramLayout, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(layout.primes[i]), torch.from_numpy(layout.offsets[i]),
            torch.from_numpy(layout.multipliers[i]))


def hash_all(layout: EngramLayout, cids: torch.Tensor) -> torch.Tensor:
    """[T, n_layers, C] hash ids of every engram layer."""
    return torch.stack([engram_hash_ids(cids, *layer_tensors(layout, i))
                        for i in range(len(layout.layer_ids))], dim=1)


def text_config() -> dict:
    return json.loads((CKPT / "config.json").read_text())["text_config"]


def tiny_layout() -> EngramLayout:
    c = text_config()
    return EngramLayout.from_config(c["engram_layer_ids"], c["engram_vocab_size"], c["engram_n_heads"],
                                    c["engram_max_ngram_size"], c["engram_compressed_vocab_size"],
                                    c["engram_num_embeddings"])


def prompts() -> list[np.ndarray]:
    ref = np.load(REF / "expected.npz")
    ids, offsets = ref["prompt_ids"], ref["prompt_offsets"]
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture(scope="module")
def token_map() -> np.ndarray:
    return build_token_map(CKPT / "tokenizer.json")


@torch.no_grad()
def engram_fp32(streams: torch.Tensor, hash_ids: torch.Tensor, table: torch.Tensor, wkv: torch.Tensor,
                q: torch.Tensor, k: torch.Tensor, eps: float, kv_dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """§3.4-3.5 written token by token and stream by stream, as two RMS-normalised vectors'
    dot product, in float32 apart from kv, rounded to ``kv_dtype`` (the reference's bf16 GEMM
    output)."""
    t, n, d = streams.shape
    out = torch.empty(t, n, d)
    for i in range(t):
        kv = (wkv.float() @ table.float()[hash_ids[i]].reshape(-1)).to(kv_dtype).float()
        value = kv[n * d:]
        for s in range(n):
            h, key = streams[i, s].float(), kv[s * d:(s + 1) * d]
            hn = h / torch.sqrt((h * h).mean() + eps) * q[s].float()
            kn = key / torch.sqrt((key * key).mean() + eps) * k[s].float()
            dot = float((hn * kn).sum()) / d ** 0.5
            root = max(abs(dot), 1e-6) ** 0.5
            gate = 1 / (1 + np.exp(-(root if dot >= 0 else -root)))
            out[i, s] = h + gate * value
    return out


# -- 1. layout constants ---------------------------------------------------------------------------

def test_is_prime_matches_trial_division():
    def trial(n: int) -> bool:
        return n >= 2 and all(n % p for p in range(2, int(n ** 0.5) + 1))
    assert [n for n in range(5000) if _is_prime(n)] == [n for n in range(5000) if trial(n)]
    assert _is_prime(2 ** 61 - 1) and not _is_prime(3215031751)   # Mersenne prime; strong pseudoprime to 2,3,5,7


def test_release_layout_constants():
    layout = EngramLayout.from_config(**RELEASE, num_embeddings=[384006168, 384016682])
    assert layout.layer_ids == (1, 14) and layout.n_cols == 24
    assert layout.primes.tolist() == [RELEASE_PRIMES[1], RELEASE_PRIMES[14]]
    assert layout.num_embeddings == (384006168, 384016682)
    assert layout.offsets[0, :3].tolist() == [0, 16000057, 32000136]
    assert layout.offsets[0, -1] == 368005705
    for i in range(2):
        assert layout.offsets[i].tolist() == np.concatenate([[0], np.cumsum(layout.primes[i])[:-1]]).tolist()
    # Pinned: numpy does not promise its generator stream across versions.
    assert layout.multipliers.tolist() == [RELEASE_MULTIPLIERS[1], RELEASE_MULTIPLIERS[14]]
    assert layout.multipliers.dtype == np.int64


def test_num_embeddings_mismatch_is_named():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramLayout.from_config(**RELEASE, num_embeddings=[384006168, 384016683])


# -- 2. release hash vectors (§6 item 3) ----------------------------------------------------------

def test_release_hash_vectors():
    layout = EngramLayout.from_config(**RELEASE)
    cids = lookback(torch.tensor([0, 17, 99091, 5, 42]), torch.arange(5), 4, pad=2)
    ids = hash_all(layout, cids)                                                 # [5, 2, 24]
    assert ids[:, 0, [0, 8, 16]].tolist() == [
        [5702652, 131476717, 257520185],
        [15771438, 134548059, 267074741],
        [379248, 137943873, 261100116],
        [12391924, 137477310, 262553944],
        [11751002, 143663808, 263417579],
    ]
    assert ids[4, 1, [0, 8, 16]].tolist() == [13244839, 142496274, 268295962]
    assert ids[4, 0].tolist() == [
        11751002, 19154144, 47464265, 49947747, 69685187, 86934321, 111559629, 115407552,
        143663808, 145682533, 175801271, 182944799, 193082130, 212166078, 232310635, 250660910,
        263417579, 287389967, 300979060, 317278069, 328701211, 346671628, 355769107, 377528558]
    assert (ids < torch.tensor(layout.num_embeddings)[None, :, None]).all()


# -- 3. the tiny reference checkpoint -------------------------------------------------------------

def test_token_map_of_reference_tokenizer(token_map):
    assert token_map.dtype == np.int32 and token_map.shape == (text_config()["vocab_size"],)
    assert token_map.max() + 1 == len(np.unique(token_map)) == text_config()["engram_compressed_vocab_size"]
    assert token_map[2] == 2
    _, first = np.unique(token_map, return_index=True)
    assert (np.diff(first) > 0).all()             # ids handed out in first-seen order


def test_reference_hash_ids(token_map):
    layout = tiny_layout()
    c = text_config()
    pad = int(token_map[c["engram_pad_token_id"]])
    expected = torch.from_numpy(np.load(REF / "expected.npz")["hash_ids"])      # [T, 2, 6]
    got = []
    for ids in prompts():
        history = torch.from_numpy(token_map[ids]).long()
        got.append(hash_all(layout, lookback(history, torch.arange(len(ids)), layout.max_ngram, pad)))
    assert torch.equal(torch.cat(got), expected)


# -- 4. chunk invariance --------------------------------------------------------------------------

def test_hashing_is_chunk_invariant(token_map):
    layout = tiny_layout()
    ids = np.concatenate(prompts()[:3])
    history = torch.from_numpy(token_map[ids]).long()
    whole = hash_all(layout, lookback(history, torch.arange(len(ids)), layout.max_ngram, 2))
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        cuts = sorted(torch.randperm(len(ids) - 1, generator=g)[:6].add(1).tolist())
        chunks = []
        for s, e in zip([0, *cuts], [*cuts, len(ids)]):
            # Only the history up to the chunk's end exists when it runs.
            chunks.append(hash_all(layout, lookback(history[:e], torch.arange(s, e), layout.max_ngram, 2)))
        assert torch.equal(torch.cat(chunks), whole)
    decode = [hash_all(layout, lookback(history[:p + 1], torch.tensor([p]), layout.max_ngram, 2))
              for p in range(len(ids))]
    assert torch.equal(torch.cat(decode), whole)
    # A different token at p changes the hashes at p .. p+N-1 and nowhere else.
    p = 40
    other = history.clone()
    other[p] = (other[p] + 1) % int(token_map.max() + 1)
    changed = hash_all(layout, lookback(other, torch.arange(len(ids)), layout.max_ngram, 2)) != whole
    assert changed.any(-1).any(-1).nonzero().flatten().tolist() == list(range(p, p + layout.max_ngram))


# -- 5. the Engram module -------------------------------------------------------------------------

def random_engram(g: torch.Generator, dtype: torch.dtype = torch.float32, d: int = 64, n: int = 4,
                  heads: int = 2, head_dim: int = 32, rows: int = 660) -> Engram:
    module = Engram(d, n, 3, heads, head_dim, rows, eps=1e-20).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p is module.wkv.weight else 1.0) + 0.05)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_matches_fp32_transcription(dtype):
    g = torch.Generator().manual_seed(0)
    module = random_engram(g, dtype)
    t, n, d = 7, 4, 64
    streams = torch.randn(t, n, d, generator=g).to(dtype)
    hash_ids = torch.randint(0, 660, (t, 6), generator=g)
    with torch.no_grad():
        got = module(streams, module.lookup(hash_ids))
    assert got.dtype == dtype and got.shape == (t, n, d)
    want = engram_fp32(streams, hash_ids, module.embed.weight, module.wkv.weight, module.q_weight,
                       module.k_weight, 1e-20, kv_dtype=dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        # kv rounded alike on both sides; the module rounds its float32 result to bf16 once.
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()


def test_engram_reads_expanded_streams_and_zero_dot_gate():
    g = torch.Generator().manual_seed(1)
    module = random_engram(g)
    with torch.no_grad():
        module.q_weight[2].zero_()                # stream 2: dot = +0 -> gate sigmoid(1e-3)
    x = torch.randn(5, 64, generator=g)
    streams = x[:, None, :].expand(5, 4, 64)      # the first layer's stride-0 streams
    hash_ids = torch.randint(0, 660, (5, 6), generator=g)
    with torch.no_grad():
        got = module(streams, module.lookup(hash_ids))
        value = module.wkv(module.lookup(hash_ids))[:, 4 * 64:]
    assert torch.equal(streams, x[:, None, :].expand(5, 4, 64))
    large = value.abs() > 0.5                     # where the gate is well determined by (out - x) / value
    gate = ((got[:, 2] - x) / value)[large]
    torch.testing.assert_close(gate, torch.full_like(gate, 0.50025), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, engram_fp32(streams, hash_ids, module.embed.weight, module.wkv.weight,
                                                module.q_weight, module.k_weight, 1e-20), atol=1e-5, rtol=1e-5)


def checkpoint_tensors(prefix: str) -> dict[str, torch.Tensor]:
    with safe_open(str(CKPT / "model.safetensors"), framework="pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def test_dequant_engram_table():
    raw = checkpoint_tensors("layers.1.engram.")
    weight, scale = raw["embed.weight"], raw["embed.scale"]
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    exponent = scale.view(torch.uint8).long()                                    # [rows, cols/32]
    want = torch.empty(weight.shape)
    for r in range(weight.shape[0]):
        for j in range(weight.shape[1] // 32):
            want[r, j * 32:(j + 1) * 32] = weight[r, j * 32:(j + 1) * 32].float() * 2.0 ** (exponent[r, j] - 127)
    assert torch.equal(dequant_engram_table(weight, scale), want)
    assert torch.equal(dequant_engram_table(weight, scale.view(torch.uint8)), want)
    # Several groups a row: each scale covers its own 32 columns.
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(5, 96, generator=g) * 50).to(torch.float8_e4m3fn)
    e = torch.randint(110, 140, (5, 3), generator=g, dtype=torch.uint8)
    want = q.float() * torch.exp2(e.float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(dequant_engram_table(q, e), want)
    with pytest.raises(ValueError, match="scale of shape"):
        dequant_engram_table(q, e[:, :2])


def test_engram_with_reference_checkpoint_tensors(token_map):
    c = text_config()
    raw = checkpoint_tensors("layers.1.engram.")
    d, n = c["hidden_size"], c["hc_mult"]
    module = Engram(d, n, c["engram_max_ngram_size"] - 1, c["engram_n_heads"], c["engram_head_dim"],
                    c["engram_num_embeddings"][0], c["rms_norm_eps"])
    block = json.loads((CKPT / "config.json").read_text())["quantization_config"]["weight_block_size"][0]
    module.load_state_dict({
        "embed.weight": dequant_engram_table(raw["embed.weight"], raw["embed.scale"]),
        "wkv.weight": dequant_fp8_block(raw["wkv.weight"], raw["wkv.scale"], block),
        "q_weight": raw["q_weight"].float(),
        "k_weight": raw["k_weight"].float(),
    })
    hash_ids = torch.from_numpy(np.load(REF / "expected.npz")["hash_ids"][:43, 0])   # layer 1, prompt 0
    assert (hash_ids < c["engram_num_embeddings"][0]).all()
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(len(hash_ids), n, d, generator=g)
    with torch.no_grad():
        got = module(streams, module.lookup(hash_ids))
    want = engram_fp32(streams, hash_ids, module.embed.weight, module.wkv.weight, module.q_weight,
                       module.k_weight, c["rms_norm_eps"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, streams)
