"""Structured outputs: the grammar backend contract, the compiled-grammar cache and
the compilation time limit.

What belongs here: turning a request's ``StructuredOutputsParams`` into a compiled
grammar (cached, time-limited), and the per-sequence matcher interface the runner
drives. What does not: a particular grammar library (``xgrammar_backend.py``), the
token bitmask itself (``bitmask.py``), which rows are sampled (the runner) and when
a sequence finishes (the scheduler).

Life of a constrained request: ``Engine.add_request`` compiles its grammar
(``StructuredOutputBackend.compile``; a bad spec raises ValueError there and never
reaches the scheduler); the first plan that sends the sequence to the runner carries
the compiled grammar; the runner makes one matcher per sequence (every sibling of
``n > 1`` has its own), fills the row's token bitmask before each draw, and feeds
the drawn token back. A matcher terminates when it accepts a stop token after a
complete match; the scheduler then finishes the sequence with "stop".
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from deepinfer.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar request in canonical, hashable form: the compiled-grammar cache key.

    ``spec`` is the JSON Schema text (dicts serialised with their key order, which
    fixes the order of generated properties), the regex, the EBNF text, the choices
    as a JSON list, the structural tag as JSON text, or "" for ``json_object``.
    ``any_whitespace`` only matters for the JSON kinds and is True for the others, so
    it never splits their cache entries.
    """

    kind: str                  # json | regex | choice | grammar | json_object | structural_tag
    spec: str
    any_whitespace: bool = True

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        kind = params.kind
        if kind in ("json", "structural_tag"):
            value = getattr(params, kind)
            spec = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            spec = json.dumps(params.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(params, kind)
        json_kind = kind in ("json", "json_object")
        return cls(kind, spec, any_whitespace=not params.disable_any_whitespace if json_kind else True)


class GrammarMatcher(ABC):
    """The grammar state of one sequence: which tokens may come next.

    Mutated only by ``accept_token`` and ``rollback``; ``fill_bitmask`` and
    ``is_terminated`` read it. Not thread-safe: one sequence, one owner (the runner).
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. Returns False, leaving the state unchanged, when the
        grammar does not allow the token or the matcher has terminated."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32, the format of
        ``bitmask.py``). Once the match is complete only stop tokens are allowed, plus
        whatever would extend the match."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match: the sequence is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding rejects drafts)."""


class CompiledGrammar(ABC):
    """An immutable compiled grammar, shared by every sequence that uses the same spec
    (it sits in the backend's cache). Safe to share across threads."""

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one sequence."""


class StructuredOutputBackend(ABC):
    """Compiles grammars for one tokenizer vocabulary, with a cache and a time limit.

    Contract for a backend: ``_compile(spec)`` returns a ``CompiledGrammar`` whose
    token ids are those of the model (bitmask width covers the model's vocab_size,
    which may exceed the tokenizer's; tokens beyond the tokenizer and special tokens
    other than the stop tokens are never allowed); it raises ValueError, with the
    library's message, for a spec it cannot compile; and it must release the GIL while
    compiling (native code), since the time limit runs it in a worker thread.

    ``compile`` serves repeated specs from an LRU cache of ``cache_size`` compiled
    grammars (the same object every time). A compilation that outlives
    ``compile_timeout_s`` raises ValueError; its worker thread cannot be interrupted
    and finishes in the background, and its result is dropped.
    """

    def __init__(self, compile_timeout_s: float = 30.0, cache_size: int = 64) -> None:
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s={compile_timeout_s} must be > 0")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params``, from the cache when it holds the spec.
        Raises ValueError for an invalid spec or one that takes too long to compile."""
        spec = GrammarSpec.from_params(params)
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = self._compile_with_limit(spec)
        with self._lock:
            self._cache[spec] = grammar
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile_with_limit(self, spec: GrammarSpec) -> CompiledGrammar:
        future: Future[CompiledGrammar] = Future()

        def work() -> None:
            try:
                future.set_result(self._compile(spec))
            except BaseException as exc:  # delivered to the waiting caller, re-raised there
                future.set_exception(exc)

        # A fresh daemon thread per compilation: one that overruns keeps running (native
        # code cannot be cancelled) but never blocks the compilations after it.
        threading.Thread(target=work, name=f"grammar-compile-{spec.kind}", daemon=True).start()
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise ValueError(
                f"structured_outputs.{spec.kind}: grammar compilation exceeded "
                f"{self.compile_timeout_s:g} s; simplify the {spec.kind} spec") from None

    @abstractmethod
    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile one spec (no cache, no time limit); ValueError if it is invalid."""
