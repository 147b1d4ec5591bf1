"""Speculation counters per sequence, and the numbers derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts only committed tokens: an accepted draft cut off by a stop is not counted.
    A step without a draft is a plain step: only `gamma_histogram[0]` counts it."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # accepted count per draft position
    draft_histogram: list[int] = field(default_factory=list)  # steps that drafted that far, per draft position
    gamma_histogram: list[int] = field(default_factory=list)  # steps per γ verified (0: a plain step)
    # steps per number of draft tokens verified: a chain's γ, a tree's node count (its γ is its depth)
    verified_histogram: list[int] = field(default_factory=list)
    num_draft_forwards: int = 0  # forwards of a draft model (its catch-up and drafting)
    num_draft_tokens_fed: int = 0  # tokens those forwards took in: one each, more where the draft caught up
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, num_draft_forwards: int = 0, num_draft_tokens_fed: int = 0,
               num_verified: int | None = None) -> None:
        """A step that drafted `num_drafted` positions (a tree: its depth) and verified `num_verified` draft tokens
        (a tree: its nodes; default num_drafted)."""
        num_verified = num_drafted if num_verified is None else num_verified
        for histogram, index in ((self.gamma_histogram, num_drafted), (self.verified_histogram, num_verified)):
            if len(histogram) <= index:
                histogram.extend([0] * (index + 1 - len(histogram)))
            histogram[index] += 1
        self.num_draft_forwards += num_draft_forwards
        self.num_draft_tokens_fed += num_draft_tokens_fed
        if num_drafted == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for histogram in (self.acceptance_histogram, self.draft_histogram):
            if len(histogram) < num_drafted:
                histogram.extend([0] * (num_drafted - len(histogram)))
        for position in range(num_accepted):
            self.acceptance_histogram[position] += 1
        for position in range(num_drafted):
            self.draft_histogram[position] += 1

    @classmethod
    def from_summary(cls, summary: dict) -> "SpecStats":
        """Back from `summary()`, e.g. to add up the stats of many requests (fields it lacks start empty)."""
        return cls(**{f: summary[f] for f in cls.__dataclass_fields__ if f in summary})

    def merged(self, other: "SpecStats") -> "SpecStats":
        return SpecStats(
            self.num_spec_steps + other.num_spec_steps,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            _add(self.acceptance_histogram, other.acceptance_histogram),
            _add(self.draft_histogram, other.draft_histogram),
            _add(self.gamma_histogram, other.gamma_histogram),
            _add(self.verified_histogram, other.verified_histogram),
            self.num_draft_forwards + other.num_draft_forwards,
            self.num_draft_tokens_fed + other.num_draft_tokens_fed,
            self.draft_time_s + other.draft_time_s,
            self.verify_time_s + other.verify_time_s,
        )

    def summary(self) -> dict:
        steps = self.num_spec_steps
        mean_length = 1 + self.num_accepted_tokens / steps if steps else None
        gamma = self.num_draft_tokens / steps if steps else None
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "mean_acceptance_length": mean_length,
            "alpha": alpha_from_mean_length(mean_length, gamma) if steps else None,
            "acceptance_histogram": list(self.acceptance_histogram),
            "draft_histogram": list(self.draft_histogram),
            # P(position i accepted | the step drafted position i): acceptance per position, not i.i.d.
            "per_position_acceptance": [a / d for a, d in zip(self.acceptance_histogram, self.draft_histogram)],
            "gamma_histogram": list(self.gamma_histogram),
            "verified_histogram": list(self.verified_histogram),
            "num_draft_forwards": self.num_draft_forwards,
            "num_draft_tokens_fed": self.num_draft_tokens_fed,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
        }


def _add(a: list[int], b: list[int]) -> list[int]:
    width = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)))]


def expected_length(alpha: float, gamma: float) -> float:
    """E[L] = (1 − α^(γ+1)) / (1 − α): tokens per step when each draft is accepted with probability α."""
    if alpha >= 1.0:
        return gamma + 1
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def alpha_from_mean_length(mean_length: float, gamma: float) -> float:
    """The α that gives the observed mean acceptance length (Leviathan's per-token acceptance).

    E[L] increases with α from 1 (α = 0) to γ + 1 (α = 1), so bisection finds it; γ is the
    mean number of drafted tokens per step.
    """
    if mean_length >= gamma + 1 - 1e-12:
        return 1.0
    if mean_length <= 1.0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_length(mid, gamma) < mean_length else (low, mid)
    return (low + high) / 2
