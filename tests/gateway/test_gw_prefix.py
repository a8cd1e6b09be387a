"""Prompt prefixes as chained block hashes."""

from __future__ import annotations

from kvfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.engine.server.protocol_responses import ResponsesRequest
from kvfleet.gateway.prefix import PrefixConfig, request_hashes, text_hashes, token_hashes

CFG = PrefixConfig(block_chars=8, block_tokens=4, max_blocks=4)


def test_only_full_blocks_count_and_the_chain_covers_what_came_before() -> None:
    assert text_hashes("1234567", CFG) == ()
    a, b = text_hashes("AAAAAAAABBBBBBBB", CFG), text_hashes("AAAAAAAACCCCCCCCtail", CFG)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    # the same second block after a different first block hashes differently
    assert text_hashes("XXXXXXXXBBBBBBBB", CFG)[1] != a[1]


def test_at_most_max_blocks() -> None:
    assert len(text_hashes("x" * 1000, CFG)) == 4
    assert len(token_hashes(list(range(100)), CFG)) == 4


def test_token_ids_hash_per_id_not_per_digit() -> None:
    assert token_hashes([1, 23, 4, 5], CFG) != token_hashes([12, 3, 4, 5], CFG)


def test_chat_requests_sharing_a_system_prompt_share_leading_blocks() -> None:
    system = {"role": "system", "content": "You are a helpful assistant for the ACME corporation."}
    r1 = ChatCompletionRequest.model_validate({"model": "m", "messages": [system, {"role": "user", "content": "hi"}]})
    r2 = ChatCompletionRequest.model_validate({"model": "m", "messages": [system, {"role": "user", "content": "yo"}]})
    h1, h2 = request_hashes(r1, CFG), request_hashes(r2, CFG)
    assert len(h1) == 4 and h1 == h2  # 4 blocks of 8 chars lie inside the system prompt


def test_completion_prompt_kinds() -> None:
    for prompt in ("abcdefgh" * 2, ["abcdefgh" * 2, "other"], [1, 2, 3, 4, 5], [[1, 2, 3, 4], [9]]):
        req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        assert len(request_hashes(req, CFG)) >= 1


def test_a_responses_conversation_hashes_as_the_same_chat_does() -> None:
    """Instructions first (the system message the engine makes of them), then the input in order: a Responses
    request shares its leading blocks with the same conversation sent as a chat, and with its own follow-ups."""
    system = "You are a helpful assistant for the ACME corporation."
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
    for body in ({"instructions": system, "input": "hi"},
                 {"instructions": system, "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                  "text": "hi"}]}]}):
        req = ResponsesRequest.model_validate({"model": "m", **body})
        assert request_hashes(req, CFG) == request_hashes(chat, CFG)
    cfg = PrefixConfig(block_chars=8, block_tokens=4, max_blocks=64)
    first = ResponsesRequest.model_validate({"model": "m", "instructions": system, "input": "hi"})
    follow_up = ResponsesRequest.model_validate({"model": "m", "instructions": system, "input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]})
    h1, h2 = request_hashes(first, cfg), request_hashes(follow_up, cfg)
    assert len(h2) > len(h1) and h2[:len(h1)] == h1
    other = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief. " + system, "input": "hi"})
    assert request_hashes(other, cfg)[1] != h1[1]   # (the first block is the role's header, `\x1esystem\x1f`)
