"""User-facing configuration: frozen dataclasses validated on construction (vLLM names)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. Filters apply in the order temperature → top-k → top-p →
    min-p, each on the distribution the previous one left (as transformers' warpers do).
    top_k 0 or -1 disables it; top_p 1 and min_p 0 likewise.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: int | None = None  # per output token: its log-probability under the target, and this many top ones

    def __post_init__(self) -> None:
        # Accept a single stop string or any iterable, as vLLM does; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed <= 2**64 - self.n),
               f"seed must be None or an integer in [-2**63, 2**64 - n], got {self.seed!r}")
        _check(self.logprobs is None or _is_count(self.logprobs, 0, MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters_vocabulary(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (vLLM's default limit)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


QUANTIZATION_METHODS = ("int8", "int4")
# "auto": the weight format measured fastest for the model's role on its device (models/linear.py,
# `resolve_quantization`); None: the checkpoint's float weights in `dtype`.
AUTO_QUANTIZATION = "auto"


def _check_quantization(value: object, owner: str) -> None:
    _check(
        value is None or value == AUTO_QUANTIZATION or value in QUANTIZATION_METHODS,
        f"{owner} quantization must be None, {AUTO_QUANTIZATION!r} or one of {list(QUANTIZATION_METHODS)}, got {value!r}",
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "float32"
    quantization: str | None = AUTO_QUANTIZATION  # the target's weight format: "auto", None (dtype), "int8" or "int4"
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_prefill_chunk: int = 512  # prompt tokens per sequence per step (chunked prefill)
    # tokens one step's forward takes in, drafts included: decoding sequences first, then prompt chunks
    max_num_batched_tokens: int = 2048
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model must be a non-empty name or path")
        _check(isinstance(self.max_model_len, int) and self.max_model_len >= 2, f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        _check(isinstance(self.max_prefill_chunk, int) and self.max_prefill_chunk >= 1, f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk!r}")
        _check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= self.max_num_seqs,
               f"max_num_batched_tokens must be an integer >= max_num_seqs ({self.max_num_seqs}): every running "
               f"sequence needs a token per step; got {self.max_num_batched_tokens!r}")
        _check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check_quantization(self.quantization, "model")


# vLLM's defaults for its n-gram proposer when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: which proposer, and γ = num_speculative_tokens.

    - `draft_model`: `model` and that model's weight format `quantization` (independent of the target's);
    - `ngram` (prompt lookup): `prompt_lookup_min`/`prompt_lookup_max`, the n-gram sizes matched
      against the context; one given sets the other, neither gives 5 and 5 (vLLM's rule);
    - `suffix` (SuffixDecoding): `suffix_decoding_max_tree_depth` (longest pattern and proposal),
      `suffix_decoding_max_cached_requests` (previous requests' outputs kept for matching, LRU; 0
      matches only within the request), `suffix_decoding_max_spec_factor` (a match of m tokens
      proposes at most m × factor tokens), `suffix_decoding_min_token_prob` (stop where the
      continuation's estimated probability falls below it), `suffix_decoding_speculate_tree` (draft a token
      tree of the most probable continuations, up to γ nodes, instead of one path; default False). γ
      defaults to the tree depth.
    - `medusa`: `model`, a directory of Medusa heads (`specdec train-heads`; default: the heads trained for
      the target under the cache dir); `speculative_token_tree`, the tree of the heads' candidates as
      choice paths (a list of tuples, or its string as vLLM takes it; default `DEFAULT_MEDUSA_TREE`,
      below, down to as many levels as there are heads); γ (default: the tree's depth) is the deepest a step drafts.
    - `eagle`: `model`, a directory with an EAGLE draft layer (`specdec train-heads --method eagle`, or an
      official EAGLE-1/2 checkpoint; default: the layer trained for the target under the cache dir), in weight
      format `quantization`; SGLang's tree knobs: `speculative_eagle_topk` (1, the default, drafts a chain as
      vLLM's EAGLE does; k > 1 grows EAGLE-2's dynamic tree, expanding the k most confident candidates per
      depth), `speculative_num_draft_tokens` (the tree's nodes, default `DEFAULT_EAGLE_DRAFT_TOKENS`),
      `speculative_num_steps` (an alias of num_speculative_tokens, the depth; default `DEFAULT_EAGLE_DEPTH`).
    - `eagle3`: as `eagle`, with an EAGLE-3 layer (`specdec train-heads --method eagle3`, or an official EAGLE-3
      checkpoint), which reads three of the target's layers and has its own head over a draft vocabulary.
    - `mtp`: `model`, a directory of multi-token prediction modules (`specdec train-heads --method mtp`; default:
      the target checkpoint's own `model.mtp_layers.*` where it has them, else the modules trained for it under
      the cache dir); module k drafts the k-th token (num_speculative_tokens, default 1; deeper than the modules,
      the last one repeats).
      `draft_model` takes the same tree knobs (SGLang's standalone speculation): top-k > 1 drafts dynamic trees.
    Tree drafts (Medusa, EAGLE) at temperature > 0: `acceptance_method` "rejection_sampler" (lossless, default) or
    "typical_acceptance_sampler" (Medusa's, lossy: a candidate x passes where p(x) > min(ε, δ·exp(−H(p))),
    ε = `typical_acceptance_sampler_posterior_threshold`, δ = `typical_acceptance_sampler_posterior_alpha`).
    Every method: `adaptive` (default True) lets the engine choose γ ≤ num_speculative_tokens each step
    from measured acceptance and cost, plain steps included (engine/adaptive.py); False drafts γ every
    step, as vLLM does. `draft_confidence_threshold`: a draft model stops drafting after a token it
    gives less than this probability (HF's `assistant_confidence_threshold`; 0 disables).
    Options of other methods are ignored, as in vLLM.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    quantization: str | None = AUTO_QUANTIZATION
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    # vLLM keeps 10000; our Python tree takes up to 1.75 MB per 256-token output at depth 24 (measured, distinct
    # tokens; repeats share nodes), so 1000 outputs stay under ~1.8 GB
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_speculate_tree: bool = False
    adaptive: bool = True
    draft_confidence_threshold: float = 0.0
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    acceptance_method: str = "rejection_sampler"
    typical_acceptance_sampler_posterior_threshold: float = 0.09
    typical_acceptance_sampler_posterior_alpha: float = 0.3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.method, str) and bool(self.method), f"speculative method must be a name, got {self.method!r}")
        if self.speculative_token_tree is not None:
            object.__setattr__(self, "speculative_token_tree", _token_tree(self.speculative_token_tree))
        if self.speculative_num_steps is not None:
            _check(self.num_speculative_tokens in (None, self.speculative_num_steps),
                   f"speculative_num_steps ({self.speculative_num_steps!r}) is an alias of num_speculative_tokens "
                   f"({self.num_speculative_tokens!r}): give one, or both equal")
            object.__setattr__(self, "num_speculative_tokens", self.speculative_num_steps)
        _check(_is_count(self.speculative_eagle_topk, 1, 16),
               f"speculative_eagle_topk must be an integer in [1, 16], got {self.speculative_eagle_topk!r}")
        if self.method in ("eagle", "eagle3") and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_EAGLE_DEPTH)
        if self.method == "mtp" and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 1)  # DeepSeek-V3 drafts with its one module
        if self.num_speculative_tokens is None and self.method == "medusa":
            tree = self.speculative_token_tree or DEFAULT_MEDUSA_TREE
            object.__setattr__(self, "num_speculative_tokens", max(map(len, tree)))
        _check(self.acceptance_method in ACCEPTANCE_METHODS,
               f"acceptance_method must be one of {', '.join(ACCEPTANCE_METHODS)}, got {self.acceptance_method!r}")
        _check(_is_number(self.typical_acceptance_sampler_posterior_threshold)
               and 0 <= self.typical_acceptance_sampler_posterior_threshold <= 1,
               "typical_acceptance_sampler_posterior_threshold must be in [0, 1], got "
               f"{self.typical_acceptance_sampler_posterior_threshold!r}")
        _check(_is_number(self.typical_acceptance_sampler_posterior_alpha)
               and 0 <= self.typical_acceptance_sampler_posterior_alpha <= 1,
               f"typical_acceptance_sampler_posterior_alpha must be in [0, 1], got {self.typical_acceptance_sampler_posterior_alpha!r}")
        _check(_is_count(self.suffix_decoding_max_tree_depth, 1, 64),
               f"suffix_decoding_max_tree_depth must be an integer in [1, 64], got {self.suffix_decoding_max_tree_depth!r}")
        if self.num_speculative_tokens is None and self.method == "suffix":
            object.__setattr__(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth)  # as vLLM
        _check(self.num_speculative_tokens is not None, "speculative_config needs 'num_speculative_tokens'")
        _check(
            _is_count(self.num_speculative_tokens, 1, 64),
            f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}",
        )
        if self.speculative_num_draft_tokens is None:
            default = self.num_speculative_tokens if self.speculative_eagle_topk == 1 else DEFAULT_EAGLE_DRAFT_TOKENS
            object.__setattr__(self, "speculative_num_draft_tokens", default)
        _check(_is_count(self.speculative_num_draft_tokens, 1, 64),
               f"speculative_num_draft_tokens must be an integer in [1, 64], got {self.speculative_num_draft_tokens!r}")
        _check_quantization(self.quantization, "draft")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        _check(_is_count(low, 1, 64) and _is_count(high, 1, 64) and low <= high,
               f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max <= 64, got "
               f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        _check(_is_count(self.suffix_decoding_max_cached_requests, 0, 10**7),
               f"suffix_decoding_max_cached_requests must be an integer >= 0, got {self.suffix_decoding_max_cached_requests!r}")
        _check(_is_number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
               f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor!r}")
        _check(_is_number(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1,
               f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob!r}")
        _check(isinstance(self.adaptive, bool), f"adaptive must be true or false, got {self.adaptive!r}")
        _check(isinstance(self.suffix_decoding_speculate_tree, bool),
               f"suffix_decoding_speculate_tree must be true or false, got {self.suffix_decoding_speculate_tree!r}")
        _check(_is_number(self.draft_confidence_threshold) and 0 <= self.draft_confidence_threshold < 1,
               f"draft_confidence_threshold must be in [0, 1), got {self.draft_confidence_threshold!r}")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | Mapping | None") -> "SpeculativeConfig | None":
        """Accept a SpeculativeConfig, a vLLM-style dict, or None (plain decoding)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        _check(not unknown, f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        _check("method" in value, "speculative_config needs a 'method', e.g. 'draft_model'")
        return cls(**dict(value))


ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
# EAGLE's depth when neither num_speculative_tokens nor speculative_num_steps is given, and its tree's nodes where
# top-k > 1: a tree's rows cost a CPU verify forward what a GPU's don't (BENCHMARKS.md, medusa), so the default
# tree is small next to EAGLE-2's 60 nodes
DEFAULT_EAGLE_DEPTH = 4
DEFAULT_EAGLE_DRAFT_TOKENS = 8
# Medusa's own default trees (mc_sim_7b_63) verify 63 nodes: on a GPU nearly free, on this CPU ~3× a step. This one
# keeps 10 nodes down to depth 4; verified whole every step it loses here (BENCHMARKS.md, medusa), while the adaptive
# controller (the default) cuts it to the depth that pays, mostly the heads' top 3 at depth 1.
DEFAULT_MEDUSA_TREE = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1), (0, 1), (1,), (1, 0), (2,), (0, 0, 0, 1))


def _token_tree(value: object) -> tuple[tuple[int, ...], ...]:
    """Choice paths from a list of tuples, or from its string (vLLM passes `speculative_token_tree` as one)."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as error:
            raise ValueError(f"speculative_token_tree must be a list of tuples like '[(0,), (0, 0)]', got {value!r}") from error
    _check(isinstance(value, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in value),
           f"speculative_token_tree must be a list of tuples like [(0,), (0, 0)], got {value!r}")
    paths = tuple(tuple(c) for c in value)
    _check(bool(paths) and all(c and all(_is_count(i, 0, 1024) for i in c) for c in paths),
           f"speculative_token_tree needs non-empty choice paths of candidate ranks >= 0, got {value!r}")
    return paths


def _is_count(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
