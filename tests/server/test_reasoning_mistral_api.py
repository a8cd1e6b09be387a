"""`--reasoning-parser mistral` over HTTP through the real `openai` client against a real `kvfleet serve` process: a
tiny random model whose tokenizer has Magistral's `[THINK]` and `[/THINK]` as special tokens (gone from text decoded
the default way), and a template that opens the thinking. The markers are decoded for the parser, so the thinking
comes as `reasoning`, the answer after `[/THINK]` as `content`, and a structured output holds for the answer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator

import openai
import pytest

from server_proc import Server, start_server

TEMPLATE = ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
            "{% if add_generation_prompt %}[THINK]{% endif %}")
ASK: Any = [{"role": "user", "content": "what is two and two"}]


@pytest.fixture(scope="module")
def client(tiny_model_factory: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = tiny_model_factory("mistral", special_tokens=("[THINK]", "[/THINK]"))
    logs = tmp_path_factory.mktemp("reasoning-mistral")
    (logs / "template.jinja").write_text(TEMPLATE)
    server: Server = start_server(model, logs, "--max-model-len", "256", "--reasoning-parser", "mistral",
                                  "--chat-template", str(logs / "template.jinja"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    server.stop()


def test_the_thinking_opened_by_the_template_is_reasoning(client: openai.OpenAI) -> None:
    """The random model never closes the thinking in 12 tokens: all of it is reasoning, no marker in it; the stream's
    reasoning deltas join to the same text."""
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    message = got.choices[0].message.to_dict()
    assert message["content"] is None and message["reasoning"] and "[THINK]" not in message["reasoning"], message
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.to_dict().get("reasoning") or "" for c in chunks if c.choices) == \
        message["reasoning"]


def test_the_special_end_marker_ends_the_thinking_and_the_answer_holds_to_the_regex(client: openai.OpenAI) -> None:
    """A bias toward [/THINK] (a special token: decoded the default way it would vanish, and the whole output would
    read as thinking) ends the thinking at once; the answer after it matches the regex, streamed the same."""
    (end,) = client.post("/../tokenize", body={"prompt": "[/THINK]", "add_special_tokens": False},
                         cast_to=dict)["tokens"]
    regex: Any = {"structured_outputs": {"regex": "[ab]{3} ok"}}
    kwargs: Any = dict(model="tiny", messages=ASK, max_tokens=20, temperature=0, logit_bias={str(end): 100},
                       extra_body=regex)
    got = client.chat.completions.create(**kwargs)
    message = got.choices[0].message.to_dict()
    assert message["reasoning"] == "" and re.fullmatch("[ab]{3} ok", message["content"]), message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message["content"]
