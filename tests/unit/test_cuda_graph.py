"""Decode CUDA graphs without a GPU: the options, the padded static inputs, and the padded
forward run eagerly (``enable_decode_graphs(capture=False)``) against the plain path.

The engine tests compare greedy tokens of the padded static-buffer path with the plain
path on the tiny trained DeepSeek-V4 of tests/data/tiny-v4-model (compressed groups), a tiny Llama (one full group)
and a tiny Qwen3 with sliding layers (two groups), through mixed prompt lengths, batch
sizes between buckets and sequences finishing mid-run. A padding or slot bug (a padding
row storing into a real block, a stale table entry, a wrong compressed slot) changes
tokens there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.config import SchedulerConfig, flatten_text_config
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.runner.cuda_graph import DecodeGraphs, max_blocks_per_seq
from deepinfer.runner.inputs import StepInputs, token_slot
from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.scheduler.plan import ScheduledSeq

from .. import TINY_V4_MODEL
from ..engine.conftest import make_checkpoint
from ..engine.test_deepseek_engine import v3_dir  # noqa: F401  (fixture)

CPU = torch.device("cpu")


# -- options ---------------------------------------------------------------------------
def test_default_buckets_follow_max_num_seqs():
    assert SchedulerConfig(max_num_seqs=64).graph_batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert SchedulerConfig(max_num_seqs=20).graph_batch_sizes == (1, 2, 4, 8, 16, 20)
    assert SchedulerConfig(max_num_seqs=3).graph_batch_sizes == (1, 2, 3)
    assert SchedulerConfig(max_num_seqs=1000).graph_batch_sizes[-2:] == (248, 256)
    assert SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=12).graph_batch_sizes == (1, 2, 4, 8, 12)


def test_explicit_buckets_are_sorted():
    cfg = SchedulerConfig(max_num_seqs=16, cuda_graph_sizes=[16, 1, 5])
    assert cfg.cuda_graph_sizes == (1, 5, 16)
    assert cfg.graph_batch_sizes == (1, 5, 16)


@pytest.mark.parametrize("sizes,match", [
    ([], "empty"),
    ([0, 4], "entry 0"),
    ([4, 65], "entry 65 exceeds max_num_seqs=64"),
    ([2.0], "entry 2.0"),
    ([True], "entry True"),
    ([4, 4], "twice"),
])
def test_bad_buckets_are_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(max_num_seqs=64, cuda_graph_sizes=sizes)


def test_llm_kwargs_reach_the_config():
    from deepinfer.entrypoints.cli import build_parser, engine_kwargs
    from deepinfer.entrypoints.llm import build_engine_config

    args = build_parser().parse_args(["generate", "--prompt", "x", "--enforce-eager",
                                      "--cuda-graph-sizes", "4", "1", "--device", "cpu"])
    cfg = build_engine_config(**engine_kwargs(args))
    assert cfg.enforce_eager and cfg.scheduler.cuda_graph_sizes == (1, 4)
    assert not build_engine_config(device="cpu").enforce_eager


# -- inputs and static buffers ---------------------------------------------------------------
def group(kind: str, block_size: int, ratio: int = 1) -> KVCacheGroup:
    return KVCacheGroup(kind=kind, layer_ids=(0,), specs=(), block_size=block_size,
                        sliding_window=8 if kind == "sliding" else None, compress_ratio=ratio)


def test_compressed_slots_go_to_the_completing_token():
    table = [7, 3]
    # Ratio 4, block size 2: tokens 3, 7, 11, 15 complete entries 0..3 (blocks 7, 7, 3, 3).
    slots = [token_slot(table, p, 2, 4) for p in range(16)]
    assert slots == [-1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1, 6, -1, -1, -1, 7]
    assert [token_slot(table, p, 2, 1) for p in (0, 1, 2, 3)] == [14, 15, 6, 7]


def test_max_blocks_per_seq():
    assert max_blocks_per_seq(group("full", 16), 100) == 7
    assert max_blocks_per_seq(group("sliding", 16), 100) == 7
    assert max_blocks_per_seq(group("compressed", 4, ratio=4), 100) == 7    # 25 entries
    assert max_blocks_per_seq(group("compressed", 4, ratio=128), 100) == 1


class _Echo(nn.Module):
    """Stands in for a model: hidden state = float(input id), so row order shows."""

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        return input_ids.float()[:, None]


def test_prepare_pads_to_the_bucket_and_clears_stale_rows():
    groups = [group("full", 4), group("compressed", 2, ratio=4)]
    graphs = DecodeGraphs(_Echo(), groups, sizes=[1, 2, 4], max_model_len=64, device=CPU, capture=False)
    views = graphs.buckets[4].views
    assert views["table0"].shape == (4, 16) and views["table1"].shape == (4, 8)

    def seq(tok: int, pos: int, full: list[int], comp: list[int]) -> ScheduledSeq:
        return ScheduledSeq(req_id=str(tok), token_ids=[tok], start_pos=pos, block_tables=[full, comp],
                            sample=True)

    # A wide step first, so the next one must overwrite its rows and columns.
    wide = [seq(5, 40, list(range(1, 12)), [9, 8, 7]), seq(6, 2, [3], []), seq(7, 9, [4, 5, 6], [2]),
            seq(8, 0, [2], [])]
    graphs.prepare(StepInputs.build(wide, groups))
    step = [seq(10, 11, [4, 5, 6], [2, 1]), seq(11, 3, [9], [3])]
    ids, ctx = graphs.prepare(StepInputs.build(step, groups))
    assert ids.tolist() == [10, 11]                          # bucket 2 holds both
    assert ctx.decode_only and ctx.max_seq_len == 64 and ctx.num_seqs == 2

    step = step[:1] + [seq(12, 0, [7], [])] + step[1:]        # three sequences: bucket 4
    ids, ctx = graphs.prepare(StepInputs.build(step, groups))
    assert ids.tolist() == [10, 12, 11, 0]
    assert ctx.positions.tolist() == [11, 0, 3, 0]
    assert ctx.seq_lens == [12, 1, 4, 1] and ctx.seq_lens_t.tolist() == [12, 1, 4, 1]
    assert ctx.query_start_loc == [0, 1, 2, 3, 4] and ctx.query_start_loc_t.tolist() == [0, 1, 2, 3, 4]
    assert ctx.token_seq.tolist() == [0, 1, 2, 3]
    full, comp = ctx.groups
    assert full.block_table.tolist() == [[4, 5, 6] + [0] * 13, [7] + [0] * 15, [9] + [0] * 15, [0] * 16]
    assert full.slot_mapping.tolist() == [6 * 4 + 3, 7 * 4 + 0, 9 * 4 + 3, -1]
    # Position 11 completes compressed entry 2 (block row [2, 1], block size 2: block 1, offset 0);
    # position 3 completes entry 0 (block 3); position 0 completes none; padding writes nothing.
    assert comp.block_table.tolist() == [[2, 1] + [0] * 6, [0] * 8, [3] + [0] * 7, [0] * 8]
    assert comp.slot_mapping.tolist() == [1 * 2 + 0, -1, 3 * 2 + 0, -1]
    assert graphs.holds(ids) and not graphs.holds(ids.clone())
    assert graphs.run(ids, ctx)[:, 0].tolist() == [10, 12, 11, 0]


class _Recorder(nn.Module):
    """Reads what a replay would see: the host lengths the forward is given, and a fresh output
    a step (a captured graph's output is the bucket's, overwritten by its next replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_lens: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        self.host_lens.append(list(ctx.seq_lens))
        return input_ids.float()[:, None], ctx.seq_lens_t.clone()


def test_without_capture_a_step_sees_what_a_replay_sees():
    """The eager padded path is the CPU's stand-in for a replay, so it gives the forward the
    capture's host context (lengths of 1; the actual lengths only on the device) and returns
    the bucket's held output, overwritten by the bucket's next step: a forward that read host
    lengths, or a caller that read a step's output after the next, fails here as on a GPU."""
    groups = [group("full", 4)]
    model = _Recorder()
    graphs = DecodeGraphs(model, groups, sizes=[2], max_model_len=32, device=CPU, capture=False)
    outs = []
    for tok, pos in ((3, 6), (4, 9)):
        seq = ScheduledSeq(req_id="a", token_ids=[tok], start_pos=pos, block_tables=[[1, 2, 3]], sample=True)
        ids, ctx = graphs.prepare(StepInputs.build([seq], groups))
        assert ctx.seq_lens == [pos + 1, 1]                    # the step's own context keeps them
        outs.append(graphs.run(ids, ctx))
        assert outs[-1][1].tolist() == [pos + 1, 1]          # on the device
    assert model.host_lens == [[1, 1], [1, 1]]
    assert all(a is b for a, b in zip(*outs))               # one held output, now the second step's
    assert outs[0][0][:, 0].tolist() == [4, 0]


def test_bucket_inputs_share_one_buffer_and_mirrors_alternate():
    """A bucket's inputs are typed views of one buffer that one copy fills; consecutive steps
    fill alternate host mirrors, and the buffer holds the latest step whichever was used."""
    groups = [group("full", 4), group("compressed", 2, ratio=4)]
    graphs = DecodeGraphs(_Echo(), groups, sizes=[2], max_model_len=32, device=CPU, capture=False)
    bucket = graphs.buckets[2]
    storage = bucket.buffer.untyped_storage().data_ptr()
    for name, view in bucket.views.items():
        assert view.untyped_storage().data_ptr() == storage and view.is_contiguous(), name
    assert bucket.views["slots1"].dtype == torch.long and bucket.views["table1"].dtype == torch.int32
    mirrors = []
    for tok in (3, 4, 5):
        mirrors.append(id(bucket.host()))
        seq = ScheduledSeq(req_id="a", token_ids=[tok], start_pos=tok - 3, block_tables=[[tok], []],
                           sample=True)                  # positions 0-2 complete no compressed entry
        ids, ctx = graphs.prepare(StepInputs.build([seq], groups))
        assert ids.tolist() == [tok, 0] and ctx.positions.tolist() == [tok - 3, 0]
        assert ctx.groups[0].block_table[0, :2].tolist() == [tok, 0]
    assert mirrors[0] != mirrors[1] and mirrors[0] == mirrors[2]


def test_prepare_refuses_what_no_bucket_holds():
    groups = [group("full", 4)]
    graphs = DecodeGraphs(_Echo(), groups, sizes=[2], max_model_len=8, device=CPU, capture=False)
    one = ScheduledSeq(req_id="a", token_ids=[1], start_pos=0, block_tables=[[1]], sample=True)
    assert graphs.bucket_for(3) is None
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 2"):
        graphs.prepare(StepInputs.build([one] * 3, groups))
    chunk = ScheduledSeq(req_id="a", token_ids=[1, 2], start_pos=0, block_tables=[[1]], sample=True)
    with pytest.raises(ValueError, match="decode-only"):
        graphs.prepare(StepInputs.build([chunk], groups))
    too_wide = ScheduledSeq(req_id="a", token_ids=[1], start_pos=0, block_tables=[[1, 2, 3]], sample=True)
    with pytest.raises(ValueError, match="exceeds the 2 that max_model_len=8 allows"):
        graphs.prepare(StepInputs.build([too_wide], groups))


# -- the padded forward through the engine ---------------------------------------------------
def _prompts(model: str | None) -> list[list[int]]:
    config = flatten_text_config(json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text()))
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (21, 3, 9, 14, 6)]


# Different lengths: the batch shrinks 5 -> 4 -> ... as sequences finish mid-run, through
# sizes that are not buckets (5 and 3 pad to 8 and 4).
MAX_TOKENS = [7, 3, 11, 5, 9]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _padded_vs_plain(model: str) -> None:
    kwargs = dict(model=model, device="cpu", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  max_num_batched_tokens=64, block_size=4, num_kv_blocks=200)
    prompts = _prompts(model)
    plain = LLM(**kwargs)
    assert plain.engine.runner.decode_graphs is None            # CPU: no graphs by default
    expected = _generate(plain, prompts)
    del plain

    padded = LLM(**kwargs)
    runner = padded.engine.runner
    runner.enable_decode_graphs(capture=False)
    sizes: list[int] = []
    run = runner.decode_graphs.run

    def counting_run(input_ids, ctx):
        sizes.append(input_ids.shape[0])
        return run(input_ids, ctx)

    runner.decode_graphs.run = counting_run
    assert _generate(padded, prompts) == expected
    assert {8, 4, 2}.issubset(sizes), sizes                  # padded batches of 5, 3 and 2 ran
    assert set(sizes) <= {1, 2, 4, 8}
    kv = padded.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_padded_decode_matches_plain_on_the_tiny_deepseek_v4():
    _padded_vs_plain(TINY_V4_MODEL)


def test_padded_decode_matches_plain_on_deepseek_v3(v3_dir):
    """DeepSeek-V3's decode steps (absorbed MLA over device seq_lens) through the graphs'
    padded static inputs: padding rows (length 1, null block table) change nothing."""
    _padded_vs_plain(str(v3_dir))


@pytest.mark.slow        # ~32 s
def test_padded_decode_matches_plain_on_deepseek_v41():
    """DeepSeek-V4.1's decode steps (pair pooling for every row, shared-source selections,
    engram history) through the padded static inputs."""
    _padded_vs_plain(str(Path(__file__).resolve().parent.parent / "data" / "v41_reference" / "checkpoint"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hybrid"), "Qwen3ForCausalLM", num_hidden_layers=3,
                           use_sliding_window=True, max_window_layers=1, sliding_window=8, head_dim=16)


def test_padded_decode_matches_plain_on_llama(llama_dir):
    _padded_vs_plain(str(llama_dir))


def test_padded_decode_matches_plain_with_sliding_layers(hybrid_dir):
    _padded_vs_plain(str(hybrid_dir))


def _generate_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _verification_through_graphs(model: str) -> None:
    """Speculative verification steps (n-gram drafts) through the graphs' padded static
    inputs, one row per token: the tokens and their logprobs equal the plain path's, and
    steps of several tokens per sequence did run through the buckets."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    kwargs = dict(model=model, device="cpu", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  max_num_batched_tokens=64, block_size=4, num_kv_blocks=200, speculative_config=spec)
    # Each prompt followed by its greedy continuation and itself again, so that prompt lookup
    # drafts the continuation (and the trained checkpoints accept some of it).
    base = _prompts(model)
    eager = LLM(**{k: v for k, v in kwargs.items() if k != "speculative_config"})
    prompts = [p + list(o) + p for p, o in zip(base, _generate(eager, base))]
    del eager
    plain = LLM(**kwargs)
    expected = _generate_logprobs(plain, prompts)
    assert plain.engine.scheduler.spec_stats.num_accepted_tokens > 0
    del plain

    padded = LLM(**kwargs)
    runner = padded.engine.runner
    runner.enable_decode_graphs(capture=False)
    assert runner.decode_graphs.sizes == [1, 2, 4, 8, 16, 32]
    shared_rows: list[int] = []
    prepare = runner.decode_graphs.prepare

    def counting_prepare(inputs):
        # Rows of one sequence (per_token) hold its block-table row: count the rows that share.
        shared_rows.append(len(inputs.input_ids) - len({id(r) for r in inputs.block_tables[0]}))
        return prepare(inputs)

    runner.decode_graphs.prepare = counting_prepare
    got = _generate_logprobs(padded, prompts)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lp), (_, ref) in zip(got, expected):
        assert lp == pytest.approx(ref, abs=1e-4)
    assert padded.engine.scheduler.spec_stats.num_drafts > 0
    assert max(shared_rows) > 0                     # verification steps ran through the buckets
    kv = padded.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_verification_steps_through_graphs_on_the_tiny_deepseek_v4():
    _verification_through_graphs(TINY_V4_MODEL)


def test_verification_steps_through_graphs_on_deepseek_v3(v3_dir):
    _verification_through_graphs(str(v3_dir))


@pytest.mark.slow
def test_verification_steps_through_graphs_on_deepseek_v41():
    _verification_through_graphs(str(Path(__file__).resolve().parent.parent / "data" / "v41_reference" / "checkpoint"))


def test_verification_steps_through_graphs_on_llama(llama_dir):
    _verification_through_graphs(str(llama_dir))


def test_verification_steps_through_graphs_with_sliding_layers(hybrid_dir):
    _verification_through_graphs(str(hybrid_dir))


def test_counters_allocated_in_a_capture_are_zeroed_after_it(monkeypatch):
    """A split-K counter set first needed inside a CUDA-graph capture is allocated there, where
    its zeroing is only recorded into that graph; the capturer zeroes it for real before any
    replay (another graph of the same capture stream may replay first). Simulated on the CPU:
    the capture flag is forced and the set is filled with what a pool's old memory could hold."""
    from deepinfer.kernels import launch

    device = torch.device("cpu")
    monkeypatch.setattr(launch, "_counters", {})
    monkeypatch.setattr(launch, "_capturing", lambda dev: True)
    counters = launch.tile_counters(device, 4096)
    counters.fill_(7)                                   # the recorded zeroing has not run
    assert launch.tile_counters(device, 100) is counters  # later users share the set
    monkeypatch.setattr(launch, "_capturing", lambda dev: False)
    launch.zero_captured_counters()
    assert not counters.any()
    counters.fill_(3)                                   # eager sets are not tracked: zeroed at allocation
    launch.zero_captured_counters()
    assert counters.eq(3).all()
