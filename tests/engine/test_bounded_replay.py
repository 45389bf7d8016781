"""Bounded replay ("YOCO prefill truncation") through the engine on the tiny trained
DeepSeek-V4 (tests/data/tiny-v4-model), which has none: the truncated modes are refused when the engine starts,
and with a stand-in ``replay_keep_tokens`` each prompt's replay_start reaches the
model's forward context."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

from .. import TINY_V4_MODEL


@pytest.mark.parametrize("mode", ["exact", "compact"])
def test_model_without_bounded_replay_refuses_truncation(mode):
    with pytest.raises(ValueError, match=f"prefill truncation mode '{mode}' needs a model with bounded "
                                         r"replay \(DeepSeek-V4.1\); DeepseekV4ForCausalLM has none"):
        LLM(model=TINY_V4_MODEL, device="cpu", yoco_prefill_truncation_mode=mode)


def test_truncation_from_the_environment_is_refused_too(monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    with pytest.raises(ValueError, match="'compact' needs a model with bounded replay"):
        LLM(model=TINY_V4_MODEL, device="cpu")


@pytest.fixture(scope="module")
def tiny_v4_llm() -> LLM:
    return LLM(model=TINY_V4_MODEL, device="cpu", max_num_batched_tokens=256)


def test_replay_starts_reach_the_forward(monkeypatch, tiny_v4_llm):
    asked = []

    def keep_as_asked(self, mode: str, keep: int) -> int | None:
        asked.append((mode, keep))
        return keep

    monkeypatch.setattr(DeepseekV4ForCausalLM, "replay_keep_tokens", keep_as_asked)
    llm = LLM(model=TINY_V4_MODEL, device="cpu", max_num_batched_tokens=256,
              yoco_prefill_truncation_mode="exact", yoco_prefill_keep_tokens=8)
    engine = llm.engine
    assert asked == [("exact", 8)]
    assert engine.scheduler.replay_keep_tokens == 8 and engine.runner.bounded_replay

    seen = []
    forward_rows = engine.model.forward_rows

    def recording(input_ids, ctx, select):
        seen.append((ctx.decode_only, ctx.replay_starts))
        return forward_rows(input_ids, ctx, select)

    monkeypatch.setattr(engine.model, "forward_rows", recording)
    prompts = [list(range(100, 130)), list(range(200, 205))]      # 30 and 5 tokens
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert seen[0] == (False, [22, 0])
    assert all(starts is None for decode_only, starts in seen if decode_only)
    # The tiny V4 ignores replay_starts, so the tokens are those of an engine without it.
    ref = tiny_v4_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
