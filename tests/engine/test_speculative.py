"""Speculative decoding through the whole engine: greedy output with drafts equals greedy
output without them, token for token (and logprob for logprob), on the embedded
DeepSeek-V4.1, DeepSeek's V4.1 reference checkpoint, tiny random DeepSeek-V4 / V3 and a
sliding-window Mistral, through batching, chunked prefill, small pages, prefix-cache hits,
preemption and ``n`` > 1; stop strings, ``max_tokens`` and EOS inside an accepted span end
the output where one token per step would have; the counters count.

Drafts from n-gram lookup are rarely right on random weights, so most tests swap in a
:class:`ScriptedDrafter`: it proposes the true greedy continuation with some positions
corrupted, so every step accepts some drafts and rejects others."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.spec.drafter import Drafter

from .test_deepseek_engine import v3_dir, v4_dir  # noqa: F401  (fixtures)

V41_REFERENCE = Path(__file__).resolve().parent.parent / "data" / "v41_reference" / "checkpoint"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class ScriptedDrafter(Drafter):
    """Drafts the known greedy continuation of each prompt, wrong at every position whose
    (context length + draft index) is a multiple of ``wrong_every``."""

    def __init__(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                 max_draft: int = 4, wrong_every: int = 3, vocab_size: int = 300) -> None:
        self.max_draft = max_draft
        self.wrong_every = wrong_every
        self.vocab_size = vocab_size
        self.full = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        self.prompt_lens = [len(p) for p in prompts]

    def propose(self, req_id: str, token_ids: Sequence[int]) -> list[int]:
        n = len(token_ids)
        for full, plen in zip(self.full, self.prompt_lens):
            if n >= plen and list(token_ids) == full[:n]:
                truth = full[n:n + self.max_draft]
                return [(t + 1) % self.vocab_size if (n + j) % self.wrong_every == 0 else t
                        for j, t in enumerate(truth)]
        return []


def prompt_ids(llm: LLM, count: int = 4) -> list[list[int]]:
    vocab = llm.engine.config.model.vocab_size
    lengths = [11, 29, 5, 40, 17, 23][:count]
    return [[(7 * i + 13 * j + 3) % vocab for j in range(n)] for i, n in enumerate(lengths)]


def scripted(llm: LLM, prompts: list[list[int]], outputs: list[list[int]], **kw) -> ScriptedDrafter:
    drafter = ScriptedDrafter(prompts, outputs, vocab_size=llm.engine.config.model.vocab_size, **kw)
    llm.engine.runner.drafter = drafter
    return drafter


def run(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_equal_with_drafts(model: str | None, settings: dict, params: SamplingParams = GREEDY,
                            count: int = 4, **model_kw) -> LLM:
    base = LLM(model=model, device="cpu", **model_kw, **settings)
    prompts = prompt_ids(base, count)
    want = run(base, prompts, params)
    spec = LLM(model=model, device="cpu", speculative_config=NGRAM, **model_kw, **settings)
    scripted(spec, prompts, [o.outputs[0].token_ids for o in want])
    got = run(spec, prompts, params)
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        if params.logprobs is not None:
            for wo, go in zip(w.outputs, g.outputs):
                for wp, gp in zip(wo.logprobs, go.logprobs):
                    assert wp.keys() == gp.keys()
                    for t in wp:
                        assert gp[t].logprob == pytest.approx(wp[t].logprob, abs=1e-4)
                        assert gp[t].rank == wp[t].rank
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0                       # drafts were accepted ...
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ... and rejected
    kv = spec.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    return spec


SETTINGS = {
    "default": {},
    # Chunks of 16 tokens and pages of 4: drafts cross page boundaries, windows slide.
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    # A pool small enough to preempt.
    "preempting": {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 4},
}


@pytest.mark.parametrize("settings", [pytest.param(v, marks=pytest.mark.slow) if k == "preempting" else v
                                      for k, v in SETTINGS.items()], ids=SETTINGS.keys())
def test_embedded_v41_greedy_equal_with_drafts(settings):
    spec = check_equal_with_drafts(None, settings)
    if "num_kv_blocks" in settings:
        assert spec.engine.scheduler.num_preemptions > 0


def test_v41_reference_greedy_equal_with_drafts():
    check_equal_with_drafts(str(V41_REFERENCE), SETTINGS["chunked"], dtype="float32", kv_cache_dtype="float32")


def test_v4_greedy_equal_with_drafts(v4_dir):  # noqa: F811
    check_equal_with_drafts(str(v4_dir), SETTINGS["chunked"])


def test_v3_greedy_equal_with_drafts(v3_dir):  # noqa: F811
    check_equal_with_drafts(str(v3_dir), SETTINGS["chunked"])


def test_sliding_window_greedy_equal_with_drafts(sliding_model_dir):
    check_equal_with_drafts(str(sliding_model_dir), SETTINGS["chunked"])


def test_logprobs_and_penalties_equal_with_drafts():
    """Row j of a verification sees drafts 0..j-1 as output: penalties count them, and each
    committed token's logprobs are those of its own row."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.3, frequency_penalty=0.4)
    check_equal_with_drafts(None, {}, params)


def test_n_siblings_and_prefix_hits_with_drafts():
    base = LLM(device="cpu")
    prompts = prompt_ids(base, 2)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    want = run(base, prompts, params)
    spec = LLM(device="cpu", speculative_config=NGRAM)
    scripted(spec, prompts, [o.outputs[0].token_ids for o in want])
    for _ in range(2):                      # the second run hits the prefix cache
        got = run(spec, prompts, params)
        assert [[o.token_ids for o in g.outputs] for g in got] == [[o.token_ids for o in w.outputs] for w in want]
    assert got[1].num_cached_tokens >= 16          # 29 tokens: one 16-token block


def test_output_ends_inside_an_accepted_span():
    """max_tokens, a stop token and a stop string that fall inside a step's accepted drafts
    end the output exactly where one token per step ends it."""
    base = LLM(device="cpu")
    prompts = prompt_ids(base, 3)
    long = run(base, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    outs = [o.outputs[0].token_ids for o in long]
    text = base.get_tokenizer().decode(outs[1][:12])
    cases = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[outs[0][9]]),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[text[-3:]], ignore_eos=True),
    ]
    spec = LLM(device="cpu", speculative_config=NGRAM)
    for params in cases:
        want = run(base, prompts, params)
        scripted(spec, prompts, outs, wrong_every=7)
        got = run(spec, prompts, params)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
            [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]


def test_ngram_drafts_on_repetitive_text_and_metrics():
    """The n-gram drafter on the trained tiny V4's own repetitive text: drafts are accepted,
    output unchanged, and get_metrics reports vLLM's spec-decode counters."""
    model = str(Path(__file__).resolve().parent.parent / "data" / "tiny-v4-model")
    prompts = ["one two three one two three one two three one two", "abc abc abc abc abc abc abc"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=model, device="cpu").generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=model, device="cpu", speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    metrics = {m.name: m for m in spec.get_metrics()}
    stats = spec.engine.scheduler.spec_stats
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 4 and sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))   # position k+1 needs k accepted


def test_bad_speculative_config_names_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        LLM(device="cpu", speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="draft_model"):
        LLM(device="cpu", speculative_config={"method": "ngram", "draft_model": "x"})


# -- DSpark -------------------------------------------------------------------------------

def reference_prompts() -> tuple[dict, list[list[int]]]:
    import numpy as np

    e = dict(np.load(V41_REFERENCE.parent / "expected.npz"))
    ids, off = e["prompt_ids"], e["prompt_offsets"]
    return e, [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def dspark_llm(**settings) -> LLM:
    return LLM(model=str(V41_REFERENCE), device="cpu", dtype="float32", kv_cache_dtype="float32",
               speculative_config={"method": "dspark", "num_speculative_tokens": 4}, **settings)


@pytest.mark.parametrize("settings", [SETTINGS["default"], SETTINGS["chunked"]], ids=["default", "chunked"])
def test_dspark_in_the_engine_drafts_as_the_official_reference(settings):
    """Every proposal the engine's DSpark makes (its context rows written by the target's
    steps into the paged cache, through chunked prefill, page boundaries and prefix hits)
    equals the drafts DeepSeek's reference made from one full forward at that position,
    and greedy output equals the reference's greedy output."""
    expected, prompts = reference_prompts()
    llm = dspark_llm(**settings)
    drafter = llm.engine.runner.drafter
    seen: list[tuple[str, int, int, list[int]]] = []
    propose = drafter.propose

    def recording(state, commit, ctx, generator, **kwargs):
        tokens = propose(state, commit, ctx, generator, **kwargs)
        lasts = ctx.positions[commit.last_rows]
        seen.extend(zip(commit.req_ids, lasts.tolist(), commit.anchors.tolist(), tokens.tolist()))
        return tokens

    drafter.propose = recording
    for _ in range(2):                                  # the second run hits the prefix cache
        out = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == expected["greedy_noquant"].tolist()
    checked = 0
    for req_id, last, anchor, tokens in seen:
        i = int(req_id) % len(prompts)
        j = last - len(prompts[i])                      # the reference's row: s = P + j
        if 0 <= j < expected["dspark_ids_noquant"].shape[1]:
            assert [anchor, *tokens] == expected["dspark_ids_noquant"][i, j].tolist()
            checked += 1
    assert checked >= 2 * 8 * 10
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_dspark_needs_a_checkpoint_with_the_module(tmp_path):
    # The embedded model without its drafter (its mtp.* tensors and config keys).
    from safetensors.torch import load_file, save_file

    from deepinfer.entrypoints.llm import DEFAULT_MODEL

    shutil.copytree(DEFAULT_MODEL, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: t for k, t in weights.items() if not k.startswith("mtp.")}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"] = {k: v for k, v in config["text_config"].items() if not k.startswith("dspark_")}
    config["text_config"]["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no DSpark module"):
        LLM(model=str(tmp_path), device="cpu", speculative_config={"method": "dspark"})


@pytest.mark.parametrize("method", ["ngram", "dspark", "dspark-varlen"])
def test_seeded_sampling_with_speculation_equals_without(method):
    """Deterministic sampling: a seeded request is verified by exact match against the
    sampler's own keyed draws, so its tokens are those it gets without speculation, alone
    or among other requests, with varlen verification choosing different widths per batch,
    and through preemption."""
    _, prompts = reference_prompts()
    config = {"method": "dspark", "num_speculative_tokens": 4}
    if method == "ngram":
        config = NGRAM
    elif method == "dspark-varlen":
        config = {**config, "varlen": True, "sps_table": ((8, 100.0), (16, 99.0), (24, 30.0), (64, 5.0))}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(V41_REFERENCE), device="cpu", dtype="float32", kv_cache_dtype="float32")
    want = run(plain, prompts[:1], seeded)[0].outputs[0].token_ids
    llm = LLM(model=str(V41_REFERENCE), device="cpu", dtype="float32", kv_cache_dtype="float32",
              speculative_config=config)
    assert run(llm, prompts[:1], seeded)[0].outputs[0].token_ids == want
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], [seeded, other, other, seeded],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    tight = LLM(model=str(V41_REFERENCE), device="cpu", dtype="float32", kv_cache_dtype="float32",
                speculative_config=config, **SETTINGS["preempting"])
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], [seeded] + [other] * 7, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert outs[0].outputs[0].token_ids == want


@pytest.mark.parametrize("sps_table", [((8, 100.0), (16, 99.0), (24, 30.0), (64, 5.0)), None],
                         ids=["given", "profiled"])
def test_dspark_varlen_verification(sps_table):
    """Confidence-scheduled verification: each request verifies the prefix of its drafts the
    hardware-aware scheduler picks (here a steep SPS table trims them), and greedy output
    is still the reference's. Without a table, the engine profiles one at start."""
    expected, prompts = reference_prompts()
    llm = LLM(model=str(V41_REFERENCE), device="cpu", dtype="float32", kv_cache_dtype="float32",
              speculative_config={"method": "dspark", "num_speculative_tokens": 4, "varlen": True,
                                  "sps_table": sps_table})
    out = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == expected["greedy_noquant"].tolist()
    stats = llm.engine.scheduler.spec_stats
    if sps_table is not None:
        assert 0 < stats.num_draft_tokens < 4 * stats.num_drafts      # drafts verified, some trimmed
    else:
        # On the CPU a step's time grows with its tokens and this random drafter's confidences
        # are low: the scheduler may rightly verify nothing, so only the table is checked.
        sizes = [b for b, _ in llm.engine.scheduler.varlen_sps.points]
        assert sizes[0] == 1 and sizes == sorted(sizes) and sizes[-1] == 64 * 5


def test_varlen_needs_confidences():
    with pytest.raises(ValueError, match="varlen"):
        LLM(device="cpu", speculative_config={"method": "ngram", "varlen": True})


def test_structured_outputs_with_drafts():
    """A grammar constrains every verification row (its matcher advanced over the drafts
    before it, then rolled back), drafts are cut at the first token it refuses: greedy output
    equals the engine's without drafts, and sampled output still matches the grammar."""
    import re

    from deepinfer.sampling_params import StructuredOutputsParams

    pattern = r"(one two three )+(four|five)"
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = ["Count: one two three one two three", "List: one two"]
    base = LLM(device="cpu")
    want = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    spec = LLM(device="cpu", speculative_config=NGRAM)
    got = spec.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    bounded = r"(one two three ){1,3}(four|five)"
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(regex=bounded))
    for out in spec.generate(prompts * 2, sampled, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(bounded, out.outputs[0].text)
