"""The issue's quality guard on the embedded 1.5B (slow: real weights): int8's mean NLL over the held text within 1% of
float32's."""

from __future__ import annotations

import gc

import pytest

from specdec.bench.cost_curve import _mean_nll, held_text
from specdec.models.loader import load_decoder, load_tokenizer, resolve_model_dir

pytestmark = pytest.mark.slow
INT8_NLL_GUARD = 0.01  # measured: +0.00% smoothed, +1.12% unsmoothed on an Intel host, +0.85% on Zen hosts


def test_int8_nll_on_the_held_text_is_within_one_percent_of_float32():
    model_dir = resolve_model_dir("qwen2.5-coder-1.5b")
    ids = load_tokenizer(model_dir).encode(held_text())
    float32 = _mean_nll(load_decoder(model_dir, prepack=False), ids)
    gc.collect()  # the float32 model's 7 GB, before the int8 one loads
    int8 = _mean_nll(load_decoder(model_dir, quantization="int8"), ids)
    assert int8 <= float32 * (1 + INT8_NLL_GUARD), (int8, float32)
