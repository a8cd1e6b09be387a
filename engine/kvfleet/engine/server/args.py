"""Flags of `kvfleet serve`, named like `vllm serve`, each also read from `KVFLEET_<FLAG>`.

Pure argparse: nothing heavy is imported here so `kvfleet --help` stays fast. The
operator configures pods through the environment variables, so every flag has one.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

ENV_PREFIX = "KVFLEET_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `KVFLEET_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str, name: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}: expected a boolean (true/false), got {text!r}")


@dataclass(frozen=True)
class Flag:
    name: str
    help: str
    type: Callable[[str], Any] | None = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False  # --x / --no-x
    metavar: str | None = None


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--host", "Address to listen on.", default="0.0.0.0"),
    Flag("--port", "Port to listen on.", type=int, default=8000),
    Flag("--served-model-name", "Model name clients send in the `model` field and see in /v1/models "
         "(default: MODEL as given, or SmolLM2-135M-Instruct for the embedded model).", metavar="NAME"),
    Flag("--tokenizer", "Tokenizer path if it differs from the model's.", metavar="PATH"),
    Flag("--device", "Device to run the model on; auto picks CUDA when present.", default="auto",
         choices=("auto", "cuda", "cpu")),
    Flag("--dtype", "Weight and activation dtype; auto = the model's (bfloat16 on GPU, float32 on CPU).",
         default="auto", choices=("auto", "float32", "float16", "bfloat16", "half", "float")),
    Flag("--tensor-parallel-size", "Number of GPUs to shard the model over.", type=int, default=1, metavar="N"),
    Flag("--max-model-len", "Context length (prompt + output tokens); default: the model's.", type=int,
         metavar="N"),
    Flag("--gpu-memory-utilization", "Fraction of GPU memory the engine may use (weights + KV cache).",
         type=float, default=0.9, metavar="FRACTION"),
    Flag("--max-num-seqs", "Most sequences batched in one step (engine default 256).", type=int, metavar="N"),
    Flag("--max-num-batched-tokens", "Token budget of one step (chunked prefill; engine default by device).",
         type=int, metavar="N"),
    Flag("--block-size", "Tokens per KV-cache block.", type=int, default=16, metavar="N"),
    Flag("--num-gpu-blocks-override", "Fix the number of KV-cache blocks instead of sizing from memory.", type=int,
         metavar="N"),
    Flag("--kv-cache-memory-bytes", "Bytes of KV cache (instead of --gpu-memory-utilization; on CPU the "
         "default is 256 MiB).", type=int, metavar="BYTES"),
    Flag("--enable-chunked-prefill", "Split long prompts over several steps.", boolean=True, default=True),
    Flag("--enable-prefix-caching", "Reuse KV blocks of shared prompt prefixes.", boolean=True, default=True),
    Flag("--enforce-eager", "Never capture CUDA graphs.", boolean=True, default=False),
    Flag("--async-scheduling", "Schedule and process outputs while the step before runs on the device "
         "(default: on for CUDA, off on CPU).", boolean=True, default=None),
    Flag("--seed", "Engine random seed.", type=int, default=0, metavar="N"),
    Flag("--quantization", "fp8: quantize the bf16/fp16 weights to FP8 (E4M3, a scale per output channel) at load "
         "and the activations per token at run time (GPUs of compute capability >= 8.9).", choices=("fp8",)),
    Flag("--load-format", "auto: read the weights (safetensors or GGUF); dummy: random weights of the right "
         "shapes (benchmarks).", default="auto", choices=("auto", "safetensors", "gguf", "dummy")),
    Flag("--chat-template", "Jinja chat template file overriding the tokenizer's.", metavar="FILE"),
    Flag("--enable-auto-tool-choice", "Serve tool_choice \"auto\" (the default when a request has tools): the "
         "model's answer is parsed for tool calls with --tool-call-parser.", boolean=True, default=False),
    Flag("--tool-call-parser", "The format the model's chat template writes tool calls in (hermes: "
         "<tool_call>{...}</tool_call>, Qwen2.5, Qwen3, Hermes; llama3_json: {\"name\": ..., \"parameters\": ...}, "
         "Llama 3.1-3.3; pythonic: [name(arg=value), ...], Llama 3.2 and 4's pythonic templates; mistral: "
         "[TOOL_CALLS] then a JSON list or name[ARGS]{...}, Mistral's templates, with 9-character call ids).",
         choices=("hermes", "llama3_json", "pythonic", "mistral"), metavar="NAME"),
    Flag("--reasoning-parser", "Answer a thinking model's reasoning (between <think> and </think>) in the "
         "message's `reasoning` field, apart from its content; tool calls and structured outputs apply to the "
         "answer after it (deepseek_r1: DeepSeek-R1, QwQ; qwen3: Qwen3; mistral: Magistral's [THINK] and "
         "[/THINK], decoded with special tokens kept).", choices=("deepseek_r1", "qwen3", "mistral"),
         metavar="NAME"),
    Flag("--api-key", "Single API key clients must send as `Authorization: Bearer KEY` (tenant `default`).",
         metavar="KEY"),
    Flag("--api-keys-file", "YAML or JSON file mapping API key -> tenant name; requests without a listed "
         "key get 401 and the tenant labels the request metrics.", metavar="FILE"),
    Flag("--max-queue-len", "Most requests waiting for their first token; beyond it a request gets 429 with "
         "Retry-After (default: no limit).", type=int, metavar="N"),
    Flag("--max-request-bytes", "Largest request body accepted; larger ones get 413 without being read.",
         type=int, default=32 * 2**20, metavar="BYTES"),
    Flag("--metrics-port", "Serve /metrics on this port (of --host) instead of --port, which then answers 404 "
         "for it: the request metrics name tenants, and a port of its own can be kept from clients "
         "(default: /metrics on --port, open to anyone who reaches it).", type=int, metavar="PORT"),
    Flag("--max-connections", "Most connections open at once; past it, a new connection's request gets 503 "
         "with Retry-After and the connection is closed.", type=int, default=4096, metavar="N"),
    Flag("--timeout-keep-alive", "Seconds a connection may stay idle (before its first request or between two) "
         "before it is closed.", type=float, default=5.0, metavar="SECONDS"),
    Flag("--timeout-request-headers", "Seconds a request's line and headers may take to arrive, from their first "
         "byte; then 408 and the connection is closed.", type=float, default=10.0, metavar="SECONDS"),
    Flag("--timeout-request-body", "Seconds a request's body may take to arrive after its headers; then 408 and "
         "the connection is closed.", type=float, default=60.0, metavar="SECONDS"),
    Flag("--shutdown-grace-period", "Seconds running requests may take to finish after SIGTERM (new ones "
         "get 503).", type=float, default=30.0, metavar="SECONDS"),
    Flag("--log-level", "Log level of kvfleet and uvicorn.", default="info",
         choices=("debug", "info", "warning", "error")),
    Flag("--disable-log-requests", "Do not log one line per finished request.", boolean=True, default=False),
)


def _env_default(flag: Flag, env: Mapping[str, str]) -> Any:
    name = env_name(flag.name)
    if name not in env:
        return flag.default
    raw = env[name]
    try:
        if flag.boolean:
            return parse_bool(raw, name)
        value = flag.type(raw) if flag.type else raw
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"kvfleet: error: environment variable {name}={raw!r} is invalid: {exc}") from exc
    if flag.choices and value not in flag.choices:
        raise SystemExit(f"kvfleet: error: environment variable {name}={raw!r} is not one of {flag.choices}")
    return value


def add_serve_args(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Add the serve flags; a set environment variable replaces the built-in default."""
    env = os.environ if env is None else env
    parser.add_argument("model", nargs="?", default=env.get(env_name("--model")),
                        help="Model: an HF folder, a .gguf file or a config-only folder with --load-format "
                             "dummy (env KVFLEET_MODEL; default: the embedded SmolLM2-135M-Instruct GGUF).")
    for flag in SERVE_FLAGS:
        default = _env_default(flag, env)
        shown = "" if flag.default is None else "; default: %(default)s"
        help_text = f"{flag.help} (env {env_name(flag.name)}{shown})"
        dest = flag.name.lstrip("-").replace("-", "_")
        if flag.boolean:
            parser.add_argument(flag.name, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag.name, dest=dest, type=flag.type or str, default=default, choices=flag.choices,
                                metavar=flag.metavar, help=help_text)


def check_serve_args(args: argparse.Namespace) -> None:
    """Cross-flag rules argparse cannot express; raises ValueError naming the flag."""
    if args.api_key and args.api_keys_file:
        raise ValueError("--api-key and --api-keys-file are exclusive")
    for name in ("port", "tensor_parallel_size", "block_size", "max_request_bytes", "max_connections"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_queue_len",
                 "num_gpu_blocks_override", "kv_cache_memory_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        raise ValueError("--metrics-port must be in [1, 65535]")
    if args.metrics_port is not None and args.metrics_port == args.port:
        raise ValueError("--metrics-port must differ from --port")
    for name in ("timeout_keep_alive", "timeout_request_headers", "timeout_request_body"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.shutdown_grace_period < 0:
        raise ValueError("--shutdown-grace-period must be >= 0")


_ENGINE_KWARGS = ("tokenizer", "device", "dtype", "tensor_parallel_size", "max_model_len",
                  "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "seed", "load_format",
                  "kv_cache_memory_bytes", "async_scheduling", "quantization")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `AsyncLLM(model, **kwargs)` arguments; unset optional flags are left to the engine."""
    kwargs = {k: getattr(args, k) for k in _ENGINE_KWARGS if getattr(args, k) is not None}
    if args.num_gpu_blocks_override is not None:
        kwargs["num_kv_blocks"] = args.num_gpu_blocks_override
    return kwargs
