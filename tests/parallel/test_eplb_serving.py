"""Expert load balancing while serving: a tiny Qwen3-MoE engine at ep=2 (two gloo worker
processes) with EPLB on and a short interval rebalances several times during generation, gives
the same greedy tokens as the engine without EPLB, and reports its rebalances and imbalance in
``LLM.get_metrics()`` and the server's /metrics; bad EPLB settings are refused before anything
loads, naming the field."""

from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.cli import build_parser, engine_kwargs
from deepinfer.metrics import Counter, Gauge
from tests.engine.conftest import make_checkpoint
from tests.parallel.shapes import MOE

pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "In a hole in the ground there lived", "1, 2, 3, 4,"]
NEW_TOKENS = 10
EPLB = dict(enable_eplb=True, num_redundant_experts=2, eplb_window_size=4, eplb_step_interval=3)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("eplb"), "Qwen3MoeForCausalLM", **MOE)


def _generate(path: Path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(path), device="cpu", expert_parallel_size=2, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def _metrics(llm: LLM) -> dict[tuple[str, tuple], float]:
    return {(m.name, tuple(sorted(m.labels.items()))): m.value for m in llm.get_metrics()
            if isinstance(m, (Counter, Gauge))}


@pytest.mark.slow
def test_rebalancing_while_serving_keeps_greedy_tokens(qwen3_moe):
    from deepinfer.entrypoints.openai.metrics import ServerMetrics

    ref, plain = _generate(qwen3_moe)
    try:
        assert not any(name.startswith("deepinfer:eplb") for name, _ in _metrics(plain))
    finally:
        plain.engine.close()
    got, llm = _generate(qwen3_moe, **EPLB)
    try:
        assert got == ref
        assert all(len(t) == NEW_TOKENS for t in got)
        metrics = _metrics(llm)
        labels = (("model_name", str(qwen3_moe)),)
        # 1 prefill step + NEW_TOKENS - 1 decode steps, a rebalance every 3 of them.
        rebalances = metrics[("deepinfer:eplb_rebalances", labels)]
        assert rebalances >= NEW_TOKENS // EPLB["eplb_step_interval"] - 1 >= 1
        assert metrics[("deepinfer:eplb_steps_since_rebalance", labels)] < EPLB["eplb_step_interval"]
        for when in ("before", "after"):
            # max / mean tokens per rank: at least 1 once a rebalance has measured a load.
            assert metrics[("deepinfer:eplb_imbalance", (*labels, ("when", when)))] >= 1.0
        server = ServerMetrics("m")
        server.observe_engine(llm.engine)
        text = server.render().decode()
        found = re.search(r'^deepinfer:eplb_rebalances_total\{model_name="m"\} (\S+)$', text, re.M)
        assert found and float(found[1]) == rebalances
        for when in ("before", "after"):
            assert re.search(rf'^deepinfer:eplb_imbalance\{{model_name="m",when="{when}"\}} (\S+)$', text, re.M)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(enable_eplb=True), ValueError, "enable_eplb=True needs expert parallelism: expert_parallel_size=1"),
    (dict(expert_parallel_size=2, num_redundant_experts=2), ValueError,
     "num_redundant_experts=2 needs enable_eplb=True"),
    (dict(expert_parallel_size=2, enable_eplb=True, num_redundant_experts=1), ValueError,
     r"expert_parallel_size=2 must divide the model's 8 routed experts \+ num_redundant_experts=1 = 9 slots"),
    (dict(expert_parallel_size=2, enable_eplb=True, num_redundant_experts=-1), ValueError,
     "num_redundant_experts=-1 must be an int >= 0"),
    (dict(expert_parallel_size=2, enable_eplb=True, eplb_window_size=0), ValueError,
     "eplb_window_size=0 must be an int >= 1"),
    (dict(expert_parallel_size=2, enable_eplb=True, eplb_step_interval=0), ValueError,
     "eplb_step_interval=0 must be an int >= 1"),
    (dict(expert_parallel_size=2, enable_eplb=True, distributed_executor_backend="external_launcher"),
     NotImplementedError, "enable_eplb=True with distributed_executor_backend='external_launcher' is not yet"),
])
def test_bad_eplb_settings_are_refused_before_loading(qwen3_moe, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(model=str(qwen3_moe), device="cpu", **kwargs)
    assert not mp.active_children()


def test_eplb_on_a_dense_model_is_refused(tmp_path):
    path = make_checkpoint(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="has no routed experts"):
        LLM(model=str(path), device="cpu", expert_parallel_size=2, enable_eplb=True)
    assert not mp.active_children()


def test_command_line_flags():
    args = build_parser().parse_args(["serve", "--ep", "2", "--eplb", "--num-redundant-experts", "2",
                                      "--eplb-window", "4", "--eplb-interval", "3"])
    kwargs = engine_kwargs(args)
    assert (kwargs["expert_parallel_size"], kwargs["enable_eplb"], kwargs["num_redundant_experts"],
            kwargs["eplb_window_size"], kwargs["eplb_step_interval"]) == (2, True, 2, 4, 3)
    off = engine_kwargs(build_parser().parse_args(["serve"]))
    assert (off["enable_eplb"], off["num_redundant_experts"]) == (False, 0)
