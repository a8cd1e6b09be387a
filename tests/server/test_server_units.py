"""Pure parts of the serving process: flags and env, keys, limits, error bodies, logprobs, metrics."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvfleet.engine.bench.serve import RequestResult, load_jsonl, load_workload, percentiles, summarize, tiny_workload
from kvfleet.engine.outputs import Logprob, RequestMetrics
from kvfleet.engine.server.args import SERVE_FLAGS, Flag, add_serve_args, check_serve_args, engine_kwargs, env_name
from kvfleet.engine.server.auth import ApiKeys, KeyFileError, bearer_token, load_keys, parse_keys, tenant_for
from kvfleet.engine.server.errors import describe_validation_errors, value_error_param
from kvfleet.engine.server.limits import Admission, RequestError, admit, resolve_max_tokens, retry_after_seconds
from kvfleet.engine.server.logprobs import chat_logprobs, completion_logprobs
from kvfleet.engine.server.metrics import ServerMetrics, request_timings
from kvfleet.engine.server.protocol import lone_surrogate_at


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser, env or {})
    return parser.parse_args(argv)


def test_flags_defaults_env_and_cli_precedence() -> None:
    args = parse([])
    assert (args.host, args.port, args.block_size, args.enable_prefix_caching) == ("0.0.0.0", 8000, 16, True)
    env = {"KVFLEET_PORT": "9001", "KVFLEET_ENABLE_PREFIX_CACHING": "false", "KVFLEET_MODEL": "/m",
           "KVFLEET_MAX_QUEUE_LEN": "5", "KVFLEET_DEVICE": "cpu"}
    args = parse([], env)
    assert (args.port, args.enable_prefix_caching, args.model, args.max_queue_len, args.device) == \
        (9001, False, "/m", 5, "cpu")
    args = parse(["--port", "9002", "--enable-prefix-caching", "other"], env)
    assert (args.port, args.enable_prefix_caching, args.model) == (9002, True, "other")
    kwargs = engine_kwargs(args)
    assert kwargs["device"] == "cpu" and kwargs["enable_prefix_caching"] is True
    assert "max_model_len" not in kwargs and kwargs["tensor_parallel_size"] == 1


def _env_sample(flag: Flag) -> tuple[str, object]:
    """A valid non-default value for `flag`, as its env var text and as parsed."""
    if flag.boolean:
        return ("false", False) if flag.default else ("true", True)
    if flag.choices:
        value = next(c for c in flag.choices if c != flag.default)
        return value, value
    if flag.type is int:
        return "7", 7
    if flag.type is float:
        return "0.5", 0.5
    return "some-value", "some-value"


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=lambda f: f.name)
def test_every_flag_reads_its_env_var_and_the_command_line_wins(flag: Flag) -> None:
    dest = flag.name.lstrip("-").replace("-", "_")
    text, value = _env_sample(flag)
    assert value != flag.default
    assert getattr(parse([], {env_name(flag.name): text}), dest) == value
    if not flag.boolean:
        if flag.choices:
            others = [c for c in flag.choices if c != value]
            if not others:   # a flag of one choice (--quantization fp8): the command line alone sets it
                assert getattr(parse([flag.name, value], {}), dest) == value
                return
            cli = others[0]
        else:
            cli = {int: "9", float: "0.25"}.get(flag.type, "from-cli")  # type: ignore[arg-type]
        got = getattr(parse([flag.name, cli], {env_name(flag.name): text}), dest)
        assert got == (flag.type(cli) if flag.type else cli)
    else:
        assert getattr(parse([flag.name if value is False else "--no-" + flag.name[2:]],
                             {env_name(flag.name): text}), dest) is (not value)


def test_union_fields_say_which_forms_were_tried() -> None:
    from kvfleet.engine.server.protocol import CompletionRequest

    for prompt, why in (([], "at least 1 item"), ([1, -2], "at [1]: Input should be greater than or equal to 0"),
                        ([True], "as list[int], at [0]: Input should be a valid integer")):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate({"prompt": prompt})
        msg, param, code = describe_validation_errors(err.value.errors())
        assert param == "prompt" and "'prompt'" in msg and why in msg and code == "invalid_value", msg
        assert "constrained" not in msg


@pytest.mark.parametrize("env, needle", [({"KVFLEET_PORT": "eighty"}, "KVFLEET_PORT"),
                                         ({"KVFLEET_ENFORCE_EAGER": "maybe"}, "KVFLEET_ENFORCE_EAGER"),
                                         ({"KVFLEET_DEVICE": "tpu"}, "KVFLEET_DEVICE")])
def test_bad_env_value_names_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SystemExit, match=needle):
        parse([], env)


def test_cross_flag_checks() -> None:
    with pytest.raises(ValueError, match="--api-key"):
        check_serve_args(parse(["--api-key", "a", "--api-keys-file", "f"]))
    with pytest.raises(ValueError, match="--max-queue-len"):
        check_serve_args(parse(["--max-queue-len", "0"]))
    check_serve_args(parse(["--max-queue-len", "3"]))
    for flag in ("--timeout-keep-alive", "--timeout-request-headers", "--timeout-request-body"):
        with pytest.raises(ValueError, match=flag):
            check_serve_args(parse([flag, "0"]))
    with pytest.raises(ValueError, match="--max-connections"):
        check_serve_args(parse(["--max-connections", "0"]))
    for port in ("8000", "70000"):
        with pytest.raises(ValueError, match="--metrics-port"):
            check_serve_args(parse(["--metrics-port", port]))
    check_serve_args(parse(["--metrics-port", "9090"]))


def test_keys_yaml_json_and_lookup(tmp_path) -> None:
    assert parse_keys("k1: team-a\nk2: team-b\n", "f") == {"k1": "team-a", "k2": "team-b"}
    assert parse_keys(json.dumps({"k3": "team-c"}), "f") == {"k3": "team-c"}
    with pytest.raises(KeyFileError, match="entry 2") as err:
        parse_keys("good: a\nsecret-key: ''\n", "f")
    assert "secret-key" not in str(err.value)  # keys never echoed
    with pytest.raises(KeyFileError, match="mapping"):
        parse_keys("- a\n- b\n", "f")
    path = tmp_path / "keys.yaml"
    path.write_text("sk-1: alpha\n")
    keys = load_keys(None, str(path))
    assert keys is not None and keys.tenant_for(bearer_token("Bearer sk-1")) == "alpha"
    assert keys.tenant_for(bearer_token("Bearer sk-2")) is None
    assert keys.tenant_for(bearer_token("Basic sk-1")) is None
    solo = load_keys("solo", None)
    assert solo is not None and solo.keys == {"solo": "default"} and load_keys(None, None) is None
    assert tenant_for("sk-1", {"sk-1": "alpha"}) == "alpha"


def test_a_key_file_is_read_again_when_it_changes(tmp_path, caplog) -> None:
    """As a Secret volume rotates: the file swapped for a new one; a broken file keeps the last good table."""
    path = tmp_path / "keys.yaml"
    path.write_text("sk-old-1: alpha\n")
    keys = ApiKeys.from_file(path, check_interval_s=1.0)
    t = time.monotonic() + 1000.0
    assert keys.tenant_for("sk-old-1", now=t) == "alpha"
    new = tmp_path / "keys.new"
    new.write_text("sk-new-22: beta\n")
    new.replace(path)                                               # a new inode, as the kubelet's swap
    assert keys.tenant_for("sk-old-1", now=t + 0.5) == "alpha"      # not looked at again within the interval
    assert keys.tenant_for("sk-new-22", now=t + 1.0) == "beta"
    assert keys.tenant_for("sk-old-1", now=t + 1.0) is None
    path.write_text("- not a mapping\n")
    with caplog.at_level("WARNING", logger="kvfleet.server"):
        assert keys.tenant_for("sk-new-22", now=t + 2.0) == "beta"  # the last good table stays
    assert "not reloaded" in caplog.text and "sk-new-22" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvfleet.server"):
        assert keys.tenant_for("sk-new-22", now=t + 2.5) == "beta"   # within the interval: not looked at
        path.unlink()
        assert keys.tenant_for("sk-new-22", now=t + 3.0) == "beta"
        assert keys.tenant_for("sk-new-22", now=t + 3.5) == "beta"
        assert keys.tenant_for("sk-new-22", now=t + 4.5) == "beta"
    assert caplog.text.count("not reloaded") == 1                      # a new problem, logged once
    path.write_text("sk-3: gamma\n")
    assert keys.tenant_for("sk-3", now=t + 5.5) == "gamma"


def test_context_limits_and_admission() -> None:
    assert resolve_max_tokens(None, 10, 64, "prompt", "max_tokens") == 54
    assert resolve_max_tokens(5, 10, 64, "prompt", "max_tokens") == 5
    assert resolve_max_tokens(None, 10, 64, "prompt", "max_tokens", kv_capacity=32) == 22  # cache < context
    for requested in (None, 1):   # a prompt over the whole KV cache names the prompt, not max_tokens
        with pytest.raises(RequestError, match="KV cache") as err:
            resolve_max_tokens(requested, 40, 64, "prompt", "max_tokens", kv_capacity=32)
        assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="KV cache holds 32 tokens") as err:
        resolve_max_tokens(30, 10, 64, "messages", "max_completion_tokens", kv_capacity=32)
    assert err.value.param == "max_completion_tokens"
    assert resolve_max_tokens(22, 10, 64, "prompt", "max_tokens", kv_capacity=32) == 22
    with pytest.raises(RequestError) as err:
        resolve_max_tokens(60, 10, 64, "prompt", "max_tokens")
    assert err.value.param == "max_tokens" and "64" in err.value.message
    with pytest.raises(RequestError) as err:
        resolve_max_tokens(1, 64, 64, "messages", "max_tokens")
    assert err.value.param == "messages"
    assert admit(0, 5, 2) and admit(1, 1, 2) and not admit(2, 1, 2) and admit(100, 1, None)
    adm = Admission()
    t1, t2 = adm.ticket(), adm.ticket()
    t1.started()
    t1.release()
    t1.release()
    assert (adm.waiting, adm.inflight) == (1, 1)
    t2.release()
    assert (adm.waiting, adm.inflight) == (0, 0)
    assert retry_after_seconds(10, 2) == 6 and retry_after_seconds(0, 2) == 1


def test_validation_errors_name_the_field() -> None:
    msg, param, code = describe_validation_errors([{"loc": ("body", "temprature"), "type": "extra_forbidden",
                                                    "msg": "Extra inputs are not permitted"}])
    assert param == "temprature" and "temprature" in msg and code == "unknown_field"
    # an OpenAI field this server does not implement is named as such, not as a typo
    msg, param, code = describe_validation_errors([{"loc": ("body", "tool_choice"), "type": "extra_forbidden",
                                                    "msg": "Extra inputs are not permitted"}])
    assert (msg, param, code) == ("'tool_choice' is not supported by this server", "tool_choice",
                                  "unsupported_field")
    _, _, code = describe_validation_errors([{"loc": ("body", "messages", 0, "tools"), "type": "extra_forbidden",
                                              "msg": "Extra inputs are not permitted"}])
    assert code == "unknown_field"   # only at the top level
    msg, param, _ = describe_validation_errors([{"loc": ("body", "messages", 0, "role"), "type": "literal_error",
                                                 "msg": "Input should be 'user'"}])
    assert param == "messages" and "messages[0].role" in msg
    msg, param, _ = describe_validation_errors([{"loc": ("body",), "type": "value_error",
                                                 "msg": "Value error, stream_options: only with stream"}])
    assert param == "stream_options"
    _, param, code = describe_validation_errors([{"loc": ("body", 5), "type": "json_invalid", "msg": "x"}])
    assert code == "invalid_json" and param is None
    assert value_error_param("top_k: must be -1", ["top_k", "n"]) == "top_k"
    assert value_error_param("something else", ["top_k"]) is None


def test_logprob_shapes() -> None:
    decode = {5: "a", 6: "b", 7: "c"}.__getitem__
    positions = [{5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.5, 2, "b")}, {7: Logprob(float("-inf"), 3, "c"),
                                                                       6: Logprob(-0.3, 1, "b")}]
    legacy = completion_logprobs([5, 7], positions, 1, decode, text_offset=3)
    assert legacy["tokens"] == ["a", "c"] and legacy["token_logprobs"] == [-0.1, -9999.0]
    assert legacy["top_logprobs"] == [{"a": -0.1}, {"b": -0.3}] and legacy["text_offset"] == [3, 4]
    chat = chat_logprobs([5], positions[:1], 2, decode)
    assert chat[0]["token"] == "a" and [t["token"] for t in chat[0]["top_logprobs"]] == ["a", "b"]
    assert chat[0]["bytes"] == [97]


def test_metrics_names_labels_and_scrape_time_stats() -> None:
    stats = {"num_waiting": 3, "num_running": 2, "kv_cache_usage": 0.25, "prefix_cache_queries": 10,
             "prefix_cache_hits": 4, "num_preemptions": 1, "prompt_tokens": 30, "generation_tokens": 7}
    live = {"s": None}
    m = ServerMetrics("tiny", lambda: live["s"])
    assert b"num_requests_waiting" not in m.render()  # nothing before the engine is up
    live["s"] = stats
    t = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finished_time=4.0)
    assert request_timings(t) == {"ttft": 1.0, "e2e": 3.0, "queue": 0.5}
    assert request_timings(RequestMetrics(arrival_time=1.0)) == {} and request_timings(None) == {}
    m.observe_finished("alpha", "stop", t)
    m.observe_itl(0.2, 2)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert samples[("kvfleet:num_requests_waiting", (("model_name", "tiny"),))] == 3
    assert samples[("kvfleet:kv_cache_usage_perc", (("model_name", "tiny"),))] == 0.25
    assert samples[("kvfleet:prefix_cache_hits_total", (("model_name", "tiny"),))] == 4
    assert samples[("kvfleet:generation_tokens_total", (("model_name", "tiny"),))] == 7
    key = ("kvfleet:request_success_total", (("finished_reason", "stop"), ("model_name", "tiny"),
                                              ("tenant", "alpha")))
    assert samples[key] == 1
    assert samples[("kvfleet:inter_token_latency_seconds_count", (("model_name", "tiny"),))] == 2
    assert samples[("kvfleet:time_to_first_token_seconds_sum", (("model_name", "tiny"),))] == 1.0
    live["s"] = dict(stats, num_waiting=0)
    assert "kvfleet:num_requests_waiting{model_name=\"tiny\"} 0.0" in m.render().decode()


def test_bench_stats_and_workloads(tmp_path) -> None:
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == pytest.approx(50.5)
    results = [RequestResult(True, 4, 10, ttft=0.1, e2e=1.0, itl=[0.1] * 9), RequestResult(False, error="HTTP 429")]
    s = summarize(results, 2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, {"HTTP 429": 1})
    assert s["output_throughput"] == 5.0 and s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["per_request"] == [{"sent_s": 0.0, "first_token_s": 0.1, "ttft_ms": 100.0, "e2e_ms": 1000.0}]
    later = [RequestResult(True, 4, 2, ttft=0.5, e2e=0.6, sent_s=0.25), RequestResult(True, 4, 2, e2e=0.2, sent_s=0.0)]
    assert [(r["sent_s"], r["first_token_s"], r["ttft_ms"]) for r in summarize(later, 1.0)["per_request"]] == [
        (0.0, None, None), (0.25, 0.75, 500.0)]   # in send order; a stream without tokens has no first token
    assert tiny_workload(5, 1) == tiny_workload(5, 1) and len(tiny_workload(5, 1)) == 5
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": [1, 2, 3], "output_len": 4}\n{"prompt": "hi", "max_tokens": 2}\n')
    reqs = load_jsonl(f)
    assert reqs[0].prompt_len == 3 and reqs[1].output_len == 2
    f.write_text('{"prompt": [], "output_len": 4}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        load_jsonl(f)
    named = load_workload("random-1024-128", 2, 0)
    assert [(r.prompt_len, r.output_len) for r in named] == [(1024, 128), (1024, 128)]
    with pytest.raises(ValueError, match="chat-mix"):
        load_workload("no-such-workload", 2, 0)


def _nested(depth: int) -> object:
    value: object = "\ud800"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_json_depth_is_measured_without_parsing() -> None:
    from kvfleet.engine.server.jsondepth import json_depth_exceeds

    for depth in (1, 3, 10, 64, 65, 200):
        text = json.dumps(_nested(depth))
        for encoding in ("utf-8", "utf-16", "utf-32"):
            assert json_depth_exceeds(text.encode(encoding), 64) is (depth > 64), (depth, encoding)
        assert json_depth_exceeds(text.encode(), depth) is False and json_depth_exceeds(text.encode(), depth - 1)
    # Brackets inside strings (escaped quotes included) do not nest; unclosed openers do.
    assert not json_depth_exceeds(json.dumps({"p": "[{" * 500 + '\\"[' * 100}).encode(), 2)
    assert not json_depth_exceeds(b'{"p": "\\\\", "q": [' + b"[]," * 1000 + b"[]]}", 3)
    assert json_depth_exceeds(b'{"p": ' + b"[" * 70, 64)
    assert json_depth_exceeds(b'["unterminated ' + b"[" * 70, 64)   # a broken string hides nothing
    assert not json_depth_exceeds(b"]" * 100 + b"[" * 10, 64)       # a parser stops at the first `]`
    assert json_depth_exceeds(b"[" * 1_000_000, 64)


def test_lone_surrogate_walk_needs_no_recursion() -> None:
    assert lone_surrogate_at({"a": [1, "x", {"b": ["ok", "\ud800"]}]}) == "a[2].b[1]"
    assert lone_surrogate_at({"m": {"\udfff": 1}}) == "m" and lone_surrogate_at({"ok": ["fine"]}) is None
    where = lone_surrogate_at(_nested(100_000))   # far past the interpreter's recursion limit
    assert where is not None and where.count(".k[0]") == 49_999   # the path to it, level by level


def test_token_id_checks_fast_paths_agree_with_the_element_walks() -> None:
    """The C-speed paths for lists of plain numbers (issue 16's burst intake) decide as the per-element walks."""
    import copy

    from kvfleet.engine.core.inputs import _as_ids, check_prompt
    from kvfleet.engine.sampling_params import SamplingParams
    from kvfleet.engine.server.limits import check_prompt_ids

    class Int(int):
        pass

    assert lone_surrogate_at({"prompt": list(range(2000)), "x": [1.5, None, True]}) is None
    assert lone_surrogate_at({"prompt": [1, 2, "\ud800"]}) == "prompt[2]"
    assert lone_surrogate_at({"prompt": [[1, 2], [3, ["\udfff"]]]}) == "prompt[1][1][0]"
    ids = list(range(1000))
    assert _as_ids(ids) == ids and _as_ids(ids) is not ids and _as_ids([]) == []
    assert _as_ids((1, 2)) == [1, 2] and _as_ids([Int(3), 4]) == [3, 4]   # tuples and int subclasses: the walk
    for bad in ([1, True], [1, 2.0], [1, "2"], [1, None], "12"):
        with pytest.raises(ValueError, match="prompt_token_ids: must be a list of ints"):
            _as_ids(bad)
    for prompt, offender in (([5, 9, 10, -1, 11], 10), ([5, -3, 10], -3), ([0, 12, -2], 12)):   # the first one
        with pytest.raises(ValueError, match=f"token id {offender} is outside the vocabulary"):
            check_prompt(prompt, 10, 64, 4, 1000)
        with pytest.raises(RequestError, match=f"prompt: token id {offender} is outside"):
            check_prompt_ids(prompt, 10, "prompt")
    assert check_prompt([0, 9], 10, 64, 4, 1000) == 4
    check_prompt_ids([0, 9], 10, "prompt")
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2], max_tokens=3)
    twin = params.clone()
    assert twin == params and twin == copy.deepcopy(params)
    assert twin.stop is not params.stop and twin.stop_token_ids is not params.stop_token_ids
    twin.stop.append("c")
    twin.stop_token_ids.append(3)
    twin.max_tokens = 9
    assert params.stop == ["a", "b"] and params.stop_token_ids == [1, 2] and params.max_tokens == 3


def _tokenizer_spec(**parts: object) -> dict[str, object]:
    spec: dict[str, object] = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"},
                               "model": {"type": "BPE", "unk_token": None, "fuse_unk": False}}
    spec.update(parts)
    return spec


def test_chars_per_token_bound_only_for_tokenizers_that_keep_the_text() -> None:
    from kvfleet.engine.server.textbound import chars_per_token_bound

    vocab = ["a", "Ġthe", "<|im_start|>"]
    assert chars_per_token_bound(_tokenizer_spec(), vocab) == 12
    nfc = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Prepend", "prepend": "▁"}]}
    assert chars_per_token_bound(_tokenizer_spec(normalizer=nfc), vocab) == 48   # composition: x4
    spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert chars_per_token_bound(_tokenizer_spec(normalizer=spaces), vocab) == 12
    unigram = {"type": "Unigram", "byte_fallback": True}
    assert chars_per_token_bound(_tokenizer_spec(model=unigram, pre_tokenizer={"type": "Metaspace"}), vocab) == 12
    for lossy in ({"normalizer": {"type": "Strip"}}, {"normalizer": {"type": "BertNormalizer"}},
                  {"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}},
                  {"normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": ""}},
                  {"pre_tokenizer": {"type": "WhitespaceSplit"}},
                  {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Removed"}]}},
                  {"model": {"type": "WordPiece"}}, {"model": {"type": "Unigram"}},
                  {"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}}):
        assert chars_per_token_bound(_tokenizer_spec(**lossy), vocab) is None, lossy


def test_no_text_that_fits_is_over_the_character_bound() -> None:
    """The bound is a real upper bound: every text has at least len(text) / bound tokens (random
    Unicode, long runs, the longest vocabulary entries, special tokens)."""
    import random

    from kvfleet.engine.server.textbound import tokenizer_chars_per_token
    from kvfleet.engine.testing import build_tokenizer

    rng = random.Random(0)
    tok = build_tokenizer()
    bound = tokenizer_chars_per_token(tok)
    assert bound == max(len(t) for t in tok.get_vocab())
    longest = max(tok.get_vocab(), key=len)
    texts = [" " * 5000, "#" * 5000, "\n" + " " * 4000, "<|im_start|>" * 300, longest * 50,
             tok.convert_tokens_to_string([max((t for t in tok.get_vocab() if not t.startswith("<")), key=len)]) * 50]
    texts += ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(128, 0x2FFF)]))
                      for _ in range(rng.randrange(1, 400))) for _ in range(300)]
    for text in texts:
        assert len(tok.encode(text, add_special_tokens=False)) * bound >= len(text), text[:40]


def test_gil_switch_interval_from_the_environment() -> None:
    from kvfleet.engine.server.launch import DEFAULT_GIL_SWITCH_INTERVAL_MS, gil_switch_interval_s

    assert gil_switch_interval_s({}) == DEFAULT_GIL_SWITCH_INTERVAL_MS / 1e3
    assert gil_switch_interval_s({"KVFLEET_GIL_SWITCH_INTERVAL_MS": "0.5"}) == 0.0005
    for bad in ("fast", "0", "1000"):
        with pytest.raises(ValueError, match="KVFLEET_GIL_SWITCH_INTERVAL_MS"):
            gil_switch_interval_s({"KVFLEET_GIL_SWITCH_INTERVAL_MS": bad})
