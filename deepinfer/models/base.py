"""CausalLM: the interface every model implements, and its default weight loading.

What belongs here: the contract between the runner and a model (forward over a
flattened batch, float32 logits, the attention layers that need a KV cache) and
the strict name-by-name checkpoint loading most models use unchanged. What does
not: reading files (models/loader.py) and model math (each model file, layers/).

Parameters are created in torch's default dtype on the default device;
``models.loader.load_model`` sets both before building a model, so a model
names ``dtype`` itself only where it must differ (the KV-cache spec, float32
router or mixing weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.layers.moe import FusedMoE
from deepinfer.models.quant import SCALE_SUFFIXES
from deepinfer.parallel.tensor import ParallelLMHead, VocabParallelEmbedding, shard_of

# Per-expert checkpoint names (``...mlp.experts.7.up_proj.weight``), loaded into
# the stacked weights of a FusedMoE module at ``...mlp.experts``.
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")

# How many names an error message lists before it summarises the rest.
_MAX_NAMES_SHOWN = 10


@dataclass(frozen=True)
class ParamSlice:
    """A checkpoint tensor that fills part of a parameter: ``param[index] = tensor``."""

    name: str
    index: tuple[int | slice, ...]


class OtherRank:
    """:meth:`CausalLM.remap_weight_name`'s answer for a routed expert's tensor that another
    expert-parallel rank holds: skipped like None, and, being known as such before it is read,
    left unread by the loader (:meth:`CausalLM.skips_tensor`)."""


OTHER_RANK = OtherRank()


class CausalLM(nn.Module):
    """A decoder-only language model over a flattened batch of T tokens.

    Module and parameter names follow the HF checkpoint names, so that the
    default :meth:`load_weights` maps checkpoint tensors 1:1; a model whose
    checkpoint differs overrides :meth:`remap_weight_name`.
    """

    # Submodules a checkpoint may leave out entirely (e.g. MTP layers, which HF's
    # checkpoints drop); load_weights removes them instead of reporting them missing.
    optional_modules: tuple[str, ...] = ()

    # Whether the runner may capture decode steps in CUDA graphs: in a ``decode_only``
    # context the forward (with the Triton kernel backend) never synchronises with the
    # host and sizes its work from T, B and ctx.max_seq_len only (forward_context.py).
    supports_cuda_graphs: bool = False

    # Whether the model runs under context parallelism (parallel/context.py): its attention
    # layers gather a split step's K/V (``ForwardContext.cp``) before storing it, and nothing
    # else in its forward looks across tokens.
    supports_context_parallel: bool = False

    # The ``kv_cache_dtype`` values the model's constructor takes (keyword ``kv_cache_dtype``);
    # empty: the model takes none and only "auto" (the compute dtype) is served.
    kv_cache_dtypes: tuple[str, ...] = ()

    # The dense layers ``quantization`` keeps in FP8 (models/quantize.py): a regex searched in
    # module names, or None for every plain ``nn.Linear`` but ``lm_head``.
    fp8_linears: str | None = None

    def __init__(self, hf_config: dict, dtype: torch.dtype) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        # The seed of the random weights (``load_format="dummy"``), or None for a checkpoint's:
        # parts built after loading (a drafter) draw theirs from it.
        self.dummy_seed: int | None = None
        # Bytes of the weights in device memory by kind, set by ``models.loader.load_model``
        # (``models.quantize.weight_bytes``).
        self.weight_bytes: dict[str, int] | None = None
        # Checkpoint tensors (FP8/FP4 codes and their scales) that load as stored into layers
        # made quantised before loading (``models.quantize.keep_shipped``).
        self.shipped_tensors: frozenset[str] = frozenset()

    @classmethod
    def check_parallel(cls, hf_config: dict, tp: int) -> None:
        """Raise (before anything loads) unless this model can be built with tensor parallel
        size ``tp``: a model with tensor-parallel layers overrides it to check that ``tp``
        divides its sharded widths. The default has none and takes tp=1 only."""
        if tp > 1:
            raise NotImplementedError(f"tensor_parallel_size={tp}: {cls.__name__} has no tensor-parallel "
                                      "layers yet; run it with tensor_parallel_size=1")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64 -> hidden states [T, H] (final norm applied)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def forward_rows(self, input_ids: torch.Tensor, ctx: ForwardContext,
                     select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The hidden states of the rows the caller needs: ``select(forward(...))``, where
        ``select`` takes the rows (the first dimension) it wants from a per-token tensor. A
        model whose last per-token layers cost time overrides it to run them on those rows
        only (a prefill samples from one row of thousands, or none at all mid-prompt)."""
        return select(self(input_ids, ctx))

    def replay_keep_tokens(self, mode: str, keep: int) -> int | None:
        """Bounded replay ("YOCO prefill truncation"): how many trailing prompt tokens the
        layers after the model's last KV-source layer must see under ``mode`` (``exact`` or
        ``compact``) with ``keep`` asked for, or None when every layer sees every token
        (``full``). The engine asks once at start-up; the scheduler then gives each request
        a fixed ``replay_start`` (its first position those layers compute), which the
        runner passes in ``ForwardContext.replay_starts``. A model with bounded replay
        overrides this and validates ``keep``; the default has none and refuses the
        truncated modes."""
        if mode == "full":
            return None
        raise ValueError(f"prefill truncation mode {mode!r} needs a model with bounded replay "
                         f"(DeepSeek-V4.1); {type(self).__name__} has none")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        return self.lm_head(hidden).float()

    def kv_cache_layers(self) -> list[nn.Module]:
        """Modules that declare a ``kv_spec`` (and receive ``kv_cache``/``group_id``), in layer order."""
        return [m for m in self.modules() if hasattr(m, "kv_spec")]

    def make_lm_head(self, embed_tokens: nn.Embedding) -> nn.Linear:
        """The output projection; with ``tie_word_embeddings`` it shares the embedding
        matrix, and a checkpoint may then omit ``lm_head.weight``. A vocabulary-parallel
        embedding gets a vocabulary-parallel head (its logits gathered), sharded alike."""
        if isinstance(embed_tokens, VocabParallelEmbedding):
            head = ParallelLMHead(embed_tokens.embedding_dim, embed_tokens.vocab_size, group=embed_tokens.tp)
        else:
            head = nn.Linear(embed_tokens.embedding_dim, embed_tokens.num_embeddings, bias=False)
        if self.hf_config.get("tie_word_embeddings", False):
            head.weight = embed_tokens.weight
        return head

    # -- weights -----------------------------------------------------------------
    def load_assets(self, path: str) -> None:
        """Called by ``models.loader.load_model`` before the weights load, with the checkpoint
        directory: a model that needs more than tensors (e.g. DeepSeek-V4.1's engram token
        map, built from tokenizer.json) reads it here. The default reads nothing."""

    def keeps_quantized(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` reaches :meth:`load_weights` as stored: not
        dequantised (a quantised weight and its scale both pass), and mapped read-only from its
        file by ``models.loader`` rather than read, because the model keeps it in host memory
        as it is (DeepSeek-V4.1's host-memory engram tables), or copies it into a layer that keeps
        the checkpoint's format (:attr:`shipped_tensors`). Such a tensor must never be written.
        The default keeps the shipped tensors; overrides add theirs to it."""
        return name in self.shipped_tensors

    def after_load(self) -> None:
        """Called once by ``models.loader.load_model`` after the weights are in place
        (loaded or dummy), before the first forward: a model may re-lay out its weights
        for speed here (e.g. fuse projections). The forward must stay correct without it,
        for models filled by other means. The default packs the routed experts' weights
        for the fused MoE kernels where they run (:meth:`FusedMoE.packing_helps`), one
        layer at a time, and notes the range of FP4 experts' scales
        (:meth:`FusedMoE.note_fp4_scales`), and lets every module with a ``note_fp8_inputs`` method
        see which of its kernels' outputs feed FP8 linears; overrides call it."""
        for module in self.modules():
            if isinstance(module, FusedMoE) and module.packing_helps():
                module.pack_weights()
            if isinstance(module, FusedMoE):
                module.note_fp4_scales()
            # Kernels whose outputs feed FP8 linears quantise them in their own launch
            # (kernels/backend.attach_fp8).
            if hasattr(module, "note_fp8_inputs"):
                module.note_fp8_inputs()

    def skips_tensor(self, name: str) -> bool:
        """Whether the loader may leave checkpoint tensor ``name`` unread: a routed expert's
        weight, or its scale, that :meth:`remap_weight_name` places on another expert-parallel
        rank (:data:`OTHER_RANK`). Never true for a model without expert-parallel layers."""
        weight = next((name[:-len(s)] + ".weight" for s in SCALE_SUFFIXES if name.endswith(s)), name)
        if ".experts." not in weight or not weight.endswith(".weight"):
            return False
        try:
            return self.remap_weight_name(weight) is OTHER_RANK
        except (ValueError, NotImplementedError):
            return False     # the load itself reports the name

    def remap_weight_name(self, name: str) -> str | ParamSlice | OtherRank | None:
        """Where checkpoint tensor ``name`` goes: a parameter name, a part of a
        parameter, or None to skip it. The default is the identity, plus per-expert
        weights into the stacked tensors of :class:`FusedMoE` modules (:data:`OTHER_RANK`
        when an expert-parallel layer holds the expert on another rank)."""
        m = _EXPERT_WEIGHT.match(name)
        if m is not None:
            try:
                module = self.get_submodule(m["prefix"])
            except AttributeError:
                return name
            if isinstance(module, FusedMoE):
                try:
                    where = module.expert_weight_index(m["proj"], int(m["expert"]))
                except ValueError as err:
                    raise ValueError(f"checkpoint tensor {name!r}: {err}") from None
                return OTHER_RANK if where is None else ParamSlice(f"{m['prefix']}.{where[0]}", where[1])
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters and persistent buffers through
        :meth:`remap_weight_name` (:func:`load_module_weights`); submodules named in
        ``optional_modules`` that the checkpoint leaves out entirely are dropped."""
        load_module_weights(self, weights, self._remap_shipped, self.optional_modules)

    def _remap_shipped(self, name: str) -> str | ParamSlice | OtherRank | None:
        """:meth:`remap_weight_name`, and for the scale of a shipped tensor (:attr:`shipped_tensors`)
        the scale beside its weight's destination: ``M.weight`` -> ``M.scale``, rows of an FP4
        expert stack ``P`` -> the same rows of ``P_scale``."""
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None or name not in self.shipped_tensors:
            return self.remap_weight_name(name)
        dest = self.remap_weight_name(name[:-len(suffix)] + ".weight")
        if isinstance(dest, ParamSlice):
            return ParamSlice(dest.name + "_scale", dest.index)
        if isinstance(dest, str) and dest.endswith(".weight"):
            return dest[:-len(".weight")] + ".scale"
        return dest


@torch.no_grad()
def load_module_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        remap: Callable[[str], str | ParamSlice | OtherRank | None],
                        optional_modules: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into ``module``'s parameters and persistent buffers (cast to
    their dtype and device), each to where ``remap(name)`` says (None, OTHER_RANK: skipped); a
    tensor-parallel shard (``parallel/tensor.py``) takes only this rank's part of its tensor. Raises
    ValueError on an unexpected name, a
    mis-shaped tensor, a tensor given twice, and, at the end, on parameters the
    checkpoint left (partly) unfilled. Tied parameters load through their first name.
    Refuses a model whose experts ``after_load`` packed (their parameters no longer have
    the checkpoint's layout): call ``unpack_weights()`` on them first, ``after_load()`` after.
    With expert-parallel layers, whole stacked expert tensors are split per expert first so
    that each rank takes its own."""
    packed = [name for name, m in module.named_modules() if isinstance(m, FusedMoE) and m.packed]
    if packed:
        raise ValueError(f"load_weights: the expert weights of {len(packed)} layer(s) ({_names(packed)}) are "
                         "tile-packed for the fused MoE kernels by after_load(); call unpack_weights() on "
                         "them before loading, and after_load() again after")
    if any(isinstance(m, FusedMoE) and m.ep is not None for m in module.modules()):
        weights = _per_expert(weights)
    targets: dict[str, torch.Tensor] = {}
    aliases: set[str] = set()
    seen_ids: set[int] = set()
    for pname, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen_ids:
            aliases.add(pname)
        else:
            seen_ids.add(id(tensor))
            targets[pname] = tensor
    filled = dict.fromkeys(targets, 0)   # elements written per target
    written: set[tuple[str, str]] = set()

    for name, tensor in weights:
        dest = remap(name)
        if dest is None or dest is OTHER_RANK or (isinstance(dest, str) and dest in aliases):
            continue
        pname, index = (dest, ()) if isinstance(dest, str) else (dest.name, dest.index)
        if pname not in targets:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter "
                             f"{pname!r} in {type(module).__name__}")
        key = (pname, repr(index))
        if key in written:
            raise ValueError(f"checkpoint tensor {name!r} writes {pname}{_fmt(index)}, "
                             "which an earlier tensor already wrote")
        dst = targets[pname].data[index]
        if dst.dtype in _STORED_DTYPES:
            tensor = _as_stored(name, tensor, pname, dst.dtype)
        if not index:
            tensor = shard_of(targets[pname], tensor)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"but {pname}{_fmt(index)} has shape {tuple(dst.shape)}")
        if filled[pname] + dst.numel() > targets[pname].numel():
            raise ValueError(f"checkpoint tensor {name!r} overlaps tensors already loaded "
                             f"into {pname}")
        dst.copy_(tensor)
        written.add(key)
        filled[pname] += dst.numel()

    for prefix in optional_modules:
        if not any(n for p, n in filled.items() if p.startswith(prefix + ".")):
            # The checkpoint ships none of this module (HF drops MTP layers): drop it
            # rather than keep random weights.
            sub = getattr(module, prefix)
            setattr(module, prefix, nn.ModuleList() if isinstance(sub, nn.ModuleList) else None)
            filled = {p: n for p, n in filled.items() if not p.startswith(prefix + ".")}
    missing = [f"{p} ({n} of {targets[p].numel()} elements loaded)" if n else p
               for p, n in filled.items() if n != targets[p].numel()]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) of "
                         f"{type(module).__name__}: {_names(missing)}")


# Dtypes of quantised parameters (FP8 codes; packed FP4 codes and UE8M0 scales as bytes): a
# checkpoint tensor is copied into them bit for bit, never converted.
_STORED_DTYPES = (torch.float8_e4m3fn, torch.uint8)
# Storage dtypes of the same bytes in checkpoints: FP4 codes as int8, UE8M0 scales as float8_e8m0fnu.
_SAME_BYTES = (torch.int8, torch.float8_e8m0fnu, torch.uint8)


def _as_stored(name: str, tensor: torch.Tensor, pname: str, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor ``name`` as the bytes parameter ``pname`` (of quantised ``dtype``) keeps;
    ValueError for a tensor of another kind (a 16-bit weight for FP8 codes, say)."""
    if dtype == torch.uint8 and tensor.dtype in _SAME_BYTES:
        return tensor.view(torch.uint8)
    if tensor.dtype != dtype:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {tensor.dtype}, but {pname} keeps quantised "
                         f"{dtype} values as the checkpoint ships them; it takes only tensors stored so")
    return tensor


# HF's in-memory layout of a layer's experts, stored whole: ``...experts.gate_up_proj`` [E, 2I, H].
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with whole stacked expert tensors split into per-expert ones
    (``...experts.{e}.gate_proj.weight`` etc.), which an expert-parallel layer loads only for
    its own experts; everything else unchanged."""
    for name, tensor in weights:
        m = _STACKED_EXPERTS.match(name)
        if m is None or tensor.dim() != 3:
            yield name, tensor
        elif m["proj"] == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{m['prefix']}.{e}.down_proj.weight", tensor[e]
        else:
            i = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{m['prefix']}.{e}.gate_proj.weight", tensor[e, :i]
                yield f"{m['prefix']}.{e}.up_proj.weight", tensor[e, i:]


def _names(names: list[str]) -> str:
    """The first _MAX_NAMES_SHOWN names, comma-separated, and how many more there are."""
    more = f" and {len(names) - _MAX_NAMES_SHOWN} more" if len(names) > _MAX_NAMES_SHOWN else ""
    return ", ".join(names[:_MAX_NAMES_SHOWN]) + more


def _fmt(index: tuple[int | slice, ...]) -> str:
    if not index:
        return ""
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"


def config_value(hf_config: dict, key: str) -> Any:
    """A required config.json field, with an error naming it when absent."""
    if hf_config.get(key) is None:
        raise ValueError(f"config.json has no {key!r} field, which this architecture needs")
    return hf_config[key]
