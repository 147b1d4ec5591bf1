"""N-gram prompt lookup: the incremental index against brute-force search."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.spec.proposers.ngram import NgramIndex


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Scan the whole context: longest suffix first, latest earlier occurrence, then copy on as if the
    sequence continued (a match overlapping the suffix repeats its period)."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == tokens[length - n :]:
                copy = list(tokens)
                for i in range(k):
                    copy.append(copy[end + i])
                return copy[length:]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=40),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(0, 9),
)
def test_index_matches_brute_force_at_every_length(tokens, chunks, sizes, k):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n, max_n)
    position = 0
    for chunk in chunks:  # committed tokens arrive in blocks of any size (prompt, accepted drafts + bonus)
        index.extend(tokens[position : position + chunk])
        position = min(len(tokens), position + chunk)
        assert index.propose(k) == brute_force_lookup(tokens[:position], min_n, max_n, k)


def test_latest_occurrence_of_the_longest_suffix_wins():
    index = NgramIndex(1, 3)
    index.extend([7, 1, 2, 3, 9, 1, 2, 4, 8, 2, 5, 1, 2])
    assert index.propose(3) == [4, 8, 2]  # "1 2" last seen before "4 8"; the longer "5 1 2" never occurred
    index.extend([4, 8])
    assert index.propose(2) == [2, 5]  # "2 4 8"
    index = NgramIndex(1, 2)
    index.extend([5, 6, 5, 6, 5])
    assert index.propose(5) == [6, 5, 6, 5, 6]  # the match overlaps the suffix: its period repeats


def test_no_match_proposes_nothing():
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4, 5, 1])  # "5 1" never occurred before; a 1-gram match is below min_n
    assert index.propose(4) == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramIndex(3, 2)
