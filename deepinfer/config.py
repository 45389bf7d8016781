"""Engine configuration: frozen dataclasses validated at construction.

Every field that a user can set is checked in ``__post_init__`` and a bad value
raises ``ValueError`` naming the field and what to change. Derived values are
properties, never stored twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer import env

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is bf16 on CUDA and float32 on the CPU (DESIGN.md, Numerics)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


# "safetensors" is vLLM's name for what "auto" does here: checkpoints are read from
# safetensors files only.
LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Architectures whose release config.json nests the language model's fields under
# ``text_config`` (next to a ``vision_config``), and the outer keys that still apply to
# the text model: its identity, the checkpoint's quantisation and the special tokens.
_TEXT_CONFIG_WRAPPERS = frozenset({"DeepseekV41ForCausalLM"})
_WRAPPER_KEYS_KEPT = ("architectures", "model_type", "quantization_config", "bos_token_id",
                      "eos_token_id", "pad_token_id", "dtype", "torch_dtype")


def flatten_text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal release wrapper, else ``hf_config`` itself.

    DeepSeek-V4.1's config.json keeps every language-model field in ``text_config``;
    the models read them at the top level, as for every other checkpoint. So the
    ``text_config`` keys become the top level, the outer keys in ``_WRAPPER_KEYS_KEPT``
    are laid over them (the outer ``model_type`` replaces ``deepseek_v41_text``, as in
    mlx-lm), and the rest of the wrapper (``vision_config``, ``image_token_id``) is
    dropped: the engine serves text only. Idempotent; other architectures pass unchanged.
    """
    text = hf_config.get("text_config")
    arch = (hf_config.get("architectures") or [None])[0]
    if not isinstance(text, dict) or arch not in _TEXT_CONFIG_WRAPPERS:
        return hf_config
    outer = {k: hf_config[k] for k in _WRAPPER_KEYS_KEPT if k in hf_config}
    return {**text, **outer}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json of the checkpoint directory ``path``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"model={str(path)!r}: no config.json in that directory")
    return json.loads(cfg_file.read_text())


def apply_hf_overrides(hf_config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` (flattened) with ``overrides`` laid over it (vLLM's ``hf_overrides`` as a
    dict): a dict value merges into the dict it replaces, key by key; any other value replaces."""
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides={overrides!r} must be a dict of config.json fields (a callable, "
                         "which vLLM applies to a transformers PretrainedConfig, is not supported)")

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    return merge(flatten_text_config(hf_config), overrides)


# How the weights are kept in device memory (models/quantize.py says what each does).
QUANTIZATIONS = ("auto", "none", "fp8", "mxfp4-experts", "fp8+mxfp4-experts")


def check_quantization(hf_config: dict[str, Any], quantization: str | None) -> str:
    """vLLM's ``quantization`` as one of ``QUANTIZATIONS``: None is "auto" (the checkpoint's own
    formats, ``quantization_config``); anything else must be one of them."""
    if quantization is None:
        return "auto"
    if quantization not in QUANTIZATIONS:
        own = (hf_config.get("quantization_config") or {}).get("quant_method")
        has = f"its own is {own!r}" if own else "it has none"
        raise ValueError(f"quantization={quantization!r} is not supported (the checkpoint's quantization_config: "
                         f"{has}); choose one of {', '.join(QUANTIZATIONS)}, or None for the checkpoint's own")
    return quantization


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint directory and the HF ``config.json`` read from it.

    ``load_format="dummy"`` reads no weights: parameters are seeded random values
    (models/dummy.py), for benchmarks at real widths without a checkpoint; ``path``
    is then only a label. ``skip_tokenizer_init`` builds no tokenizer: prompts must
    be token ids and outputs carry no text. ``tokenizer``: the directory the tokenizer
    files are read from (None: ``path``). ``max_logprobs``: the most logprobs a request
    may ask for per position (-1: no limit), vLLM's name and default. ``hf_config`` is
    stored flat: a release wrapper with a ``text_config`` (DeepSeek-V4.1) is flattened
    (``flatten_text_config``).
    """

    path: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    # What the KV cache stores (vLLM's name): "auto" the model's own format (DeepSeek-V4.1:
    # the release's rounded records), "fp8" (DeepSeek-V4: DeepSeek's FP8 KV records), or
    # unrounded values in "bfloat16" / "float32" where the model offers them
    # (``CausalLM.kv_cache_dtypes``).
    kv_cache_dtype: str = "auto"
    tokenizer: str | None = None
    max_logprobs: int = 20
    # How the weights are kept (QUANTIZATIONS; models/quantize.py): "auto" the checkpoint's own
    # formats on CUDA (FP8 / FP4 as shipped) and the compute dtype on the CPU.
    quantization: str = "auto"

    @classmethod
    def from_path(cls, path: str | Path, dtype: str | torch.dtype, max_model_len: int | None,
                  device: torch.device, **options: Any) -> "ModelConfig":
        """``options``: the other fields (``load_format``, ``skip_tokenizer_init``,
        ``kv_cache_dtype``, ``tokenizer``, ``max_logprobs``, ``quantization``)."""
        return cls.from_hf_config(read_hf_config(path), str(Path(path)), dtype, max_model_len, device,
                                  **options)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], path: str, dtype: str | torch.dtype,
                       max_model_len: int | None, device: torch.device, **options: Any) -> "ModelConfig":
        """A config.json already in memory (``path`` names where it came from)."""
        hf_config = flatten_text_config(hf_config)
        if max_model_len is None:
            max_model_len = int(hf_config.get("max_position_embeddings", 2048))
        return cls(path=path, hf_config=hf_config, dtype=resolve_dtype(dtype, device),
                   max_model_len=max_model_len, **options)

    def __post_init__(self) -> None:
        # Also for a ModelConfig built directly rather than through from_hf_config.
        object.__setattr__(self, "hf_config", flatten_text_config(self.hf_config))
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if not self.hf_config.get("architectures"):
            raise ValueError(f"{self.path}/config.json has no 'architectures' field")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported; choose one of "
                             f"{', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        m = self.max_logprobs
        if isinstance(m, bool) or not isinstance(m, int) or m < -1:
            raise ValueError(f"max_logprobs={m!r} must be an int >= 0, or -1 for no limit")

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer files are: ``tokenizer``, else the checkpoint directory."""
        return self.tokenizer if self.tokenizer is not None else self.path

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def config_eos_token_ids(self) -> set[int]:
        """config.json's ``eos_token_id`` (an int or a list), for engines without a tokenizer."""
        eos = self.hf_config.get("eos_token_id")
        return {int(t) for t in ([eos] if isinstance(eos, int) else eos or [])}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    On CUDA the cache takes ``gpu_memory_utilization`` of the device's total memory
    minus what weights and a profiling forward use; on the CPU it takes
    ``cpu_kv_cache_bytes``. ``num_gpu_blocks_override`` fixes the block count
    (tests use it to force preemption).

    Lower tiers of the prefix cache (scheduler/kv_tiers.py): blocks evicted from the
    device cache move to ``kv_offload_bytes`` of host memory, and from there to
    ``kv_disk_bytes`` under ``kv_disk_dir``, which a restarted engine of the same model
    and cache layout finds again. 0 bytes turn a tier off; both need prefix caching.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None
    kv_offload_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes={self.cpu_kv_cache_bytes} must be >= 1")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"num_blocks_override={self.num_blocks_override} must be >= 2 "
                             "(block 0 is reserved as the null block)")
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes} must be >= 0")
        if self.kv_disk_bytes < 0:
            raise ValueError(f"kv_disk_bytes={self.kv_disk_bytes} must be >= 0")
        if (self.kv_disk_dir is None) != (self.kv_disk_bytes == 0):
            raise ValueError(f"kv_disk_dir={self.kv_disk_dir!r} and kv_disk_bytes={self.kv_disk_bytes}: the disk "
                             "tier needs both a directory and a size above 0 (or neither)")
        if self.has_lower_tiers and not self.enable_prefix_caching:
            raise ValueError("kv_offload_bytes / kv_disk_bytes need enable_prefix_caching=True: the lower "
                             "tiers hold prefix-cache blocks")

    @property
    def has_lower_tiers(self) -> bool:
        """A host or disk tier is configured."""
        return self.kv_offload_bytes > 0 or self.kv_disk_bytes > 0


# The default CUDA-graph buckets stop here: larger decode batches are rare, and each
# bucket costs start-up time and graph memory.
MAX_DEFAULT_CUDA_GRAPH_SIZE = 256


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits: sequences per step and tokens per step.

    ``cuda_graph_sizes``: the decode batch sizes that get a CUDA graph (vLLM's name;
    here always the exact list: any sequence of ints, stored as a sorted tuple). A
    decode batch of B sequences replays the smallest size >= B with padding rows;
    larger batches run eagerly. None: 1, 2, 4, then multiples of 8, up to
    ``min(max_num_seqs, max_num_batched_tokens, 256)`` (which is always included).
    ``async_scheduling`` (overlapped scheduling, vLLM's name): plan and launch step
    N+1 while the device runs step N, and post-process step N while it runs N+1.
    Outputs are the same either way (scheduler/scheduler.py says when it falls back
    to a synchronous step).
    ``prefill_truncation_mode`` / ``prefill_keep_tokens``: bounded replay of prompts
    (DeepSeek's "YOCO prefill truncation"; ``full``, ``exact`` or ``compact``, and how
    many trailing prompt tokens the late layers keep). None takes
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE / DEEPINFER_YOCO_PREFILL_KEEP_TOKENS (env.py),
    resolved at construction. A mode other than ``full`` needs a model with bounded
    replay (``CausalLM.replay_keep_tokens``), checked when the engine starts.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    cuda_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool = True
    prefill_truncation_mode: str | None = None
    prefill_keep_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.prefill_truncation_mode is None:
            object.__setattr__(self, "prefill_truncation_mode", env.yoco_prefill_truncation_mode())
        if self.prefill_truncation_mode not in env.PREFILL_TRUNCATION_MODES:
            raise ValueError(f"prefill_truncation_mode={self.prefill_truncation_mode!r} is not valid; "
                             f"choose one of {', '.join(env.PREFILL_TRUNCATION_MODES)}")
        if self.prefill_keep_tokens is None:
            object.__setattr__(self, "prefill_keep_tokens", env.yoco_prefill_keep_tokens())
        keep = self.prefill_keep_tokens
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"prefill_keep_tokens={keep!r} must be an int >= 1")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(self.cuda_graph_sizes)
            if not sizes:
                raise ValueError("cuda_graph_sizes is empty: list at least one decode batch size, "
                                 "or pass enforce_eager=True to run without CUDA graphs")
            for n in sizes:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"cuda_graph_sizes entry {n!r} must be an int >= 1")
                if n > self.max_num_seqs:
                    raise ValueError(f"cuda_graph_sizes entry {n} exceeds max_num_seqs={self.max_num_seqs}: "
                                     "a decode batch never holds more sequences")
            if len(set(sizes)) != len(sizes):
                raise ValueError(f"cuda_graph_sizes={list(sizes)} lists a batch size twice")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(sizes)))

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture, ascending (``cuda_graph_sizes`` or the default)."""
        if self.cuda_graph_sizes is not None:
            return self.cuda_graph_sizes
        cap = min(self.max_num_seqs, self.max_num_batched_tokens, MAX_DEFAULT_CUDA_GRAPH_SIZE)
        sizes = {n for n in (1, 2, 4) if n <= cap} | set(range(8, cap + 1, 8)) | {cap}
        return tuple(sorted(sizes))


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor (``tp``), expert (``ep``), data (``dp``), context (``cp``) and pipeline (``pp``)
    parallel sizes.

    Tensor, expert, attention data and context parallelism run now; pipeline parallelism is
    refused as not yet supported. The world is ``max(ep, tp*dp, tp*cp)`` ranks, one process
    (and on CUDA one device) each; every size must divide it. Ranks ``[k*tp, (k+1)*tp)`` form a
    tensor-parallel group and ranks ``[k*ep, (k+1)*ep)`` an expert-parallel group. Without data
    parallelism every rank runs every request, so tensor-parallel groups beyond the first
    repeat the first one's work (``tp=2, ep=4``: attention on two ranks, twice; experts over
    all four). With ``dp`` > 1 tensor-parallel group k serves data-parallel rank k mod dp: its
    own requests, KV cache and prefix cache (:meth:`dp_rank_of`; parallel/data.py); the MoE
    layers stay expert-parallel over the ``ep`` group, each rank dispatching its own tokens.
    Context parallelism (``cp``, ranks ``[k*cp, (k+1)*cp)``) splits each long prefill's tokens
    over its ranks (parallel/context.py); it is not combined with ``dp`` (refused) nor yet with
    ``tp`` > 1.

    ``distributed_executor_backend`` (vLLM's name): ``"mp"`` — the engine starts one worker
    process per rank itself (parallel/executor.py); ``"external_launcher"`` — every rank is a
    process someone else started (``torchrun``), each running the whole engine on its shard.

    Expert load balancing (EPLB, vLLM's names): with ``enable_eplb`` every worker counts its
    experts' load and, every ``eplb_step_interval`` engine steps, places the experts anew for
    the load of the last ``eplb_window_size`` steps (parallel/balancer.py), using
    ``num_redundant_experts`` extra slots per MoE layer for replicas of busy experts. It needs
    ``ep`` > 1 and the ``"mp"`` executor; the experts plus the redundant slots must divide by
    ``ep`` (checked against the model in ``parallel.executor.check_parallel``)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    pp: int = 1
    distributed_executor_backend: str = "mp"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000

    def __post_init__(self) -> None:
        for name, long_name in (("tp", "tensor_parallel_size"), ("ep", "expert_parallel_size"),
                                ("dp", "data_parallel_size"), ("cp", "context_parallel_size"),
                                ("pp", "pipeline_parallel_size")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} ({long_name}) must be an int >= 1")
            if value > 1 and name == "pp":
                raise NotImplementedError(
                    f"{name}={value} ({long_name}): pipeline parallelism is not yet supported; run with "
                    f"{name}=1 (tensor, expert, data and context parallelism are: tp, ep, dp, cp)")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is not "
                             f"supported; choose one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}")
        self._check_context_parallel()
        self._check_data_parallel()
        if self.world_size % self.tp or self.world_size % self.ep:
            raise ValueError(f"tp={self.tp} (tensor_parallel_size) and ep={self.ep} (expert_parallel_size) "
                             f"must divide each other: the world is max(tp, ep)={self.world_size} ranks")
        self._check_eplb()

    def _check_data_parallel(self) -> None:
        """Attention data parallelism: ``dp`` blocks of ``tp`` ranks each take their own
        requests; the experts stay expert-parallel over ``ep`` ranks."""
        if self.dp == 1:
            return
        if self.ep == 1:
            raise NotImplementedError(
                f"dp={self.dp} (data_parallel_size) without expert parallelism (expert_parallel_size=1): "
                "attention data parallelism is not yet supported on its own; it shards the requests of a MoE "
                "model whose experts are expert-parallel (set expert_parallel_size > 1), and replicas of a "
                "whole model run as separate engines behind `deepinfer router`")
        if self.world_size % (self.tp * self.dp) or self.world_size % self.ep:
            raise ValueError(f"ep={self.ep} (expert_parallel_size) and tp={self.tp} x dp={self.dp} "
                             f"(data_parallel_size) = {self.tp * self.dp} must divide the world of "
                             f"max(ep, tp x dp)={self.world_size} ranks")
        if self.distributed_executor_backend != "mp":
            raise NotImplementedError(f"dp={self.dp} (data_parallel_size) with distributed_executor_backend="
                                      f"{self.distributed_executor_backend!r} is not yet supported; use 'mp'")

    def _check_eplb(self) -> None:
        for name, low in (("num_redundant_experts", 0), ("eplb_window_size", 1), ("eplb_step_interval", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if not isinstance(self.enable_eplb, bool):
            raise ValueError(f"enable_eplb={self.enable_eplb!r} must be a bool")
        if not self.enable_eplb:
            if self.num_redundant_experts:
                raise ValueError(f"num_redundant_experts={self.num_redundant_experts} needs enable_eplb=True: "
                                 "only the load balancer places replicas in the redundant slots")
            return
        if self.ep == 1:
            raise ValueError("enable_eplb=True needs expert parallelism: expert_parallel_size=1; balancing "
                             "moves experts between ranks, so set expert_parallel_size > 1")
        if self.distributed_executor_backend != "mp":
            raise NotImplementedError(f"enable_eplb=True with distributed_executor_backend="
                                      f"{self.distributed_executor_backend!r} is not yet supported; use 'mp'")

    def _check_context_parallel(self) -> None:
        if self.cp == 1:
            return
        if self.dp > 1:
            raise ValueError(f"dp={self.dp} (data_parallel_size) and cp={self.cp} (context_parallel_size) "
                             "cannot be combined: attention ranks either serve their own requests or share "
                             "one prefill; set one of them to 1")
        if self.tp > 1:
            raise NotImplementedError(f"cp={self.cp} (context_parallel_size) with tp={self.tp} "
                                      "(tensor_parallel_size) is not yet supported; run context parallelism "
                                      "with tp=1")
        if self.world_size % self.cp:
            raise ValueError(f"cp={self.cp} (context_parallel_size) must divide the world of "
                             f"{self.world_size} ranks (max(ep, tp * dp, tp * cp))")

    @property
    def world_size(self) -> int:
        """Ranks (processes, devices) the engine runs its model on: ``max(ep, tp * dp, tp * cp)``."""
        return max(self.ep, self.tp * self.dp, self.tp * self.cp)

    def dp_rank_of(self, rank: int) -> int:
        """The attention data-parallel rank whose requests global rank ``rank`` runs: ranks
        ``[k*tp, (k+1)*tp)`` form tensor-parallel group k, and group k serves DP rank k mod dp
        (groups past the first tp x dp ranks repeat the first ones' work)."""
        return (rank // self.tp) % self.dp

    def describe(self) -> str:
        """The resolved rank layout in one line (what ``--tp/--ep/--dp/--cp`` resolve to)."""
        parts = [f"world={self.world_size}"]
        for name, what in (("tp", "tensor"), ("dp", "attention data"), ("cp", "context"), ("ep", "expert")):
            size = getattr(self, name)
            if size > 1 and name == "dp":
                ranks = ", ".join(str(self.dp_rank_of(r)) for r in range(self.world_size))
                parts.append(f"dp={size} (attention data-parallel rank of ranks 0..{self.world_size - 1}: {ranks})")
            elif size > 1:
                parts.append(f"{name}={size} ({what}-parallel groups of ranks "
                             + ", ".join(f"[{s}..{s + size - 1}]" for s in range(0, self.world_size, size)) + ")")
        if len(parts) == 1:
            parts.append("one rank, no parallelism")
        return "; ".join(parts)


SPECULATIVE_METHODS = ("ngram", "dspark", "mtp")
# The longest draft a step verifies.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each decode step verifies a
    request's last token plus up to ``num_speculative_tokens`` draft tokens in one forward
    and commits the accepted prefix plus one token of the target's own (spec/ says how).

    ``method``: ``ngram`` (drafts copied from the context after the latest earlier match of
    its last ``prompt_lookup_min``..``prompt_lookup_max`` tokens; no model), ``dspark`` (the
    DSpark module of a DeepSeek-V4/V4.1 checkpoint) or ``mtp`` (a DeepSeek-V3 MTP layer,
    chained). ``num_speculative_tokens`` None takes DEEPINFER_USE_NEXTN_DECODE (env.py).
    ``varlen`` (None: DEEPINFER_ENABLE_MTP_VARLEN): verify a confidence-scheduled prefix of
    each draft instead of all of it (spec/scheduling.py); it needs a drafter with
    confidences. ``sps_table``: the target's steps per second at token batch sizes B,
    ``((B, sps), ...)`` ascending, for the varlen scheduler; None: profiled when the engine
    starts. ``confidence_temperatures``: per draft position, the temperature T_k of
    sequential temperature scaling (``scheduling.fit_sts``) applied to the drafter's
    confidence logits (c_k = sigmoid(l_k / T_k)); None: the raw confidences. ``cuda_graphs``:
    with a model drafter (``dspark``, ``mtp``), its decode and verification steps replay CUDA
    graphs (the target's forward with what the drafter keeps of it, and the proposal) where
    the decode graphs are on; False runs those steps eagerly.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    varlen: bool | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    sps_table: tuple[tuple[int, float], ...] | None = None
    confidence_temperatures: tuple[float, ...] | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"speculative_config cuda_graphs={self.cuda_graphs!r} must be True or False")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not supported; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", env.use_nextn_decode())
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={n!r} must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if self.varlen is None:
            object.__setattr__(self, "varlen", env.enable_mtp_varlen())
        if not isinstance(self.varlen, bool):
            raise ValueError(f"speculative_config varlen={self.varlen!r} must be True or False")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name}={v!r} must be an int >= 1")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
        if self.sps_table is not None:
            from deepinfer.spec.scheduling import SPSTable

            table = tuple((int(b), float(sps)) for b, sps in self.sps_table)
            SPSTable(table)                  # validates
            object.__setattr__(self, "sps_table", table)
        if self.confidence_temperatures is not None:
            temps = tuple(float(t) for t in self.confidence_temperatures)
            if len(temps) != n or any(not t > 0 for t in temps):
                raise ValueError(f"speculative_config confidence_temperatures={list(temps)} must hold "
                                 f"num_speculative_tokens={n} positive values")
            object.__setattr__(self, "confidence_temperatures", temps)
        if self.varlen and self.method == "ngram":
            raise ValueError("speculative_config varlen=True (DEEPINFER_ENABLE_MTP_VARLEN=1) schedules drafts by "
                             "the drafter's confidences; method='ngram' has none: use method='dspark'")

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """vLLM's dict form, e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r} must be a dict such as "
                             "{'method': 'dspark', 'num_speculative_tokens': 5}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(unknown)} not supported; supported keys: "
                             f"{', '.join(sorted(known))}")
        return cls(**config)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    # Run every forward eagerly: no CUDA graphs for decode steps (vLLM's name).
    enforce_eager: bool = False
    # Batch-invariant mode (batch_invariant.py); None takes DEEPINFER_BATCH_INVARIANT (env.py).
    # Refused where it is not built (batch_invariant.check_supported).
    batch_invariant: bool | None = None
    # Speculative decoding; None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant", env.batch_invariant())
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} must be True or False")
        if self.batch_invariant:
            from deepinfer.batch_invariant import check_supported
            check_supported(self.device, self.model.architecture, self.parallel.world_size)
        if self.scheduler.max_num_batched_tokens < self.cache.block_size:
            raise ValueError(
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens} must be >= "
                f"block_size={self.cache.block_size}")
        if (not self.scheduler.enable_chunked_prefill
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens} must be >= max_model_len="
                f"{self.model.max_model_len}")
