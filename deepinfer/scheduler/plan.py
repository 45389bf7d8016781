"""What crosses from the scheduler to the runner (StepPlan) and back (StepResult).

Plain data only. A request's static data (prompt, sampling parameters) goes to
the runner once, in ``new_requests``, when the runner has not seen it (first
schedule, resume after preemption, fork); later steps carry only the tokens to
feed and the block tables.

Overlapped scheduling: a plan may be made while the previous one still runs, so
a sequence that samples in step N is fed in step N+1 a token the host does not
know yet. Its ``ScheduledSeq.placeholder`` is set and the slot holds
``PLACEHOLDER_TOKEN_ID``; the runner takes the real token from step N's sampled
ids on the device.

KV-cache tiers: ``StepPlan.kv_tier_ops`` are the byte movements the scheduler's tier
index (scheduler/kv_tiers.py) decided this step, in order; the runner carries them out
(runner/kv_offload.py). Saves read device blocks before anything of the step writes them;
loads fill blocks no sequence holds yet, and are done when the step lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.outputs import PositionLogprobs
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.base import CompiledGrammar

# Fills the slot of a token still in flight (see ScheduledSeq.placeholder). Out of every
# vocabulary, so an unfilled slot fails the embedding lookup instead of feeding a real token.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class TierOp:
    """One movement of a lower-tier entry (a cached block's bytes in one group's part of a
    page). ``key``: the entry (its longest prefix key); ``slot``: its host-memory copy.

    - ``save``: device block ``block`` -> host slot ``slot`` (the block is being evicted);
    - ``demote``: host slot -> disk file of ``key`` (with ``keys``, every key the entry
      serves, for a restarted engine's index), then the host copy is dropped;
    - ``drop``: forget the copy in ``tier`` (host slot or disk file);
    - ``load``: the copy in ``tier`` -> device block ``block`` (for ``req_id``'s hit).
    """

    kind: str
    key: bytes
    group: int
    slot: int = -1
    block: int = 0
    keys: tuple[bytes, ...] = ()
    tier: str = "host"
    req_id: str = ""


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stream_index: int
    grammar: CompiledGrammar | None = None   # structured outputs: the runner makes the matcher
    replay_start: int = 0                    # Request.replay_start (bounded replay)


@dataclass
class ScheduledSeq:
    req_id: str
    token_ids: list[int]               # tokens fed this step
    start_pos: int                     # position of token_ids[0] (= tokens already cached)
    block_tables: list[list[int]]      # one block table per KV-cache group
    sample: bool                       # this step reaches the end of the known tokens
    prompt_logprob_rows: int = 0       # leading rows of this chunk that need prompt logprobs
    fork_ids: list[str] = field(default_factory=list)  # siblings sampled from the same logits
    # token_ids[-1] is PLACEHOLDER_TOKEN_ID: the token the previous launched step samples for
    # this sequence, which the runner gathers on the device (overlapped scheduling).
    placeholder: bool = False
    # Speculative decoding: the last num_draft token_ids are draft tokens, verified this step
    # (the token before them is the last one sampled). Logits come from all 1 + num_draft rows.
    num_draft: int = 0
    # Speculative decoding, overlapped: planned while the sequence's previous step was in flight,
    # before its accepted drafts were known. ``start_pos`` is then the position the step starts
    # at when every draft in flight is accepted and ``token_ids`` are placeholders; the runner
    # takes the true start, the token the previous step committed last and the drafts it
    # proposed (the first ``num_draft`` of them, or as many as there are) from that step's result.
    ahead: bool = False


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages, before the forward
    kv_tier_ops: list[TierOp] = field(default_factory=list)            # before the block copies
    # Why the next step cannot be planned before this one's tokens reach the host (the
    # scheduler's fallback to a synchronous step), or None when it can.
    sync_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def has_tier_loads(self) -> bool:
        """Blocks are loaded from a lower tier: the step must land before they are used."""
        return any(op.kind == "load" for op in self.kv_tier_ops)


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: PositionLogprobs | None
    grammar_terminated: bool = False   # the grammar accepted a stop token: the sequence is done
    error: str | None = None           # the sequence cannot continue (e.g. a token its grammar refused)


@dataclass
class StepResult:
    # req_id -> token sampled for it this step (also for fork_ids siblings).
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # Speculative decoding: req_id -> its accepted draft tokens, committed before its
    # ``sampled`` token (the target's own: a correction, or the bonus when all passed).
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for its next step (speculative decoding), and where the
    # drafter has them, each draft's confidence (P(survives | the drafts before it did)).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_confidences: dict[str, list[float]] = field(default_factory=dict)
    # req_id -> prompt logprobs computed for this chunk's rows.
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Device time (ms) between the previous step's last kernel and this step's first, and
    # this step's own device time; None where not measured (CPU, or first step after idle).
    gpu_idle_ms: float | None = None
    gpu_busy_ms: float | None = None
    # Keys of the tier entries whose load failed (a disk entry found corrupt): not used.
    kv_load_failures: set[bytes] = field(default_factory=set)
