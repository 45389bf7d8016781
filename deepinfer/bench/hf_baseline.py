"""The baseline a user would otherwise run: HF transformers ``generate`` on the same
model shapes and the same random weights, in the same process.

HF's model is built on the device from the same config dict, then every tensor of its
state dict is refilled by models/dummy.py under the name our model gives it
(``remap_weight_name``), so both hold the same values (up to the dtype each keeps a
tensor in) without either copy existing twice. transformers is an optional dependency
(the ``bench`` extra), imported only here.

Timing, batch B, prompt length L, greedy, ``min_new_tokens = max_new_tokens = n``:

- prefill: ``generate`` with n = 1 (one forward over the prompts and one sampled token);
- decode ms/step: ``(t(n2) - t(n1)) / (n2 - n1)`` with n1 = 2, so the prefill and cache
  creation cancel out.

HF's eager attention materialises ``[B, H, L, L + entries]`` scores, so prompts whose
scores would not fit in half the free memory are shortened (``fit_context``); the
result records the length actually used.
"""

from __future__ import annotations

import copy
import re
import statistics
import time
from typing import Any

import torch

from deepinfer.bench.common import free_memory, sync
from deepinfer.models.dummy import fill_dummy_
from deepinfer.models.registry import get_model_class

DECODE_REPEATS = 3      # runs of each generate length in decode(); the fastest counts

# Bytes of eager-attention temporaries per (query, key) pair and head: bf16 scores,
# float32 softmax, bf16 probabilities, mask; times 1.25 for CSA's compressed entries.
_ATTN_BYTES_PER_SCORE = 15
_CPU_MEMORY_BUDGET = 8 << 30
_CONTEXT_QUANTUM = 64


def import_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the HF transformers baseline needs transformers: pip install 'deepinfer[bench]', "
                          "or pass --no-hf") from exc
    return transformers


def fit_context(batch: int, context: int, num_heads: int, free_bytes: int) -> int:
    """The longest prompt <= ``context`` whose eager attention scores fit in half of ``free_bytes``
    (a multiple of 64 when shortened; 0 when not even 64 tokens fit)."""
    budget = free_bytes // 2
    if batch * num_heads * context * context * _ATTN_BYTES_PER_SCORE <= budget:
        return context
    longest = int((budget / (batch * num_heads * _ATTN_BYTES_PER_SCORE)) ** 0.5)
    return longest // _CONTEXT_QUANTUM * _CONTEXT_QUANTUM


def hf_skip_reason(hf_config: dict[str, Any]) -> str | None:
    """Why HF transformers cannot run ``hf_config`` (its ``model_type`` is not one of
    transformers' models, e.g. DeepSeek-V4.1), or None: the benchmark reports the baseline
    as skipped rather than failing after the engine's figures are taken."""
    transformers = import_transformers()
    model_type = hf_config.get("model_type")
    if model_type is not None and model_type not in transformers.CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no {model_type!r} model"
    return None


class HFBaseline:
    """HF transformers' model for ``hf_config`` on ``device`` with our random weights."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 seed: int) -> None:
        transformers = import_transformers()
        self.device = device
        self.vocab_size = int(hf_config["vocab_size"])
        self.num_heads = int(hf_config["num_attention_heads"])
        kwargs = {k: v for k, v in copy.deepcopy(hf_config).items() if k != "model_type"}
        if "model_type" not in hf_config:
            raise ValueError("the HF baseline needs config.json's 'model_type' to pick HF's model class")
        cfg = transformers.AutoConfig.for_model(hf_config["model_type"], **kwargs)
        with torch.device(device):
            self.model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        self._keep_fp32_as_from_pretrained(dtype)
        self._fill(hf_config, dtype, seed)

    def _keep_fp32_as_from_pretrained(self, dtype: torch.dtype) -> None:
        """``from_pretrained`` loads the tensors matching ``_keep_in_fp32_modules_strict`` (name
        substrings) in float32 when asked for bf16/fp16; ``from_config`` does not, so do it here."""
        keep = getattr(self.model, "_keep_in_fp32_modules_strict", None)
        if not keep or dtype not in (torch.float16, torch.bfloat16):
            return
        pattern = re.compile("|".join(sorted(keep)))
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if pattern.search(name) and tensor.is_floating_point():
                tensor.data = tensor.data.float()

    @torch.no_grad()
    def _fill(self, hf_config: dict[str, Any], dtype: torch.dtype, seed: int) -> None:
        with torch.device("meta"):
            ours = get_model_class(hf_config["architectures"][0])(hf_config, dtype)
        ours_shapes = {n: tuple(t.shape) for n, t in ours.state_dict().items()}
        num_experts = hf_config.get("n_routed_experts")
        filled: set[str] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            dest = ours.remap_weight_name(name)
            if not isinstance(dest, str) or dest not in ours_shapes:
                raise ValueError(f"HF tensor {name!r} has no counterpart in deepinfer's model "
                                 f"(maps to {dest!r})")
            if ours_shapes[dest] != tuple(tensor.shape):
                raise ValueError(f"HF tensor {name!r} has shape {tuple(tensor.shape)}, deepinfer's "
                                 f"{dest!r} has {ours_shapes[dest]}")
            fill_dummy_(tensor.data, dest, seed, num_experts)
            filled.add(dest)
        missing = sorted(set(ours_shapes) - filled)
        if missing:
            raise ValueError(f"HF's model has no tensor for {len(missing)} of deepinfer's: {missing[:5]}")

    def close(self) -> None:
        del self.model
        free_memory(self.device)

    def max_context(self, batch: int, context: int) -> int:
        if self.device.type == "cuda":
            # Memory the caching allocator holds but does not use is free for HF's temporaries.
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            free = torch.cuda.mem_get_info(self.device)[0] + cached
        else:
            free = _CPU_MEMORY_BUDGET
        return fit_context(batch, context, self.num_heads, free)

    @torch.inference_mode()
    def _generate_s(self, ids: torch.Tensor, new_tokens: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        sync(self.device)
        elapsed = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"HF generate returned {out.shape[1] - ids.shape[1]} new tokens, "
                               f"asked for {new_tokens}")
        return elapsed

    def _prompts(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (batch, length), generator=gen).to(self.device)

    def prefill(self, batch: int, prompt_len: int, iters: int, gen: torch.Generator) -> dict[str, Any]:
        """Median time of ``generate(max_new_tokens=1)`` over ``iters`` runs after one warm-up."""
        length = self.max_context(batch, prompt_len)
        if length == 0:
            return {"skipped": f"batch {batch} x {prompt_len} tokens of eager attention does not fit"}
        try:
            self._generate_s(self._prompts(batch, length, gen), 1)
            times = [self._generate_s(self._prompts(batch, length, gen), 1) for _ in range(iters)]
        except torch.OutOfMemoryError as exc:
            return self._out_of_memory(batch, length, exc)
        ms = statistics.median(times) * 1e3
        return {"prompt_len": length, "ms": ms, "input_tok_s": batch * length / (ms * 1e-3)}

    def decode(self, batch: int, context: int, steps: int, gen: torch.Generator) -> dict[str, Any]:
        """Decode ms/step at ``batch`` from the time difference of two ``generate`` lengths, each
        the fastest of ``DECODE_REPEATS`` runs (one run each let a busy host make the difference
        zero or negative)."""
        length = self.max_context(batch, context)
        if length == 0:
            return {"skipped": f"batch {batch} x {context} tokens of eager attention does not fit"}
        try:
            self._generate_s(self._prompts(batch, length, gen), 2)
            short = min(self._generate_s(self._prompts(batch, length, gen), 2) for _ in range(DECODE_REPEATS))
            long = min(self._generate_s(self._prompts(batch, length, gen), 2 + steps) for _ in range(DECODE_REPEATS))
        except torch.OutOfMemoryError as exc:
            return self._out_of_memory(batch, length, exc)
        ms = max(long - short, 0.0) / steps * 1e3
        return {"context_len": length, "ms_per_step": ms,
                "tok_s": batch * 1e3 / ms if ms > 0 else None, "steps": steps}

    def _out_of_memory(self, batch: int, length: int, exc: Exception) -> dict[str, Any]:
        """A batch that does not fit is reported, not fatal: the engine's figures are already taken."""
        free_memory(self.device)
        return {"skipped": f"out of memory at batch {batch} x {length} tokens: {str(exc).splitlines()[0]}"}
