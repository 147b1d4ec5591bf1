"""Benchmarks, shipped with the package so `specdec bench NAME` works from an install.

The engine never imports this package; each engine under test runs in its own subprocess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _benchmarks() -> dict[str, Callable[[Sequence[str]], int]]:
    from specdec.bench import cost_curve, cuda, draft_model, gamma_trace, ngram, plain_decode, serve_load, sweep

    return {"sweep": sweep.main, "plain_decode": plain_decode.main, "draft_model": draft_model.main,
            "cost_curve": cost_curve.main, "ngram": ngram.main, "gamma_trace": gamma_trace.main,
            "serve_load": serve_load.main, "cuda": cuda.main}


def run_benchmark(name: str, argv: Sequence[str]) -> int:
    benchmarks = _benchmarks()
    if name not in benchmarks:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(benchmarks)}")
    return benchmarks[name](argv)
