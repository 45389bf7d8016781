"""Structured outputs without a model: parameter validation, the xgrammar backend on a
toy vocabulary and on the embedded tokenizer (against xgrammar's own transformers
path), the compiled-grammar cache and time limit, the JSON Schema support check,
the bitmask kernel against a bit-unpacking reference, and the sampler's mask."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from deepinfer.runner.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams
from deepinfer.structured import GrammarSpec, allocate_token_bitmask, apply_token_bitmask
from deepinfer.structured.json_schema import check_json_schema
from deepinfer.structured.xgrammar_backend import XGrammarBackend, tokenizer_info_from_file

from .conftest import TOKENIZER_JSON

# -- parameters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "set exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json_object=False), "got none"),
    (dict(json="{"), "structured_outputs.json is not valid JSON"),
    (dict(json=3), "structured_outputs.json=3 must be a JSON Schema"),
    (dict(json={"enum": [{1, 2}]}), "structured_outputs.json is not JSON-serialisable"),
    (dict(regex=""), "structured_outputs.regex='' must be a non-empty str"),
    (dict(grammar=5), "structured_outputs.grammar=5 must be a non-empty str"),
    (dict(choice="ab"), "structured_outputs.choice='ab' must be a non-empty list of str"),
    (dict(choice=[]), "must be a non-empty list of str"),
    (dict(choice=["a", 1]), "every choice must be a str"),
    (dict(json_object="yes"), "structured_outputs.json_object='yes' must be True or False"),
    (dict(regex="a", disable_any_whitespace=1), "disable_any_whitespace=1 must be True or False"),
    (dict(structural_tag="{"), "structured_outputs.structural_tag is not valid JSON"),
    (dict(structural_tag="[1]"), "structured_outputs.structural_tag='\\[1\\]' must be a JSON object"),
    (dict(structural_tag={"x": {1, 2}}), "structured_outputs.structural_tag is not JSON-serialisable"),
])
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StructuredOutputsParams(**kwargs)


def test_params_in_sampling_params():
    p = SamplingParams(structured_outputs={"choice": ("a", "b")})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.kind == "choice" and p.structured_outputs.choice == ["a", "b"]
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="unknown field\\(s\\) regexp"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="structured_outputs='a' must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="a")


def test_grammar_spec_keys():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    a = GrammarSpec.from_params(StructuredOutputsParams(json=schema))
    assert a == GrammarSpec.from_params(StructuredOutputsParams(json=json.loads(json.dumps(schema))))
    assert json.loads(a.spec) == schema and list(json.loads(a.spec)["properties"]) == ["b", "a"]
    assert a != GrammarSpec.from_params(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    # The whitespace flag only splits JSON kinds.
    assert GrammarSpec.from_params(StructuredOutputsParams(regex="x", disable_any_whitespace=True)) == \
        GrammarSpec("regex", "x")
    assert GrammarSpec.from_params(StructuredOutputsParams(choice=["x", "y"])).spec == '["x", "y"]'


# -- the backend on a toy vocabulary -------------------------------------------------------------------

TOY = ["<eos>", "a", "b", "ab", "1", "2", "12", "-", "<pad>"]
EOS_ID = 0


@pytest.fixture(scope="module")
def toy_backend() -> XGrammarBackend:
    # "<pad>" gets no spelling (never allowed); the model's vocabulary is wider than the tokenizer's.
    vocab = TOY[:-1] + [""]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=40, stop_token_ids=[EOS_ID])
    return XGrammarBackend(info, max_threads=1)


def allowed(matcher, vocab_size=40) -> set[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1        # [W, 32]
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def test_toy_regex_matcher(toy_backend):
    m = toy_backend.compile(StructuredOutputsParams(regex="a+-[12]+")).new_matcher()
    assert allowed(m) == {1}                                     # only "a": "ab" would put a b after a
    assert m.accept_token(1) and allowed(m) == {1, 7}            # more a, or "-"
    assert not m.accept_token(2)                                 # "b" is refused, state unchanged
    assert allowed(m) == {1, 7}
    assert m.accept_token(7) and allowed(m) == {4, 5, 6}         # "1", "2", "12"
    assert m.accept_token(6)
    assert allowed(m) == {4, 5, 6, EOS_ID}                       # complete: stop, or more digits
    assert not m.is_terminated()
    m.rollback(1)
    assert allowed(m) == {4, 5, 6}
    assert m.accept_token(4) and m.accept_token(EOS_ID) and m.is_terminated()
    assert not m.accept_token(4)


def test_toy_choice_and_grammar(toy_backend):
    m = toy_backend.compile(StructuredOutputsParams(choice=["ab", "b-1"])).new_matcher()
    assert allowed(m) == {1, 2, 3}
    assert m.accept_token(3) and allowed(m) == {EOS_ID}
    g = toy_backend.compile(StructuredOutputsParams(grammar='root ::= "1" root | "2"')).new_matcher()
    for tok in (4, 4, 5):
        assert g.accept_token(tok)
    assert allowed(g) == {EOS_ID}
    # Every matcher is independent.
    m2 = toy_backend.compile(StructuredOutputsParams(choice=["ab", "b-1"])).new_matcher()
    assert allowed(m2) == {1, 2, 3}


def test_cache_returns_the_same_object_and_evicts_lru():
    info = xgr.TokenizerInfo(TOY, xgr.VocabType.RAW, stop_token_ids=[EOS_ID])
    b = XGrammarBackend(info, cache_size=2, max_threads=1)
    ga = b.compile(StructuredOutputsParams(regex="a+"))
    assert b.compile(StructuredOutputsParams(regex="a+")) is ga
    gb = b.compile(StructuredOutputsParams(regex="b+"))
    assert b.compile(StructuredOutputsParams(regex="a+")) is ga   # a is now the most recent
    b.compile(StructuredOutputsParams(regex="1+"))                 # evicts b
    assert b.compile(StructuredOutputsParams(regex="a+")) is ga
    assert b.compile(StructuredOutputsParams(regex="b+")) is not gb


def large_schema(n: int) -> dict:
    leaf = {"type": "object", "properties": {f"f{j}": {"type": "string", "pattern": "[a-z]{2,9}@[0-9]+"}
                                             for j in range(10)},
            "required": [f"f{j}" for j in range(10)]}
    return {"type": "object", "properties": {f"k{i}": leaf for i in range(n)},
            "required": [f"k{i}" for i in range(n)]}


def test_compilation_time_limit(tokenizer):
    b = XGrammarBackend.from_tokenizer_file(TOKENIZER_JSON, tokenizer.vocab_size, tokenizer.eos_token_ids,
                                            tokenizer.all_special_ids, compile_timeout_s=0.01)
    with pytest.raises(ValueError, match=r"structured_outputs.json: grammar compilation exceeded 0.01 s"):
        b.compile(StructuredOutputsParams(json=large_schema(40)))
    with pytest.raises(ValueError, match="compile_timeout_s=0 must be > 0"):
        XGrammarBackend(b.tokenizer_info, compile_timeout_s=0)


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(regex="a("), (r"structured_outputs.regex cannot be compiled: Regex parsing error "
                                           r"at position 3: The parenthesis is not closed")),
    (StructuredOutputsParams(grammar="root ::= foo"), (r'structured_outputs.grammar cannot be compiled: EBNF '
                                                       r'parser error at line 1, column 10: Rule "foo" is not')),
    (StructuredOutputsParams(json={"type": "foo"}), r"unknown type 'foo' at #/type"),
    (StructuredOutputsParams(json="false"), ("structured_outputs.json cannot be compiled: Schema 'false' "
                                             "cannot accept any value")),
])
def test_invalid_specs_raise_value_error(backend, params, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(params)


def test_structural_tag(backend, tokenizer):
    """A structural tag: free text up to a marker, then a JSON Schema; the schemas inside a
    tag pass the same support check as structured_outputs.json."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": schema},
         "end": "</call>"}]}}
    compiled = backend.compile(StructuredOutputsParams(structural_tag=tag))
    assert backend.compile(StructuredOutputsParams(structural_tag=json.dumps(tag))) is compiled

    def accepts(text: str) -> bool:
        m = compiled.new_matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(m.accept_token(t) for t in ids) and m.accept_token(min(tokenizer.eos_token_ids))

    assert accepts('some thought</think><call>{"n": 12}</call>')
    assert not accepts('some thought</think><call>{"n": "x"}</call>')        # the schema holds
    assert not accepts('<call>{"n": 1}</call>')                               # reasoning must close first
    assert not accepts('x</think><call>{"n": 1}</call>tail')
    bad = {"type": "structural_tag", "format": {"type": "json_schema",
                                                "json_schema": {"type": "integer", "not": {"const": 1}}}}
    with pytest.raises(ValueError, match=r'keyword "not" \(at #/not\)'):
        backend.compile(StructuredOutputsParams(structural_tag=bad))
    with pytest.raises(ValueError, match="structured_outputs.structural_tag cannot be compiled"):
        backend.compile(StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                                "format": {"type": "no-such-format"}}))


# -- the JSON Schema support check ----------------------------------------------------------------------

@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "not": {"const": 1}}, r'keyword "not" \(at #/not\)'),
    ({"type": "object", "properties": {"a": {"type": "integer", "if": {"minimum": 0}, "then": {}}}},
     r'keyword "if" \(at #/properties/a/if\)'),
    ({"maxLength": 2}, r'"maxLength" in a schema without "type" \(add "type": "string"'),
    ({"type": "object", "properties": {"a": {"minimum": 3}}}, r"at #/properties/a/minimum"),
    ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 3}, r'"minimum" beside "\$ref"'),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": 0}]}, r'"type" beside "anyOf"'),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, r'"maxLength" beside "enum"'),
    ({"type": "integer", "enum": ["a"]}, r'"type" beside "enum"'),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "maximum": 5}]}, r'"allOf" with more than one'),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
     r'"oneOf" whose branches 0 and 1 may both match'),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, r'"oneOf" whose branches 0 and 1'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, r'"uniqueItems": true'),
    ({"type": "number", "multipleOf": 1.5}, r'"multipleOf" other than an integer'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     r"\"required\" names 'b', which \"properties\" does not define"),
    ({"$ref": "http://example.com/s.json"}, r"only references inside the schema"),
    ({"type": "object", "properties": {"a": {"$id": "x", "type": "integer"}}}, r'"\$id" inside a subschema'),
    ({"type": "object", "propertyNames": {"maxLength": 2, "not": {}}}, r'"not" in "propertyNames"'),
    ({"type": "object", "propertyNames": {"type": "string", "minimum": 3}}, r'"minimum" in "propertyNames"'),
    ({"type": 3}, r'"type": 3 must be a type name'),
    ({"type": "object", "properties": {"a": 5}}, r"the schema at #/properties/a must be an object"),
])
def test_unenforceable_schemas_are_refused(backend, schema, message):
    with pytest.raises(ValueError, match=message):
        check_json_schema(schema)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json"):
        backend.compile(StructuredOutputsParams(json=schema))


# A pydantic v2 schema (model_json_schema of an order with an enum, Optional fields, a
# constrained list and a discriminated union), as generated, plus other enforceable shapes.
PYDANTIC_ORDER = {
    "$defs": {
        "Cat": {"properties": {"kind": {"const": "cat", "title": "Kind", "type": "string"},
                               "lives": {"maximum": 9, "minimum": 0, "title": "Lives", "type": "integer"}},
                "required": ["kind", "lives"], "title": "Cat", "type": "object"},
        "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
        "Dog": {"properties": {"kind": {"const": "dog", "title": "Kind", "type": "string"},
                               "name": {"maxLength": 10, "pattern": "^[A-Z][a-z]+$", "title": "Name",
                                        "type": "string"}},
                "required": ["kind", "name"], "title": "Dog", "type": "object"},
        "Item": {"properties": {"name": {"title": "Name", "type": "string"},
                                "price": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None,
                                          "title": "Price"},
                                "color": {"$ref": "#/$defs/Color"},
                                "tags": {"default": [], "items": {"type": "string"}, "title": "Tags",
                                         "type": "array"}},
                 "required": ["name", "color"], "title": "Item", "type": "object"}},
    "properties": {
        "items": {"items": {"$ref": "#/$defs/Item"}, "minItems": 1, "title": "Items", "type": "array"},
        "pet": {"discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                                  "propertyName": "kind"},
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "title": "Pet"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"}},
    "required": ["items", "pet"], "title": "Order", "type": "object"}


@pytest.mark.parametrize("schema", [
    PYDANTIC_ORDER,
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},           # "object" inferred
    {"items": {"type": "integer"}, "minItems": 1},                             # "array" inferred
    {"type": ["string", "null"], "maxLength": 3, "format": "date"},
    {"type": "integer", "multipleOf": 3, "minimum": 0},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"const": 1}, {"enum": ["a", None]}]},
    {"type": "number", "enum": [1, 2.5]},
    True,
])
def test_enforceable_schemas_pass(backend, schema):
    check_json_schema(schema)
    backend.compile(StructuredOutputsParams(json=json.dumps(schema)))


# -- the tokenizer's vocabulary ---------------------------------------------------------------------------

def test_tokenizer_info_matches_xgrammar_from_huggingface(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON), eos_token="<|im_end|>")
    ref = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=1024, stop_token_ids=[0, 2])
    ours = tokenizer_info_from_file(TOKENIZER_JSON, 1024, tokenizer.eos_token_ids, tokenizer.all_special_ids)
    assert (ours.vocab_type, ours.add_prefix_space) == (ref.vocab_type, ref.add_prefix_space)
    assert ours.vocab_type == xgr.VocabType.BYTE_LEVEL and ours.vocab_size == 1024
    assert ours.stop_token_ids == [0, 2]
    ours_vocab, ref_vocab = ours.decoded_vocab, ref.decoded_vocab
    assert ours_vocab[3:1000] == ref_vocab[3:1000]
    assert ours_vocab[4] == b'"' and b" " in ours_vocab            # byte-level decoding (Ġ -> space)
    # <|im_start|> (special, not a stop token) and the padding ids beyond the tokenizer are never allowed.
    assert ref_vocab[1] == b"<|im_start|>" and 1 not in ref.special_token_ids
    assert set(ours.special_token_ids) == {1} | set(range(1000, 1024))


# -- the bitmask kernel and the sampler ---------------------------------------------------------------------

def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Unpack the bits: token t of row i is allowed iff bit t % 32 of word t // 32 is set."""
    v = logits.shape[1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1          # [N, W, 32]
    allow = bits.flatten(1)[:, :v].bool()                                               # [N, V]
    out = logits.clone()
    for i in rows:
        out[i] = out[i].masked_fill(~allow[i], float("-inf"))
    return out


@pytest.mark.parametrize("v", [32, 70, 1000])
def test_apply_token_bitmask_matches_reference(v):
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(5, v, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (v + 31) // 32), generator=g, dtype=torch.int32)
    rows = [0, 2, 3]
    expect = reference_apply(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expect)
    assert torch.isinf(logits[0]).any() and torch.isfinite(logits[1]).all()
    with pytest.raises(ValueError, match="expected int32"):
        apply_token_bitmask(logits, bitmask.long(), rows)


def masked_bitmask(n: int, v: int, allowed_ids: list[set[int]]) -> torch.Tensor:
    bitmask = torch.zeros(n, (v + 31) // 32, dtype=torch.int32)
    for i, ids in enumerate(allowed_ids):
        for t in ids:
            word = int(bitmask[i, t // 32]) | (1 << (t % 32))
            bitmask[i, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask


def test_sampler_applies_mask_and_keeps_raw_logprobs():
    v, eos = 40, 2
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, v + 8, generator=g) * 3                   # 8 padding columns
    allowed_sets = [{5, 33}, {7}, set(), {1, 39}]
    bitmask = masked_bitmask(4, v, allowed_sets)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], [], grammar=True),
            SamplingRow(SamplingParams(seed=3, logprobs=2), [1], [], grammar=True),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], []),   # no grammar
            SamplingRow(SamplingParams(), [1], [], grammar=True)]
    sampler = Sampler(v, {eos}, seed=0)
    out = sampler(logits, rows, bitmask)
    raw = torch.log_softmax(logits[:, :v], -1)
    assert out.token_ids[0] == max(allowed_sets[0], key=lambda t: float(logits[0, t]))
    assert out.token_ids[1] == 7
    assert out.token_ids[2] == int(logits[2, :v].argmax())
    assert out.token_ids[3] in allowed_sets[3]
    for i, tok in enumerate(out.token_ids):                           # logprobs of the raw distribution
        assert out.sampled_logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-5)
    top = torch.topk(raw[1], 2)
    assert {t: lp.logprob for t, lp in out.logprobs[1].items() if t != 7} == pytest.approx(
        {int(t): float(x) for t, x in zip(top.indices, top.values) if int(t) != 7}, abs=1e-5)
    with pytest.raises(ValueError, match="rows with grammar=True need a token_bitmask"):
        sampler(logits, rows)


def test_min_tokens_yields_to_a_complete_grammar():
    v, eos = 40, 2
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(1))
    bitmask = masked_bitmask(2, v, [{eos}, {eos, 9}])
    params = SamplingParams(temperature=0.0, min_tokens=5)
    rows = [SamplingRow(params, [1], [], grammar=True), SamplingRow(params, [1], [], grammar=True)]
    out = Sampler(v, {eos}, seed=0)(logits, rows, bitmask)
    assert out.token_ids == [eos, 9]          # only EOS left: it stays; otherwise min_tokens masks it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_token_bitmask_on_cuda_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 129280, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, (129280 + 31) // 32), generator=g, dtype=torch.int32)
    rows = [1, 4, 5]
    expect = reference_apply(logits, bitmask, rows)
    on_device = logits.cuda()
    apply_token_bitmask(on_device, bitmask.cuda(), rows)
    assert torch.equal(on_device.cpu(), expect)
