"""A prompt's KV blocks exported by one engine and imported by another (prefill/decode
disaggregation, engine side): the importing engine's output equals a single engine's, token
for token and logprobs within 1e-5, on the embedded DeepSeek-V4.1 model, the tiny V4 and a
tiny Llama; the import serves every whole base block of the prompt; another model's export
is refused; no block leaks in any tier."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import kv_transfer
from deepinfer.entrypoints.cli import main
from deepinfer.scheduler.kv_tiers import TierIndex

from .. import TINY_V4_MODEL
from ..engine.conftest import make_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module", params=["v4.1", "v4", "llama"])
def model(request, tmp_path_factory):
    if request.param == "llama":
        return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM"))
    return None if request.param == "v4.1" else TINY_V4_MODEL


def llm_for(model: str | None, **kw) -> LLM:
    return LLM(**({"model": model} if model else {}), device="cpu", num_kv_blocks=64, **kw)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (150, 77)]


def assert_same(got, want) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for tok, lg, lw in zip(got.outputs[0].token_ids, got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert abs(lg[tok].logprob - lw[tok].logprob) <= 1e-5


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    if kv.tiers is not None:
        llm.engine.runner.kv_tiers.flush()
        assert set(llm.engine.runner.kv_tiers.host) == {e.slot for e in kv.tiers.host.values()}


def test_imported_prefix_gives_a_single_engines_output(model):
    single = llm_for(model, enable_prefix_caching=False)
    want = single.generate(prompts(), PARAMS, use_tqdm=False)

    prefill = llm_for(model)
    prefill.generate(prompts(), PREFILL, use_tqdm=False)
    export = kv_transfer.export_prompts(prefill.engine, prompts())
    step = prefill.engine.kv.hit_step
    assert export.num_tokens == [(len(p) - 1) // step * step for p in prompts()]
    blob = kv_transfer.encode(export)

    decode = llm_for(model, kv_offload_gib=0.01)
    result = kv_transfer.import_blocks(decode.engine, kv_transfer.decode(blob))
    assert result.imported == len(export.blocks) > 0 and result.skipped == 0
    got = decode.generate(prompts(), PARAMS, use_tqdm=False)
    for g, w, hit in zip(got, want, export.num_tokens):
        assert_same(g, w)
        assert g.num_cached_tokens == hit
    assert decode.engine.kv.tier_hits["host"] == sum(export.num_tokens)
    # A second import of the same blocks finds them held.
    again = kv_transfer.import_blocks(decode.engine, kv_transfer.decode(blob))
    assert again.imported == 0 and again.skipped == len(export.blocks)
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_export_of_another_model_is_refused(tmp_path):
    llama = str(make_checkpoint(tmp_path, "LlamaForCausalLM"))
    prefill = llm_for(llama)
    prefill.generate(prompts()[:1], PREFILL, use_tqdm=False)
    blob = kv_transfer.encode(kv_transfer.export_prompts(prefill.engine, prompts()[:1]))
    decode = llm_for(None, kv_offload_gib=0.01)
    with pytest.raises(ValueError, match="another model"):
        kv_transfer.import_blocks(decode.engine, kv_transfer.decode(blob))
    assert decode.engine.kv.tiers.host_used == 0
    no_tier = llm_for(llama)
    with pytest.raises(ValueError, match="needs a host tier"):
        kv_transfer.import_blocks(no_tier.engine, kv_transfer.decode(blob))


def test_malformed_exports_are_named():
    with pytest.raises(ValueError, match="bad magic"):
        kv_transfer.decode(b"nonsense")
    blob = kv_transfer.encode(kv_transfer.KVExport("f", [16], [kv_transfer.ExportedBlock(0, [b"k" * 32], b"x" * 8)]))
    with pytest.raises(ValueError, match="header describes"):
        kv_transfer.decode(blob[:-1])
    back = kv_transfer.decode(blob)
    assert back.blocks[0].data == b"x" * 8 and back.blocks[0].keys == [b"k" * 32] and back.num_tokens == [16]


def test_tier_index_takes_imports_like_evicted_blocks():
    index = TierIndex(host_bytes=200, disk_bytes=0, group_bytes=[100])
    first = index.imported(0, [b"a16", b"a32"])
    assert first is not None and index.lookup(b"a16") is index.lookup(b"a32") is first
    slot = first.slot
    assert index.imported(0, [b"a16", b"a32"]) is None          # held already
    index.imported(0, [b"b"])
    index.imported(0, [b"c"])                                   # over budget: the oldest goes
    assert not index.has(b"a32") and index.has(b"b") and index.has(b"c")
    ops = index.take_ops()
    assert [(op.kind, op.slot) for op in ops] == [("drop", slot)]   # no save: the bytes came with it
    assert index.host_used == 200 and index.stats.imported_blocks == 3
    assert TierIndex(host_bytes=50, disk_bytes=0, group_bytes=[100]).imported(0, [b"x"]) is None


@pytest.mark.parametrize("argv, message", [
    (["router", "--prefill", "http://127.0.0.1:1"], "needs both --prefill"),
    (["router", "--backend", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2", "--decode",
      "http://127.0.0.1:3"], "--backend with --prefill"),
    (["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"], "listed twice"),
    (["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--prefill-timeout", "0"],
     "prefill_timeout_s must be > 0"),
    (["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--prefill-min-len", "-1"],
     "prefill_min_len must be >= 0"),
    (["serve", "--role", "decode"], "--kv-offload-gib"),
    (["serve", "--role", "prefill", "--replicas", "2"], "--role and --replicas"),
])
def test_cli_refuses_bad_pd_settings(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
