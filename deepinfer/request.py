"""A request and its status machine.

One :class:`Request` is one generated sequence. A user request with ``n > 1``
becomes ``n`` sequences sharing a ``parent_id``; the first computes the prompt
and the others are forked from it (sharing its KV blocks) when its prefill
completes.

    WAITING -> RUNNING -> FINISHED_*
       ^          |
       +-- PREEMPTED (blocks freed, recomputed on resume)
    FORK_PENDING -> RUNNING (forked from the first sibling) or WAITING
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.outputs import PositionLogprobs

if TYPE_CHECKING:
    from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    FORK_PENDING = "fork_pending"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str                    # unique per sequence
    parent_id: str                     # the user's request id
    index: int                         # which of the parent's n sequences
    prompt_token_ids: list[int]
    params: "SamplingParams"
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache on first schedule
    # Bounded replay: the first position the model's late layers compute (0: every position).
    # Set by the scheduler when the request is queued and fixed for its life (scheduler.py).
    replay_start: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # Speculative decoding: draft tokens proposed for the next step (dropped on preemption),
    # and where the drafter has them their confidences (varlen verification schedules by them).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_confidences: list[float] = field(default_factory=list)
    # Siblings (n > 1) waiting to be forked when this sequence's prefill completes.
    fork_children: list["Request"] = field(default_factory=list)
    # Accumulated results.
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode step reads
        one token of a sequence that may hold thousands)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    @property
    def prompt_logprobs_done(self) -> bool:
        # Entry 0 is None (no logprob for the first token), then one per prompt token.
        return len(self.prompt_logprobs) >= self.num_prompt_tokens
