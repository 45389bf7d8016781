"""The JSON-Schema-Test-Suite (draft 2020-12, vendored under tests/data) against the
xgrammar backend: every schema compiles or is refused with a ValueError; no schema
that compiles accepts an instance the suite marks invalid; and documents generated
by the embedded model for a fixed sample of the compiling schemas validate with
``jsonschema`` whenever the grammar finished them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from deepinfer import SamplingParams
from deepinfer.sampling_params import StructuredOutputsParams

SUITE = Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft2020-12"
SAMPLE_SIZE = 40


def suite_cases() -> list[tuple[str, dict]]:
    """(id, case) for every schema of the suite, in file order."""
    cases = []
    for path in sorted(SUITE.glob("*.json")):
        for i, case in enumerate(json.loads(path.read_text())):
            cases.append((f"{path.stem}[{i}] {case['description']}", case))
    return cases


def params(schema) -> StructuredOutputsParams:
    # A JSON string: the suite has boolean schemas, which the dict form does not take.
    return StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)


@pytest.fixture(scope="module")
def compiled(backend) -> list[tuple[str, dict, object]]:
    """The suite's schemas that compile, with their grammars; refusals must be ValueErrors."""
    out, refused = [], []
    for name, case in suite_cases():
        try:
            out.append((name, case, backend.compile(params(case["schema"]))))
        except ValueError as exc:
            refused.append((name, str(exc)))
    assert len(out) + len(refused) == len(suite_cases()) > 300
    assert all(msg.startswith("structured_outputs.json") for _, msg in refused)
    # What xgrammar 0.2.8 enforces, measured when this was written: a drop means a regression.
    assert len(out) >= 120
    return out


def test_every_schema_compiles_or_is_refused(compiled):
    assert compiled


def test_compiled_schemas_accept_no_invalid_instance(compiled, tokenizer):
    """Feed each suite instance, tokenised, to a fresh matcher: an invalid instance must
    be refused before it completes."""
    eos = min(tokenizer.eos_token_ids)
    checked = 0
    for name, case, grammar in compiled:
        for test in case["tests"]:
            matcher = grammar.new_matcher()
            ids = tokenizer.encode(json.dumps(test["data"], separators=(", ", ": ")), add_special_tokens=False)
            accepted = all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos)
            assert not accepted or test["valid"], f"{name}: accepts invalid instance ({test['description']})"
            if accepted:
                assert matcher.is_terminated()
            checked += 1
    assert checked > 300


def test_generated_documents_validate(compiled, llm):
    step = max(1, len(compiled) // SAMPLE_SIZE)
    sample = compiled[::step][:SAMPLE_SIZE]
    sampling = [SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=params(case["schema"]))
                for i, (_, case, _) in enumerate(sample)]
    outs = llm.generate(["A JSON document:"] * len(sample), sampling, use_tqdm=False)
    valid = cut_off = 0
    for (name, case, _), out in zip(sample, outs):
        c = out.outputs[0]
        if c.finish_reason == "length":        # cut off before the grammar finished: not checkable
            cut_off += 1
            continue
        assert c.finish_reason == "stop", f"{name}: {c.finish_reason} {out.error}"
        jsonschema.Draft202012Validator(case["schema"]).validate(json.loads(c.text))
        valid += 1
    assert valid + cut_off == len(sample) and valid >= 0.75 * len(sample), (valid, cut_off)
