"""Model drafters (DSpark, MTP) through the decode graphs' static buffers, without a GPU: the
padded path run eagerly (``enable_decode_graphs(capture=False)``) against the eager engine.

With a graph-safe model drafter a decode or verification step that a bucket holds runs the
drafter's forward (the target's, keeping what the drafter reads) on the bucket's padded,
one-row-per-token inputs, and its proposal on :class:`DraftGraphs`' padded static rows. The
tokens, their logprobs, every proposal's drafts (and confidences) and the acceptance
counters must equal the eager engine's, through batch sizes between buckets, sequences
finishing mid-run, varlen verification and sampled requests. A padding row that wrote into
a real block, a wrong table row of a per-token step or a stale static row changes drafts
there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.runner.cuda_graph import DraftGraphs
from deepinfer.spec.drafter import DraftRows, ModelDrafter

from ..engine.test_mtp_drafter import v3_mtp_dir, v3_repeat_dir  # noqa: F401  (fixtures)
from ..models.v4_dspark_checkpoint import BLOCK as V4_BLOCK
from ..models.v4_dspark_checkpoint import PROMPTS as V4_PROMPTS
from ..models.v4_dspark_checkpoint import write_bigram_checkpoint_for

BLOCK = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["text_config"]["dspark_block_size"]
SIZES = [1, 2, 4, 8]
# Different lengths: the batch shrinks 5 -> 4 -> ... as sequences finish mid-run, through
# sizes that are not buckets (5 and 3 pad to 8 and 4).
MAX_TOKENS = [24, 8, 32, 14, 28]
TEXT = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "Run command with arguments and return a CompletedProcess instance.\n\nThe returned instance will have",
    "Open a bzip2-compressed file in binary or text mode.\n\nThe",
    # Past the 32-token window: the drafter's context rows come from a full window.
    "This module provides access to some objects used or maintained by the interpreter and to "
    "functions that interact strongly with the interpreter. " * 2,
]


def greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]


def mixed() -> list[SamplingParams]:
    """Greedy, seeded sampled (exact-match verification), unseeded sampled (rejection
    sampling), and one with top-k that ends early (while it runs, proposals take the filtered
    graphs, every row's filters on; then the sampled ones)."""
    params = greedy()
    params[1] = SamplingParams(temperature=0.7, seed=5, top_k=20, max_tokens=MAX_TOKENS[1], ignore_eos=True,
                               logprobs=0)
    params[2] = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS[2], ignore_eos=True, logprobs=0)
    params[4] = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS[4], ignore_eos=True, logprobs=0)
    # Unseeded: rejection sampling against the draft distributions the graphs kept, drawing
    # from the runner's generator in the same order as the eager path.
    params[3] = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS[3], ignore_eos=True, logprobs=0)
    return params


class Recorded:
    """Every proposal of a run: (request id, drafts, confidences or None)."""

    def __init__(self, llm: LLM) -> None:
        self.proposals: list[tuple[str, list[int], list[float] | None]] = []
        drafter = llm.engine.runner.drafter
        propose = drafter.propose

        def recording(state, commit, ctx, generator, **kwargs):
            drafts = propose(state, commit, ctx, generator, **kwargs)
            conf = drafter.confidences()
            confs = [None] * len(commit.req_ids) if conf is None else conf.tolist()
            self.proposals.extend(zip(commit.req_ids, drafts.tolist(), confs))
            return drafts

        drafter.propose = recording


def generate(llm: LLM, prompts, params) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.scheduler.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def graph_vs_eager(prompts, params, min_accepted: int, modes: set[str] = frozenset({"greedy"}), **kwargs) -> LLM:
    """Run eagerly, then on the padded static path; assert equal outputs, drafts and counters,
    that proposals of 5 and 3 sequences ran padded to buckets 8 and 4, and that proposals of
    each of ``modes`` (DraftGraphs' sampling modes) went through the static rows. Returns the
    padded engine."""
    kwargs = dict(device="cpu", max_num_seqs=8, cuda_graph_sizes=SIZES, max_num_batched_tokens=160,
                  block_size=4, num_kv_blocks=300, **kwargs)
    eager = LLM(**kwargs)
    assert eager.engine.runner.decode_graphs is None             # CPU: no graphs by default
    rec_eager = Recorded(eager)
    expected = generate(eager, prompts, params)
    want_counters = counters(eager)
    del eager

    padded = LLM(**kwargs)
    runner = padded.engine.runner
    runner.enable_decode_graphs(capture=False)
    assert isinstance(runner.draft_graphs, DraftGraphs) and runner.draft_graphs.sizes == SIZES
    forward_sizes: list[int] = []
    run = runner.decode_graphs.run

    def counting_run(input_ids, ctx):
        forward_sizes.append(input_ids.shape[0])
        return run(input_ids, ctx)

    runner.decode_graphs.run = counting_run
    after_sizes: list[int] = []
    run_after = runner.decode_graphs.run_after

    def counting_after(state, next_ids, ctx):
        after_sizes.append(next_ids.shape[0])
        return run_after(state, next_ids, ctx)

    runner.decode_graphs.run_after = counting_after
    draft_sizes: list[int] = []
    draft_modes: set[str] = set()
    real_draft = runner.drafter.draft

    def counting_draft(rows: DraftRows):
        # Proposals on the static rows (the others, those of prompt steps, run eagerly).
        if rows.anchors.data_ptr() == runner.draft_graphs.anchors.data_ptr():
            draft_sizes.append(rows.anchors.shape[0])
            sampling = rows.sampling
            draft_modes.add("greedy" if sampling is None else "sampled" if sampling.top_k is None else "filtered")
        return real_draft(rows)

    runner.drafter.draft = counting_draft
    rec = Recorded(padded)
    got = generate(padded, prompts, params)

    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lp), (_, ref) in zip(got, expected):
        assert lp == pytest.approx(ref, abs=1e-4)
    assert [(r, d) for r, d, _ in rec.proposals] == [(r, d) for r, d, _ in rec_eager.proposals]
    for (_, _, c), (_, _, ref) in zip(rec.proposals, rec_eager.proposals):
        assert (c is None) == (ref is None) and (c is None or c == pytest.approx(ref, abs=1e-4))
    assert counters(padded) == want_counters
    assert want_counters[2] >= min_accepted, want_counters       # drafts were accepted, and rejected
    assert want_counters[2] < want_counters[1]
    # Decode and verification steps ran the drafter's forward on the buckets and its proposal
    # on the padded static rows, through sizes between buckets.
    assert runner.drafter_graph_steps == len(forward_sizes) > 0
    assert runner.draft_graphs.steps == len(draft_sizes) > 0
    assert set(draft_sizes) <= set(SIZES) and {8, 4}.issubset(draft_sizes), draft_sizes
    assert set(modes) <= draft_modes, draft_modes
    # A drafter with a context pass (MTP) runs it on every graphed step's bucket rows.
    has_pass = runner.drafter.has_context_pass
    assert after_sizes == (forward_sizes if has_pass else []) and (runner.decode_graphs.after is not None) == has_pass
    kv = padded.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    return padded


def test_dspark_through_the_static_buffers_matches_eager():
    llm = graph_vs_eager(TEXT, greedy(), min_accepted=10, model=DEFAULT_MODEL,
                         speculative_config={"method": "dspark", "num_speculative_tokens": BLOCK})
    # Full-width verification steps: the buckets hold B x (1 + drafts) rows.
    assert {n * (1 + BLOCK) for n in SIZES} <= set(llm.engine.runner.decode_graphs.sizes)


def test_dspark_sampled_requests_through_the_static_buffers_match_eager():
    graph_vs_eager(TEXT, mixed(), min_accepted=5, modes={"filtered", "sampled"}, model=DEFAULT_MODEL,
                   speculative_config={"method": "dspark", "num_speculative_tokens": BLOCK})


def test_dspark_varlen_verification_through_the_static_buffers_matches_eager(monkeypatch):
    """Varlen (DEEPINFER_ENABLE_MTP_VARLEN): each sequence verifies its own draft prefix,
    so token counts fall between the verification buckets and pad to the next."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    spec = {"method": "dspark", "num_speculative_tokens": BLOCK,
            "sps_table": ((8, 100.0), (16, 99.0), (24, 30.0), (64, 5.0))}
    llm = graph_vs_eager(TEXT, greedy(), min_accepted=5, model=DEFAULT_MODEL, speculative_config=spec)
    assert llm.engine.config.speculative.varlen


@pytest.fixture(scope="module")
def v4_dspark_dir(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V4 checkpoint with an FP8 DSpark drafter that knows the target's
    greedy bigrams on the prompts (so drafts are accepted)."""
    return write_bigram_checkpoint_for(tmp_path_factory.mktemp("v4dspark"), V4_PROMPTS, MAX_TOKENS)


def test_v4_dspark_seeded_requests_through_the_static_buffers_match_eager(v4_dspark_dir):
    """A DeepSeek-V4 target with its (FP8) DSpark module: greedy and seeded sampled requests,
    one with top-k (tests/gpu/test_drafter_graphs.py runs the same requests replayed)."""
    params = greedy()
    for i, seed in ((1, 7), (2, 3), (4, 5)):
        params[i] = SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS[i], ignore_eos=True,
                                   top_k=20 if i == 1 else 0, logprobs=0)
    graph_vs_eager(V4_PROMPTS, params, min_accepted=5, modes={"filtered", "sampled"}, model=str(v4_dspark_dir),
                   dtype="float32", speculative_config={"method": "dspark", "num_speculative_tokens": V4_BLOCK})


def _mtp_prompts() -> list[list[int]]:
    vocab = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["text_config"]["vocab_size"]
    return [[(7 * i + 13 * j + 3) % vocab for j in range(n)] for i, n in enumerate([11, 29, 5, 40, 17])]


def test_mtp_through_the_static_buffers_matches_eager(v3_repeat_dir):
    """The chained MTP drafter (its context pass over the bucket's rows, its chain on the
    static rows, lookahead slots of padding rows -1) on a module whose drafts are often right."""
    graph_vs_eager([{"prompt_token_ids": p} for p in _mtp_prompts()], greedy(), min_accepted=1,
                   model=str(v3_repeat_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 3})


def test_mtp_sampled_requests_through_the_static_buffers_match_eager(v3_repeat_dir):
    graph_vs_eager([{"prompt_token_ids": p} for p in _mtp_prompts()], mixed(), min_accepted=1,
                   modes={"filtered", "sampled"},
                   model=str(v3_repeat_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 3})


@pytest.mark.parametrize("how", ["config", "drafter"])
def test_a_drafter_that_is_not_graph_safe_runs_eagerly(how, monkeypatch):
    """The runner asks the drafter (``graph_safe``), and ``cuda_graphs=False`` turns the
    drafter's graphs off: its steps then run eagerly, verification buckets are not added."""
    from deepinfer.spec.dspark import DSparkEngineDrafter

    spec = {"method": "dspark", "num_speculative_tokens": BLOCK}
    if how == "config":
        spec["cuda_graphs"] = False
    else:
        monkeypatch.setattr(DSparkEngineDrafter, "graph_safe", False)
    llm = LLM(model=DEFAULT_MODEL, device="cpu", max_num_seqs=8, cuda_graph_sizes=SIZES, speculative_config=spec)
    runner = llm.engine.runner
    assert isinstance(runner.drafter, ModelDrafter) and not runner.graphs_serve_drafter
    runner.enable_decode_graphs(capture=False)
    assert runner.draft_graphs is None and runner.decode_graphs.sizes == SIZES
    llm.generate(TEXT[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert runner.drafter_graph_steps == 0 and runner.verify_graph_steps == 0


def test_speculative_config_cuda_graphs_is_validated():
    from deepinfer.config import SpeculativeConfig

    with pytest.raises(ValueError, match="cuda_graphs=1 must be True or False"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=2, cuda_graphs=1)


def test_padding_rows_of_the_dspark_cache_write_nothing():
    """A slot of -1 (a bucket's padding row) leaves the cache as it was, the null block too."""
    from deepinfer.spec.dspark import DSparkContextCache

    cache = DSparkContextCache(num_stages=2, head_dim=4, window=8, dtype=torch.float32)
    cache.kv_cache = torch.zeros(3, 4, 1, 2, 4)
    cache.kv_cache[1:] = torch.randn(2, 4, 1, 2, 4)
    before = cache.kv_cache.clone()
    rows = torch.randn(3, 2, 4)
    cache.write(torch.tensor([-1, 5, -1]), rows)                    # block 1, offset 1
    assert torch.equal(cache.kv_cache[1, 1, 0], rows[1])
    after = cache.kv_cache.clone()
    after[1, 1, 0] = before[1, 1, 0]
    assert torch.equal(after, before)


class _EchoDrafter(ModelDrafter):
    """Stands in for a drafter: drafts echo its rows (anchor, position, first table entry),
    so row order, padding and the static buffers show."""

    max_draft, num_slots, vocab_size, row_state_size = 2, 3, 5, 0

    def __init__(self) -> None:
        self._probs, self._confidence = {}, None
        self.seen: list[DraftRows] = []

    def kv_cache_layers(self):
        return []

    def forward(self, model, input_ids, ctx, select):
        raise AssertionError("not used")

    def draft(self, rows: DraftRows):
        from deepinfer.spec.drafter import DraftOutput

        self.seen.append(rows)
        tokens = torch.stack([rows.anchors, rows.last_positions + rows.tables[:, 0].long()], 1)
        probs = None if rows.sampling is None else rows.sampling.noise[:, :2] * rows.sampling.temperature[:, None, None]
        return DraftOutput(tokens=tokens, confidences=rows.last_positions[:, None].float().expand(-1, 2), probs=probs)


def _rows(anchors, positions, tables, sampling=None) -> DraftRows:
    return DraftRows(anchors=torch.tensor(anchors), last_positions=torch.tensor(positions),
                     tables=torch.tensor(tables, dtype=torch.int32), max_seq_len=64, sampling=sampling)


def test_draft_graphs_pad_to_the_bucket_and_pick_the_mode():
    from deepinfer.models.dspark import DraftSampling

    drafter = _EchoDrafter()
    graphs = DraftGraphs(drafter, decode=None, sizes=[1, 2, 4], table_width=3, max_seq_len=64, dtype=torch.float32,
                         device=torch.device("cpu"), capture=False)
    # A wide step first, so that the next one's padding rows must lose its tables.
    out = graphs.draft(_rows([1, 2, 3, 4], [10, 20, 30, 40], [[4, 5, 6], [7, 0, 0], [8, 9, 0], [3, 3, 3]]))
    assert out.tokens.tolist() == [[1, 14], [2, 27], [3, 38], [4, 43]] and out.probs is None
    assert drafter.seen[-1].anchors.shape == (4,) and drafter.seen[-1].sampling is None      # bucket 4
    noise = torch.rand(2, 3, 5) + 0.5
    sampling = DraftSampling(greedy=torch.tensor([True, False]), temperature=torch.tensor([1.0, 0.5]), noise=noise)
    out = graphs.draft(_rows([6, 7], [11, 12], [[2, 3], [5, 1]], sampling))
    rows = drafter.seen[-1]
    assert rows.anchors.shape == (2,) and rows.sampling.top_k is None                     # bucket 2, sampled
    assert rows.tables.tolist() == [[2, 3, 0], [5, 1, 0]]                                # columns past: null
    assert out.tokens.tolist() == [[6, 13], [7, 17]]
    assert torch.equal(out.probs, noise[:, :2] * torch.tensor([1.0, 0.5])[:, None, None])
    kept = out.probs
    # Three rows with filters: bucket 4, the filtered mode; row 3 pads with a null table.
    filtered = DraftSampling(greedy=torch.tensor([False, True, False]), temperature=torch.ones(3),
                             min_p=torch.tensor([0.1, 0.0, 0.0]), top_k=torch.tensor([5, 5, 2]),
                             top_p=torch.tensor([1.0, 1.0, 0.9]), noise=torch.rand(3, 3, 5) + 0.5)
    out = graphs.draft(_rows([1, 1, 1], [0, 0, 0], [[1, 1, 1]] * 3, filtered))
    rows = drafter.seen[-1]
    assert rows.anchors.shape == (4,) and rows.sampling.top_k.tolist() == [5, 5, 2, 5]
    assert rows.tables[3].tolist() == [0, 0, 0] and out.tokens.shape == (3, 2)
    # The distributions handed out earlier were copies: later proposals leave them as they were.
    assert torch.equal(kept, noise[:, :2] * torch.tensor([1.0, 0.5])[:, None, None])
    assert graphs.steps == 3
    # Above the largest bucket: no graph takes the rows (the caller drafts eagerly).
    assert graphs.draft(_rows([1] * 5, [0] * 5, [[1]] * 5)) is None and graphs.steps == 3
    with pytest.raises(ValueError, match="block table of 4 blocks exceeds the 3"):
        graphs.draft(_rows([1], [0], [[1, 2, 3, 4]]))


def test_draft_graph_static_bytes_cover_the_buffers_allocated():
    # The cache budget reserves static_bytes before the cache exists; it must not undercount.
    drafter = _EchoDrafter()
    graphs = DraftGraphs(drafter, decode=None, sizes=[1, 4, 8], table_width=3, max_seq_len=64, dtype=torch.float32,
                         device=torch.device("cpu"), capture=False)
    allocated = sum(t.numel() * t.element_size() for t in vars(graphs).values() if isinstance(t, torch.Tensor))
    reserved = DraftGraphs.static_bytes(drafter, 8, torch.float32)
    assert allocated <= reserved <= allocated + 8 * 128
