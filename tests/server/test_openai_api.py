"""The OpenAI API of a real `kvfleet serve` process, through the real `openai` client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_proc import ALPHA, BETA, Server, kvfleet_cmd

PROMPT = "once upon a time there lived"
CHAT = [{"role": "user", "content": "what is the capital of france"}]


def greedy(**extra: Any) -> Any:
    from kvfleet.engine.sampling_params import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, **extra})


def test_models_health_version(client: openai.OpenAI, api_server: Server) -> None:
    # While the model loaded (the port is open at once), /health said 503 "loading"; then 200.
    assert api_server.startup_health == [(503, "loading"), (200, "ok")]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    card = httpx.get(api_server.url + "/v1/models", headers={"Authorization": f"Bearer {ALPHA}"}).json()["data"][0]
    assert card["root"] == "tiny" and card["max_model_len"] == 128   # the served name, never the folder's path
    assert str(api_server.proc.args[api_server.proc.args.index("serve") + 1]) not in json.dumps(card)
    assert httpx.get(api_server.url + "/health").status_code == 200
    assert httpx.get(api_server.url + "/version").json()["version"]


def test_completion_greedy_equals_offline_llm(client: openai.OpenAI, offline: Any) -> None:
    expected = offline.generate(PROMPT, greedy())[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, user="alice")
    assert got.choices[0].text == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPT))
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_chat_greedy_equals_offline_llm(client: openai.OpenAI, offline: Any) -> None:
    expected = offline.chat(CHAT, greedy())[0].outputs[0]
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n2_seeded_sampling(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})  # vLLM's extra field: exact lengths
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 16  # 2 x 8
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, n=2, temperature=1.0,
                                          stream=True)
    indexes = {c.choices[0].index for c in chat if c.choices}
    assert indexes == {0, 1}


SAMPLING_CASES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0, "repetition_penalty": 1.3},
    {"temperature": 1.0, "top_k": 5, "seed": 3},
    {"temperature": 1.0, "top_p": 0.5, "seed": 3},
    {"temperature": 1.0, "min_p": 0.3, "seed": 3},
    {"temperature": 0.7, "seed": 11, "min_tokens": 12},
]


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, offline: Any) -> None:
    """Each sampling field sent over HTTP gives exactly what the offline engine gives with that
    SamplingParams (seeded sampling does not depend on the batch), so none is dropped or misread."""
    prompt = "the cat the cat the dog the cat"
    texts = []
    for case in SAMPLING_CASES:
        expected = offline.generate(prompt, greedy(**case))[0].outputs[0]
        body = dict(case)
        extra = {k: body.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "min_tokens") if k in body}
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=extra,
                                        **{"temperature": 0.0, **body})
        assert got.choices[0].text == expected.text, case
        assert got.usage.completion_tokens == len(expected.token_ids), case
        texts.append(expected.text)
    plain = offline.generate(prompt, greedy())[0].outputs[0].text
    assert len(set(texts) | {plain}) >= 4   # the fields really change the output


def test_logit_bias_bans_and_forces_tokens_like_offline(client: openai.OpenAI, offline: Any) -> None:
    """OpenAI's logit_bias (token ids as JSON keys): -100 bans the greedy first token, +100 forces another; the
    HTTP text is the offline engine's with the same SamplingParams.logit_bias, and differs from the plain one."""
    prompt = "the cat the cat the dog the cat"
    plain = offline.generate(prompt, greedy())[0].outputs[0]
    banned, forced = plain.token_ids[0], (plain.token_ids[0] + 1) % 100 + 3
    for bias in ({banned: -100.0}, {forced: 100.0}):
        expected = offline.generate(prompt, greedy(logit_bias=bias))[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                        logit_bias={str(t): v for t, v in bias.items()})
        assert got.choices[0].text == expected.text and expected.text != plain.text, bias
    assert expected.token_ids == [forced] * len(expected.token_ids)
    assert banned not in offline.generate(prompt, greedy(logit_bias={banned: -100.0}))[0].outputs[0].token_ids[:1]


def test_allowed_token_ids_and_bad_words_reach_the_engine(client: openai.OpenAI, offline: Any) -> None:
    """vLLM's allowed_token_ids and bad_words over HTTP: the offline engine's text with the same SamplingParams,
    which differs from the plain one."""
    prompt = "the cat the cat the dog the cat"
    plain = offline.generate(prompt, greedy())[0].outputs[0]
    word = plain.text.split()[0]
    for extra in ({"allowed_token_ids": list(range(5, 300, 3))}, {"bad_words": [word]}):
        expected = offline.generate(prompt, greedy(**extra))[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, extra_body=extra)
        assert got.choices[0].text == expected.text and expected.text != plain.text, extra


def test_openai_features_not_implemented_are_named_unsupported(client: openai.OpenAI) -> None:
    """OpenAI's deprecated `functions` and vLLM's old guided_* fields through the openai client: a 400 naming the
    field as unsupported (not as a typo); plain text, response_format's default, is served as without it (JSON modes:
    test_structured_outputs_api.py; tools: test_tool_calls_api.py)."""
    msgs: Any = [{"role": "user", "content": "hi"}]
    asks: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"functions": [{"name": "f", "parameters": {"type": "object"}}]}},
         "'functions' is not supported by this server"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "'guided_json' is not supported by this server"),
    ]
    for extra, says in asks:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **extra)
        field = next(iter(extra["extra_body"])) if "extra_body" in extra else next(iter(extra))
        assert info.value.param == field and says in info.value.message, info.value.body
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    text = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_batch_of_prompts(client: openai.OpenAI, offline: Any) -> None:
    prompts = [PROMPT, "the king of the city"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(max_tokens=6))]
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [expected[0], expected[0], expected[1], expected[1]]
    stream = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    texts: dict[int, str] = {}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected[0], 1: expected[1]}
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens // 2  # n=1 now


def test_stop_string_truncates_like_offline(client: openai.OpenAI, offline: Any) -> None:
    full = offline.generate(PROMPT, greedy())[0].outputs[0].text
    cut = next(i for i in range(2, len(full) - 2) if full[i:i + 2].strip() and full.find(full[i:i + 2]) == i)
    stop = full[cut:cut + 2]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:cut] and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == full[:cut]


def test_logprobs_and_echo(client: openai.OpenAI) -> None:
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    choice = got.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == got.usage.prompt_tokens + got.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)


def test_echo_of_a_token_id_prompt_is_its_text(client: openai.OpenAI, api_server: Server) -> None:
    """A token-id prompt is decoded for `echo` (only then: the server skips that work otherwise)."""
    ids = httpx.post(api_server.url + "/tokenize", json={"prompt": PROMPT},
                     headers={"Authorization": f"Bearer {ALPHA}"}).json()["tokens"]
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == PROMPT + plain.choices[0].text


def test_tokenize_detokenize(api_server: Server) -> None:
    h = {"Authorization": f"Bearer {ALPHA}"}
    tok = httpx.post(api_server.url + "/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
    back = httpx.post(api_server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
    assert back["prompt"] == PROMPT
    for body in ({"prompt": "\ud800"}, {"messages": [{"role": "user", "content": "\udfff"}]}):
        resp = post_json(api_server.url + "/tokenize", body)
        assert resp.status_code == 400 and error_of(resp)["param"] in body, resp.text


def test_continue_final_message_goes_on_from_the_assistants_text(api_server: Server, client: openai.OpenAI) -> None:
    """The prompt ends inside the last (assistant) message, its turn left open: a prefix of the closed
    conversation's prompt, and what a chat completion of it is given."""
    h = {"Authorization": f"Bearer {ALPHA}"}
    messages = CHAT + [{"role": "assistant", "content": "The answer is"}]
    closed = httpx.post(api_server.url + "/tokenize", headers=h, json={
        "messages": messages, "add_generation_prompt": False}).json()["tokens"]
    open_turn = httpx.post(api_server.url + "/tokenize", headers=h, json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True}).json()["tokens"]
    assert len(open_turn) < len(closed) and closed[:len(open_turn)] == open_turn
    text = httpx.post(api_server.url + "/detokenize", headers=h, json={"tokens": open_turn}).json()["prompt"]
    assert text.endswith("The answer is")
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.usage and got.usage.prompt_tokens == len(open_turn)


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as ASCII-escaped JSON, so even text that is no valid Unicode goes out as the client wrote it."""
    return httpx.post(url, content=json.dumps(body), headers={"Authorization": f"Bearer {ALPHA}",
                                                              "Content-Type": "application/json"})


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temprature": 0.5}, 400, "temprature"),               # unknown field
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),            # wrong type
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),              # invalid sampling value
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "top_k": 100000}, 400, "top_k"),                       # beyond the vocabulary
    ({"prompt": "x " * 200}, 400, "prompt"),                                # over the context length
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt"),                             # token id outside the vocab
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),                      # not served
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),               # no type coercion
    ({"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": [True, False]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),                                        # empty, every form
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),   # outside the vocabulary
    ({"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "seed": "7"}, 400, "seed"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),             # keys are token ids
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),            # values in [-100, 100]
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, 400, "logit_bias"),       # in the vocabulary
    ({"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ({"prompt": "\ud800"}, 400, "prompt"),                # valid JSON, not Unicode: a lone surrogate
    ({"prompt": "x", "stop": ["\udfff"]}, 400, "stop"),
    ({"prompt": "x", "model": "\ud800"}, 400, "model"),
    ({"prompt": "x", "user": "\ud800"}, 400, "user"),
])
def test_bad_input_gets_openai_error(api_server: Server, body: dict[str, Any], status: int, param: str) -> None:
    resp = post_json(api_server.url + "/v1/completions", body)
    assert resp.status_code == status, resp.text
    err = error_of(resp)
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("body, status, param", [
    ({"messages": CHAT, "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x " * 300}]}, 400, "messages"),     # over the context
    ({"messages": CHAT, "max_completion_tokens": 500}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": 500}, 400, "max_tokens"),
    ({"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ({"messages": CHAT, "top_k": -2}, 400, "top_k"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": CHAT, "n": 0, "stream": True}, 400, "n"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user"}], "tools": []}, 400, "tools"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400, "messages"),
    ({"messages": CHAT + [{"role": "assistant", "content": "It"}], "continue_final_message": True}, 400,
     "continue_final_message"),   # and add_generation_prompt (true by default): vLLM's rule
    ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}, 400,
     "continue_final_message"),   # the last message is no assistant's
    ({"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "chat_template_kwargs"),
])
def test_bad_chat_input_gets_openai_error(api_server: Server, body: dict[str, Any], status: int,
                                          param: str) -> None:
    resp = post_json(api_server.url + "/v1/chat/completions", body)
    assert resp.status_code == status, resp.text
    err = error_of(resp)
    assert err["param"] == param and param in err["message"], err


DEEP_BODIES = {   # a JSON body nested `depth` levels, in the places a client could put it
    "array": lambda d: b"[" * d + b"]" * d,
    "object": lambda d: b'{"a":' * d + b"1" + b"}" * d,
    "prompt": lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}",
    "message": lambda d: b'{"messages": [{"role": "user", "content": ' + b"[" * d + b"]" * d + b"}]}",
    "unclosed": lambda d: b'{"prompt": ' + b"[" * d,
    "utf-16": lambda d: ("[" * d + "]" * d).encode("utf-16"),
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_deeply_nested_json_gets_400_naming_the_depth(api_server: Server, path: str) -> None:
    """Any nesting, however deep (960 once overflowed a recursive check into a 500), is a 400 that says
    why, before any parser or validator walks it; bodies just inside the bound are ordinary 400s."""
    h = {"Authorization": f"Bearer {ALPHA}", "Content-Type": "application/json"}
    for shape, make in DEEP_BODIES.items():
        for depth in (65, 960, 964, 1000, 100_000):
            resp = httpx.post(api_server.url + path, content=make(depth), headers=h, timeout=30)
            assert resp.status_code == 400, (shape, depth, resp.text[:200])
            err = error_of(resp)
            assert err["code"] == "json_too_deep" and "64 levels" in err["message"], (shape, depth, err)
        resp = httpx.post(api_server.url + path, content=make(40), headers=h, timeout=30)
        assert resp.status_code == 400 and error_of(resp)["code"] != "json_too_deep", (shape, resp.text[:200])
    log = api_server.log.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log


def test_malformed_json_and_chat_fields(api_server: Server) -> None:
    h = {"Authorization": f"Bearer {ALPHA}", "Content-Type": "application/json"}
    resp = httpx.post(api_server.url + "/v1/completions", content=b'{"prompt": "x",', headers=h)
    assert resp.status_code == 400 and "JSON" in error_of(resp)["message"]
    resp = httpx.post(api_server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=h)
    assert resp.status_code == 400 and error_of(resp)["code"] == "invalid_json", resp.text   # not UTF-8
    resp = httpx.post(api_server.url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                      headers=h)
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"
    resp = httpx.post(api_server.url + "/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}, headers=h)
    assert resp.status_code == 400 and error_of(resp)["param"] == "top_logprobs"
    assert httpx.get(api_server.url + "/v1/nothing", headers=h).status_code == 404


def test_auth_401(api_server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {ALPHA}"}):
        resp = httpx.post(api_server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert resp.status_code == 401 and error_of(resp)["code"] == "invalid_api_key"
        assert ALPHA not in resp.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api_server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(api_server.url + "/metrics").status_code == 200  # scrapes need no key
    assert ALPHA not in api_server.log.read_text() and BETA not in api_server.log.read_text()


def test_counters_match_requests_by_tenant(api_server: Server, client: openai.OpenAI) -> None:
    beta = openai.OpenAI(base_url=api_server.url + "/v1", api_key=BETA, max_retries=0)
    before = {t: api_server.metric("kvfleet:request_success_total", tenant=t) for t in ("alpha", "beta")}
    gen_before = api_server.metric("kvfleet:generation_tokens_total")
    prompt_before = api_server.metric("kvfleet:prompt_tokens_total")
    ttft_before = api_server.metric("kvfleet:time_to_first_token_seconds_count")
    used = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0) for _ in range(3)]
    used += [beta.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4) for _ in range(2)]
    assert api_server.metric("kvfleet:request_success_total", tenant="alpha") - before["alpha"] == 3
    assert api_server.metric("kvfleet:request_success_total", tenant="beta") - before["beta"] == 2
    assert api_server.metric("kvfleet:generation_tokens_total") - gen_before == \
        sum(u.usage.completion_tokens for u in used)
    assert api_server.metric("kvfleet:prompt_tokens_total") - prompt_before == sum(u.usage.prompt_tokens for u in used)
    assert api_server.metric("kvfleet:time_to_first_token_seconds_count") - ttft_before == 5
    assert api_server.metric("kvfleet:num_requests_waiting") == 0
    assert api_server.metric("kvfleet:num_requests_running") == 0


REQUIRED_METRICS = (
    "kvfleet:num_requests_waiting", "kvfleet:num_requests_running", "kvfleet:kv_cache_usage_perc",
    "kvfleet:prefix_cache_queries_total", "kvfleet:prefix_cache_hits_total", "kvfleet:num_preemptions_total",
    "kvfleet:prompt_tokens_total", "kvfleet:generation_tokens_total", "kvfleet:request_success_total",
    "kvfleet:time_to_first_token_seconds_bucket", "kvfleet:inter_token_latency_seconds_bucket",
    "kvfleet:e2e_request_latency_seconds_bucket", "kvfleet:request_queue_time_seconds_bucket",
)


def test_every_metric_is_named_like_vllms_and_labelled_with_the_model(api_server: Server,
                                                                     client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)   # so every histogram has a sample
    samples = api_server.metrics()
    names = {name for name, _ in samples}
    assert set(REQUIRED_METRICS) <= names, set(REQUIRED_METRICS) - names
    ours = [(name, dict(labels)) for name, labels in samples if name.startswith("kvfleet:")]
    assert all(labels.get("model_name") == "tiny" for _, labels in ours), ours
    assert all("finished_reason" in labels for name, labels in ours if name == "kvfleet:request_success_total")


def test_prefix_cache_is_per_tenant(api_server: Server, client: openai.OpenAI) -> None:
    beta = openai.OpenAI(base_url=api_server.url + "/v1", api_key=BETA, max_retries=0)
    prompt = list(range(100, 148))  # three full blocks of 16

    def hits_after(c: openai.OpenAI) -> float:
        c.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        return api_server.metric("kvfleet:prefix_cache_hits_total")

    start = hits_after(client)            # alpha fills the cache (or hits an earlier alpha entry)
    again = hits_after(client)
    assert again - start >= 32            # alpha reuses its own blocks
    assert hits_after(beta) == again      # beta never sees alpha's blocks
    assert hits_after(beta) - again >= 32  # ... only its own


def test_bench_serve_short_run(api_server: Server, tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "bench.json"
    run = subprocess.run([*kvfleet_cmd(), "bench", "serve", "--base-url", api_server.url, "--api-key", BETA,
                          "--workload", "tiny", "--num-prompts", "12", "--request-rate", "inf",
                          "--max-concurrency", "4", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["errors"]) == (12, 0, {})
    assert result["total_output_tokens"] > 12 and result["output_throughput"] > 0
    assert 0 < result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"] <= result["e2el_ms"]["p99"]
    assert result["itl_ms"]["p90"] > 0
