"""`--load-format dummy` on a config-only folder (how GPU benchmarks run): token-id prompts work,
text needs a tokenizer (400 naming the field), and `bench serve` drives it from a JSONL workload."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from server_proc import Server, kvfleet_cmd, start_server


@pytest.fixture(scope="module")
def dummy_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    srv = start_server(folder, tmp_path_factory.mktemp("dummy-logs"), "--load-format", "dummy")
    yield srv
    srv.stop()


def test_token_ids_work_and_text_is_refused(dummy_server: Server) -> None:
    url = dummy_server.url
    got = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True,
                                                    "logprobs": 1}).json()
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert all(t.startswith("token_id:") for t in got["choices"][0]["logprobs"]["tokens"])
    for path, body, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
                              ("/tokenize", {"prompt": "x"}, "prompt")):
        resp = httpx.post(url + path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_bench_serve_jsonl_token_workload(dummy_server: Server, tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": m}) + "\n"
                                for n, m in ((8, 6), (20, 3), (5, 9), (12, 4))))
    out = tmp_path / "r.json"
    run = subprocess.run([*kvfleet_cmd(), "bench", "serve", "--base-url", dummy_server.url, "--workload",
                          str(workload), "--request-rate", "50", "--seed", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (45, 22)  # exact: ignore_eos
