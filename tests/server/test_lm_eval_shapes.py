"""The request shapes lm-evaluation-harness's ``local-completions`` model sends, read
back the way it parses them (lm_eval/models/openai_completions.py)."""

from __future__ import annotations

from operator import itemgetter

import httpx2
import pytest
import torch

from deepinfer.engine.engine import Engine
from deepinfer.forward_context import ForwardContext
from deepinfer.sampling_params import SamplingParams
from tests.server.conftest import MODEL, RunningServer, generate_direct, serve

CONTEXTS = ["Question: what does the list type do?\nAnswer:", "The interpreter keeps"]
CONTINUATIONS = [" it stores items in order", " a module table"]


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine) as s:
        yield s


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def full_forward_logprobs(server: RunningServer, ids: list[int]) -> torch.Tensor:
    """log_softmax of one uncached forward over the whole sequence: [T, vocab]."""
    def run(e: Engine) -> torch.Tensor:
        x = torch.tensor(ids)
        with torch.inference_mode():
            hidden = e.model(x, ForwardContext.no_cache([len(ids)], x.device))
            return torch.log_softmax(e.model.compute_logits(hidden), -1)
    return server.engine_call(run)


def test_loglikelihood_requests(server):
    tok = server.engine.tokenizer
    ctx_ids = [tok.encode(c) for c in CONTEXTS]
    full_ids = [tok.encode(c + k) for c, k in zip(CONTEXTS, CONTINUATIONS)]
    assert all(f[:len(c)] == c for c, f in zip(ctx_ids, full_ids))
    # A greedy continuation, so that one is_greedy must come back True.
    greedy = generate_direct(server, ctx_ids[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    full_ids.append(ctx_ids[1] + greedy.outputs[0].token_ids)
    ctxlens = [len(ctx_ids[0]), len(ctx_ids[1]), len(ctx_ids[1])]
    payload = {"model": MODEL, "prompt": full_ids, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    resp = httpx2.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert resp.status_code == 200
    out = resp.json()
    results = parse_logprobs(out, ctxlens)

    for choice, ids, ctxlen, (ll, is_greedy) in zip(out["choices"], full_ids, ctxlens, results):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        # Equal to the engine's own prompt_logprobs for the same prompt ...
        ref = generate_direct(server, ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
        for pos in range(1, len(ids)):
            expect = ref.prompt_logprobs[pos][ids[pos]].logprob
            assert lp["token_logprobs"][pos] == pytest.approx(expect, abs=1e-5)
        # ... and to a full forward of the model.
        logp = full_forward_logprobs(server, ids)
        expect = [logp[p - 1, ids[p]].item() for p in range(ctxlen, len(ids))]
        assert ll == pytest.approx(sum(expect), abs=1e-4)
        assert is_greedy == all(logp[p - 1].argmax().item() == ids[p] for p in range(ctxlen, len(ids)))
        assert choice["text"].startswith(tok.decode(ids, skip_special_tokens=False))
    assert [g for _, g in results] == [results[0][1], results[1][1], True]

    # vLLM's prompt_logprobs field carries the same numbers, keyed by token id.
    resp = httpx2.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": full_ids[0], "max_tokens": 1, "prompt_logprobs": 2})
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    ref = generate_direct(server, full_ids[0], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert plp[0] is None and len(plp) == len(full_ids[0])
    for pos in range(1, len(full_ids[0])):
        assert {int(t) for t in plp[pos]} == set(ref.prompt_logprobs[pos])
        for tok, lp in ref.prompt_logprobs[pos].items():
            assert plp[pos][str(tok)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert plp[pos][str(tok)]["rank"] == lp.rank
    assert server.pool_is_full()


def test_generate_until_requests(server):
    tok = server.engine.tokenizer
    ctx_ids = [tok.encode(c) for c in CONTEXTS]
    free = generate_direct(server, ctx_ids[0], SamplingParams(temperature=0, max_tokens=24)).outputs[0].text
    until = [free[4:7], "\n\n"]
    payload = {"model": MODEL, "prompt": ctx_ids, "max_tokens": 24, "temperature": 0, "stop": until,
               "seed": 1234}
    resp = httpx2.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert resp.status_code == 200
    choices = resp.json()["choices"]
    texts = [None] * len(choices)
    for c in choices:           # lm-eval's parse_generations
        texts[c["index"]] = c["text"]
    for ids, text, choice in zip(ctx_ids, texts, sorted(choices, key=itemgetter("index"))):
        params = SamplingParams(temperature=0, max_tokens=24, stop=until)
        ref = generate_direct(server, ids, params).outputs[0]
        assert text == ref.text and choice["finish_reason"] == ref.finish_reason
        assert not any(s in text for s in until)
    # The first context's free text holds a stop string: it must end right before the first one.
    cut, hit = min((free.index(s), s) for s in until if s in free)
    assert texts[0] == free[:cut] and choices[0]["finish_reason"] == "stop"
    assert choices[0]["stop_reason"] == hit
