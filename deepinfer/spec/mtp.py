"""DeepSeek-V3's MTP module as a chained drafter (``speculative_config={"method": "mtp",
"num_speculative_tokens": N}``), run inside each step with its KV in the engine's paged cache.

The MTP module (models/deepseek_v3.py, :class:`DeepseekV3MTP`) at position ``i`` reads the
previous stage's hidden state at ``i`` and the embedding of the token at ``i + 1``, runs one
MLA + MoE block (its own KV entry at ``i``) and predicts the token at ``i + 2``. Per step
(the runner calls these in order):

1. :meth:`MTPEngineDrafter.forward` — the target's forward over the step's rows, keeping
   the final-normed hidden state of *every* row (the state handed to ``propose``).
2. :meth:`MTPEngineDrafter.propose` — called every step, also when nothing was committed
   (:meth:`~MTPEngineDrafter.context_pass`, then :meth:`~MTPEngineDrafter.draft`; where the
   decode CUDA graphs hold the step, each replays a graph of its own, runner/cuda_graph.py):

   - **Context pass.** MTP module 0 over all T rows of the step, at the rows' positions
     and cache slots (the step's own ``ctx``), with ``previous_hidden`` = the target's
     hidden of the row and input id = ``commit.next_ids`` (the token at position + 1: the
     next fed row, the next prompt token at a chunk's end, the token the step committed
     after a sequence's last committed position ``s``). This writes the MTP layer's KV at
     every position the target wrote, so the two caches stay in step. Rows past ``s`` (the
     rejected drafts of a verification) write entries from wrong inputs; they are
     overwritten when their positions are computed again, exactly like the target's own
     (``num_computed_tokens`` falls back to the committed count; nothing rolls back).
     The output at ``commit.last_rows`` (position ``s``, input the anchor at ``s + 1``)
     gives draft 1, the token at ``s + 2``.
   - **Chain.** Draft k (k = 2..N) comes from a one-token-per-sequence MTP forward at
     position ``s + k - 1`` (the previous draft's position) with input id = draft k-1 and
     ``previous_hidden`` = the MTP's own pre-norm output of the previous step (vLLM's
     chaining). Each writes the MTP KV at that position's slot, read from the MTP group's
     block table (``block_table[commit.table_rows]``), so later chain steps attend to the
     earlier ones. These entries are provisional: the next step's context pass rewrites
     positions ``s + 1 ..`` with the target's hidden states. The slots lie past the step's
     fed tokens (a decode step holds blocks up to ``s``, a verification up to ``s`` plus
     the rejected drafts), so the drafter asks the scheduler for ``N - 1`` lookahead slots
     (``num_lookahead_tokens``), held when the pool has room. A chain position whose block
     is not held (pool too full, or past ``max_model_len``) writes nothing (slot -1) and
     reads the null block there: its drafts are poor, never wrong output (verification
     decides).

Prefix-cache hits and preemption need nothing more: the MTP entries live in the same
pages as the target's. One care: the entry at position ``i`` reads the token at ``i + 1``,
so a hit's last entry was written with the *writer's* next token; the drafter asks the
scheduler (``prefix_hit_margin`` = 1) to stop hits one position short (one hit step, at the
cache's granularity), so that entry is recomputed with the reader's own token and drafts
stay a function of the sequence alone.

Cost: the context pass is one MTP layer over the step's rows (about 1/61 of V3's target
work); the chain adds N - 1 sequential one-token MTP forwards and N LM-head projections
([B, V] each), so drafting cost grows linearly with N.

Sampled drafts (requests with a temperature) draw from ``softmax(filters(z / T))`` with the
request's own temperature and filters (spec/draft_sampling.py, models/dspark.py
``pick_draft``); the distributions stay here for verification (:meth:`draft_probs`).

Known approximations (drafts only; output is exact whatever the drafts are):

- Only module 0 is used. A checkpoint with several MTP modules (``num_nextn_predict_layers``
  > 1; DeepSeek's V3/R1/V3.1 ship one) would need a context pass per module to keep each
  module's KV in sync; the others are not run (a warning says so).
- A fork sibling (``n`` > 1) drafts in its first step from its parent's anchor (it shares
  the parent's row until the scheduler forks its blocks).
- No embedding zeroing at position 0 (vLLM zeroes it; HF's MtpModel and
  :class:`DeepseekV3MTP` do not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from deepinfer.config import SpeculativeConfig
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.models.dspark import pick_draft
from deepinfer.spec.drafter import DraftOutput, DraftRows, ModelDrafter

logger = logging.getLogger(__name__)


class MTPEngineDrafter(ModelDrafter):
    """Chained drafting with a DeepSeek-V3 MTP module (see the module docstring).

    State between :meth:`forward` and :meth:`propose`: the target's hidden states [T, H] of
    the step's rows. Per request it keeps only the distributions of its last sampled drafts.
    """

    MODULE = 0      # the MTP module every draft step runs
    graph_safe = True
    has_context_pass = True

    def __init__(self, config: SpeculativeConfig, mtp: nn.Module) -> None:
        from deepinfer.models.deepseek_v3 import DeepseekV3MTP

        if not isinstance(mtp, DeepseekV3MTP):
            raise TypeError(f"MTPEngineDrafter runs a DeepseekV3MTP, got {type(mtp).__name__}")
        self.mtp = mtp
        self.max_draft = config.num_speculative_tokens
        # Chain step k (2..N) writes position s + k - 1; the step fed up to at least s.
        self.num_lookahead_tokens = self.max_draft - 1
        # The entry at the hit's last position depends on the token after it.
        self.prefix_hit_margin = 1
        self.vocab_size = mtp.args.vocab_size
        self.num_slots = self.max_draft
        self.row_state_size = mtp.args.hidden_size
        self._confidence: torch.Tensor | None = None
        self.attn = mtp.layers[self.MODULE].block.self_attn
        if len(mtp.layers) > 1:
            logger.warning("the checkpoint has %d MTP modules; method='mtp' chains module 0 only "
                           "(the others' caches would need context passes of their own)", len(mtp.layers))
        self._probs: dict[str, torch.Tensor] = {}        # req_id -> [max_draft, V] of sampled drafts

    @classmethod
    def for_model(cls, config: SpeculativeConfig, model: nn.Module) -> "MTPEngineDrafter":
        from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM

        if not isinstance(model, DeepseekV3ForCausalLM):
            name = type(model).__name__
            if name == "DeepseekV41ForCausalLM":
                raise NotImplementedError(
                    "speculative_config method='mtp' runs DeepSeek-V3 MTP modules; a DeepSeek-V4.1 checkpoint's "
                    "mtp.* tensors are its DSpark drafter: use method='dspark'")
            if "DeepseekV4" in name and getattr(model, "has_dspark", False):
                raise NotImplementedError(
                    "speculative_config method='mtp' runs DeepSeek-V3 MTP modules; this DeepSeek-V4 checkpoint's "
                    "mtp.* tensors are its DSpark drafter (its config has dspark_block_size): use method='dspark'")
            if "DeepseekV4" in name:
                raise NotImplementedError(
                    f"speculative_config method='mtp' runs DeepSeek-V3 MTP modules; {name}'s MTP layers "
                    "(mtp_forward: hyper-connection streams, sliding-window and compressed caches) are not "
                    "wired as a drafter yet; use method='dspark' (V4.1 and V4 DSpark checkpoints) or 'ngram'")
            raise NotImplementedError(
                f"speculative_config method='mtp' runs the MTP module of DeepSeek-V3-architecture "
                f"checkpoints (V3, R1, V3.1); {name} is not supported (method='ngram' works with any model)")
        if model.mtp is None:
            raise ValueError("speculative_config method='mtp': the checkpoint has no MTP module "
                             "(no model.layers.{num_hidden_layers}.* tensors, or "
                             "num_nextn_predict_layers=0); use method='ngram'")
        return cls(config, model.mtp)

    # -- ModelDrafter ------------------------------------------------------------------
    def kv_cache_layers(self) -> list[nn.Module]:
        """The MLA layer of the module the drafter runs (its own KV, paged like the target's)."""
        return [self.attn]

    # -- a step ------------------------------------------------------------------------
    def forward(self, model: nn.Module, input_ids: torch.Tensor, ctx: ForwardContext,
                select: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward over every row (the context pass needs all of them); returns
        the selected rows' hidden states and, as the state, all of them [T, H]."""
        hidden = model(input_ids, ctx)                                                    # [T, H]
        return select(hidden), hidden

    def context_pass(self, state: torch.Tensor, next_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The MTP KV of every row of the step, at the step's slots; its output [T, H]."""
        return self.mtp(next_ids, ctx, previous_hidden=state, step=self.MODULE)

    def row_state(self, carry: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        return carry.index_select(0, last_rows)                                           # [B, H] at s

    def draft(self, rows: DraftRows) -> DraftOutput:
        """N chained drafts per row: [B, N] int64, each one-token MTP step writing its KV at
        position s + k - 1 (nothing where that block is not held)."""
        n = self.max_draft
        sampling = rows.sampling
        noise = None if sampling is None else sampling.noise                              # [B, N, V]
        hidden = rows.hidden                                                              # [B, H] at s
        token, q = pick_draft(self.mtp.compute_logits(hidden, self.MODULE), sampling,
                              None if noise is None else noise[:, 0])                     # [B], [B, V]
        tokens, probs = [token], [q]
        # Chain: draft k from position s + k - 1, one token per sequence.
        if n > 1:
            chain = _ChainContext(rows, self.attn.group_id, n - 1, self.attn.kv_cache.shape[1])
            for k in range(2, n + 1):
                hidden = self.mtp(token, chain.at(k - 1), previous_hidden=hidden, step=self.MODULE)   # [B, H]
                token, q = pick_draft(self.mtp.compute_logits(hidden, self.MODULE), sampling,
                                      None if noise is None else noise[:, k - 1])
                tokens.append(token)
                probs.append(q)
        return DraftOutput(tokens=torch.stack(tokens, 1), confidences=None,
                           probs=None if sampling is None else torch.stack(probs, 1))


class _ChainContext:
    """Forward contexts of the chain's one-token steps: row i at position ``s_i + j``
    (j = 1 .. max_offset), writing the MTP KV at that position's slot of its block table in
    the MTP layer's group, attending to positions ``0 .. s_i + j``. Decode-shaped: only
    device tensors carry lengths (no host sync); ``rows.max_seq_len`` bounds them."""

    def __init__(self, rows: DraftRows, group_id: int, max_offset: int, block_size: int) -> None:
        tables = rows.tables
        dev = tables.device
        self.group_id, self.bs, self.bound = group_id, block_size, rows.max_seq_len
        self.last_positions = rows.last_positions                                         # [B]
        # Null-block columns, so that every chain position's block index lies in the table.
        pad = torch.zeros(tables.shape[0], max_offset // self.bs + 1, dtype=tables.dtype, device=dev)
        self.tables = torch.cat([tables, pad], 1)                                         # [B, W']
        b = tables.shape[0]
        self.query_start_loc = list(range(b + 1))
        self.query_start_loc_t = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=dev)

    def at(self, offset: int) -> ForwardContext:
        """The context of the chain step at positions ``s + offset`` [B]."""
        pos = self.last_positions + offset                                                # [B]
        blocks = self.tables.gather(1, (pos // self.bs)[:, None])[:, 0].long()          # [B]
        # An unheld block (no lookahead room): write nothing there.
        slots = torch.where(blocks > 0, blocks * self.bs + pos % self.bs, torch.full_like(pos, -1))
        # Only the MTP layer's group is read (the chain runs that layer alone).
        groups = [GroupMetadata(block_size=self.bs, block_table=self.tables, slot_mapping=slots)] * (self.group_id + 1)
        b = pos.shape[0]
        return ForwardContext(positions=pos, query_start_loc=self.query_start_loc, seq_lens=[self.bound] * b,
                              groups=groups, query_start_loc_t=self.query_start_loc_t,
                              seq_lens_t=(pos + 1).to(torch.int32), token_seq=self.token_seq,
                              max_seq_len=self.bound, decode_only=True)
