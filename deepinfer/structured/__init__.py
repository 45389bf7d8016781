"""Structured outputs: grammar compilation and per-sequence matchers (see base.py).

The xgrammar backend lives in ``deepinfer.structured.xgrammar_backend`` and is
imported on first use only (importing xgrammar takes seconds).
"""

from deepinfer.structured.base import CompiledGrammar, GrammarMatcher, GrammarSpec, StructuredOutputBackend
from deepinfer.structured.bitmask import allocate_token_bitmask, apply_token_bitmask, bitmask_width

__all__ = [
    "CompiledGrammar",
    "GrammarMatcher",
    "GrammarSpec",
    "StructuredOutputBackend",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
]
