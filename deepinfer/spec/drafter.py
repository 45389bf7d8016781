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
  verification needs.

``make_drafter`` builds the one ``SpeculativeConfig.method`` names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.config import SpeculativeConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.ngram import propose_ngram


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
    table_rows: list[int]         # each one's row in the step's block tables (a fork sibling: its parent's)
    last_rows: torch.Tensor       # [B] int64 the row of its last committed position s
    anchors: torch.Tensor         # [B] int64 the token it committed last (position s + 1, not fed yet)
    next_ids: torch.Tensor        # [T] int64 each row's next token (at position + 1) where known:
                                  # the next input row, the committed tokens, the anchors


class ModelDrafter(ABC):
    """A drafter that runs on the device inside the step (see the module docstring). Per step
    the runner calls :meth:`forward` (instead of the model's own) and then :meth:`propose`,
    every step: with B = 0 committed sequences when the step committed nothing (prompt
    chunks), so that a drafter keeping rows of every position sees every row's next token."""

    max_draft: int
    has_confidences: bool = False    # :meth:`confidences` gives values
    # Positions past the step's last fed token whose cache slots the drafter writes while
    # proposing (a chained drafter's later steps): the scheduler holds blocks for them when
    # the pool has room (best effort; without them those writes are skipped, see spec/mtp.py).
    num_lookahead_tokens: int = 0
    # Trailing positions of a prefix-cache hit whose drafter rows depend on the token after the
    # hit (which the writer's sequence chose): the scheduler stops a hit before them.
    prefix_hit_margin: int = 0

    @abstractmethod
    def kv_cache_layers(self) -> list[nn.Module]:
        """Its cache layers (each with a ``kv_spec``; the runner binds ``kv_cache`` and
        ``group_id`` as for the model's layers)."""

    @abstractmethod
    def forward(self, model: nn.Module, input_ids: torch.Tensor, ctx: ForwardContext,
                select: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The target's forward of the step, as ``model.forward_rows(input_ids, ctx, select)``
        (hidden states of the selected rows), keeping what the drafter reads of it; returns
        them and a state handed to :meth:`propose`. May write the drafter's cache rows."""

    @abstractmethod
    def propose(self, state: Any, commit: StepCommit, ctx: ForwardContext,
                generator: torch.Generator) -> torch.Tensor:
        """Drafts [B, max_draft] int64 (device) for the committed sequences, in ``commit``'s
        order ([0, max_draft] when B = 0); no host sync. Keeps sampled drafts' distributions
        for :meth:`draft_probs`."""

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """[max_draft, V] the distributions the sequence's last drafts were drawn from, or
        None when they were picked deterministically (greedy)."""
        return None

    def confidences(self) -> torch.Tensor | None:
        """[B, max_draft] float32 of the last :meth:`propose`: the probability that draft k
        survives given drafts 0..k-1 did (what varlen verification schedules by), or None
        when the drafter has no confidence head."""
        return None

    def remove(self, req_id: str) -> None:
        """Forget a sequence that ended."""


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
        "methods available: 'ngram', 'dspark' for DeepSeek-V4.1 checkpoints with a DSpark module, "
        "and 'mtp' for DeepSeek-V3 checkpoints with MTP layers")
