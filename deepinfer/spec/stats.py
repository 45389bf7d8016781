"""Speculative decoding's cumulative counters, with vLLM's meanings
(``vllm:spec_decode_num_drafts`` and friends)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0                 # verifications of a sequence's draft (of >= 1 token)
    num_draft_tokens: int = 0           # draft tokens verified
    num_accepted_tokens: int = 0        # of those, accepted
    # [k]: drafts whose token at position k (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for k in range(num_accepted):
            self.accepted_per_pos[k] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_committed(self) -> float | None:
        """Tokens committed per verification, the target's own included (tau, per sequence)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
