"""DSpark in the engine: the drafter of a DeepSeek-V4.1 checkpoint (models/dspark.py) run
inside each step, its context rows kept in the engine's paged KV cache.

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
from deepinfer.spec.draft_sampling import draft_sampling
from deepinfer.spec.drafter import ModelDrafter, StepCommit
from deepinfer.transfer import to_device

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
        """rows [R, S, D] at flat slots [R]. (A page is strided: no flat view of the slots.)"""
        bs = self.kv_cache.shape[1]
        self.kv_cache[slots // bs, slots % bs, 0] = rows.to(self.kv_cache.dtype)


class DSparkEngineDrafter(ModelDrafter):
    has_confidences = True

    def __init__(self, config: SpeculativeConfig, module: DSparkDrafter) -> None:
        self.module = module
        cfg = module.cfg
        self.window = cfg.window
        self.max_draft = min(config.num_speculative_tokens, cfg.block_size)
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
        from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

        if not isinstance(model, DeepseekV41ForCausalLM):
            raise NotImplementedError(
                f"speculative_config method='dspark' runs the DSpark module of DeepSeek-V4.1 checkpoints; "
                f"{type(model).__name__} has none (method='ngram' works with any model)")
        if not model.drafter_tensors and model.dummy_seed is None:
            raise ValueError("speculative_config method='dspark': the checkpoint has no DSpark module "
                             "(no mtp.* tensors); use method='ngram'")
        return cls(config, DSparkDrafter.from_target(model))

    # -- ModelDrafter ------------------------------------------------------------------
    def kv_cache_layers(self) -> list[nn.Module]:
        return [self.cache]

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self._probs.get(req_id)

    def remove(self, req_id: str) -> None:
        self._probs.pop(req_id, None)

    def confidences(self) -> torch.Tensor | None:
        return self._confidence

    # -- a step ------------------------------------------------------------------------
    def forward(self, model: nn.Module, input_ids: torch.Tensor, ctx: ForwardContext,
                select: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, None]:
        """The target's forward keeping the features of every row, then each stage's context
        rows of the step's positions written into the cache."""
        from deepinfer.models.deepseek_v41 import FeatureCapture

        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        capture = FeatureCapture.new(self.module.cfg.target_layer_ids, rows, self.module.cfg.hidden_size,
                                     self.module.main_proj.weight.dtype)
        hidden = model.forward_rows(input_ids, ctx, select, capture=capture)
        context = self.module.context_kv(capture.out, ctx.positions)                        # [S, T, D]
        self.cache.write(ctx.groups[self.cache.group_id].slot_mapping, context.transpose(0, 1))
        return hidden, None

    def propose(self, state: None, commit: StepCommit, ctx: ForwardContext,
                generator: torch.Generator) -> torch.Tensor:
        """Drafts [B, max_draft] from each committed sequence's last token over its context
        rows (gathered from the cache). Keeps the sampled rows' draft distributions."""
        dev = commit.anchors.device
        if not commit.req_ids:                                                            # nothing committed
            self._confidence = None
            return torch.empty(0, self.max_draft, dtype=torch.long, device=dev)
        last_positions = ctx.positions.index_select(0, commit.last_rows)                  # [B] s
        positions, valid = window_positions(last_positions, self.window)                 # [B, W]
        group = ctx.groups[self.cache.group_id]
        bs = group.block_size
        tables = group.block_table.index_select(0, to_device(commit.table_rows, torch.long, dev))  # [B, blocks]
        blocks = tables.gather(1, (positions // bs).clamp(max=tables.shape[1] - 1)).long()  # [B, W]
        context = self.cache.read(blocks * bs + positions % bs)                          # [B, W, S, D]
        valid = valid & (blocks > 0)                                                      # freed or unheld: null block
        params = commit.params
        sampling = draft_sampling(params, commit.stream_indices, commit.prompt_lens, last_positions, generator,
                                  self.module.cfg.block_size, self.module.cfg.vocab_size)
        proposal = self.module.propose(commit.anchors, last_positions + 1, context.permute(2, 0, 1, 3), valid,
                                       sampling)
        logits = proposal.confidence_logits[:, :self.max_draft]                           # [B, max_draft]
        self._confidence = torch.sigmoid(logits if self._temperatures is None else logits / self._temperatures)
        for i, (req_id, p) in enumerate(zip(commit.req_ids, params)):
            if p.greedy:
                self._probs.pop(req_id, None)
            else:
                self._probs[req_id] = proposal.probs[i, :self.max_draft]
        return proposal.tokens[:, :self.max_draft]
