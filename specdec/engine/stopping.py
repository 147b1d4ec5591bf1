"""Appending tokens to a sequence: incremental detokenization and every stop condition.

Tokens are appended one at a time even when a step produces several (speculation), so
an EOS, stop token, stop string or length limit inside a block ends the output exactly
where plain decoding would have.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specdec.engine.sequence import Sequence, SequenceStatus

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so word boundaries come out right


@dataclass(frozen=True)
class StopRules:
    tokenizer: Any | None
    eos_token_ids: frozenset[int]
    max_model_len: int


def start_detokenizer(seq: Sequence) -> None:
    seq.read_offset = len(seq.prompt_token_ids)
    seq.prefix_offset = max(seq.read_offset - _PROMPT_CONTEXT, 0)


def append_tokens(seq: Sequence, tokens: Iterable[int], rules: StopRules) -> int:
    """Append tokens until one ends the sequence; returns how many were kept."""
    kept = 0
    for token in tokens:
        if seq.is_finished:
            break
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        seq.output_token_ids.append(token)
        kept += 1
        _check_stop(seq, token, rules)
    return kept


def finish(seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = reason
    seq.stop_reason = stop_reason
    seq.finish_time = time.perf_counter()


def streamable_text(seq: Sequence) -> str:
    """Text safe to show now: while running, hold back what could begin a stop string."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[: max(len(seq.text) - hold, 0)]


def _check_stop(seq: Sequence, token: int, rules: StopRules) -> None:
    params = seq.params
    text_before = len(seq.text)
    if rules.tokenizer is not None:
        _detokenize(seq, rules.tokenizer)
    if not params.ignore_eos and token in rules.eos_token_ids:
        finish(seq, "stop")
    elif token in params.stop_token_ids:
        finish(seq, "stop", token)
    elif (stop := _cut_at_stop_string(seq, text_before)) is not None:
        finish(seq, "stop", stop)
    elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= rules.max_model_len:
        finish(seq, "length")
    if seq.is_finished and rules.tokenizer is not None and not isinstance(seq.stop_reason, str):
        _detokenize(seq, rules.tokenizer, final=True)


def _detokenize(seq: Sequence, tokenizer: Any, final: bool = False) -> None:
    ids, skip = seq.token_ids, seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    # A trailing U+FFFD may be an incomplete UTF-8 sequence: wait for the next token, unless none will come.
    if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
        seq.text += full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def _cut_at_stop_string(seq: Sequence, text_before: int) -> str | None:
    """Cut the text at the first stop string this token completed; returns that string."""
    params = seq.params
    for stop in params.stop:
        # a new match must end inside the text this token added
        at = seq.text.find(stop, max(text_before - len(stop) + 1, 0))
        if at >= 0:
            seq.text = seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
            return stop
    return None
