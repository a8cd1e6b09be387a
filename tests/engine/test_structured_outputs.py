"""Structured outputs (`SamplingParams.structured_outputs`, vLLM's API) on real engines.

The reference is transformers on the same weights, constrained by hand: at each step its logits with every token
the constraint does not allow at -inf, greedy argmax, the constraint advanced by that token. The engine's greedy
tokens must be these exactly (synchronous and async scheduling, batched with unconstrained requests), on a tiny
random model for a choice, a regex and a Lark grammar and on the real SmolLM2 weights for a JSON schema; sampled
outputs must satisfy their constraint; bad constraints are a ValueError naming the field.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.sampling_params import StructuredOutputsParams as Structured
from kvfleet.engine.testing import hf_constrained_greedy_tokens

CHOICES = ["red apple", "green pear", "blue \"plum\""]
REGEX = r"[0-9]{2,4}-[a-f]{1,3}\."   # bounded: a random model may repeat a token as long as it is allowed
LARK = 'start: "say " word ("," word)? "!"\nword: "hi" | "ho" | "ha"'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}


def reference(hf: Any, llm: LLM, spec: Structured, prompt: list[int], max_tokens: int) -> list[int]:
    engine = llm.llm_engine
    return hf_constrained_greedy_tokens(hf, engine.compile_grammar(spec), prompt, max_tokens, engine.eos_token_ids)


def assert_no_leak(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    assert not llm.llm_engine.groups


def test_greedy_under_a_constraint_is_transformers_argmax_over_allowed_tokens(tiny: LLM, hf_tiny: Any) -> None:
    """Choice, regex and Lark constraints batched with a free request: each constrained output is the reference's
    token for token, ends where the constraint is complete (finish_reason stop), and satisfies it; the free one is
    untouched by its neighbours' masks."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 19, 33, 12)]
    specs = [Structured(choice=CHOICES), Structured(regex=REGEX), Structured(grammar=LARK), None]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=s) for s in specs]
    outs = tiny.generate(prompts, params)
    free = tiny.generate(prompts[3:], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert outs[3].outputs[0].token_ids == free.token_ids
    for prompt, spec, out in zip(prompts[:3], specs[:3], outs[:3], strict=True):
        got = out.outputs[0]
        assert spec is not None
        assert got.token_ids == reference(hf_tiny, tiny, spec, prompt, 40), spec.kind
        assert got.finish_reason == "stop", (spec.kind, got.text)
    assert outs[0].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, outs[1].outputs[0].text)
    assert re.fullmatch(r"say (hi|ho|ha)(,(hi|ho|ha))?!", outs[2].outputs[0].text)
    assert_no_leak(tiny)


def test_every_sample_satisfies_its_constraint(tiny: LLM) -> None:
    """n=4 seeded samples each advance their own copy of the constraint (forked from the request's)."""
    out = tiny.generate([[5, 9, 13, 200, 31]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40,
                                                              structured_outputs=Structured(regex=REGEX)))[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1   # really sampled, independently
    assert_no_leak(tiny)


def test_a_constraint_ends_the_output_under_ignore_eos(tiny: LLM) -> None:
    """ignore_eos takes EOS out of the stop ids; a completed constraint still ends the sequence ("stop")."""
    out = tiny.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                    structured_outputs=Structured(choice=["yes", "no"])))[0]
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_bad_constraints_name_their_field(tiny: LLM) -> None:
    cases: list[tuple[Any, str]] = [
        (Structured(regex="(("), "structured_outputs.regex: .*unclosed group"),
        (Structured(json={"type": "nope"}), "structured_outputs.json: .*nope"),
        (Structured(json="{not json"), "structured_outputs.json: not valid JSON"),
        (Structured(grammar="start: missing_rule"), "structured_outputs.grammar: .*missing_rule"),
        (Structured(regex="a", choice=["b"]), "structured_outputs: give exactly one of .*got regex, choice"),
        (Structured(), "structured_outputs: give exactly one"),
        (Structured(choice=[]), "structured_outputs.choice: must be a non-empty list"),
        (Structured(choice=["a", ""]), "structured_outputs.choice: must be a non-empty list of non-empty strings"),
    ]
    for spec, says in cases:
        with pytest.raises(ValueError, match=says):
            tiny.generate([[3, 4]], SamplingParams(max_tokens=4, structured_outputs=spec))
    with pytest.raises(ValueError, match="structured_outputs: is not supported with beam search"):
        SamplingParams(n=2, use_beam_search=True, structured_outputs=Structured(regex="a")).validate()
    assert_no_leak(tiny)


def test_a_model_without_a_tokenizer_refuses_constraints(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A config-only folder with dummy weights (how GPU benchmarks run) has no tokenizer to constrain with."""
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=16)
    with pytest.raises(ValueError, match="structured_outputs: this model has no tokenizer"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=4, structured_outputs=Structured(regex="a")))
    assert llm.llm_engine.prepare_structured_outputs() is False
    assert llm.generate([[3, 4]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids


def test_the_token_table_is_built_once_before_the_first_constrained_request(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`prepare_structured_outputs` (the server calls it before /health turns ready) builds llguidance's token table;
    constrained requests after it use that table instead of building one on their own time."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=32)
    with caplog.at_level(logging.INFO, logger="kvfleet.engine.structured_outputs"):
        assert llm.llm_engine.prepare_structured_outputs() is True
        built = [r for r in caplog.records if r.getMessage() == "structured outputs: token table built"]
        assert len(built) == 1
        out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=40,
                                                      structured_outputs=Structured(choice=CHOICES)))
        assert out[0].outputs[0].text in CHOICES
        assert llm.llm_engine.prepare_structured_outputs() is True
    assert [r for r in caplog.records if r.getMessage() == "structured outputs: token table built"] == built


@pytest.mark.slow
def test_real_weights_write_json_that_matches_the_schema_as_transformers_does(smollm2_path: Path) -> None:
    """SmolLM2-135M-Instruct (real weights): the JSON-schema output is transformers' constrained greedy output token
    for token, parses, and matches the schema; a JSON-object request gives a JSON object."""
    import transformers

    llm = LLM(str(smollm2_path), max_model_len=512, num_kv_blocks=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                           dtype=torch.float32).eval()
    conv = [{"role": "user", "content": "Name a big city and rank it from 1 to 9, as JSON."}]
    spec = Structured(json=SCHEMA, disable_any_whitespace=True)
    out = llm.chat([conv], SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=spec))[0]
    got = out.outputs[0]
    assert got.token_ids == reference(hf, llm, spec, out.prompt_token_ids, 48)
    value = json.loads(got.text)
    assert set(value) == {"city", "rank"} and isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["rank"], int) and 1 <= value["rank"] <= 9 and got.finish_reason == "stop"
    anything = llm.chat([conv], SamplingParams(temperature=0.0, max_tokens=64,
                                               structured_outputs=Structured(json_object=True)))[0].outputs[0]
    if anything.finish_reason == "stop":   # else cut at max_tokens: a prefix of an object
        assert isinstance(json.loads(anything.text), dict)
    assert anything.text.lstrip().startswith("{")


def test_the_mask_benchmark_runs_and_agrees_with_llguidances_pool(bench_module: Any, tmp_path: Path) -> None:
    """bench/structured_masks.py: the engine's masks (one row at a time) equal llguidance's pool's; JSON written."""
    bench = bench_module("structured_masks")
    assert bench.main(["--label", "t", "--batches", "1,8", "--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "structured-masks-t.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 8] and all(r["one_by_one_ms"] > 0 for r in rows)
