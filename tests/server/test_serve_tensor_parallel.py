"""`kvfleet serve --tensor-parallel-size 2` (what the operator starts for a ModelDeployment with
tensorParallelSize 2): a real server process with a spawned worker rank, on CPU over gloo, answers
through the real `openai` client with the offline engine's greedy text, and leaves no worker behind."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from server_proc import start_server

PROMPT = "once upon a time there lived"


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None when gone (Linux)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())
    except OSError:
        return None


def _tensor_parallel_workers(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the live processes `pid` started through multiprocessing's spawn: its
    tensor-parallel workers. Its other child, multiprocessing's resource tracker, is left out: it is
    not a worker, and it exits only after the server, on seeing the server's end of its pipe close."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if fields and int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            workers.append((int(entry.name), fields[19]))   # field 22 of stat: start time, against pid reuse
    return workers


def _alive(worker: tuple[int, str]) -> bool:
    fields = _stat(worker[0])
    return fields is not None and fields[0] != "Z" and fields[19] == worker[1]   # a zombie is dead too


def _wait_gone(workers: list[tuple[int, str]], timeout: float) -> list[tuple[int, str]]:
    """The workers still alive after waiting up to `timeout` seconds for them to end."""
    deadline = time.monotonic() + timeout
    while (alive := [w for w in workers if _alive(w)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


# Bounds for a busy machine: a TP server starts two processes that each import torch and load the
# model, then meet over gloo; on 2 shared cores at load ~18 that took past 120 s (one run in ~15).
READY_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120


@pytest.mark.timeout(600)
def test_tensor_parallel_server_answers_like_the_offline_engine_and_exits_clean(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    offline = LLM(str(tiny_model_dir), device="cpu", max_model_len=128)
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    offline.shutdown()
    srv = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--max-model-len", "128",
                       ready_timeout=READY_TIMEOUT_S)
    try:
        workers = _tensor_parallel_workers(srv.proc.pid)
        assert len(workers) == 1, f"tensor parallel 2 needs one worker process, the server has {workers}"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="no-keys-configured", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == expected
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.usage.completion_tokens <= 5 and chat.choices[0].finish_reason in ("stop", "length")
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log_tail()
    # the server joins its workers before it exits; the bounded wait keeps the check from racing a worker on its way out
    assert not _wait_gone(workers, timeout=10), "a tensor-parallel worker outlived the server"
    assert "Traceback" not in srv.log.read_text(errors="replace"), srv.log_tail()
