"""Drafters: where speculative decoding's draft tokens come from.

A drafter proposes, after each step that sampled a token for a sequence, the draft tokens
that sequence's next step verifies (``StepResult.draft_token_ids``; the scheduler may
verify fewer). It holds no scheduler state; what it keeps per sequence (if anything) is
keyed by request id and dropped in ``remove``. Proposals may be wrong: verification
(spec/verify.py) keeps the output distribution exact whatever they are, so a drafter only
decides how many tokens a step commits. Two kinds:

- :class:`Drafter` works on the host from the token ids (n-gram lookup), after a step's
  tokens are known;
- :class:`ModelDrafter` runs on the device inside the step (spec/dspark.py): it reads the
  target's hidden features of the step's rows, keeps its own context rows in the engine's
  paged KV cache (its ``kv_cache_layers``, written by position like the target's, so a
  rejected draft's rows are simply overwritten later and prefix hits, forks and
  preemption treat them as any other layer's), and drafts from the step's sampled tokens
  before the step ends; it also keeps the distribution each draft was drawn from, which
  verification needs. One that declares ``graph_safe`` runs inside the decode CUDA graphs
  (runner/cuda_graph.py): its proposal is split so that the host's part stays outside.

``make_drafter`` builds the one ``SpeculativeConfig.method`` names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepinfer.config import SpeculativeConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.ngram import propose_ngram
from deepinfer.transfer import to_device

if TYPE_CHECKING:
    from deepinfer.models.dspark import DraftSampling


class Drafter(ABC):
    max_draft: int      # the most tokens one proposal holds

    @abstractmethod
    def propose(self, req_id: str, token_ids: Sequence[int]) -> list[int]:
        """Draft tokens continuing ``token_ids`` (the sequence's prompt and output so far,
        its last token just sampled); at most ``max_draft``, possibly none."""

    def remove(self, req_id: str) -> None:
        """Forget a sequence that ended (or was preempted: it is proposed for afresh)."""


class NgramDrafter(Drafter):
    """Prompt lookup (spec/ngram.py): stateless."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_draft = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, req_id: str, token_ids: Sequence[int]) -> list[int]:
        return propose_ngram(token_ids, self.min_n, self.max_n, self.max_draft)


@dataclass
class StepCommit:
    """What one step committed, on the device, for a :class:`ModelDrafter`: B sequences that
    got tokens (in this order), T rows of the step's flattened batch."""

    req_ids: list[str]
    params: list[SamplingParams]
    stream_indices: list[int]
    prompt_lens: list[int]        # position p holds output token p - prompt_len
    table_rows: list[int]         # each one's row in the step's block tables (a fork sibling: its parent's;
                                  # a step with a row per token: its first token's)
    last_rows: torch.Tensor       # [B] int64 the row of its last committed position s
    anchors: torch.Tensor         # [B] int64 the token it committed last (position s + 1, not fed yet)
    next_ids: torch.Tensor        # [T] int64 each row's next token (at position + 1) where known:
                                  # the next input row, the committed tokens, the anchors


@dataclass
class DraftRows:
    """What a :class:`ModelDrafter`'s proposal reads, one row per committed sequence (B rows;
    in a CUDA graph's static buffers, padded to the bucket: a padding row has a null-block
    table row, so it reads only the null block and writes nothing)."""

    anchors: torch.Tensor                 # [B] int64 the token each committed last (position s + 1)
    last_positions: torch.Tensor          # [B] int64 s, its last committed position
    tables: torch.Tensor                  # [B, W] int32 its block-table row in the drafter's KV-cache group
    max_seq_len: int                      # >= s + 1 + max_draft of every row (the chain's attention bound)
    hidden: torch.Tensor | None = None    # [B, H] the drafter's per-sequence state at s (MTP), if it reads one
    sampling: DraftSampling | None = None  # None: every row greedy; else its ``noise`` is set


@dataclass
class DraftOutput:
    """A proposal's device tensors, one row per :class:`DraftRows` row."""

    tokens: torch.Tensor                  # [B, max_draft] int64
    confidences: torch.Tensor | None      # [B, max_draft] float32, when the drafter has a confidence head
    probs: torch.Tensor | None            # [B, max_draft, V] float32 the sampled drafts' distributions


class ModelDrafter(ABC):
    """A drafter that runs on the device inside the step (see the module docstring). Per step
    the runner calls :meth:`forward` (instead of the model's own) and then :meth:`propose`,
    every step: with B = 0 committed sequences when the step committed nothing (prompt
    chunks), so that a drafter keeping rows of every position sees every row's next token.

    A proposal is three parts: :meth:`context_pass` (work over the step's rows that needs the
    committed tokens), the host's :meth:`draft_rows` (B rows of device tensors) and
    :meth:`draft` (static shapes, no host sync). With ``graph_safe`` the runner's decode CUDA
    graphs capture :meth:`forward` (in a ``decode_only`` context, ``select`` the identity), the
    context pass (with ``has_context_pass``) per bucket of rows and :meth:`draft` per bucket of
    committed sequences (runner/cuda_graph.py)."""

    max_draft: int
    has_confidences: bool = False    # :meth:`confidences` gives values
    # forward() and draft() may be captured in CUDA graphs: neither synchronises with the host
    # nor depends on host values beyond the shapes and DraftRows.max_seq_len.
    graph_safe: bool = False
    has_context_pass: bool = False   # :meth:`context_pass` does work (else it returns None)
    # Positions past the step's last fed token whose cache slots the drafter writes while
    # proposing (a chained drafter's later steps): the scheduler holds blocks for them when
    # the pool has room (best effort; without them those writes are skipped, see spec/mtp.py).
    num_lookahead_tokens: int = 0
    # Trailing positions of a prefix-cache hit whose drafter rows depend on the token after the
    # hit (which the writer's sequence chose): the scheduler stops a hit before them.
    prefix_hit_margin: int = 0
    # Width of DraftRows.hidden (0: the drafter reads no per-sequence state).
    row_state_size: int = 0
    # Draft slots a proposal samples (noise [B, num_slots, V]); >= max_draft.
    num_slots: int
    vocab_size: int
    # Set by subclasses: req_id -> [max_draft, V] of its last sampled drafts; the last proposal's
    # confidences [B, max_draft] (None without a confidence head).
    _probs: dict[str, torch.Tensor]
    _confidence: torch.Tensor | None

    @abstractmethod
    def kv_cache_layers(self) -> list[nn.Module]:
        """Its cache layers (each with a ``kv_spec``; the runner binds ``kv_cache`` and
        ``group_id`` as for the model's layers). The first is the one whose group's block
        tables :class:`DraftRows` carries."""

    @abstractmethod
    def forward(self, model: nn.Module, input_ids: torch.Tensor, ctx: ForwardContext,
                select: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The target's forward of the step, as ``model.forward_rows(input_ids, ctx, select)``
        (hidden states of the selected rows), keeping what the drafter reads of it; returns
        them and a state handed to :meth:`propose`. May write the drafter's cache rows."""

    def context_pass(self, state: Any, next_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Work over every row of the step once its tokens are committed (MTP: its layer over
        the rows and ``next_ids`` [T], each row's next token, ``StepCommit.next_ids``); returns
        what :meth:`row_state` reads, or None. No host sync."""
        return None

    def row_state(self, carry: torch.Tensor | None, last_rows: torch.Tensor) -> torch.Tensor | None:
        """DraftRows.hidden of the committed sequences (rows ``last_rows`` of the context pass)."""
        return None

    @abstractmethod
    def draft(self, rows: DraftRows) -> DraftOutput:
        """The drafts of ``rows``: static shapes, no host sync (a CUDA graph may hold it)."""

    def propose(self, state: Any, commit: StepCommit, ctx: ForwardContext, generator: torch.Generator,
                graphs: "DraftGraphRunner | None" = None) -> torch.Tensor:
        """Drafts [B, max_draft] int64 (device) for the committed sequences, in ``commit``'s
        order ([0, max_draft] when B = 0); no host sync (but for seeded sampled requests'
        noise, spec/draft_sampling.py). Keeps sampled drafts' distributions for
        :meth:`draft_probs`. ``graphs``: run :meth:`draft` through them when they take the rows."""
        carry = graphs.context_pass(state, commit.next_ids, ctx) if graphs is not None else None
        if carry is None:
            carry = self.context_pass(state, commit.next_ids, ctx)
        dev = commit.anchors.device
        if not commit.req_ids:                                                            # nothing committed
            self._confidence = None
            return torch.empty(0, self.max_draft, dtype=torch.long, device=dev)
        rows = self.draft_rows(carry, commit, ctx, generator)
        out = graphs.draft(rows) if graphs is not None else None
        if out is None:
            out = self.draft(rows)
        self._confidence = out.confidences
        for i, (req_id, p) in enumerate(zip(commit.req_ids, commit.params)):
            if p.greedy:
                self._probs.pop(req_id, None)
            else:
                self._probs[req_id] = out.probs[i]
        return out.tokens

    def draft_rows(self, carry: torch.Tensor | None, commit: StepCommit, ctx: ForwardContext,
                   generator: torch.Generator) -> DraftRows:
        """The committed sequences' :class:`DraftRows` from the step (device gathers; the host
        lists of ``commit`` go to the device without a sync)."""
        from deepinfer.spec.draft_sampling import draft_sampling

        dev = commit.anchors.device
        group = ctx.groups[self.kv_cache_layers()[0].group_id]
        last_positions = ctx.positions.index_select(0, commit.last_rows)                  # [B] s
        tables = group.block_table.index_select(0, to_device(commit.table_rows, torch.long, dev))
        sampling = draft_sampling(commit.params, commit.stream_indices, commit.prompt_lens, last_positions,
                                  generator, self.num_slots, self.vocab_size)
        return DraftRows(anchors=commit.anchors, last_positions=last_positions, tables=tables,
                         max_seq_len=ctx.max_seq_len + self.max_draft, hidden=self.row_state(carry, commit.last_rows),
                         sampling=sampling)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """[max_draft, V] the distributions the sequence's last drafts were drawn from, or
        None when they were picked deterministically (greedy)."""
        return self._probs.get(req_id)

    def confidences(self) -> torch.Tensor | None:
        """[B, max_draft] float32 of the last :meth:`propose`: the probability that draft k
        survives given drafts 0..k-1 did (what varlen verification schedules by), or None
        when the drafter has no confidence head."""
        return self._confidence

    def remove(self, req_id: str) -> None:
        """Forget a sequence that ended."""
        self._probs.pop(req_id, None)


class DraftGraphRunner(ABC):
    """Runs a :class:`ModelDrafter`'s context pass and :meth:`ModelDrafter.draft` through
    captured graphs (runner/cuda_graph.py)."""

    @abstractmethod
    def context_pass(self, state: Any, next_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """:meth:`ModelDrafter.context_pass` of a step on a decode graph's buffers from its
        bucket's graph, or None when the drafter has none."""

    @abstractmethod
    def draft(self, rows: DraftRows) -> DraftOutput | None:
        """The drafts of ``rows`` from a graph's replay, or None when no graph takes them."""


def make_drafter(config: SpeculativeConfig, model: nn.Module) -> Drafter | ModelDrafter:
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "dspark":
        from deepinfer.spec.dspark import DSparkEngineDrafter

        return DSparkEngineDrafter.for_model(config, model)
    if config.method == "mtp":
        from deepinfer.spec.mtp import MTPEngineDrafter

        return MTPEngineDrafter.for_model(config, model)
    raise NotImplementedError(
        f"speculative_config method={config.method!r} is not built yet for {type(model).__name__}; "
        "methods available: 'ngram', 'dspark' for DeepSeek-V4.1 / V4 checkpoints with a DSpark module, "
        "and 'mtp' for DeepSeek-V3 checkpoints with MTP layers")
