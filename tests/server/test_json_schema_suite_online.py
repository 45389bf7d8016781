"""The JSON-Schema-Test-Suite through the server: every schema is either served
(200, with a document that validates whenever the grammar finished it) or refused
with a clean 400; never a 5xx, and the server is healthy afterwards."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import pytest

from ..structured.test_json_schema_suite import suite_cases
from .conftest import MODEL, serve


@pytest.mark.slow        # ~45 s: every schema of the suite through the server
def test_suite_schemas_are_served_or_refused(engine):
    statuses: dict[int, int] = {}
    validated = 0
    with serve(engine) as server, httpx2.Client(base_url=server.url, timeout=120) as http:
        for name, case in suite_cases():
            body = {"model": MODEL, "prompt": "A JSON value:", "max_tokens": 24, "temperature": 0,
                    "structured_outputs": {"json": json.dumps(case["schema"])}}
            r = http.post("/v1/completions", json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (name, r.status_code, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["type"] == "invalid_request_error", name
                continue
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(choice["text"]), case["schema"])
                validated += 1
        assert http.get("/health").status_code == 200
        assert server.pool_is_full()
    assert statuses.get(200, 0) >= 100 and statuses.get(400, 0) >= 100
    assert validated >= 20
