"""Speculation method name → proposer, looked up once where the configuration comes in."""

from __future__ import annotations

from collections.abc import Callable

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.models.decoder import Decoder
from specdec.spec.proposers.base import Proposer


def _draft_model(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.linear import DEFAULT_DRAFT_QUANTIZATION, resolve_quantization
    from specdec.models.loader import load_decoder, parse_dtype, resolve_model_dir
    from specdec.spec.proposers.draft_model import DraftModelProposer

    from specdec.models.zoo import DEFAULT_DRAFT_MODEL

    name = spec.model or DEFAULT_DRAFT_MODEL  # the embedded pair's draft
    dtype = parse_dtype(engine.dtype)
    quantization = resolve_quantization(spec.quantization, DEFAULT_DRAFT_QUANTIZATION, dtype, engine.device)
    draft = load_decoder(resolve_model_dir(name), dtype, engine.device, quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft model {name!r} has vocabulary size {draft.config.vocab_size}, the target "
            f"{target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    return DraftModelProposer(draft, engine.max_num_seqs, engine.max_model_len, spec.draft_confidence_threshold)


def _no_model(spec: SpeculativeConfig) -> None:
    if spec.model is not None:
        raise ValueError(f"method {spec.method!r} proposes from the context and takes no model, got model={spec.model!r}")


def _ngram(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.spec.proposers.ngram import NgramProposer

    _no_model(spec)
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _suffix(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.spec.proposers.suffix import SuffixProposer

    _no_model(spec)
    return SuffixProposer(
        spec.suffix_decoding_max_tree_depth,
        spec.suffix_decoding_max_cached_requests,
        spec.suffix_decoding_max_spec_factor,
        spec.suffix_decoding_min_token_prob,
    )


PROPOSERS: dict[str, Callable[[SpeculativeConfig, Decoder, EngineConfig], Proposer]] = {
    "draft_model": _draft_model,
    "ngram": _ngram,
    "suffix": _suffix,
}


def build_proposer(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    if spec.method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {spec.method!r}; available: {', '.join(PROPOSERS)}")
    return PROPOSERS[spec.method](spec, target, engine)
