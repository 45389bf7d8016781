"""DSpark in the engine: the drafter of a DeepSeek-V4.1 checkpoint, or of a DeepSeek-V4 one
that ships it (V4-Flash-0731, V4-Flash-DSpark; models/dspark.py), run inside each step, its
context rows kept in the engine's paged KV cache.

Per step (the runner calls these in order):

1. :meth:`DSparkEngineDrafter.forward` — the target's forward, keeping the target
   features of every row, then each stage's context row of every position of the step,
   written at the position's slot of the drafter's window group, exactly as a target layer
   writes its window rows. Rows of drafts the verification then rejects are overwritten
   when their positions are computed again; no proposal reads past the last committed
   position, so nothing is rolled back. Every position gets its rows, not only the last
   window a proposal reads: a cached block must hold them wherever another request's hit
   may end (it costs ``main_proj`` and one ``wkv`` per stage a token, about 1% of the
   target's prefill work at V4.1-Flash widths). Under bounded replay, positions before a
   sequence's replay start get rows of zero features; no proposal reads them (prefix hits
   stop at the replay start, which lies at least a window before the prompt's end);
2. :meth:`DSparkEngineDrafter.propose` — after sampling or verification: for each sampled
   sequence, the block ``[a, noise, ...]`` at its last committed position ``s`` + 1, where
   ``a`` is the token the step just committed last, over its context rows of positions
   ``s - W + 1 .. s`` gathered from the cache. Drafts go to the host with the step's
   results; the distribution each was drawn from stays here until the next verification.

Where the decode CUDA graphs hold a step (runner/cuda_graph.py), step 1 replays the bucket's
graph of :meth:`DSparkEngineDrafter.forward` (padding rows' slots are -1: their context rows
are not written) and step 2's block forward, heads and draft sampling
(:meth:`DSparkEngineDrafter.draft`) replay a graph per bucket of committed sequences.

Because the context rows live in pages like any layer's, a prefix-cache hit brings them
with it (they are a function of the tokens, as the target's rows are), a fork copies
them, and a preempted sequence recomputes them with its prompt.

Sampled drafts (requests with a temperature) draw from ``softmax(filters(z / T))`` with the
request's own temperature and min-p / top-k / top-p; a seeded request's draws are keyed
by (seed, sample index, ``s``), a position no earlier round of the request drafted from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from deepinfer.config import SpeculativeConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.models.dspark import DSparkDrafter, window_positions
from deepinfer.spec.drafter import DraftOutput, DraftRows, ModelDrafter

logger = logging.getLogger(__name__)


class DSparkContextCache(nn.Module):
    """The drafter's context rows in the engine's cache: one sliding-window layer whose
    entry holds every stage's row of a position ([S, D] as S "heads" of one tensor)."""

    def __init__(self, num_stages: int, head_dim: int, window: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kv_spec = KVCacheSpec("sliding", num_stages, head_dim, dtype, num_tensors=1, sliding_window=window)
        self.kv_cache: torch.Tensor | None = None    # [blocks, block_size, 1, S, D], bound by the runner
        self.group_id = -1

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows at flat slots (``block * block_size + offset``) [...] -> [..., S, D]."""
        bs = self.kv_cache.shape[1]
        return self.kv_cache[slots // bs, slots % bs, 0]

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [R, S, D] at flat slots [R], nothing where the slot is -1 (a CUDA graph's
        padding rows). (A page is strided: no flat view of the slots.)"""
        bs = self.kv_cache.shape[1]
        # Without a data-dependent shape: a -1 row writes slot 0 of the null block with what
        # it holds (zeros, never written otherwise), so every row writes a slot.
        keep = slots >= 0
        safe = torch.where(keep, slots, 0)
        blocks, offsets = safe // bs, safe % bs
        old = self.kv_cache[blocks, offsets, 0]
        self.kv_cache[blocks, offsets, 0] = torch.where(keep[:, None, None], rows.to(self.kv_cache.dtype), old)


class DSparkEngineDrafter(ModelDrafter):
    has_confidences = True
    graph_safe = True

    def __init__(self, config: SpeculativeConfig, module: DSparkDrafter) -> None:
        self.module = module
        cfg = module.cfg
        self.window = cfg.window
        self.max_draft = min(config.num_speculative_tokens, cfg.block_size)
        self.num_slots, self.vocab_size = cfg.block_size, cfg.vocab_size
        if config.num_speculative_tokens > cfg.block_size:
            logger.warning("num_speculative_tokens=%d exceeds the DSpark block (%d): verifying %d drafts",
                           config.num_speculative_tokens, cfg.block_size, cfg.block_size)
        dtype = module.main_proj.weight.dtype
        self.cache = DSparkContextCache(cfg.num_stages, cfg.head_dim, cfg.window, dtype)
        self._probs: dict[str, torch.Tensor] = {}        # req_id -> [max_draft, V] of sampled drafts
        self._confidence: torch.Tensor | None = None      # [B, max_draft] of the last proposal
        temps = config.confidence_temperatures
        self._temperatures = None if temps is None else torch.tensor(temps[:self.max_draft], dtype=torch.float32,
                                                                    device=module.main_proj.weight.device)

    @classmethod
    def for_model(cls, config: SpeculativeConfig, model: nn.Module) -> "DSparkEngineDrafter":
        from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, has_dspark
        from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

        if isinstance(model, DeepseekV4ForCausalLM):
            if not has_dspark(model.hf_config):
                raise ValueError("speculative_config method='dspark': this DeepSeek-V4 checkpoint has no DSpark "
                                 "module (its config has no dspark_block_size; V4-Flash-0731 and V4-Flash-DSpark "
                                 "ship one); use method='ngram'")
        elif not isinstance(model, DeepseekV41ForCausalLM):
            raise NotImplementedError(
                f"speculative_config method='dspark' runs the DSpark module of DeepSeek-V4.1 and DeepSeek-V4 "
                f"DSpark checkpoints; {type(model).__name__} has none (method='ngram' works with any model)")
        if not model.drafter_tensors and model.dummy_seed is None:
            raise ValueError("speculative_config method='dspark': the checkpoint has no DSpark module "
                             "(no mtp.* tensors); use method='ngram'")
        return cls(config, DSparkDrafter.from_target(model))

    # -- ModelDrafter ------------------------------------------------------------------
    def kv_cache_layers(self) -> list[nn.Module]:
        return [self.cache]

    # -- a step ------------------------------------------------------------------------
    def forward(self, model: nn.Module, input_ids: torch.Tensor, ctx: ForwardContext,
                select: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, None]:
        """The target's forward keeping the features of every row, then each stage's context
        rows of the step's positions written into the cache."""
        from deepinfer.models.deepseek_v4 import FeatureCapture

        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        capture = FeatureCapture.new(self.module.cfg.target_layer_ids, rows, self.module.cfg.hidden_size,
                                     self.module.main_proj.weight.dtype)
        hidden = model.forward_rows(input_ids, ctx, select, capture=capture)
        context = self.module.context_kv(capture.out, ctx.positions)                        # [S, T, D]
        self.cache.write(ctx.groups[self.cache.group_id].slot_mapping, context.transpose(0, 1))
        return hidden, None

    def draft(self, rows: DraftRows) -> DraftOutput:
        """Drafts [B, max_draft] from each row's anchor over its context rows (gathered from
        the cache at its window's slots), with the confidences and draft distributions."""
        positions, valid = window_positions(rows.last_positions, self.window)            # [B, W]
        bs = self.cache.kv_cache.shape[1]
        tables = rows.tables
        blocks = tables.gather(1, (positions // bs).clamp(max=tables.shape[1] - 1)).long()  # [B, W]
        context = self.cache.read(blocks * bs + positions % bs)                          # [B, W, S, D]
        valid = valid & (blocks > 0)                                                      # freed or unheld: null block
        proposal = self.module.propose(rows.anchors, rows.last_positions + 1, context.permute(2, 0, 1, 3), valid,
                                       rows.sampling)
        logits = proposal.confidence_logits[:, :self.max_draft]                           # [B, max_draft]
        confidence = torch.sigmoid(logits if self._temperatures is None else logits / self._temperatures)
        return DraftOutput(tokens=proposal.tokens[:, :self.max_draft], confidences=confidence,
                           probs=None if rows.sampling is None else proposal.probs[:, :self.max_draft])
