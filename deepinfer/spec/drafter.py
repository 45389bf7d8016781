"""Drafters: where speculative decoding's draft tokens come from.

A :class:`Drafter` proposes, after each step that sampled a token for a sequence, the draft
tokens that sequence's next step verifies (``StepResult.draft_token_ids``; the scheduler
may verify fewer). It owns no KV-cache block and no scheduler state; what it keeps per
sequence (if anything) is keyed by request id and dropped in :meth:`Drafter.remove`.
Proposals may be wrong: verification (spec/verify.py) keeps the output distribution exact
whatever they are, so a drafter only decides how many tokens a step commits.

``make_drafter`` builds the one ``SpeculativeConfig.method`` names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from deepinfer.config import SpeculativeConfig
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


def make_drafter(config: SpeculativeConfig, architecture: str) -> Drafter:
    if config.method == "ngram":
        return NgramDrafter(config)
    raise NotImplementedError(
        f"speculative_config method={config.method!r} is not built yet for {architecture}; "
        "method='ngram' is available")
