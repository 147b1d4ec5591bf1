"""Speculation method name → proposer, looked up once where the configuration comes in."""

from __future__ import annotations

import functools
from pathlib import Path
from collections.abc import Callable

from specdec.config import DEFAULT_MEDUSA_TREE, EngineConfig, SpeculativeConfig
from specdec.models.decoder import Decoder
from specdec.spec.proposers.base import Proposer
from specdec.spec.verifier import TreeAcceptance, tree_rejection_sample, tree_typical_accept


def _draft_model(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.linear import DEFAULT_DRAFT_MODEL_QUANTIZATION, resolve_quantization
    from specdec.models.loader import load_decoder, parse_dtype, resolve_model_dir
    from specdec.spec.proposers.draft_model import DraftModelProposer

    from specdec.models.zoo import DEFAULT_DRAFT_MODEL

    name = spec.model or DEFAULT_DRAFT_MODEL  # the embedded pair's draft
    dtype = parse_dtype(engine.dtype)
    quantization = resolve_quantization(spec.quantization, DEFAULT_DRAFT_MODEL_QUANTIZATION, dtype, engine.device)
    draft = load_decoder(resolve_model_dir(name), dtype, engine.device, quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft model {name!r} has vocabulary size {draft.config.vocab_size}, the target "
            f"{target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    return DraftModelProposer(draft, engine.max_num_seqs, engine.max_model_len, spec.draft_confidence_threshold,
                              spec.speculative_eagle_topk, spec.speculative_num_draft_tokens)


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
        spec.suffix_decoding_speculate_tree,
    )


def _medusa(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.medusa import MedusaHeads, default_heads_dir
    from specdec.spec.proposers.medusa import MedusaProposer
    from specdec.spec.tree import TokenTree

    directory = _heads_dir(spec, engine, default_heads_dir, "Medusa heads")
    heads = MedusaHeads.load(directory).to(target.device, target.dtype)  # run beside the target, in its format
    if heads.config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the Medusa heads at {directory} read hidden size {heads.config.hidden_size}, the target "
                         f"has {target.config.hidden_size}: they were trained for another model")
    project = _output_layer(target, heads.vocab, engine)
    if spec.speculative_token_tree is not None:
        tree = TokenTree.from_choices(spec.speculative_token_tree)
    else:  # the default tree, as deep as the heads go
        tree, _ = TokenTree.from_choices(DEFAULT_MEDUSA_TREE).pruned(heads.config.num_heads)
    return MedusaProposer(heads, project, tree)


def _eagle(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.eagle import EagleDrafter, EagleLayer, default_eagle_dir
    from specdec.spec.proposers.eagle import EagleProposer

    layer = EagleLayer.load(_heads_dir(spec, engine, default_eagle_dir, "EAGLE draft layer"))
    kernel, weight_format = _draft_kernel(spec, target, engine)
    drafter = EagleDrafter(layer, target, _output_layer(target, layer.vocab, engine), kernel, weight_format)
    return EagleProposer(drafter, engine.max_num_seqs, engine.max_model_len, spec.speculative_eagle_topk,
                         spec.speculative_num_draft_tokens)


def _eagle3(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.eagle3 import Eagle3Drafter, Eagle3Layer, default_eagle3_dir
    from specdec.spec.proposers.eagle import EagleProposer

    layer = Eagle3Layer.load(_heads_dir(spec, engine, default_eagle3_dir, "EAGLE-3 draft layer"))
    drafter = Eagle3Drafter(layer, target, *_draft_kernel(spec, target, engine))
    return EagleProposer(drafter, engine.max_num_seqs, engine.max_model_len, spec.speculative_eagle_topk,
                         spec.speculative_num_draft_tokens)


def _mtp(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    from specdec.models.loader import resolve_model_dir
    from specdec.models.mtp import MtpDrafter, MtpModules, default_mtp_dir, has_native_mtp
    from specdec.spec.proposers.mtp import MtpProposer

    if spec.speculative_eagle_topk != 1:
        raise ValueError("MTP drafts a chain (each module guesses one token): speculative_eagle_topk must be 1")
    if spec.model is None and has_native_mtp(resolve_model_dir(engine.model)):
        directory = resolve_model_dir(engine.model)  # the target's own modules
    else:
        directory = _heads_dir(spec, engine, default_mtp_dir, "MTP modules")
    modules = MtpModules.load(directory)
    kernel, weight_format = _draft_kernel(spec, target, engine)
    drafter = MtpDrafter(modules, target, _output_layer(target, modules.vocab, engine), kernel, weight_format)
    return MtpProposer(drafter, engine.max_num_seqs, engine.max_model_len)


def _draft_kernel(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig):
    """The linear kernel of a draft layer's weight format (`quantization`), and the format's name."""
    from specdec.models.linear import DEFAULT_DRAFT_QUANTIZATION, linear_kernel, resolve_quantization

    quantization = resolve_quantization(spec.quantization, DEFAULT_DRAFT_QUANTIZATION, target.dtype, engine.device)
    return linear_kernel(target.dtype, engine.device, quantization), quantization or str(target.dtype)


def _heads_dir(spec: SpeculativeConfig, engine: EngineConfig, default: Callable[[str], Path], what: str) -> Path:
    """speculative_config['model'], or where `specdec train-heads` puts the target's; refused where it is missing."""
    directory = Path(spec.model) if spec.model else default(engine.model)
    if not directory.is_dir():
        raise ValueError(f"no {what} at {directory}: train with `specdec train-heads --method {spec.method} --model "
                         f"{engine.model}`, or name a directory as speculative_config['model']")
    return directory


def _output_layer(target: Decoder, vocab, engine: EngineConfig):
    """The target's LM head, or its rows of a reduced vocabulary in the target's own kernel."""
    from specdec.models.loader import resolve_model_dir
    from specdec.models.medusa import output_embedding

    if vocab is None:
        return target.lm_head
    rows = output_embedding(target, resolve_model_dir(engine.model))[vocab]
    return type(target.lm_head)(rows.to(target.dtype))


PROPOSERS: dict[str, Callable[[SpeculativeConfig, Decoder, EngineConfig], Proposer]] = {
    "draft_model": _draft_model,
    "ngram": _ngram,
    "suffix": _suffix,
    "medusa": _medusa,
    "eagle": _eagle,
    "eagle3": _eagle3,
    "mtp": _mtp,
}


def build_proposer(spec: SpeculativeConfig, target: Decoder, engine: EngineConfig) -> Proposer:
    if spec.method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {spec.method!r}; available: {', '.join(PROPOSERS)}")
    return PROPOSERS[spec.method](spec, target, engine)


def build_tree_acceptance(spec: SpeculativeConfig) -> TreeAcceptance:
    """How tree drafts are verified at temperature > 0 (`acceptance_method`)."""
    if spec.acceptance_method == "typical_acceptance_sampler":
        return functools.partial(
            tree_typical_accept,
            posterior_threshold=spec.typical_acceptance_sampler_posterior_threshold,
            posterior_alpha=spec.typical_acceptance_sampler_posterior_alpha,
        )
    return tree_rejection_sample
