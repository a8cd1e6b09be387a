"""The `kvfleet` command line: help text, env variables, lazy imports, subcommand dispatch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.engine.server.args import SERVE_FLAGS, env_name

from server_proc import kvfleet_cmd


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kvfleet_cmd(), *args], capture_output=True, text=True, timeout=300, env=env)


def test_serve_help_explains_every_flag_and_its_env_var() -> None:
    out = run("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in SERVE_FLAGS:
        assert flag.name in text and env_name(flag.name) in text, flag.name
    for vllm_flag in ("--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size",
                      "--no-enable-prefix-caching", "--api-keys-file", "--max-queue-len", "--load-format"):
        assert vllm_flag in text


def test_top_level_help_is_light() -> None:
    code = ("import sys; from kvfleet.engine.cli import build_parser; build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'uvicorn', 'kopf') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("argv, needle", [(["serve", "--api-key", "a", "--api-keys-file", "b"], "exclusive"),
                                          (["serve", "--block-size", "0"], "--block-size"),
                                          (["serve", "--device", "tpu"], "--device"),
                                          (["serve", "--enable-auto-tool-choice"], "needs --tool-call-parser"),
                                          (["serve", "--tool-call-parser", "no-such-format"], "--tool-call-parser")])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], needle: str) -> None:
    out = run(*argv)
    assert out.returncode == 2 and needle in out.stderr


def test_bad_env_var_is_named() -> None:
    import os

    out = run("serve", "--help", env=dict(os.environ, KVFLEET_MAX_NUM_SEQS="lots"))
    assert out.returncode != 0 and "KVFLEET_MAX_NUM_SEQS" in out.stderr


def test_missing_keys_file_is_a_clear_error(tmp_path) -> None:
    out = run("serve", str(tmp_path), "--api-keys-file", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "--api-keys-file" in out.stderr and "cannot read" in out.stderr


def test_subcommands_dispatch() -> None:
    assert "--workload" in run("bench", "serve", "--help").stdout
    assert "--workload" in run("bench", "throughput", "--help").stdout
    assert run("operator", "--help").returncode == 0


def test_model_that_cannot_load_exits_1_with_the_reason(tmp_path) -> None:
    from server_proc import free_port

    out = run("serve", str(tmp_path / "no-such-model"), "--host", "127.0.0.1", "--port", str(free_port()),
              "--device", "cpu")
    assert out.returncode == 1 and "model load failed" in out.stderr and "no-such-model" in out.stderr


def test_bad_engine_setting_read_at_import_is_one_line(tmp_path) -> None:
    # Kernel settings are read when their module is imported, before `serve` parses its flags.
    import os

    from server_proc import free_port

    out = run("serve", str(tmp_path), "--host", "127.0.0.1", "--port", str(free_port()), "--device", "cpu",
              env=dict(os.environ, KVFLEET_MIXED_DECODE_SPLITS="abc"))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "KVFLEET_MIXED_DECODE_SPLITS" in out.stderr and "'abc'" in out.stderr


def test_bad_engine_setting_read_at_load_is_the_reason_without_traceback(tiny_model_dir) -> None:
    import os

    from server_proc import free_port

    out = run("serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(free_port()), "--device", "cpu",
              env=dict(os.environ, KVFLEET_WARMUP="maybe"))
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert "model load failed: KVFLEET_WARMUP: expected 0, 1 or auto, got 'maybe'" in out.stderr
