"""Speculative decoding in ``bench decode | curve`` (``--speculative N``).

The engine is built with ``speculative_config={"method": "ngram", "num_speculative_tokens": N}``
and each point is measured twice on it, without speculation then with it
(:func:`speculation` toggles the drafter between measurements, the engine idle). The
drafter is ``--spec-method``:

- ``fixed`` (default): :class:`FixedDrafter` proposes N tokens every step, so every step
  verifies 1 + N tokens per request and its time is that of a verification step;
- ``ngram``: the engine's own prompt lookup (spec/drafter.py); steps verify 1 + 0..N tokens;
- ``dspark``: a DeepSeek-V4.1 config with the release's DSpark drafter (random weights,
  ``model_shapes.with_dspark``): every step runs the drafter and verifies 1 + N tokens, so the
  step time is that of DSpark decoding at full acceptance. Its steps replay CUDA graphs (the
  drafter's forward and proposal; ``spec_counters`` counts them) unless ``--no-drafter-graphs``;
  with them, the decode graphs hold the drafter's forward, so the run without speculation
  on the same engine also writes the drafter's context rows (a few small GEMMs a step).

Reported for the speculative run, never mixed: full-acceptance throughput
``SPS x B x (1 + N) / cp``; effective throughput (tokens committed / time); measured tau
(tokens committed per request per step, the target's own included, from the scheduler's
counters over the timed window); per-user speed against the run without speculation; the
step time against a plain decode step; and, labelled assumed, the throughput under an
assumed acceptance (tau = 1 + nextn x acceptance, DeepInfer's convention nextn 3 at 75%) from
the measured time of width-(1 + nextn) verification steps. The weights are random, so the
measured acceptance says nothing of a trained model's: only the full-acceptance and assumed
figures carry over.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from deepinfer.bench.common import CP, fmt, print_table
from deepinfer.engine.engine import Engine
from deepinfer.spec.drafter import Drafter
from deepinfer.spec.stats import SpecDecodingStats

SPEC_METHODS = ("fixed", "ngram")
RANDOM_WEIGHTS_NOTE = ("random weights: the drafts' acceptance is not meaningful (it says nothing of a "
                       "trained model's), so tau and the effective figures are measured but only the "
                       "full-acceptance and assumed figures carry over")


class FixedDrafter(Drafter):
    """Always ``n`` drafts (the last token repeated): every decode step verifies 1 + n tokens
    per request, whatever the model predicts."""

    def __init__(self, n: int) -> None:
        self.max_draft = n

    def propose(self, req_id: str, token_ids: Sequence[int]) -> list[int]:
        return [token_ids[-1]] * self.max_draft


@dataclass
class SpecSetup:
    """``--speculative`` and its options, with the drafter the speculative runs use."""

    method: str
    num_tokens: int
    drafter: Drafter
    assumed_nextn: int
    assumed_acceptance: float
    drafter_graphs: bool = True      # a model drafter's steps may replay CUDA graphs (--drafter-graphs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, engine: Engine) -> SpecSetup | None:
        """None without ``--speculative``; ``engine`` was built with :func:`engine_settings`."""
        if not args.speculative:
            return None
        drafter = FixedDrafter(args.speculative) if args.spec_method == "fixed" else engine.runner.drafter
        assert drafter is not None and drafter.max_draft == args.speculative
        return cls(args.spec_method, args.speculative, drafter, args.assumed_nextn, args.assumed_acceptance,
                   args.drafter_graphs)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_tokens,
                "assumed_nextn": self.assumed_nextn, "assumed_acceptance": self.assumed_acceptance,
                "drafter_graphs": self.drafter_graphs, "note": RANDOM_WEIGHTS_NOTE}


def check_spec_args(args: argparse.Namespace) -> None:
    if args.speculative < 0 or args.assumed_nextn < 1 or not 0.0 <= args.assumed_acceptance <= 1.0:
        raise ValueError("--speculative must be >= 0 (0: off), --assumed-nextn >= 1 and --assumed-acceptance "
                         "in [0, 1]")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``build_engine`` settings: a speculative config of ``--speculative`` tokens, DSpark's for
    ``--spec-method dspark`` and an n-gram one otherwise (its drafter replaced for ``fixed``),
    or none."""
    if not args.speculative:
        return {}
    method = "dspark" if args.spec_method == "dspark" else "ngram"
    return {"speculative_config": {"method": method, "num_speculative_tokens": args.speculative,
                                   "varlen": False, "cuda_graphs": args.drafter_graphs}}


@contextmanager
def speculation(engine: Engine, drafter: Drafter | None) -> Iterator[None]:
    """Speculative decoding with ``drafter`` (None: off) on the idle ``engine`` meanwhile."""
    saved = engine.runner.drafter, engine.scheduler.num_speculative_tokens
    engine.runner.drafter = drafter
    engine.scheduler.num_speculative_tokens = drafter.max_draft if drafter is not None else 0
    try:
        yield
    finally:
        engine.runner.drafter, engine.scheduler.num_speculative_tokens = saved


def counters_since(before: SpecDecodingStats, after: SpecDecodingStats) -> dict[str, int]:
    """The scheduler's speculative counters between two snapshots."""
    return {"drafts": after.num_drafts - before.num_drafts,
            "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens}


def spec_figures(run: dict[str, Any], plain: dict[str, Any], batch: int, steps: int,
                 setup: SpecSetup) -> dict[str, Any]:
    """The speculative run's figures (``run``: its ``measure_decode`` result), against the
    ``plain`` run of the same engine and point."""
    n, c = setup.num_tokens, run["spec_counters"]
    # Every request verified N drafts in every timed step: the step is a width-(1 + N) one.
    full_width = c["drafts"] == steps * batch and c["draft_tokens"] == n * c["drafts"]
    a, p = setup.assumed_nextn, setup.assumed_acceptance
    tau_assumed = 1 + a * p
    assumed: dict[str, Any] = {"label": "assumed acceptance (not measured)", "nextn": a, "acceptance": p,
                               "tau": tau_assumed, "tok_s_per_gpu": None, "tok_s_per_user": None,
                               "unavailable": None}
    if n == a and full_width:
        assumed.update(tok_s_per_gpu=run["steps_per_s"] * batch * tau_assumed / CP,
                       tok_s_per_user=run["steps_per_s"] * tau_assumed)
    else:
        assumed["unavailable"] = (f"needs the time of a width-{1 + a} verification step: a run with "
                                  f"--speculative {a} where every step verifies {1 + a} tokens per request "
                                  "(--spec-method fixed)")
    return {
        "method": setup.method, "num_speculative_tokens": n, "timed_steps": steps,
        **{k: run[k] for k in ("ms_per_step", "steps_per_s", "full_acceptance_tok_s", "effective_tok_s",
                               "per_user_tok_s", "step_ms_median", "step_ms_max", "tokens_committed",
                               "min_tokens_per_step", "sync_steps", "gpu_idle_ms_per_step",
                               "gpu_busy_ms_per_step", "spec_counters")},
        "full_acceptance_tok_s_per_user": run["steps_per_s"] * (1 + n),
        # Tokens committed per request per step, the target's own included (steps without
        # drafts count, committing 1); per verification it is the engine's mean_committed.
        "tau": 1 + c["accepted_tokens"] / (steps * batch),
        "tau_per_verification": 1 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else None,
        "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None,
        "full_width_steps": full_width,
        "per_user_over_no_spec": run["per_user_tok_s"] / plain["per_user_tok_s"],
        "step_over_plain_step": run["ms_per_step"] / plain["ms_per_step"],
        "plain_cuda_graphs": plain["cuda_graphs"], "plain_async_scheduling": plain["async_scheduling"],
        "assumed": assumed,
    }


def _drafter_graphs(spec: dict[str, Any]) -> str:
    """A model drafter's graph counters for the report line ('' for a host drafter)."""
    c = spec["spec_counters"]
    if spec["method"] != "dspark":
        return ""
    return (f"; drafter: {c['drafter_graph_steps']} of {spec['timed_steps']} forwards and "
            f"{c['draft_graph_proposals']} proposals through CUDA graphs")


def report_spec(setup: dict[str, Any], points: list[dict[str, Any]]) -> None:
    """The speculative table under ``bench decode | curve``'s (``setup``: ``SpecSetup.describe()``)."""
    n, a, p = setup["num_speculative_tokens"], setup["assumed_nextn"], setup["assumed_acceptance"]
    rows = []
    for pt in points:
        s = pt["spec"]
        rows.append([f"B={pt['batch']}", s["ms_per_step"], s["step_over_plain_step"], s["full_acceptance_tok_s"],
                     s["effective_tok_s"], s["per_user_tok_s"], s["per_user_over_no_spec"], s["tau"],
                     s["assumed"]["tok_s_per_gpu"], s["assumed"]["tok_s_per_user"]])
    print_table(f"speculative decoding ({setup['method']} drafter, {n} drafts/step; full = SPS x B x (1 + {n}) / cp, "
                f"eff. = committed / time, assumed = SPS x B x tau {1 + a * p:g} / cp at nextn {a}, "
                f"acceptance {p:g})",
                ["", "ms/step", "x plain step", "tok/s full", "tok/s eff.", "tok/s/user", "x no-spec user",
                 "tau", "tok/s assumed", "tok/s/user assumed"], rows)
    for pt in points:
        s = pt["spec"]
        step = (f"a verification step ({1 + n} tokens/request)" if s["full_width_steps"]
                else "a speculative step (mean; not every request verified all drafts)")
        plain = ", ".join([*(["CUDA graphs"] if s["plain_cuda_graphs"] else []),
                           "overlapped" if s["plain_async_scheduling"] else "synchronous"])
        print(f"B={pt['batch']}: {step} takes {fmt(s['step_over_plain_step'])}x a plain decode step (plain: {plain}; "
              f"speculative steps: {s['sync_steps']} of {s['timed_steps']} synchronous, device idle "
              f"{fmt(s['gpu_idle_ms_per_step'])} ms between steps (a planned-ahead step still waits for the one "
              f"before at launch), {s['spec_counters']['graph_verifications']} of {s['timed_steps']} "
              f"through CUDA graphs{_drafter_graphs(s)}); "
              f"tau {fmt(s['tau'])} measured ({s['spec_counters']['drafts']} verifications of "
              f"{s['spec_counters']['draft_tokens']} drafts, {s['spec_counters']['accepted_tokens']} accepted)")
        if s["assumed"]["unavailable"]:
            print(f"B={pt['batch']}: assumed acceptance: {s['assumed']['unavailable']}")
    print(f"note: {setup['note']}")
