"""`kvfleet serve --tensor-parallel-size 2` (what the operator starts for a ModelDeployment with
tensorParallelSize 2): a real server process with a spawned worker rank, on CPU over gloo, answers
through the real `openai` client with the offline engine's greedy text, and leaves no worker behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from server_proc import start_server

PROMPT = "once upon a time there lived"


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc: Linux, where the tests run)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead too
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_tensor_parallel_server_answers_like_the_offline_engine_and_exits_clean(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    offline = LLM(str(tiny_model_dir), device="cpu", max_model_len=128)
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    offline.shutdown()
    srv = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--max-model-len", "128")
    try:
        workers = _children(srv.proc.pid)
        assert workers, "the server spawned no tensor-parallel worker"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="no-keys-configured", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == expected
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.usage.completion_tokens <= 5 and chat.choices[0].finish_reason in ("stop", "length")
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log_tail()
    # The children include multiprocessing's resource tracker, which exits once it reads the end of its
    # pipe: a moment after the server. A worker that outlives it by seconds is a leak.
    deadline = time.monotonic() + 10
    while [p for p in workers if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)], "a tensor-parallel worker outlived the server"
    assert "Traceback" not in srv.log.read_text(errors="replace"), srv.log_tail()
