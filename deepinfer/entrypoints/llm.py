"""Offline batch inference: ``LLM.generate`` and ``LLM.chat``, with vLLM's ``LLM`` interface."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from deepinfer.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                              SpeculativeConfig, apply_hf_overrides, check_quantization, read_hf_config)
from deepinfer.engine.engine import Engine
from deepinfer.metrics import Metric, engine_metrics
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm_args import parse_llm_kwargs
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("deepinfer.llm")

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-model")

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dict.
PromptType = str | list[int] | dict[str, Any]


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
                        max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                        cpu_kv_cache_bytes: int = 1 << 30, block_size: int = 16,
                        num_kv_blocks: int | None = None, enable_prefix_caching: bool = True,
                        kv_offload_gib: float = 0.0, kv_disk_dir: str | None = None, kv_disk_gib: float = 0.0,
                        enable_chunked_prefill: bool = True, async_scheduling: bool = True,
                        seed: int = 0, device: str = "auto",
                        tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                        data_parallel_size: int = 1, context_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1, distributed_executor_backend: str = "mp",
                        enable_eplb: bool = False, num_redundant_experts: int = 0,
                        eplb_window_size: int = 1000, eplb_step_interval: int = 3000,
                        enforce_eager: bool = False,
                        cuda_graph_sizes: Sequence[int] | None = None,
                        hf_config: dict[str, Any] | None = None, hf_overrides: dict[str, Any] | None = None,
                        load_format: str = "auto", quantization: str | None = None,
                        skip_tokenizer_init: bool = False, tokenizer: str | None = None,
                        kv_cache_dtype: str = "auto", max_logprobs: int = 20,
                        yoco_prefill_truncation_mode: str | None = None,
                        yoco_prefill_keep_tokens: int | None = None,
                        batch_invariant: bool | None = None,
                        speculative_config: dict[str, Any] | SpeculativeConfig | None = None) -> EngineConfig:
    """The engine configuration for ``LLM(...)`` / ``deepinfer serve`` keyword arguments;
    ``model=None`` is the tiny model embedded in the package. ``hf_config`` gives the
    config.json in memory (``model`` then only labels it; use with ``load_format="dummy"``
    for random weights and ``skip_tokenizer_init=True`` for token-id prompts).
    ``hf_overrides``: config.json fields laid over the model's (``apply_hf_overrides``).
    ``quantization``: how the weights are kept (``config.QUANTIZATIONS``, models/quantize.py):
    None / "auto" the checkpoint's own formats (FP8/FP4 as shipped on CUDA, dequantised on the
    CPU), "none" all in ``dtype``, "fp8" / "mxfp4-experts" / "fp8+mxfp4-experts" quantised at load.
    ``tokenizer``: a directory to read the tokenizer from instead of the model's.
    ``max_num_batched_tokens=None``: 2048, or with chunked prefill off at least
    ``max_model_len`` (vLLM's rule).
    ``yoco_prefill_*``: bounded replay of prompts (``SchedulerConfig.prefill_truncation_mode``
    and ``prefill_keep_tokens``; None takes the DEEPINFER_YOCO_PREFILL_* variables).
    ``batch_invariant``: bitwise-reproducible outputs whatever the batch and chunking
    (``EngineConfig.batch_invariant``; None takes DEEPINFER_BATCH_INVARIANT).
    ``speculative_config``: vLLM's dict (``SpeculativeConfig.from_dict``); None: no
    speculative decoding. ``distributed_executor_backend``: how ranks start above one
    (``ParallelConfig``): ``"mp"`` worker processes, or ``"external_launcher"`` under torchrun.
    ``enable_eplb``, ``num_redundant_experts``, ``eplb_window_size``, ``eplb_step_interval``:
    expert load balancing while serving (``ParallelConfig``; needs ``expert_parallel_size`` > 1).
    ``kv_offload_gib``: host memory (GiB) for blocks evicted from the KV cache;
    ``kv_disk_dir`` / ``kv_disk_gib``: a disk tier below it, found again by a restarted
    engine (``CacheConfig``)."""
    dev = resolve_device(device)
    options = dict(load_format=load_format, skip_tokenizer_init=skip_tokenizer_init,
                   kv_cache_dtype=kv_cache_dtype, tokenizer=tokenizer, max_logprobs=max_logprobs)
    path = model or ("<in-memory config>" if hf_config is not None else DEFAULT_MODEL)
    if hf_config is None:
        hf_config = read_hf_config(path)
    if hf_overrides:
        hf_config = apply_hf_overrides(hf_config, hf_overrides)
    options["quantization"] = check_quantization(hf_config, quantization)
    model_cfg = ModelConfig.from_hf_config(hf_config, path, dtype, max_model_len, dev, **options)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, model_cfg.max_model_len)
    return EngineConfig(
        model=model_cfg,
        cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                          cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                          enable_prefix_caching=enable_prefix_caching,
                          num_blocks_override=num_kv_blocks,
                          kv_offload_bytes=_gib_bytes("kv_offload_gib", kv_offload_gib),
                          kv_disk_dir=None if kv_disk_dir is None else str(kv_disk_dir),
                          kv_disk_bytes=_gib_bytes("kv_disk_gib", kv_disk_gib)),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  cuda_graph_sizes=cuda_graph_sizes,
                                  async_scheduling=async_scheduling,
                                  prefill_truncation_mode=yoco_prefill_truncation_mode,
                                  prefill_keep_tokens=yoco_prefill_keep_tokens),
        parallel=ParallelConfig(tp=tensor_parallel_size, ep=expert_parallel_size,
                                dp=data_parallel_size, cp=context_parallel_size, pp=pipeline_parallel_size,
                                distributed_executor_backend=distributed_executor_backend,
                                enable_eplb=enable_eplb, num_redundant_experts=num_redundant_experts,
                                eplb_window_size=eplb_window_size, eplb_step_interval=eplb_step_interval),
        device=dev, seed=seed, enforce_eager=enforce_eager, batch_invariant=batch_invariant,
        speculative=None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config))


def _gib_bytes(name: str, gib: float) -> int:
    if not gib >= 0:
        raise ValueError(f"{name}={gib} must be >= 0 (GiB)")
    return int(gib * 2**30)


class LLM:
    """An engine for offline generation, with vLLM's ``LLM`` interface.

    ``model``: a checkpoint directory, or a Hugging Face repo id already in the local
    cache (nothing is downloaded); None loads the tiny model embedded in the package.
    The keyword arguments are those of :func:`build_engine_config` and vLLM's
    ``LLM`` / ``EngineArgs`` names (entrypoints/llm_args.py says how each is taken:
    honoured, a logged no-op, or refused with a ValueError saying why).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = parse_llm_kwargs(model, kwargs, build_engine_config, DEFAULT_MODEL)
        self.engine = Engine(build_engine_config(**args.engine))
        self.log_stats = args.log_stats
        self._generation_config = args.generation_config
        self._default_params: SamplingParams | None = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def close(self) -> None:
        """Persist the KV cache's tiers to the disk tier, if any, and wait for their pending
        writes; with tensor or expert parallelism, stop the worker processes (``Engine.close``).
        The LLM is not used after. Also on leaving a ``with LLM(...) as llm:`` block."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (``encode``, ``decode``, ``apply_chat_template``, and
        transformers' call shape); None when built with ``skip_tokenizer_init=True``."""
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges as vLLM's metric objects (deepinfer/metrics.py):
        prefix-cache queries and hits, preemptions, with speculative decoding its drafts,
        draft tokens and accepted tokens (in total and per draft position), and with EPLB its
        rebalances and load imbalance."""
        return engine_metrics(self.engine, self.engine.config.model.path)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults with the sampling fields of the model's generation_config.json laid
        over them (``generation_config="auto"``, the default; ``"vllm"`` ignores the file):
        what ``generate`` and ``chat`` use when given no sampling_params."""
        if self._default_params is None:
            self._default_params = SamplingParams(**generation_defaults(self._generation_config))
        return self._default_params.clone()

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: Any = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A prompt is a string,
        a list of token ids, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``
        dicts (TextPrompt / TokensPrompt); a list of those, mixed freely, is a batch.
        ``use_tqdm``: a progress bar, or a tqdm-like class to draw it with."""
        if prompts is None:
            raise ValueError("generate() needs prompts")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        parsed = [parse_prompt(p, i) for i, p in enumerate(batch_of_prompts(prompts))]
        return self._generate(parsed, sampling_params, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (the checkpoint's, or
        ``chat_template``) and generate. ``messages`` is one conversation (a list of
        messages) or a list of them. ``chat_template_content_format``: "string" joins a
        message's text parts, "openai" makes string contents a list of text parts, "auto"
        passes contents as given. ``continue_final_message`` continues the last message
        (with ``add_generation_prompt=False``). ``chat_template_kwargs`` become template
        variables (``enable_thinking``, ...). Each output's ``prompt`` is the rendered text."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: multimodal inputs are not supported")
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was built with skip_tokenizer_init=True")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template_vars = dict(chat_template_kwargs or {})
        # vLLM lets chat_template_kwargs carry these too; they win, as there.
        chat_template = template_vars.pop("chat_template", chat_template)
        add_generation_prompt = template_vars.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = template_vars.pop("continue_final_message", continue_final_message)
        if tools is not None:
            template_vars.setdefault("tools", tools)
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                chat_contents(conv, chat_template_content_format), add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, continue_final_message=continue_final_message, **template_vars)
            prompts.append(Prompt(self.tokenizer.encode(text, add_special_tokens=False), text))
        return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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
        ids = [self.engine.add_request(p.text if p.token_ids is None else p.token_ids, sp)
               for p, sp in zip(prompts, params)]
        outputs = self._run(ids, use_tqdm)
        for prompt, out in zip(prompts, outputs):
            if out.prompt is None and prompt.text is not None:
                out.prompt = prompt.text   # a token-id prompt that came with its text (chat)
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        if not ids:
            return []
        bar_cls = use_tqdm if callable(use_tqdm) else tqdm
        bar = bar_cls(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
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
        if self.log_stats:
            elapsed = max(time.perf_counter() - start, 1e-9)
            logger.info("%d requests in %.2f s: %d input tokens (%.1f/s), %d output tokens (%.1f/s)", len(ids),
                        elapsed, in_tokens, in_tokens / elapsed, out_tokens, out_tokens / elapsed)
        return [done[i] for i in ids]


@dataclass
class Prompt:
    """One prompt as the engine takes it: token ids, or text (tokenised by the engine);
    ``text`` beside ids is the text they came from, reported as the output's ``prompt``."""

    token_ids: list[int] | None
    text: str | None = None


# vLLM's TextPrompt / TokensPrompt keys, and the ones of theirs this engine refuses.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_REFUSED_PROMPT_KEYS = {
    "multi_modal_data": "multimodal inputs are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "multi_modal_uuids": "multimodal inputs are not supported",
    "token_type_ids": "token type ids are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "cache_salt": "a prefix-cache salt is not supported",
}


def batch_of_prompts(prompts: Any) -> list[Any]:
    """``prompts`` as a list of single prompts: a string, a dict or a list of token ids is
    one prompt; any other sequence is a batch."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(f"prompts must be a str, a list of token ids, a dict (TextPrompt / TokensPrompt) or a "
                     f"list of those; got {type(prompts).__name__}")


def parse_prompt(prompt: Any, index: int) -> Prompt:
    """One prompt of a batch (see ``LLM.generate``); ValueError naming what is wrong with it."""
    where = f"prompts[{index}]"
    if isinstance(prompt, str):
        return Prompt(None, prompt)
    if isinstance(prompt, dict):
        for key, why in _REFUSED_PROMPT_KEYS.items():
            if prompt.get(key) is not None:
                raise ValueError(f"{where}[{key!r}]: {why}")
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS) - set(_REFUSED_PROMPT_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; a prompt dict takes "
                             "'prompt' (text) or 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be a str")
        if ids is None:
            if text is None:
                raise ValueError(f"{where} needs 'prompt' (text) or 'prompt_token_ids'")
            return Prompt(None, text)
        return Prompt(_token_ids(ids, f"{where}['prompt_token_ids']"), text)
    if isinstance(prompt, (list, tuple)):
        return Prompt(_token_ids(prompt, where))
    raise ValueError(f"{where} must be a str, a list of token ids or a dict; got {type(prompt).__name__}")


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where} must be a list of int token ids")
    return list(ids)


def chat_contents(messages: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """The messages with their contents in the form ``content_format`` asks for (vLLM's
    ``chat_template_content_format``); a content part that is not text is refused."""
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format={content_format!r} must be 'auto', 'string' or 'openai'")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            for part in content:
                if not (isinstance(part, dict) and part.get("type", "text") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}] content part {part!r}: only text parts are supported "
                                     "(no multimodal inputs)")
            if content_format == "string":
                message = {**message, "content": "\n".join(part["text"] for part in content)}
        elif isinstance(content, str) and content_format == "openai":
            message = {**message, "content": [{"type": "text", "text": content}]}
        out.append(message)
    return out


# generation_config.json fields that set sampling defaults, and their SamplingParams names
# (vLLM's list).
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(directory: str | None) -> dict[str, Any]:
    """The SamplingParams fields ``directory``/generation_config.json sets (none without one)."""
    if directory is None:
        return {}
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    found = {ours: config[theirs] for theirs, ours in _GENERATION_FIELDS.items() if config.get(theirs) is not None}
    if found:
        logger.info("default sampling parameters from %s: %s", path, found)
    return found
