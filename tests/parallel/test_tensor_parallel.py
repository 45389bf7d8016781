"""Tensor parallelism on the CPU (gloo, worker processes): the sharded layers against their
full single-device selves, whole engines at tp=2 against the single-process run (greedy tokens
equal, float32 logprobs within 1e-5), a killed worker failing its requests without a hang, and
bad sizes refused before anything loads. The engine tests run the same code at tp=1."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.llm import DEFAULT_MODEL, build_engine_config
from deepinfer.parallel.executor import check_parallel, free_port
from deepinfer.parallel.groups import Group
from deepinfer.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_of,
)
from tests.engine.conftest import make_checkpoint
from tests.parallel.shapes import ENGINE_OPTIONS, LOGPROB_TOL, MOE, TINY_V4, V3
from tests.parallel.workers import kill_and_drain

NEW_TOKENS = 8

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {"LlamaForCausalLM": make_checkpoint(root, "LlamaForCausalLM", attention_bias=True),
            "Qwen3ForCausalLM": make_checkpoint(root, "Qwen3ForCausalLM", head_dim=16),
            "Qwen3MoeForCausalLM": make_checkpoint(root, "Qwen3MoeForCausalLM", **MOE),
            "DeepseekV3ForCausalLM": make_checkpoint(root, "DeepseekV3ForCausalLM", **V3),
            "DeepseekV4ForCausalLM": TINY_V4, "DeepseekV41ForCausalLM": Path(DEFAULT_MODEL)}


# -- the layers --------------------------------------------------------------------------------
def test_layers_at_size_1_are_the_plain_modules():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g)
    col, row = ColumnParallelLinear(12, 8), RowParallelLinear(12, 8)
    for layer in (col, row):
        assert type(layer).__mro__[1] is torch.nn.Linear
        assert not hasattr(layer.weight, "tp_shard")
        layer.weight.data.normal_(generator=g)
        layer.bias.data.normal_(generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    emb = VocabParallelEmbedding(10, 4)
    assert emb.weight.shape == (10, 4)
    ids = torch.tensor([0, 9, 3])
    torch.testing.assert_close(emb(ids), emb.weight[ids], rtol=0, atol=0)


def test_shard_of_cuts_this_ranks_part_and_names_bad_shapes():
    param = torch.empty(3, 4)
    param.tp_shard = (0, 1, 2)
    full = torch.arange(24.0).view(6, 4)
    assert torch.equal(shard_of(param, full), full[3:6])
    param_cols = torch.empty(6, 2)
    param_cols.tp_shard = (1, 1, 2)
    assert torch.equal(shard_of(param_cols, full), full[:, 2:4])
    with pytest.raises(ValueError, match=r"cannot be split into 2 shards of \(3, 4\) along dim 0"):
        shard_of(param, torch.zeros(5, 4))


def _layer_worker(rank: int, world: int, port: int, errors: mp.Queue) -> None:
    """Each rank builds the sharded layers, loads its shards of full random weights (seeded
    alike on every rank), and checks the outputs against the full single-device computation."""
    try:
        torch.manual_seed(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        tp = Group(size=world, rank=rank, group=dist.new_group(list(range(world))))
        g = torch.Generator().manual_seed(1)
        t, k, n, v = 5, 12, 8, 10
        x = torch.randn(t, k, generator=g)
        w1, b1 = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        w2, b2 = torch.randn(k, n, generator=g), torch.randn(k, generator=g)
        table = torch.randn(v, k, generator=g)
        ids = torch.randint(0, v, (t,), generator=g)

        def load(layer: torch.nn.Module, **full: torch.Tensor) -> torch.nn.Module:
            for name, tensor in full.items():
                param = getattr(layer, name)
                param.data.copy_(shard_of(param, tensor))
            return layer

        col = load(ColumnParallelLinear(k, n, group=tp), weight=w1, bias=b1)
        row = load(RowParallelLinear(n, k, group=tp), weight=w2, bias=b2)
        gathered = load(ColumnParallelLinear(k, n, gather_output=True, group=tp), weight=w1, bias=b1)
        emb = load(VocabParallelEmbedding(v, k, group=tp), weight=table)
        head = load(ParallelLMHead(k, v, group=tp), weight=table)
        with torch.inference_mode():
            h = F.linear(x, w1, b1)
            assert col.weight.shape == (n // world, k)
            torch.testing.assert_close(col(x), h[:, rank * n // world:(rank + 1) * n // world])
            # Column- then row-parallel: the whole MLP-shaped product, summed across ranks.
            torch.testing.assert_close(row(col(x)), F.linear(h, w2, b2), rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(gathered(x), h)
            torch.testing.assert_close(emb(ids), table[ids], rtol=0, atol=0)
            torch.testing.assert_close(head(x), x @ table.T)
        dist.destroy_process_group()
    except BaseException as exc:
        errors.put(f"rank {rank}: {exc!r}")
        raise


@pytest.mark.slow
def test_sharded_layers_equal_the_full_layers_on_two_ranks():
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_layer_worker, args=(r, 2, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a layer worker hung"
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0, 0]


# -- whole engines ---------------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 19, 40)]


def _run(path: Path, tp: int, **options) -> tuple[list[list[int]], list[list[dict]], list[list[int]]]:
    """Greedy tokens with prompt and sample logprobs (synchronous steps, chunked prefill), then
    greedy tokens again under overlapped scheduling with prefix-cache hits."""
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                   prompt_logprobs=3, logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(path), device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=16,
             dtype="float32", **options) as llm:
        outs = llm.generate(_prompts(), with_logprobs, use_tqdm=False)
        again = llm.generate(_prompts(), plain, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:] + o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs, [o.outputs[0].token_ids for o in again]


_reference: dict[str, tuple] = {}


def _single_process(checkpoints: dict[str, Path], arch: str) -> tuple:
    if arch not in _reference:
        _reference[arch] = _run(checkpoints[arch], tp=1, **ENGINE_OPTIONS.get(arch, {}))
    return _reference[arch]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                  "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_engine_equals_single_process(checkpoints, arch, tp):
    ref_tokens, ref_logprobs, _ = _single_process(checkpoints, arch)
    tokens, logprobs, again = _run(checkpoints[arch], tp, **ENGINE_OPTIONS.get(arch, {}))
    assert tokens == ref_tokens
    assert again == ref_tokens
    for ref_seq, seq in zip(ref_logprobs, logprobs):
        assert len(seq) == len(ref_seq)
        for ref_pos, pos in zip(ref_seq, seq):
            # The same top tokens (up to ties), each logprob within tolerance.
            common = ref_pos.keys() & pos.keys()
            assert len(common) >= len(ref_pos) - 1
            for t in common:
                assert abs(ref_pos[t] - pos[t]) <= LOGPROB_TOL, (t, ref_pos[t], pos[t])


@pytest.mark.slow
@pytest.mark.parametrize("arch, tp, ep", [("Qwen3MoeForCausalLM", 1, 2), ("Qwen3MoeForCausalLM", 2, 2),
                                          ("DeepseekV3ForCausalLM", 1, 2)])
def test_expert_parallel_engine_equals_single_process(checkpoints, arch, tp, ep):
    # Every rank runs every request (no attention data parallelism): the experts are split
    # over the ranks (parallel/expert.py), the attention over the tensor-parallel ones.
    ref_tokens, ref_logprobs, _ = _single_process(checkpoints, arch)
    tokens, logprobs, again = _run(checkpoints[arch], tp, expert_parallel_size=ep)
    assert tokens == ref_tokens and again == ref_tokens
    for ref_seq, seq in zip(ref_logprobs, logprobs):
        for ref_pos, pos in zip(ref_seq, seq):
            assert len(ref_pos.keys() & pos.keys()) >= len(ref_pos) - 1
            for t in ref_pos.keys() & pos.keys():
                assert abs(ref_pos[t] - pos[t]) <= LOGPROB_TOL, (t, ref_pos[t], pos[t])


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_worker_fails_requests_without_hanging(checkpoints, victim):
    llm = LLM(model=str(checkpoints["LlamaForCausalLM"]), device="cpu", tensor_parallel_size=2)
    engine = llm.engine
    pids = engine.runner.pids
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts()]
    kill_and_drain(llm, ids, pids[victim], victim, params)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1


@pytest.mark.slow
def test_close_stops_the_workers(checkpoints):
    with LLM(model=str(checkpoints["Qwen3ForCausalLM"]), device="cpu", tensor_parallel_size=2) as llm:
        procs = llm.engine.runner.procs
        assert all(p.is_alive() for p in procs)
    assert [p.exitcode for p in procs] == [0, 0]
    with pytest.raises(RuntimeError, match="the engine was closed|shut down"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


def _torchrun_rank(rank: int, world: int, port: int, path: str, results: mp.Queue) -> None:
    """One rank as torchrun starts it: the launcher's environment, then a whole engine."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        tokens, logprobs, again = _run(Path(path), world, distributed_executor_backend="external_launcher")
        results.put((rank, tokens, logprobs, again))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put((rank, repr(exc), None, None))
        raise


@pytest.mark.slow
def test_ranks_of_a_torchrun_launch_each_run_the_engine(checkpoints):
    arch = "LlamaForCausalLM"
    ref_tokens, ref_logprobs, _ = _single_process(checkpoints, arch)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, 2, port, str(checkpoints[arch]), results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, tokens, logprobs, again = results.get(timeout=120)
        assert logprobs is not None, f"rank {rank}: {tokens}"
        got[rank] = (tokens, logprobs, again)
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    for tokens, logprobs, again in got.values():
        assert tokens == ref_tokens and again == ref_tokens
        for ref_seq, seq in zip(ref_logprobs, logprobs):
            for ref_pos, pos in zip(ref_seq, seq):
                for t in ref_pos.keys() & pos.keys():
                    assert abs(ref_pos[t] - pos[t]) <= LOGPROB_TOL


def test_external_launcher_outside_a_launch_is_refused(checkpoints, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="external_launcher' joins a torchrun launch"):
        LLM(model=str(checkpoints["LlamaForCausalLM"]), device="cpu", tensor_parallel_size=2,
            distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' is not supported"):
        LLM(model=str(checkpoints["LlamaForCausalLM"]), device="cpu", distributed_executor_backend="ray")


# -- sizes refused before anything loads ------------------------------------------------------------
@pytest.mark.parametrize("arch, kwargs, error, message", [
    ("LlamaForCausalLM", dict(tensor_parallel_size=3), ValueError,
     r"tensor_parallel_size=3 must divide config.json num_attention_heads=4"),
    ("LlamaForCausalLM", dict(tensor_parallel_size=4), ValueError,
     r"tensor_parallel_size=4 must divide config.json num_key_value_heads=2"),
    ("LlamaForCausalLM", dict(expert_parallel_size=2), ValueError, "has no routed experts"),
    ("DeepseekV3ForCausalLM", dict(tensor_parallel_size=3), ValueError,
     r"tensor_parallel_size=3 must divide config.json num_attention_heads=4"),
    ("Qwen3MoeForCausalLM", dict(expert_parallel_size=3), ValueError,
     "expert_parallel_size=3 must divide the model's 8 routed experts"),
    ("Qwen3MoeForCausalLM", dict(tensor_parallel_size=2, expert_parallel_size=3), ValueError,
     r"must divide each other: the world is max\(tp, ep\)=3 ranks"),
    ("LlamaForCausalLM", dict(data_parallel_size=2), NotImplementedError,
     r"dp=2 \(data_parallel_size\) without expert parallelism \(expert_parallel_size=1\)"),
    ("LlamaForCausalLM", dict(context_parallel_size=2, tensor_parallel_size=2), NotImplementedError,
     r"cp=2 \(context_parallel_size\) with tp=2 \(tensor_parallel_size\) is not yet supported"),
    ("LlamaForCausalLM", dict(tensor_parallel_size=2, kv_offload_gib=0.01), NotImplementedError,
     "host and disk tiers are not yet supported under parallelism"),
    ("LlamaForCausalLM", dict(tensor_parallel_size=2, speculative_config={"method": "mtp"}),
     NotImplementedError, "model drafters are not yet supported under parallelism"),
])
def test_bad_sizes_are_refused_before_loading(checkpoints, arch, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(model=str(checkpoints[arch]), device="cpu", **kwargs)
    assert not mp.active_children()


def test_sizes_that_do_not_divide_deepseek_v4_attention_are_refused():
    # 4 heads in 2 output groups: tp=4 splits the heads but not the groups.
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide config.json o_groups=2"):
        LLM(device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide config.json num_attention_heads=4"):
        LLM(model=str(TINY_V4), device="cpu", tensor_parallel_size=3)
    assert not mp.active_children()


def test_a_model_without_tensor_parallel_layers_is_refused(monkeypatch):
    from deepinfer.models.base import CausalLM
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

    monkeypatch.setattr(DeepseekV41ForCausalLM, "check_parallel", classmethod(CausalLM.check_parallel.__func__))
    with pytest.raises(NotImplementedError, match="DeepseekV41ForCausalLM has no tensor-parallel layers yet"):
        LLM(device="cpu", tensor_parallel_size=2)
    assert not mp.active_children()


def test_more_ranks_than_cuda_devices_is_refused(checkpoints, monkeypatch):
    config = build_engine_config(str(checkpoints["LlamaForCausalLM"]), device="cpu", tensor_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="need 2 CUDA devices; 1 are visible"):
        check_parallel(replace(config, device=torch.device("cuda")))


def test_dummy_weights_of_a_row_parallel_shard_scale_by_the_whole_fan_in():
    from deepinfer.models.dummy import init_dummy_weights

    layer = torch.nn.Linear(64, 512, bias=False)     # this rank's half of a [512, 128] matrix
    layer.weight.tp_shard = (1, 0, 2)
    init_dummy_weights(layer, seed=0)
    assert abs(layer.weight.std().item() - 128 ** -0.5) < 0.05 * 128 ** -0.5
    column = torch.nn.Linear(64, 512, bias=False)    # a column shard keeps its inputs whole
    column.weight.tp_shard = (0, 0, 2)
    init_dummy_weights(column, seed=0)
    assert abs(column.weight.std().item() - 64 ** -0.5) < 0.05 * 64 ** -0.5


def test_fp8_quantization_takes_the_parallel_linears_at_size_1():
    from deepinfer.layers.mlp import GatedMLP
    from deepinfer.layers.quant_linear import Fp8Linear
    from deepinfer.models.quantize import QuantPlan, quantize_model

    model = torch.nn.Sequential(GatedMLP(64, 128))
    torch.nn.init.normal_(model[0].gate_proj.weight)
    counts = quantize_model(model, QuantPlan(fp8=True, fp4_experts=False, block=(32, 32)))
    assert counts["fp8_linears"] == 3
    assert all(isinstance(getattr(model[0], n), Fp8Linear) for n in ("gate_proj", "up_proj", "down_proj"))
