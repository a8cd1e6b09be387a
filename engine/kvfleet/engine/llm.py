"""`LLM`: the offline API, as vLLM's (`generate`, `chat`), on `LLMEngine`."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional, Sequence, Union

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.inputs import PromptType, check_text, find_bad_text
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvfleet.engine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]   # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts: must be a string, token ids, a dict or a list of those, got {type(prompts).__name__}")


class LLM:
    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: Optional[int] = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 num_kv_blocks: Optional[int] = None, seed: int = 0, load_format: str = "auto",
                 **kwargs: Any) -> None:
        config = EngineConfig(
            model=str(model), dtype=dtype, device=device, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            num_kv_blocks=num_kv_blocks, seed=seed, load_format=load_format, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def model_config(self) -> Any:
        return self.llm_engine.model_config

    def shutdown(self) -> None:
        """Stop the model's helper processes (tensor parallelism); the LLM is unusable after."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.llm_engine.stats()

    def generate(self, prompts: Any, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 priority: Optional[Sequence[int]] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order."""
        plist = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(plist):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(plist)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(plist)
        if priority is not None and len(priority) != len(plist):
            raise ValueError(f"priority: {len(priority)} given for {len(plist)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(plist, params, strict=True)):
                rid = str(next(self._ids))
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)   # all or nothing
            raise
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        engine = self.llm_engine
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        try:
            while pending:
                if engine.idle_steps > 1000:
                    raise RuntimeError(f"engine: no progress for {engine.idle_steps} steps with "
                                       f"{len(pending)} requests pending (KV cache too small?)")
                for out in engine.step(final_only=True):
                    if out.finished:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        return [final[i] for i in ids]

    def beam_search(self, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `beam_width` best beams of each prompt, best first."""
        outs = self.generate(prompts, params.to_sampling_params())
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.text,
                                                     c.cumulative_logprob or 0.0, c.finish_reason)
                                  for c in o.outputs]) for o in outs]

    def chat(self, messages: Union[Conversation, list[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the tokenizer's chat template."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("messages: this model has no tokenizer (and no chat template)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for k, conv in enumerate(convs):
            if not conv or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise ValueError("messages: each message must be a dict with 'role' and 'content'")
            bad = find_bad_text(conv, f"messages[{k}]" if len(convs) > 1 else "messages")
            if bad:
                raise ValueError(f"messages: invalid Unicode text at {bad} (a lone UTF-16 surrogate)")
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, **template_kwargs)
            check_text(text, "messages")   # the template or its kwargs may add bad text too
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)
