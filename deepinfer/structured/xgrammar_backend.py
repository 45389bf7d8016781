"""The xgrammar backend: JSON Schema, regex, EBNF and choice grammars over our vocabulary.

xgrammar needs the vocabulary as the tokenizer stores it (for byte-level BPE, the
byte-to-unicode spelling such as "Ġthe") and the vocabulary type to decode it.
``tokenizer_info_from_file`` builds that from ``tokenizer.json`` with the
``tokenizers`` library, so the serving path never builds a transformers tokenizer.
Special tokens other than the stop tokens are given an empty spelling, which
xgrammar treats as never allowed: a chat marker such as ``<|im_start|>`` would
otherwise count as its literal text inside a JSON string, while detokenisation
drops it.

Importing this module imports xgrammar, which takes seconds (xgrammar 0.2.8 itself
imports transformers); the engine imports it on the first structured request only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
import xgrammar as xgr
from tokenizers import Tokenizer as _HFTokenizer

from deepinfer.structured.base import CompiledGrammar, GrammarMatcher, GrammarSpec, StructuredOutputBackend
from deepinfer.structured.json_schema import check_json_schema

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_LOCATION_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def tokenizer_info_from_file(tokenizer_json: str | Path, vocab_size: int, stop_token_ids: Iterable[int],
                             special_token_ids: Iterable[int] = ()) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary in ``tokenizer_json``.

    ``vocab_size`` is the model's (the logits' width): ids the tokenizer lacks get an
    empty spelling and are never allowed; tokenizer ids at or beyond it are dropped.
    ``stop_token_ids`` end a complete match (our EOS ids); the other
    ``special_token_ids`` are never allowed.
    """
    tok = _HFTokenizer.from_file(str(tokenizer_json))
    stop = sorted(set(stop_token_ids))
    hidden = set(special_token_ids) - set(stop)
    encoded = [""] * vocab_size
    for token, tid in tok.get_vocab(with_added_tokens=True).items():
        if tid < vocab_size and tid not in hidden and tid not in stop:
            encoded[tid] = token
    # The vocabulary type (raw, byte-fallback, byte-level) and whether the tokenizer
    # prepends a space: the detection TokenizerInfo.from_huggingface runs on the same
    # serialised tokenizer (a static method of the pinned xgrammar version).
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop or None, add_prefix_space=meta["add_prefix_space"])


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. JSON string escapes are
    also EBNF string escapes, so json.dumps quotes each choice."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _tag_json_schemas(node: object) -> Iterable[dict]:
    """The JSON Schemas inside a structural tag (its ``json_schema`` formats), which must
    pass the same check as ``structured_outputs.json``; ``true`` (any JSON) needs none."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            if isinstance(node.get("json_schema"), dict):
                yield node["json_schema"]
            return
        for value in node.values():
            yield from _tag_json_schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _tag_json_schemas(value)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled))


class XGrammarBackend(StructuredOutputBackend):
    """Grammars compiled by xgrammar for one ``xgr.TokenizerInfo``.

    JSON Schemas are first checked by ``json_schema.check_json_schema`` (schemas whose
    constraints xgrammar would silently drop are refused), then compile in xgrammar's
    strict mode (properties and items the schema does not list are not generated);
    ``json_object`` is any JSON object. Structural tags compile with xgrammar's
    ``compile_structural_tag``; the JSON Schemas inside them pass the same check.
    xgrammar's own cache is off: ``StructuredOutputBackend`` keeps the LRU cache.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, compile_timeout_s: float = 30.0,
                 cache_size: int = 64, max_threads: int | None = None) -> None:
        super().__init__(compile_timeout_s, cache_size)
        self.tokenizer_info = tokenizer_info
        threads = max_threads if max_threads is not None else min(8, os.cpu_count() or 1)
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=threads, cache_enabled=False)

    @classmethod
    def from_tokenizer_file(cls, tokenizer_json: str | Path, vocab_size: int, stop_token_ids: Iterable[int],
                            special_token_ids: Iterable[int] = (), **kwargs: float) -> XGrammarBackend:
        """A backend for the vocabulary in ``tokenizer_json`` (see tokenizer_info_from_file);
        ``kwargs`` go to the constructor."""
        return cls(tokenizer_info_from_file(tokenizer_json, vocab_size, stop_token_ids, special_token_ids),
                   **kwargs)

    def _compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        c, text, ws = self._compiler, spec.spec, spec.any_whitespace
        compilers = {
            "json": lambda: c.compile_json_schema(text, any_whitespace=ws),
            "json_object": lambda: c.compile_json_schema('{"type": "object"}', any_whitespace=ws,
                                                         strict_mode=False),
            "regex": lambda: c.compile_regex(text),
            "grammar": lambda: c.compile_grammar(text),
            "choice": lambda: c.compile_grammar(choice_grammar(json.loads(text))),
            "structural_tag": lambda: c.compile_structural_tag(text),
        }
        if spec.kind not in compilers:
            raise ValueError(f"structured_outputs: unknown grammar kind {spec.kind!r}")
        if spec.kind == "json":
            check_json_schema(json.loads(text))
        elif spec.kind == "structural_tag":
            for schema in _tag_json_schemas(json.loads(text)):
                check_json_schema(schema)
        try:
            return XGrammarCompiled(compilers[spec.kind]())
        except Exception as exc:  # xgrammar reports a malformed spec as a RuntimeError
            message = _LOCATION_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {message}") from None
