"""``LLM(...)``'s keyword arguments: vLLM's names onto ``build_engine_config``'s.

Each keyword is one of four kinds, so that a vLLM user's arguments are never
silently dropped:

- an engine option: a parameter of ``build_engine_config`` (most have vLLM's name
  and meaning); ``None`` for one whose default is not None means that default, as
  in vLLM;
- a vLLM name translated here (``num_gpu_blocks_override``, ``compilation_config``,
  ``enable_expert_parallel``, ``disable_log_stats``, ``generation_config``, the
  model and tokenizer look-up with ``revision`` / ``download_dir``);
- a vLLM name whose meaning is a no-op in this engine (``trust_remote_code``:
  no code is ever run from a checkpoint), accepted with one INFO line saying why;
- a vLLM name for a feature this engine does not have: refused with a ValueError
  saying why, unless it is passed at vLLM's default (which asks for nothing).

Any other keyword is a ValueError naming the closest known names.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deepinfer.sampling_params import unknown_keyword_error

logger = logging.getLogger("deepinfer.llm")

# vLLM names with no effect here, and why (logged at INFO when passed).
_NO_OP: dict[str, str] = {
    "trust_remote_code": "deepinfer never runs code from a checkpoint: every architecture is built in",
    "code_revision": "deepinfer never runs code from a checkpoint",
    "hf_token": "deepinfer downloads nothing, so it needs no Hugging Face token",
    "swap_space": "preempted requests are recomputed, never swapped to CPU memory",
    "disable_custom_all_reduce": "all-reduces are torch.distributed's (gloo or NCCL); there is no custom one",
    "max_parallel_loading_workers": "the checkpoint is read in this process, one file at a time",
    "max_seq_len_to_capture": "the decode CUDA graphs serve every context length",
    "disable_async_output_proc": "outputs are processed while the next step runs (async_scheduling) or not "
                                 "at all; the switch is async_scheduling",
    "served_model_name": "the offline LLM reports no model name",
    "use_tqdm_on_load": "loading shows no progress bar",
}

# vLLM names for features this engine does not have: vLLM's default (accepted, asks for
# nothing) and why another value is refused.
_REFUSED: dict[str, tuple[Any, str]] = {
    "cpu_offload_gb": (0, "offloading weights to CPU memory is not supported"),
    "kv_cache_memory_bytes": (None, "the KV cache is sized by gpu_memory_utilization on CUDA and by "
                                    "cpu_kv_cache_bytes on the CPU"),
    "enable_lora": (False, "LoRA adapters are not supported"),
    "max_loras": (None, "LoRA adapters are not supported"),
    "max_lora_rank": (None, "LoRA adapters are not supported"),
    "enable_sleep_mode": (False, "sleep mode is not supported"),
    "calculate_kv_scales": (False, "FP8 KV-cache scales are not supported"),
    "disable_sliding_window": (False, "sliding-window layers always keep their window"),
    "enable_prompt_embeds": (False, "prompt embeddings are not supported; prompts are text or token ids"),
    "allowed_local_media_path": ("", "multimodal inputs are not supported"),
    "allowed_media_domains": (None, "multimodal inputs are not supported"),
    "limit_mm_per_prompt": (None, "multimodal inputs are not supported"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "worker_cls": ("auto", "the engine has no pluggable workers"),
    "worker_extension_cls": ("", "the engine has no pluggable workers"),
    "pooler_config": (None, "pooling models are not supported"),
    "override_pooler_config": (None, "pooling models are not supported"),
    "kv_transfer_config": (None, "KV-cache transfer between engines is not supported yet"),
    "scheduling_policy": ("fcfs", "requests are scheduled first come, first served"),
    "logprobs_mode": ("raw_logprobs", "logprobs are those of the raw model distribution"),
}

# vLLM names with a choice of values, of which these mean what this engine does.
_CHOICES: dict[str, tuple[tuple[Any, ...], str]] = {
    "tokenizer_mode": (("auto", "hf", "fast"), "the tokenizer is the fast one of tokenizer.json"),
    "config_format": (("auto", "hf"), "the model's config is read from config.json"),
    "task": (("auto", "generate"), "the engine generates text only"),
    "runner": (("auto", "generate"), "the engine generates text only"),
    "structured_outputs_config": ((None,), "structured outputs use xgrammar, with no options"),
    "guided_decoding_backend": (("auto", "xgrammar"), "structured outputs use xgrammar"),
}

# compilation_config keys this engine reads (vLLM's CompilationConfig names).
_COMPILATION_KEYS = ("level", "mode", "cudagraph_capture_sizes", "cudagraph_mode")

# vLLM names translated by parse_llm_kwargs.
_TRANSLATED = ("disable_log_stats", "enable_expert_parallel", "compilation_config", "num_gpu_blocks_override",
               "revision", "tokenizer_revision", "download_dir", "generation_config")


@dataclass
class LLMArgs:
    """What ``LLM(...)`` needs: ``build_engine_config``'s keyword arguments, whether to log
    stats per call, and where the default sampling parameters come from."""

    engine: dict[str, Any] = field(default_factory=dict)
    log_stats: bool = False
    generation_config: str | None = None   # a directory with generation_config.json; None: none


def engine_option_defaults(build: Callable[..., Any]) -> dict[str, Any]:
    """``build``'s keyword parameters and their defaults."""
    return {name: p.default for name, p in inspect.signature(build).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY or name == "model"}


def parse_llm_kwargs(model: str | None, kwargs: dict[str, Any], build: Callable[..., Any],
                     default_model: str) -> LLMArgs:
    """Sort ``LLM(model, **kwargs)`` into ``build``'s (``build_engine_config``) arguments;
    ValueError for a refused or unknown keyword (see the module docstring). ``model=None``
    is ``default_model``, the embedded one."""
    defaults = engine_option_defaults(build)
    known = sorted(set(defaults) | set(_NO_OP) | set(_REFUSED) | set(_CHOICES) | set(_TRANSLATED))
    kwargs = dict(kwargs)
    for name in kwargs:
        if name not in known:
            raise unknown_keyword_error("LLM", name, known)
    for name, why in _NO_OP.items():
        if name in kwargs:
            logger.info("LLM(%s=%r) has no effect: %s", name, kwargs.pop(name), why)
    for name, (default, why) in _REFUSED.items():
        if name in kwargs and kwargs.pop(name) not in (default, None):
            raise ValueError(f"LLM({name}=...) is not supported: {why}")
    for name, (values, why) in _CHOICES.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value not in values:
                raise ValueError(f"LLM({name}={value!r}) is not supported: {why}; accepted: "
                                 f"{', '.join(repr(v) for v in values)}")

    args = LLMArgs()
    args.log_stats = not kwargs.pop("disable_log_stats", True)
    _translate_parallel(kwargs)
    _translate_compilation(kwargs.pop("compilation_config", None), kwargs)
    if "num_gpu_blocks_override" in kwargs:
        kwargs.setdefault("num_kv_blocks", kwargs.pop("num_gpu_blocks_override"))
    revision = kwargs.pop("revision", None)
    tokenizer_revision = kwargs.pop("tokenizer_revision", None)
    download_dir = kwargs.pop("download_dir", None)
    generation_config = kwargs.pop("generation_config", "auto")

    engine = {k: v for k, v in kwargs.items() if not (v is None and defaults[k] is not None)}
    in_memory = engine.get("hf_config") is not None
    if model is not None and not in_memory:
        model = resolve_checkpoint("model", model, revision, download_dir)
    else:
        for option, value in (("revision", revision), ("download_dir", download_dir)):
            if value is not None:
                logger.info("LLM(%s=%r) has no effect: the model is %s", option, value,
                            "an in-memory config" if in_memory else "the embedded one")
    if engine.get("tokenizer") is not None:
        engine["tokenizer"] = resolve_checkpoint("tokenizer", engine["tokenizer"], tokenizer_revision,
                                                 download_dir)
    elif tokenizer_revision is not None:
        logger.info("LLM(tokenizer_revision=%r) has no effect: no tokenizer=... is given, the model's "
                    "own is used", tokenizer_revision)
    engine["model"] = model
    args.engine = engine
    args.generation_config = _generation_config_dir(generation_config, model or default_model, in_memory)
    return args


def _translate_parallel(kwargs: dict[str, Any]) -> None:
    """vLLM's ``enable_expert_parallel``: experts are sharded over the tensor x data parallel
    ranks, so the expert parallel size is their product."""
    if kwargs.pop("enable_expert_parallel", False):
        if kwargs.get("expert_parallel_size") not in (None, 1):
            raise ValueError("give enable_expert_parallel (vLLM) or expert_parallel_size, not both")
        kwargs["expert_parallel_size"] = ((kwargs.get("tensor_parallel_size") or 1)
                                          * (kwargs.get("data_parallel_size") or 1))


def _translate_compilation(config: Any, kwargs: dict[str, Any]) -> None:
    """vLLM's ``compilation_config`` (an int level, or a dict of CompilationConfig fields).
    The engine uses no torch.compile, so a level is a no-op; ``cudagraph_capture_sizes``
    is ``cuda_graph_sizes`` and ``cudagraph_mode="NONE"`` is ``enforce_eager=True``; the
    engine's graphs are full graphs of decode steps, whatever other mode is named."""
    if config is None:
        return
    if isinstance(config, int) and not isinstance(config, bool):
        config = {"level": config}
    if not isinstance(config, dict):
        raise ValueError(f"compilation_config={config!r} must be an int (a compilation level) or a dict "
                         f"with any of {', '.join(_COMPILATION_KEYS)}")
    unknown = sorted(set(config) - set(_COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"compilation_config: {', '.join(unknown)} not supported; supported keys: "
                         f"{', '.join(_COMPILATION_KEYS)}")
    for key in ("level", "mode"):
        if key in config:
            logger.info("compilation_config %s=%r has no effect: deepinfer does not use torch.compile",
                        key, config[key])
    if "cudagraph_capture_sizes" in config:
        if kwargs.get("cuda_graph_sizes") is not None:
            raise ValueError("give cuda_graph_sizes or compilation_config['cudagraph_capture_sizes'], not both")
        kwargs["cuda_graph_sizes"] = config["cudagraph_capture_sizes"]
    mode = config.get("cudagraph_mode")
    if mode is not None:
        name = str(getattr(mode, "name", mode)).upper()
        if name == "NONE":
            kwargs["enforce_eager"] = True
        else:
            logger.info("compilation_config cudagraph_mode=%s: deepinfer captures full CUDA graphs of decode "
                        "steps (prefill steps run eagerly)", name)



def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not Path(name).exists()


def resolve_checkpoint(what: str, name: str | Path, revision: str | None, download_dir: str | None) -> str:
    """The local directory of ``name``: a directory as given, or a Hugging Face repo id found
    in the local Hugging Face cache (``download_dir`` if given, at ``revision``), never
    downloaded."""
    name = str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        for option, value in (("revision" if what == "model" else "tokenizer_revision", revision),
                              ("download_dir", download_dir)):
            if value is not None:
                logger.info("LLM(%s=%r) has no effect: %s=%r is a local directory", option, value, what, name)
        return str(path)
    if not _looks_like_hub_id(name):
        raise FileNotFoundError(f"{what}={name!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise FileNotFoundError(f"{what}={name!r} is not a local directory, and huggingface_hub (which finds "
                                "repo ids in the Hugging Face cache) is not installed") from None
    try:
        local = snapshot_download(name, revision=revision, cache_dir=download_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        where = f"download_dir={download_dir!r}" if download_dir else "the Hugging Face cache"
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"{what}={name!r} is not a local directory and {where} holds no copy of it{at}: deepinfer "
            f"downloads nothing; fetch it first (huggingface-cli download {name}) or pass its directory "
            f"({type(exc).__name__}: {exc})") from None
    logger.info("%s=%r found in the Hugging Face cache: %s", what, name, local)
    return local


def _generation_config_dir(option: str, model: str, in_memory: bool) -> str | None:
    """vLLM's ``generation_config``: "auto" reads the model's generation_config.json (an
    in-memory config has none), "vllm" none (vLLM's defaults), anything else is a directory
    holding one."""
    if option == "vllm":
        return None
    if option == "auto":
        return None if in_memory else model
    if not isinstance(option, str) or not Path(option).is_dir():
        raise ValueError(f"generation_config={option!r} must be 'auto', 'vllm' or a directory holding "
                         "generation_config.json")
    return option
