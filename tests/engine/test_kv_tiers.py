"""The KV cache's host and disk tiers through the whole engine, on the embedded DeepSeek-V4.1
model, the tiny DeepSeek-V4 and a tiny Llama: every layer group's bytes round-trip exactly;
a conversation resumed after its blocks left the device hits in the host tier, and after a
restart (a new engine process on the same directory) in the disk tier, with the tokens and
logprobs of no hit; corrupt and truncated disk entries are never used; aborted requests leak
no block in any tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.runner.kv_offload import SUFFIX, KVTierStore
from deepinfer.scheduler.plan import TierOp

from .. import TINY_V4_MODEL
from .conftest import make_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
FLOOD = SamplingParams(temperature=0.0, max_tokens=1)
SMALL = dict(device="cpu", num_kv_blocks=30)      # a device cache the flood empties
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["v4.1", "v4", "llama"])
def model(request, tmp_path_factory):
    if request.param == "llama":
        return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM"))
    return None if request.param == "v4.1" else TINY_V4_MODEL


def llm_for(model: str | None, **kw) -> LLM:
    return LLM(**({"model": model} if model else {}), **{**SMALL, **kw})


def conversation() -> tuple[list[int], list[int], list[list[int]]]:
    """A first turn, the next question, and unrelated prompts that push the first turn's
    blocks out of the small device cache."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(3, 1000, (200,), generator=g).tolist()
    question = torch.randint(3, 1000, (20,), generator=g).tolist()
    flood = [torch.randint(3, 1000, (150,), generator=g).tolist() for _ in range(3)]
    return first, question, flood


def reference(model: str | None) -> tuple[list[int], object]:
    """Caching off: the first turn's answer, and the second turn's output."""
    llm = llm_for(model, enable_prefix_caching=False)
    first, question, _ = conversation()
    answer = llm.generate([first], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    return list(answer), llm.generate([first + list(answer) + question], PARAMS, use_tqdm=False)[0]


def assert_same(got, want) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for tok, lg, lw in zip(got.outputs[0].token_ids, got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert abs(lg[tok].logprob - lw[tok].logprob) <= 1e-5


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    kv = engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert not engine.scheduler._tier_loads
    engine.runner.kv_tiers.flush()
    assert set(engine.runner.kv_tiers.host) == {e.slot for e in kv.tiers.host.values()}
    assert kv.tiers.host_used == sum(e.nbytes for e in kv.tiers.host.values()) <= kv.tiers.host_capacity


def test_every_group_round_trips_bit_exact(model, tmp_path):
    llm = llm_for(model, kv_offload_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    runner = llm.engine.runner
    groups = runner.groups
    assert len(groups) >= 1
    g = torch.Generator().manual_seed(1)
    runner.kv_buffer.copy_(torch.randint(0, 256, runner.kv_buffer.shape, dtype=torch.uint8, generator=g))
    n = len(groups)
    want = [runner.kv_buffer[1 + i, :groups[i].bytes_per_block].clone() for i in range(n)]
    store: KVTierStore = runner.kv_tiers
    ops = []
    for i in range(n):      # group i: block 1+i -> host; a second copy also -> disk
        ops += [TierOp("save", bytes([i]) * 32, i, slot=2 * i, block=1 + i),
                TierOp("save", bytes([i + 100]) * 32, i, slot=2 * i + 1, block=1 + i, keys=(b"k" * 32,)),
                TierOp("demote", bytes([i + 100]) * 32, i, slot=2 * i + 1, keys=(b"k" * 32,))]
    store.execute(ops)
    loads = store.execute([TierOp("load", bytes([i]) * 32, i, slot=2 * i, block=1 + n + i) for i in range(n)]
                          + [TierOp("load", bytes([i + 100]) * 32, i, block=1 + 2 * n + i, tier="disk")
                             for i in range(n)])
    assert store.wait(loads) == set()
    for i in range(n):
        assert torch.equal(runner.kv_buffer[1 + n + i, :groups[i].bytes_per_block], want[i])
        assert torch.equal(runner.kv_buffer[1 + 2 * n + i, :groups[i].bytes_per_block], want[i])
    store.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_host_tier_hit_equals_no_hit(model, async_scheduling):
    answer, want = reference(model)
    first, question, flood = conversation()
    llm = llm_for(model, kv_offload_gib=0.01, async_scheduling=async_scheduling)
    assert llm.generate([first], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == answer
    llm.generate(flood, FLOOD, use_tqdm=False)
    second = first + answer + question
    assert llm.engine.kv.find_prefix_hit("probe", second) == 0     # nothing left on the device
    llm.engine.kv.free("probe")
    out = llm.generate([second], PARAMS, use_tqdm=False)[0]
    kv = llm.engine.kv
    assert out.num_cached_tokens >= 192
    assert kv.tier_hits["host"] == out.num_cached_tokens and kv.tiers.stats.loaded_blocks["host"] > 0
    assert_same(out, want)
    assert_no_leaks(llm)


_RESTART = """
import json, sys
from deepinfer import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(device="cpu", num_kv_blocks=30, kv_disk_dir=args["dir"], kv_disk_gib=0.01)
p = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
out = llm.generate([args["prompt"]], p, use_tqdm=False)[0]
kv = llm.engine.kv
print(json.dumps({"cached": out.num_cached_tokens, "tokens": out.outputs[0].token_ids,
                  "logprobs": [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
                  "disk_hits": kv.tier_hits["disk"], "free": kv.num_free_blocks == kv.pool.num_blocks - 1}))
llm.close()
"""


def _engine_process(disk: Path, prompt: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _RESTART, json.dumps({"dir": str(disk), "prompt": prompt})],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_restart_finds_the_disk_tier(tmp_path):
    answer, want = reference(None)
    first, question, _ = conversation()
    disk = tmp_path / "kv"
    run1 = _engine_process(disk, first)
    assert run1["tokens"] == answer and run1["cached"] == 0
    assert list(disk.glob("*" + SUFFIX))
    run2 = _engine_process(disk, first + answer + question)
    assert run2["cached"] >= 192 and run2["disk_hits"] == run2["cached"] and run2["free"]
    assert run2["tokens"] == want.outputs[0].token_ids
    lw = [lp[t].logprob for t, lp in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert max(abs(a - b) for a, b in zip(run2["logprobs"], lw)) <= 1e-5


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_corrupt_and_truncated_disk_entries_are_not_used(damage, tmp_path):
    answer, want = reference(None)
    first, question, _ = conversation()
    llm = llm_for(None, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    llm.generate([first], PARAMS, use_tqdm=False)
    llm.close()
    files = sorted(tmp_path.glob("*" + SUFFIX))
    assert len(files) >= 2
    for path in files:
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(os.path.getsize(path) - 1)
            else:         # one payload byte flipped: only the checksum can tell
                f.seek(-3, os.SEEK_END)
                b = f.read(1)
                f.seek(-3, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x55]))
    llm = llm_for(None, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    kv = llm.engine.kv
    # Truncated files are not even indexed; corrupt ones are, and fail their checksum on loading.
    assert len(kv.tiers.disk) == (0 if damage == "truncate" else len(files))
    out = llm.generate([first + answer + question], PARAMS, use_tqdm=False)[0]
    assert kv.tier_hits["disk"] == 0 and out.num_cached_tokens == 0
    assert_same(out, want)
    if damage == "corrupt":
        deleted = [p for p in files if not p.exists()]
        assert deleted and len(deleted) == kv.tiers.stats.failed_loads
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_while_loading_leaks_nothing(async_scheduling, tmp_path):
    answer, _ = reference(None)
    first, question, flood = conversation()
    llm = llm_for(None, kv_offload_gib=0.001, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01,
                  async_scheduling=async_scheduling)
    llm.generate([first], PARAMS, use_tqdm=False)
    llm.generate(flood, FLOOD, use_tqdm=False)
    engine = llm.engine
    engine.add_request(first + answer + question, PARAMS, request_id="resumed")
    engine.add_request(flood[0], PARAMS, request_id="other")
    engine.step()
    assert "resumed" in engine.scheduler._tier_loads            # its blocks are being loaded
    engine.abort("resumed")
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)
