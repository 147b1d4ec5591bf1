"""vLLM-shaped results: RequestOutput → CompletionOutput per sample, plus metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specdec.engine.sequence import Sequence
from specdec.engine.stopping import streamable_text


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: log-probability}, the chosen one first


@dataclass
class RequestMetrics:
    """Times in seconds. TPOT is the mean gap between output tokens after the first."""

    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    tokens_per_s: float | None  # output tokens / end-to-end time
    num_target_forwards: int
    speculative_decoding: dict | None = None  # filled by speculative methods

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @classmethod
    def from_sequences(cls, sequences: list[Sequence], prompt: str | None) -> "RequestOutput":
        first = sequences[0]
        outputs = [
            CompletionOutput(s.index, streamable_text(s), list(s.output_token_ids), s.finish_reason, s.stop_reason,
                             None if s.logprobs is None else list(s.logprobs))
            for s in sequences
        ]
        return cls(
            request_id=first.request_id,
            prompt=prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs,
            finished=all(s.is_finished for s in sequences),
            metrics=_metrics(sequences),
        )


def _metrics(sequences: list[Sequence]) -> RequestMetrics:
    first = sequences[0]
    num_out = sum(len(s.output_token_ids) for s in sequences)
    starts = [s.first_token_time for s in sequences if s.first_token_time is not None]
    ends = [s.finish_time for s in sequences if s.finish_time is not None]
    ttft = min(starts) - first.arrival_time if starts else None
    e2e = max(ends) - first.arrival_time if len(ends) == len(sequences) else None
    gaps = [
        (s.finish_time - s.first_token_time) / (len(s.output_token_ids) - 1)
        for s in sequences
        if s.finish_time is not None and s.first_token_time is not None and len(s.output_token_ids) > 1
    ]
    return RequestMetrics(
        num_prompt_tokens=len(first.prompt_token_ids),
        num_output_tokens=num_out,
        ttft_s=ttft,
        tpot_s=sum(gaps) / len(gaps) if gaps else None,
        e2e_s=e2e,
        tokens_per_s=num_out / e2e if e2e else None,
        num_target_forwards=max(s.num_forwards for s in sequences),
        speculative_decoding=_spec_summary(sequences),
    )


def _spec_summary(sequences: list[Sequence]) -> dict | None:
    stats = [s.spec_stats for s in sequences if s.spec_stats is not None]
    if not stats:
        return None
    total = stats[0]
    for more in stats[1:]:
        total = total.merged(more)
    return total.summary()
