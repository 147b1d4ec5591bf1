"""The `LLM` facade: load a model, turn prompts into requests, run the engine to completion."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.adaptive import AdaptiveGamma, StepCosts
from specdec.engine.engine import Engine
from specdec.engine.registry import build_proposer, build_tree_acceptance
from specdec.engine.sequence import Sequence
from specdec.models import zoo
from specdec.models.cost_curve import CostCurve, cached_cost_curves
from specdec.models.linear import DEFAULT_TARGET_QUANTIZATION, resolve_quantization
from specdec.models.loader import eos_token_ids, load_decoder, load_tokenizer, parse_dtype, resolve_model_dir, resolve_tokenizer_dir

from specdec.outputs import RequestOutput
from specdec.spec.verifier import tree_rejection_sample

PromptType = str | Mapping[str, Any]


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))`, shaped like vLLM's offline API.

    `model` is an embedded name (`specdec models list`), a local HF directory
    (config.json + safetensors) or a .gguf file. `max_model_len` is capped at the
    model's own `max_position_embeddings`. `quantization` is the target's weight format: "auto"
    (default: int8 on a CPU with oneDNN's int8 kernels, else the float weights), None (the float
    weights in `dtype`), "int8" or "int4" (4-bit weights: a draft's format, on CPUs with AVX-512 VNNI); the format
    used is in `llm.config.quantization`.
    `speculative_config` (vLLM names), e.g. `{"method": "draft_model", "model": "qwen2.5-coder-0.5b",
    "num_speculative_tokens": 4, "quantization": "int8"}` (the draft's own format, "auto" by
    default: int4 for a draft model where its kernel runs, else int8); None decodes without speculation.
    γ = num_speculative_tokens is the most a step drafts: with `"adaptive": True` (default) the engine picks γ each
    step from measured acceptance and this machine's measured cost curves (engine/adaptive.py), down to plain steps
    where drafting loses.
    """

    def __init__(
        self,
        model: str = zoo.DEFAULT_MODEL,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        dtype: str = "float32",
        quantization: str | None = "auto",
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 2048,
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        spec = SpeculativeConfig.from_value(speculative_config)
        config = EngineConfig(
            model=str(model),
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            device=device,
        )
        torch_dtype = parse_dtype(dtype)
        quantization = resolve_quantization(config.quantization, DEFAULT_TARGET_QUANTIZATION, torch_dtype, device)
        config = dataclasses.replace(config, quantization=quantization)
        model_dir = resolve_model_dir(config.model)
        self.tokenizer = None
        if not skip_tokenizer_init:
            self.tokenizer = load_tokenizer(resolve_tokenizer_dir(tokenizer) if tokenizer else model_dir)
        decoder = load_decoder(model_dir, torch_dtype, device, config.quantization)
        limit = min(config.max_model_len, decoder.config.max_position_embeddings)
        self.config = dataclasses.replace(config, max_model_len=limit)
        proposer = None if spec is None else build_proposer(spec, decoder, self.config)
        self.speculative_config = spec
        controller = None
        if spec is not None and spec.adaptive:
            # measured once per machine (tens of seconds for the 1.5B and its draft, together), then read from the cache
            drafts = [] if proposer.model is None else [proposer.model]
            target_curve, *draft_curve = cached_cost_curves([decoder, *drafts], zoo.cache_dir())
            costs = StepCosts(target_curve, *draft_curve)
            controller = AdaptiveGamma(costs, stratified=proposer.stratified)
        self.engine = Engine(
            decoder,
            self.tokenizer,
            eos_token_ids(model_dir, self.tokenizer),
            self.config,
            proposer=proposer,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            controller=controller,
            tree_acceptance=tree_rejection_sample if spec is None else build_tree_acceptance(spec),
        )
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def cost_curve(self, refresh: bool = False) -> CostCurve:
        """The target's measured cost of a forward over k new tokens on this machine, in its weight
        format: measured once (tens of seconds for the 1.5B) and cached per machine."""
        [curve] = cached_cost_curves([self.engine.model], zoo.cache_dir(), refresh)
        return curve

    # --- generation -------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        requests = self._add_requests(prompt_list, params)
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm or None, leave=False) as bar:
            while self.engine.has_unfinished():
                self.engine.step()
                bar.n = sum(all(s.is_finished for s in seqs) for _, seqs, _ in requests)
                bar.refresh()
        return [RequestOutput.from_sequences(seqs, text) for _, seqs, text in requests]

    def chat(
        self,
        messages: Seq[Mapping[str, str]] | Seq[Seq[Mapping[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output (cumulative text) after every step that changed it."""
        [(request_id, seqs, text)] = self._add_requests([prompt], [sampling_params or SamplingParams()])
        try:
            while not all(s.is_finished for s in seqs):
                self.engine.step()
                yield RequestOutput.from_sequences(seqs, text)
        finally:
            if not all(s.is_finished for s in seqs):  # the consumer stopped early
                self.engine.abort(request_id)

    def apply_chat_template(self, messages: Seq[Mapping[str, str]]) -> str:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    # --- helpers -------------------------------------------------------------------
    def _add_requests(
        self, prompts: list[PromptType], params: list[SamplingParams]
    ) -> list[tuple[str, list[Sequence], str | None]]:
        encoded = [self.encode_prompt(p) for p in prompts]  # all validated before any is queued
        added: list[tuple[str, list[Sequence], str | None]] = []
        try:
            for (text, ids), p in zip(encoded, params):
                request_id = str(next(self._request_ids))
                added.append((request_id, self.engine.add_request(request_id, ids, p), text))
        except ValueError:
            for request_id, _, _ in added:
                self.engine.abort(request_id)
            raise
        return added

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, as `generate` reads it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self.encode_prompt(prompt["prompt"])
        raise ValueError(f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")


def _params_per_prompt(sampling_params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be SamplingParams objects")
    return params
