"""A request's state: the shared vocabulary of scheduler, engine and API."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.metrics import SpecStats
from specdec.sampling import position_uniform


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a sequence is one live request sample
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    prefix_offset: int = 0  # incremental detokenization window over token_ids
    read_offset: int = 0
    text: str = ""  # detokenized output, cut at a stop string
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_forwards: int = 0  # target forwards this sequence took part in
    spec_stats: SpecStats | None = None  # set when the engine speculates
    logprobs: list[dict[int, float]] | None = None  # per output token, when params.logprobs is set

    def uniform(self, position: int) -> float:
        """The uniform that the target's token at `position` (in prompt + output) is drawn from: fixed by the
        request's seed (its generator's) and the position."""
        return position_uniform(self.generator.initial_seed(), position)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids_from(self, start: int) -> list[int]:
        """token_ids[start:] without copying the whole context (proposers catching up each step)."""
        prompt = len(self.prompt_token_ids)
        if start < prompt:
            return self.prompt_token_ids[start:] + self.output_token_ids
        return self.output_token_ids[start - prompt :]

    def pending_token_ids(self, num_cached: int, max_chunk: int) -> list[int]:
        """The tokens to feed next: a chunk of the prompt, or the last sampled token."""
        return self.token_ids[num_cached : num_cached + max_chunk]
