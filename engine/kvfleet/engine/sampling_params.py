"""`SamplingParams` with vLLM's field names and defaults.

`validate(vocab_size)` raises `ValueError` naming the field and its limit; the
engine calls it before a request reaches the scheduler.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, TypeGuard, Union

_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy
MAX_LOGIT_BIAS_ENTRIES = 1024  # a request's logit_bias entries: each is work in every step of the request
MAX_BAD_WORDS = 1024        # a request's bad_words: each is matched against the output at every step


def _fail(field_name: str, message: str) -> NoReturn:
    raise ValueError(f"{field_name}: {message}")


def _is_number(value: object) -> bool:
    """A real number that is not NaN (bool is no number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema (`json`, a
    dict or its text), any JSON object (`json_object`), a regular expression, a choice of strings, or a grammar in
    llguidance's Lark dialect. Compiled by the engine (kvfleet.engine.structured_outputs); every sampled token is
    one the constraint allows, and the output ends where it is complete (EOS)."""

    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON without whitespace between tokens (small models may otherwise emit whitespace until max_tokens).
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def given(self) -> list[str]:
        """The constraints set, in KINDS' order."""
        return [k for k in self.KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """Which constraint is set (validated: exactly one)."""
        return self.given()[0]

    def validate(self) -> None:
        field = "structured_outputs"
        given = self.given()
        if len(given) != 1:
            _fail(field, f"give exactly one of {', '.join(self.KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    _fail(f"{field}.json", f"not valid JSON: {exc}")
            if not isinstance(schema, (dict, bool)):
                _fail(f"{field}.json", f"a JSON schema is an object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            _fail(f"{field}.regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail(f"{field}.grammar", "must be a non-empty string (a Lark grammar)")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                _fail(f"{field}.choice", "must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            _fail(f"{field}.json_object", f"must be a boolean, got {self.json_object!r}")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    # token id -> a number added to its logit before sampling (greedy too), in [-100, 100] as the OpenAI API's:
    # -100 bans a token, 100 all but forces it. Raw logprobs are read before it, as vLLM's.
    logit_bias: Optional[dict[int, float]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's: only these token ids may be sampled (EOS too only if listed) ...
    allowed_token_ids: Optional[list[int]] = None
    # ... and these words may not be written (the last token of each of their tokenizations is banned where the
    # output ends with the rest of it)
    bad_words: Optional[list[str]] = None

    def __post_init__(self) -> None:
        # Wrong types are left for validate() to name; nothing here may raise a TypeError.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.best_of is None:
            self.best_of = self.n
        if _is_number(self.temperature) and 0 <= self.temperature < _GREEDY_EPS and not self.use_beam_search:
            # Greedy: vLLM resets the truncation knobs so they cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    # --- derived views -------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def beam_width(self) -> int:
        return max(int(self.best_of or 1), int(self.n))

    @property
    def num_samples(self) -> int:
        """How many sequences the engine runs for this request (best_of >= n)."""
        return self.beam_width

    def clone(self) -> "SamplingParams":
        """A copy that shares nothing mutable: the containers (stop, stop_token_ids) are copied deeply, every other
        field is an immutable scalar. (`copy.deepcopy(self)` walked all ~25 fields through its generic machinery:
        ~50 µs a call on CPU, three calls a request at intake.)"""
        twin = copy.copy(self)
        for name, value in vars(twin).items():
            if isinstance(value, (list, dict, set)):
                setattr(twin, name, copy.deepcopy(value))
        return twin

    # --- validation ----------------------------------------------------------------
    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        def is_int(v: object) -> TypeGuard[int]:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "length_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                _fail(name, f"must be a number, got {value!r}")
        if not is_int(self.n) or self.n < 1:
            _fail("n", f"must be at least 1, got {self.n!r}")
        if not is_int(self.best_of) or self.best_of < self.n:
            _fail("best_of", f"must be an int >= n ({self.n}), got {self.best_of!r}")
        if self.temperature < 0.0:
            _fail("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            _fail("top_k", f"must be -1 (disable) or at least 1, got {self.top_k!r}")
        if vocab_size is not None and self.top_k > vocab_size:
            _fail("top_k", f"must be at most the vocabulary size ({vocab_size}), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            _fail("logprobs", f"must be non-negative, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            _fail("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs!r}")
        for name, val in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if vocab_size is not None and val is not None and val > vocab_size:
                _fail(name, f"must be at most the vocabulary size ({vocab_size}), got {val}")
        if self.seed is not None and not is_int(self.seed):
            _fail("seed", f"must be an int, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # torch generators take 64 bits and sample i is seeded with seed + i: a wider seed would fail
            # the whole step, other requests too. int64, as the OpenAI API documents it.
            _fail("seed", f"must be in [-2**63, 2**63), got {self.seed}")
        if not isinstance(self.stop, list):
            _fail("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            _fail("stop", "must be non-empty strings")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                _fail("stop", f"must be valid Unicode text, got {s!r} (a lone surrogate)")
        for tok in self.stop_token_ids or []:
            if not is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                _fail("stop_token_ids", f"must be token ids in [0, {vocab_size}), got {tok!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", f"must be a map of token ids to numbers, got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                _fail("logit_bias", f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
            for tok, bias in self.logit_bias.items():
                if not is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                    _fail("logit_bias", f"keys must be token ids in [0, {vocab_size}), got {tok!r}")
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    _fail("logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {tok}")
        if not isinstance(self.early_stopping, bool) and self.early_stopping != "never":
            _fail("early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                _fail("allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            for tok in self.allowed_token_ids:
                if not is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                    _fail("allowed_token_ids", f"must be token ids in [0, {vocab_size}), got {tok!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
                _fail("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings, got {self.bad_words!r}")
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                _fail("bad_words", "must be words: strings with more than whitespace")
        if (self.allowed_token_ids is not None or self.bad_words) and self.use_beam_search:
            _fail("allowed_token_ids" if self.allowed_token_ids is not None else "bad_words",
                  "is not supported with beam search")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _fail("structured_outputs", f"must be a StructuredOutputsParams, got {self.structured_outputs!r}")
            self.structured_outputs.validate()
            if self.use_beam_search:
                _fail("structured_outputs", "is not supported with beam search")
        return self


@dataclass
class BeamSearchParams:
    """vLLM's separate beam-search parameters (`LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            _fail("beam_width", f"must be at least 1, got {self.beam_width!r}")
        return SamplingParams(n=self.beam_width, best_of=self.beam_width, use_beam_search=True,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=self.temperature, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)
