"""Bounded replay ("YOCO prefill truncation") plumbing without a real model: the two
DEEPINFER_YOCO_PREFILL_* variables, the SchedulerConfig fields and options that carry
them, the model interface's default, and the runner handing each sequence's
replay_start to the forward context. The scheduler's side (replay_start values and the
prefix-cache cap) is in test_scheduler.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer import env
from deepinfer.config import EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.models.base import CausalLM
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.scheduler.kv_cache import KVCacheManager, build_groups
from deepinfer.scheduler.scheduler import Scheduler

from .test_scheduler import seqs_for

MODE = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"


# -- environment -----------------------------------------------------------------------------
def test_env_defaults(monkeypatch):
    monkeypatch.delenv(MODE, raising=False)
    monkeypatch.delenv(KEEP, raising=False)
    assert env.yoco_prefill_truncation_mode() == "full"
    assert env.yoco_prefill_keep_tokens() == 140


@pytest.mark.parametrize("value,expected", [("exact", "exact"), (" Compact ", "compact"), ("full", "full")])
def test_env_mode(monkeypatch, value, expected):
    monkeypatch.setenv(MODE, value)
    assert env.yoco_prefill_truncation_mode() == expected


@pytest.mark.parametrize("value", ["", "yes", "partial"])
def test_env_bad_mode(monkeypatch, value):
    monkeypatch.setenv(MODE, value)
    with pytest.raises(ValueError, match=f"{MODE}=.*full, exact, compact"):
        env.yoco_prefill_truncation_mode()


def test_env_keep(monkeypatch):
    monkeypatch.setenv(KEEP, " 256 ")
    assert env.yoco_prefill_keep_tokens() == 256


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "many", "", "+4"])
def test_env_bad_keep(monkeypatch, value):
    monkeypatch.setenv(KEEP, value)
    with pytest.raises(ValueError, match=f"{KEEP}=.*integer >= 1"):
        env.yoco_prefill_keep_tokens()


# -- configuration -------------------------------------------------------------------------
def test_config_takes_the_environment_when_unset(monkeypatch):
    monkeypatch.delenv(MODE, raising=False)
    monkeypatch.delenv(KEEP, raising=False)
    cfg = SchedulerConfig()
    assert (cfg.prefill_truncation_mode, cfg.prefill_keep_tokens) == ("full", 140)
    monkeypatch.setenv(MODE, "exact")
    monkeypatch.setenv(KEEP, "64")
    cfg = SchedulerConfig()
    assert (cfg.prefill_truncation_mode, cfg.prefill_keep_tokens) == ("exact", 64)
    # Explicit values win over the environment.
    cfg = SchedulerConfig(prefill_truncation_mode="compact", prefill_keep_tokens=8)
    assert (cfg.prefill_truncation_mode, cfg.prefill_keep_tokens) == ("compact", 8)


def test_config_bad_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv(KEEP, "0")
    with pytest.raises(ValueError, match=KEEP):
        SchedulerConfig()
    # Not read when the field is given.
    assert SchedulerConfig(prefill_keep_tokens=5).prefill_keep_tokens == 5


@pytest.mark.parametrize("kwargs,match", [
    (dict(prefill_truncation_mode="truncate"), "prefill_truncation_mode='truncate'"),
    (dict(prefill_keep_tokens=0), "prefill_keep_tokens=0"),
    (dict(prefill_keep_tokens=-1), "prefill_keep_tokens=-1"),
    (dict(prefill_keep_tokens=2.0), "prefill_keep_tokens=2.0"),
    (dict(prefill_keep_tokens=True), "prefill_keep_tokens=True"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_cli_and_llm_kwargs_reach_the_config(monkeypatch):
    from deepinfer.entrypoints.cli import build_parser, engine_kwargs
    from deepinfer.entrypoints.llm import build_engine_config

    monkeypatch.delenv(MODE, raising=False)
    monkeypatch.delenv(KEEP, raising=False)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu",
                                      "--yoco-prefill-truncation-mode", "exact",
                                      "--yoco-prefill-keep-tokens", "32"])
    cfg = build_engine_config(**engine_kwargs(args)).scheduler
    assert (cfg.prefill_truncation_mode, cfg.prefill_keep_tokens) == ("exact", 32)
    cfg = build_engine_config(**engine_kwargs(build_parser().parse_args(
        ["generate", "--prompt", "x", "--device", "cpu"]))).scheduler
    assert (cfg.prefill_truncation_mode, cfg.prefill_keep_tokens) == ("full", 140)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--yoco-prefill-truncation-mode", "half"])


# -- model interface -------------------------------------------------------------------------
class _Recorder(CausalLM):
    """Stands in for a model: one full-attention cache layer, zero logits (greedy token 0),
    and every forward's context kept for the test to read."""

    VOCAB = 16

    def __init__(self) -> None:
        super().__init__({"vocab_size": self.VOCAB}, torch.float32)
        self.attn = nn.Module()
        self.attn.kv_spec = KVCacheSpec("full", 1, 4, torch.float32)
        self.contexts: list[ForwardContext] = []

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        self.contexts.append(ctx)
        return torch.zeros(input_ids.shape[0], 2)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.VOCAB)


def test_default_model_has_no_bounded_replay():
    model = _Recorder()
    assert model.replay_keep_tokens("full", 140) is None
    for mode in ("exact", "compact"):
        with pytest.raises(ValueError, match=f"prefill truncation mode '{mode}' needs a model with bounded "
                                             r"replay \(DeepSeek-V4.1\); _Recorder has none"):
            model.replay_keep_tokens(mode, 140)


# -- runner ------------------------------------------------------------------------------------
def run_engine_loop(keep: int | None, prompts: dict[str, list[int]], budget: int = 16):
    """Scheduler + ModelRunner over the recording model, synchronously, to completion.
    Returns the model (its contexts) and the scheduler."""
    model = _Recorder()
    hf = {"architectures": ["Recorder"], "vocab_size": _Recorder.VOCAB}
    config = EngineConfig(model=ModelConfig(path="<recorder>", hf_config=hf, dtype=torch.float32,
                                            max_model_len=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=False))
    runner = ModelRunner(config, model, eos_token_ids={1}, bounded_replay=keep is not None)
    groups = build_groups([model.attn.kv_spec], 4)
    runner.allocate_kv_cache(groups, 64)
    sched = Scheduler(config.scheduler, KVCacheManager(groups, 64, True), 128, [1],
                      replay_keep_tokens=keep)
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add(seqs_for(rid, prompt, max_tokens=3, arrival=i))
    plans = []
    while sched.has_unfinished:
        plan = sched.schedule()
        plans.append(plan)
        sched.update(plan, runner.finish(runner.launch(plan)))
    assert len(model.contexts) == len(plans)
    return model, sched, plans


def test_runner_passes_replay_starts_to_the_context():
    # "a" (20 tokens) takes the whole first step; "b" (6 tokens) joins "a"'s decodes in a
    # mixed step; then both decode together.
    prompts = {"a": list(range(2, 22)), "b": list(range(30, 36))}
    model, sched, plans = run_engine_loop(keep=5, prompts=prompts, budget=20)
    assert [sched.requests[r].replay_start for r in prompts] == [15, 1]
    kinds = set()
    for plan, ctx in zip(plans, model.contexts):
        ids = [seq.req_id for seq in plan.seqs]
        if ctx.decode_only:
            assert ctx.replay_starts is None
            kinds.add("decode")
        else:
            assert ctx.replay_starts == [sched.requests[r].replay_start for r in ids]
            kinds.add("mixed" if len(ids) > 1 else "prefill")
    assert kinds == {"decode", "mixed", "prefill"}


def test_runner_leaves_replay_starts_out_when_off():
    model, _, _ = run_engine_loop(keep=None, prompts={"a": list(range(2, 22)), "b": list(range(30, 36))},
                                  budget=20)
    assert all(ctx.replay_starts is None for ctx in model.contexts)
