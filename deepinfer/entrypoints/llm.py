"""Offline batch inference: ``LLM.generate`` and ``LLM.chat`` (vLLM-compatible)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from deepinfer.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepinfer.engine.engine import Engine
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-model")

PromptType = str | list[int]


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)


def build_engine_config(model: str | None = None, *, dtype: str = "auto",
                        max_model_len: int | None = None, max_num_seqs: int = 64,
                        max_num_batched_tokens: int = 2048, gpu_memory_utilization: float = 0.9,
                        cpu_kv_cache_bytes: int = 1 << 30, block_size: int = 16,
                        num_kv_blocks: int | None = None, enable_prefix_caching: bool = True,
                        enable_chunked_prefill: bool = True, async_scheduling: bool = True,
                        seed: int = 0, device: str = "auto",
                        tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                        data_parallel_size: int = 1, context_parallel_size: int = 1,
                        enforce_eager: bool = False,
                        cuda_graph_sizes: Sequence[int] | None = None,
                        hf_config: dict[str, Any] | None = None, load_format: str = "auto",
                        skip_tokenizer_init: bool = False, kv_cache_dtype: str = "auto",
                        yoco_prefill_truncation_mode: str | None = None,
                        yoco_prefill_keep_tokens: int | None = None) -> EngineConfig:
    """The engine configuration for ``LLM(...)`` / ``deepinfer serve`` keyword arguments;
    ``model=None`` is the tiny model embedded in the package. ``hf_config`` gives the
    config.json in memory (``model`` then only labels it; use with ``load_format="dummy"``
    for random weights and ``skip_tokenizer_init=True`` for token-id prompts).
    ``yoco_prefill_*``: bounded replay of prompts (``SchedulerConfig.prefill_truncation_mode``
    and ``prefill_keep_tokens``; None takes the DEEPINFER_YOCO_PREFILL_* variables)."""
    dev = resolve_device(device)
    options = dict(load_format=load_format, skip_tokenizer_init=skip_tokenizer_init,
                   kv_cache_dtype=kv_cache_dtype)
    if hf_config is not None:
        model_cfg = ModelConfig.from_hf_config(hf_config, model or "<in-memory config>", dtype,
                                               max_model_len, dev, **options)
    else:
        model_cfg = ModelConfig.from_path(model or DEFAULT_MODEL, dtype, max_model_len, dev, **options)
    return EngineConfig(
        model=model_cfg,
        cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                          cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                          enable_prefix_caching=enable_prefix_caching,
                          num_blocks_override=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  cuda_graph_sizes=cuda_graph_sizes,
                                  async_scheduling=async_scheduling,
                                  prefill_truncation_mode=yoco_prefill_truncation_mode,
                                  prefill_keep_tokens=yoco_prefill_keep_tokens),
        parallel=ParallelConfig(tp=tensor_parallel_size, ep=expert_parallel_size,
                                dp=data_parallel_size, cp=context_parallel_size),
        device=dev, seed=seed, enforce_eager=enforce_eager)


class LLM:
    """An engine for offline generation.

    ``model=None`` loads the tiny model embedded in the package.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """``engine_kwargs`` are those of :func:`build_engine_config`."""
        self.engine = Engine(build_engine_config(model, **engine_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A string or a
        list of token ids is one prompt; a list of those is a batch."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
        # Only finished outputs are kept, so the engine builds no per-step outputs (copies of
        # every token list) for them; the caller's params are left as they are (one copy per
        # distinct params object).
        final: dict[int, SamplingParams] = {}
        for sp in params:
            if sp.output_kind is not RequestOutputKind.FINAL_ONLY and id(sp) not in final:
                final[id(sp)] = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final.get(id(sp), sp) for sp in params]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        while len(done) < len(ids):
            outputs = self.engine.step()
            if not outputs and not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unreported")
            for out in outputs:
                if out.finished:
                    done[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, "
                                            f"output: {out_tokens / elapsed:.1f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
