"""Property-based requests generated from /openapi.json (schemathesis): never a 5xx.

Bounded: a fixed number of valid and invalid examples per operation, derandomized so a
failure reproduces; the shared server's context of 128 tokens bounds every generation.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from server_proc import ALPHA, Server

EXAMPLES = 12


def test_openapi_schema_fuzz_finds_no_5xx(api_server: Server) -> None:
    schema = schemathesis.openapi.from_url(api_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize",
            "/detokenize"} <= paths
    failures: list[tuple[Any, ...]] = []
    calls = 0
    for op in operations:
        # A GET without parameters has nothing to make invalid.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                nonlocal calls
                calls += 1
                resp = case.call(base_url=api_server.url, headers={"Authorization": f"Bearer {ALPHA}"}, timeout=60)
                if resp.status_code >= 500:
                    failures.append((case.method, case.path, case.body, resp.status_code, resp.text[:300]))

            check()
    assert not failures, failures[:5]
    assert calls >= len(operations) * 2  # several examples per operation really ran
    # ... and the server still serves normally afterwards.
    resp = httpx.post(api_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                      headers={"Authorization": f"Bearer {ALPHA}"}, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_openapi_documents_errors(api_server: Server, path: str) -> None:
    spec = httpx.get(api_server.url + "/openapi.json").json()
    responses = spec["paths"][path]["post"]["responses"]
    assert {"200", "400", "401", "404", "429", "503"} <= set(responses)


def test_openapi_describes_metrics_as_prometheus_text(api_server: Server) -> None:
    spec = httpx.get(api_server.url + "/openapi.json").json()
    content = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert httpx.get(api_server.url + "/metrics").headers["content-type"] == list(content)[0]
