"""Multi-process expert-parallel tests on the CPU: gloo process groups in spawned processes,
tiny MoE checkpoints of each family, and the forward a rank runs under an EP group.

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` (a module-level function)
in ``world_size`` processes joined in one gloo group, with timeouts on start-up, on every
collective and on the whole run, and returns each rank's result. The checkpoint builders write
a tiny float32 checkpoint (config.json + safetensors) that every rank then loads with the
real loader, each taking its own experts.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.layers.moe import FusedMoE
from deepinfer.models.base import CausalLM
from deepinfer.models.loader import load_model
from deepinfer.parallel.balancer import EPLBConfig, ExpertLoadBalancer
from deepinfer.parallel.expert import ExpertParallelConfig, use_expert_parallel
from deepinfer.parallel.groups import Group, ParallelGroups, use_groups

CPU = torch.device("cpu")
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[2]
V41_CHECKPOINT = REPO / "tests" / "data" / "v41_reference" / "checkpoint"


# -- processes ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str,
           args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = RUN_TIMEOUT_S) -> list[Any]:
    """Each rank's ``fn(rank, world_size, *args)`` result, run in ``world_size`` gloo processes.
    A rank's exception is raised here; a run past ``timeout`` seconds is killed and fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, _free_port(), out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size} expert-parallel ranks did not finish in {timeout} s")
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


# -- checkpoints -------------------------------------------------------------------------------
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and persistent buffer random (tid2eid rows: distinct expert ids)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                e = int(model.hf_config["n_routed_experts"])
                t.copy_(torch.stack([torch.randperm(e, generator=g)[:t.shape[1]] for _ in range(t.shape[0])]))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif t.is_floating_point():
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


# DeepSeek-V4 in DeepSeek's config layout: one hash-routed layer, CSA/HCA/sliding attention.
V4_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=96, hidden_size=64,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, compress_ratios=[4, 128, 0, 0], num_hash_layers=1, sliding_window=16,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, swiglu_limit=1.0,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=512,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1},
    num_nextn_predict_layers=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)


def write_v4_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random tiny DeepSeek-V4 checkpoint under our own names (stacked experts)."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    model = DeepseekV4ForCausalLM(V4_CONFIG, torch.float32)
    randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(V4_CONFIG))
    return path


HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_MOE = {
    "Qwen3MoeForCausalLM": dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
    "DeepseekV3ForCausalLM": dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=3,
                                  moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48,
                                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                                  n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                                  norm_topk_prob=True, routed_scaling_factor=1.7,
                                  num_nextn_predict_layers=0),
}


def write_hf_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    """A tiny random HF transformers ``arch`` model (every parameter and router bias perturbed),
    saved by ``save_pretrained`` (per-expert tensors)."""
    import transformers
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**HF_TINY, **HF_MOE[arch])
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.1)
    model.save_pretrained(path)
    return path


# -- what a rank runs --------------------------------------------------------------------------
@dataclass(frozen=True)
class EPRun:
    """One rank's run: dispatch path (``auto`` switches at ``allgather_max_tokens``), redundant
    slots, and when EPLB rebalances (every ``rebalance_every`` greedy steps; 0: never)."""

    dispatch: str = "auto"
    num_redundant_experts: int = 0
    greedy_steps: int = 4
    rebalance_every: int = 0
    allgather_max_tokens: int = 128


def load(path: Path, run: EPRun, group: Group) -> CausalLM:
    with use_groups(ParallelGroups(ep=group)), \
            use_expert_parallel(ExpertParallelConfig(run.num_redundant_experts, run.dispatch,
                                                     run.allgather_max_tokens)):
        return load_model(ModelConfig.from_path(path, "float32", None, CPU), CPU)


def moe_layers(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def expected_pairs(model: CausalLM, tokens: int) -> list[int]:
    """(token, expert) pairs each MoE layer routes in one forward of ``tokens`` tokens: tokens x
    top-k, none for MTP layers (a forward does not reach them)."""
    top_k = int(model.hf_config.get("text_config", model.hf_config)["num_experts_per_tok"])
    return [0 if name.startswith("mtp.") else tokens * top_k
            for name, m in model.named_modules() if isinstance(m, FusedMoE)]


@torch.no_grad()
def logprobs(model: CausalLM, seqs: list[list[int]]) -> torch.Tensor:
    """Float32 log-probabilities [sum T, V] of one flattened no-cache forward of ``seqs``."""
    ids = torch.tensor([t for s in seqs for t in s])
    ctx = ForwardContext.no_cache([len(s) for s in seqs], CPU)
    return torch.log_softmax(model.compute_logits(model(ids, ctx)), dim=-1)


@torch.no_grad()
def run_model(model: CausalLM, seqs: list[list[int]], run: EPRun) -> dict[str, Any]:
    """A batch forward (its log-probabilities and per-layer load counts), then ``greedy_steps``
    greedy tokens of every sequence (re-running the whole batch each step), EPLB stepping after
    each forward when it is on."""
    layers = moe_layers(model)
    balancer = (ExpertLoadBalancer(model, EPLBConfig(window_size=8, interval=run.rebalance_every))
                if run.rebalance_every else None)
    first = logprobs(model, seqs)
    result: dict[str, Any] = {"logprobs": first}
    if layers and layers[0].ep is not None:
        result["load"] = [m.ep.load.clone() for m in layers]
    seqs = [list(s) for s in seqs]
    steps, placements = [], []
    for _ in range(run.greedy_steps):
        if balancer is not None:
            balancer.step()
        lp = logprobs(model, seqs)
        ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
        last = lp[ends]                                                             # [B, V]
        steps.append(last)
        for s, tok in zip(seqs, last.argmax(-1).tolist()):
            s.append(tok)
    result["greedy"] = [s[-run.greedy_steps:] for s in seqs] if run.greedy_steps else []
    result["step_logprobs"] = steps
    if balancer is not None:
        result["stats"] = balancer.stats
        placements = [m.ep.phy2log.clone() for m in layers]
        result["placements"] = placements
        result["weights"] = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in layers]
    return result


def rank_runs(rank: int, world_size: int, path: Path, seqs: list[list[int]],
              runs: list[EPRun]) -> list[dict[str, Any]]:
    """What rank ``rank`` of an EP group of ``world_size`` computes for each of ``runs`` (the
    spawned function; one model per run, so one process start serves several runs)."""
    group = Group(world_size, rank, dist.group.WORLD) if world_size > 1 else Group()
    return [run_model(load(path, run, group), seqs, run) for run in runs]


def random_seqs(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


# -- one layer, each rank its own tokens ---------------------------------------------------------
LAYER_SHAPE = dict(num_experts=8, hidden=16, inter=8, top_k=3)


def layer_inputs(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own x [T, H] and softmax top-k routing (attention data parallelism)."""
    g = torch.Generator().manual_seed(100 + rank)
    s = LAYER_SHAPE
    x = torch.randn(tokens, s["hidden"], generator=g)
    weights, ids = torch.randn(tokens, s["num_experts"], generator=g).softmax(-1).topk(s["top_k"])
    return x, weights, ids


def layer_experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    s = LAYER_SHAPE
    return (torch.randn(s["num_experts"], 2 * s["inter"], s["hidden"], generator=g) / 4,
            torch.randn(s["num_experts"], s["hidden"], s["inter"], generator=g) / 3)


def rank_layer_runs(rank: int, world_size: int, tokens: list[int],
                    configs: list[ExpertParallelConfig]) -> list[torch.Tensor]:
    """An expert-parallel FusedMoE per config over rank ``rank``'s own ``tokens[rank]`` tokens
    -> its outputs."""
    s, outs = LAYER_SHAPE, []
    gate_up, down = layer_experts()
    for config in configs:
        with use_groups(ParallelGroups(ep=Group(world_size, rank, dist.group.WORLD))), \
                use_expert_parallel(config):
            layer = FusedMoE(s["num_experts"], s["hidden"], s["inter"])
        experts = torch.tensor(layer.ep.local_experts())
        with torch.no_grad():
            layer.gate_up_proj.copy_(gate_up[experts])
            layer.down_proj.copy_(down[experts])
        outs.append(layer(*layer_inputs(rank, tokens[rank])))
    return outs
