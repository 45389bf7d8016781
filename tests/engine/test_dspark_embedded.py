"""The embedded default model's trained DSpark drafter (``mtp.*``, written by
scripts/train_dspark_drafter.py) through the whole engine: greedy output with its drafts
equals greedy output without them, token for token; its drafts are accepted on text it was
not trained on far more often than a random drafter's; the model still loads and generates
without speculation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.spec.dspark import DSparkEngineDrafter

TEXT_CONFIG = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["text_config"]
BLOCK = TEXT_CONFIG["dspark_block_size"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    # Past the 32-token window: the drafter's context rows come from a full window.
    "This module provides access to some objects used or maintained by the interpreter and to "
    "functions that interact strongly with the interpreter. " * 2,
]
# Held out from the drafter's training text (train_dspark_drafter.py's split: docstrings whose
# CRC-32 is 0 mod 20, and their chat pairs).
HELD_OUT = [
    "Run command with arguments and return a CompletedProcess instance.\n\nThe returned instance will have",
    "Open a bzip2-compressed file in binary or text mode.\n\nThe",
    "<|im_start|>user\nWhat does zipfile.ZipFile do?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat does timeit.Timer do?<|im_end|>\n<|im_start|>assistant\n",
]
# Measured on HELD_OUT (48 greedy tokens each, full blocks of 4 verified): the committed
# drafter's drafts are accepted at a rate of 0.286 (tau 2.08); a randomly initialised drafter
# of the same config (make_tiny_model's initialisation, seed 0) gets 0.094 (tau 1.36: only its
# first slot, which reads the anchor's embedding through the target's head, is ever right).
MIN_ACCEPTANCE = 0.2


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(device="cpu", speculative_config={"method": "dspark", "num_speculative_tokens": BLOCK})


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_embedded_model_loads_and_generates_without_speculation(plain):
    assert plain.engine.runner.drafter is None
    assert plain.engine.model.drafter_tensors          # the mtp.* tensors are kept, not run
    out = plain.generate(["The list type"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16 and out[0].outputs[0].text.strip()


def test_dspark_greedy_equals_greedy_without_speculation(plain, spec):
    assert isinstance(spec.engine.runner.drafter, DSparkEngineDrafter)
    before = copy.deepcopy(spec.engine.scheduler.spec_stats)
    assert token_ids(spec, PROMPTS) == token_ids(plain, PROMPTS)
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > before.num_drafts and stats.num_accepted_tokens > before.num_accepted_tokens


def test_dspark_drafts_are_accepted_on_held_out_text(spec):
    before = copy.deepcopy(spec.engine.scheduler.spec_stats)
    token_ids(spec, HELD_OUT, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    stats = spec.engine.scheduler.spec_stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and accepted / drafted >= MIN_ACCEPTANCE, (accepted, drafted)
